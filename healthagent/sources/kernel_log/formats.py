"""The record formats kernel-log text arrives in, taken apart; no I/O.

Why on its own: every input delivers one of the same few formats, and both the readers (which only
need a ``/dev/kmsg`` record's sequence number and stamp to tell new records from old) and the
parser (which needs the message and its time) take them apart the same way. The formats:

- ``/dev/kmsg`` records ``PRI,SEQ,USEC,FLAGS[,caller=..];MESSAGE`` plus the `` KEY=value``
  dictionary lines the kernel attaches to device messages (ignored). Non-printable bytes are
  escaped as ``\\xNN`` by the kernel (a multi-line printk shows ``\\x0a``) and unescaped here;
- ``dmesg`` (``[  1234.567890]``, ``-T`` ``[Mon Nov 20 10:11:12 2026]``, ``--time-format iso``,
  ``-x`` ``kern  :err   :``, ``-r`` ``<4>``, caller ids ``[    T1234]``), ``journalctl -k`` in its
  short, short-precise, short-iso(-precise), short-full, short-unix and short-monotonic outputs,
  and syslog files (``Nov 20 10:11:12 host kernel: ...``, ISO-8601 RFC 5424 stamps, rsyslog's
  ``#012`` for an embedded newline). ``syslog(2)``'s READ_ALL text is dmesg's ``-r`` form.

**Who wrote it.** A record's priority is facility * 8 + level (``PRI`` of a /dev/kmsg record, the
``<N>`` of dmesg ``-r``, READ_ALL and RFC 3164/5424 lines, the first name of dmesg ``-x``). Only the
kernel logs with facility 0 (``LOG_KERN``): the kernel gives anything user space writes to
/dev/kmsg another facility (``LOG_USER`` unless the writer names one). A syslog file
(``/var/log/messages`` on AL2/RHEL) mixes every program's lines with the kernel's, and its header
names the writer: rsyslog's kernel input writes the tag ``kernel`` (no pid: the kernel has none),
``logger -t myapp`` writes ``myapp``. So ``not_kernel`` takes every mark a line carries, and each
must say kernel: a priority of facility 0, dmesg ``-x``'s ``kern``, a syslog tag ``kernel`` with no
pid. A line with no header at all (dmesg, ``journalctl -k -o cat``) is the kernel's: those outputs
hold nothing else. ``journalctl -o json`` lines are the kernel's when the journal's own trusted
``_TRANSPORT`` field says ``kernel`` (a client cannot set a ``_`` field; it can set
``SYSLOG_FACILITY``, so that field may only refuse). ``journalctl -o export`` and ``json-pretty``
are refused: export writes a field holding a newline as raw bytes after its length, so any
program's message can forge whole lines of it, and a line-based reader cannot tell the entry a
``MESSAGE=`` line belongs to.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from healthagent.common import ErrorTally

# A syslog stamp up to this far ahead of ``now`` is clock skew, not last year's line.
FUTURE_SKEW_SECONDS = 86_400.0

# The kernel's own facility (LOG_KERN): a priority's facility is priority >> 3.
KERNEL_FACILITY = 0
# The other facilities as dmesg -x names them (util-linux's facility names, but "kern").
_OTHER_FACILITIES = frozenset({"user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron",
                               "authpriv", "ftp", *(f"local{n}" for n in range(8))})
# /dev/kmsg record header; extra fields after FLAGS (``caller=T123``) are ignored.
_KMSG_HEAD = re.compile(r"(\d{1,4}),(\d{1,20}),(\d{1,20}),[^;,]*(?:,[^;]*)?;")
# A /dev/kmsg dictionary (continuation) line: " SUBSYSTEM=pci", " DEVICE=+pci:0000:53:00.0".
_KMSG_DICT = re.compile(r" [A-Z0-9_]+=")
_KMSG_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")

# The syslog tag the kernel's lines carry in a syslog file (rsyslog's imklog, imjournal).
KERNEL_TAG = "kernel"
# The lines of journal formats a line-based reader cannot trust (module docstring).
_JOURNAL_FIELD = re.compile(r'\s*(?:MESSAGE=|"MESSAGE"\s*:|MESSAGE$)')
# An RFC 5424 header: <PRI>1 STAMP HOST APP PROCID MSGID STRUCTURED-DATA, then the message. The
# groups the other formats name but this one has not are there, never matching.
_RFC5424 = re.compile(
    r"\s*<(?P<pri>\d{1,3})>1 (?:-|(?P<iso>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d)))"
    r" (?P<host>\S{1,255}) (?P<tag>\S{1,48}) (?P<pid>\S{1,128}) \S{1,32} (?:-|(?:\[(?:[^\]\\]|\\.){0,1024}\])+)"
    r"(?P<fac>(?!))?(?P<mono>(?!))?(?P<mono2>(?!))?(?P<ctime>(?!))?(?P<full>(?!))?(?P<tz>(?!))?"
    r"(?P<syslog>(?!))?(?P<unix>(?!))?(?P<caller>(?!))?(?P<ktag>(?!))? ?(?:\ufeff)?"
)
# Everything a log tool puts before the kernel's message. All parts optional, so it always matches.
_PREFIX = re.compile(
    r"\s*(?:<(?P<pri>\d{1,3})>)?"                           # dmesg -r / raw syslog priority
    r"(?:(?P<fac>[a-z]{2,8}[0-7]?)\s*:[a-z]{2,8}\s*:\s)?"    # dmesg -x "kern  :err   : "
    r"(?:"
    r"\[\s*(?P<mono>\d+\.\d+)\]"                             # dmesg, journalctl -o short-monotonic
    r"|\[(?P<ctime>[A-Z][a-z]{2} +[A-Z][a-z]{2} +\d{1,2} +\d{1,2}:\d\d:\d\d +\d{4})\]"  # dmesg -T
    r"|(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?)"  # RFC 5424
    r"|[A-Z][a-z]{2} (?P<full>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,9})?) (?P<tz>[A-Za-z]{1,5}|[+-]\d{4})"
    r"|(?P<syslog>[A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d(?:\.\d{1,9})?)"  # RFC 3164, short-precise
    r"|(?P<unix>\d{9,11}\.\d{1,9})(?=\s)"                    # journalctl -o short-unix
    r")?"
    r"(?:\s+(?P<host>[^\s:\[]+)\s+(?P<tag>[^\s:\[]+)(?:\[(?P<pid>[^\]\s]*)\])?:(?=\s))?"  # host tag[pid]:
    r"(?:\s*(?P<ktag>kernel):(?=\s))?"                        # a syslog file without host names
    r"\s*(?:\[\s*(?P<mono2>\d+\.\d+)\])?"                   # kernel time after "kernel:"
    r"\s*(?:\[\s*(?P<caller>[TC]\d+)\])?"                   # CONFIG_PRINTK_CALLER
    r"\s*"
)
_MONTHS = {m: i for i, m in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), start=1)}


# -- /dev/kmsg records ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KmsgHeader:
    """A /dev/kmsg record's header: its sequence number (restarts every boot), its stamp
    (microseconds since boot), where its message starts in the line and its facility (0: the
    kernel's; anything else was written from user space)."""

    seq: int
    usec: int
    end: int
    facility: int = KERNEL_FACILITY


def kmsg_header(line: str) -> KmsgHeader | None:
    """The header of a /dev/kmsg record line; None for any other line."""
    head = _KMSG_HEAD.match(line)
    if head is None:
        return None
    return KmsgHeader(seq=int(head.group(2)), usec=int(head.group(3)), end=head.end(),
                      facility=int(head.group(1)) >> 3)


def is_kmsg_dictionary_line(line: str) -> bool:
    """A `` KEY=value`` line the kernel attaches to a record: metadata, never a report."""
    return line[:1] == " " and _KMSG_DICT.match(line) is not None


def unescape_kmsg(message: str) -> str:
    """Undo /dev/kmsg's ``\\xNN`` escaping (bytes, so escaped UTF-8 decodes correctly)."""
    raw = _KMSG_ESCAPE.sub(lambda m: bytes((int(m.group(1), 16),)), message.encode("utf-8"))
    return raw.decode("utf-8", errors="replace")


# -- text lines (dmesg, journalctl, syslog) -------------------------------------------------------

def text_prefix(line: str) -> re.Match[str]:
    """What a log tool put before the kernel's message (always matches; ``end()`` is where the
    message starts). Groups: the stamps ``mono``/``mono2``/``ctime``/``iso``/``full``+``tz``/
    ``syslog``/``unix``, and a syslog line's ``host``, ``tag`` and ``pid``."""
    prefix = _RFC5424.match(line) if "<" in line[:8] else None
    if prefix is None:
        prefix = _PREFIX.match(line)
    assert prefix is not None  # every part is optional
    return prefix


def not_kernel(prefix: re.Match[str]) -> str:
    """Why a text line is not the kernel's ("" when it is): every mark its prefix carries must say
    kernel (module docstring). The words name the mark that refused it, for the count's detail."""
    if (priority := prefix.group("pri")) and int(priority) >> 3 != KERNEL_FACILITY:
        return f"priority <{priority}>"
    if (facility := prefix.group("fac")) in _OTHER_FACILITIES:
        return f"facility {facility}"
    tag, pid = prefix.group("tag") or prefix.group("ktag"), prefix.group("pid")
    if tag is not None and tag != KERNEL_TAG:
        return f"syslog tag {tag[:48]!r}"
    if pid is not None and pid != "-":
        return f"syslog tag {tag!r} with pid {pid[:20]!r}"
    if tag is None and (prefix.group("syslog") or prefix.group("full") or prefix.group("unix")):
        # these stamps are syslog's and journalctl's, whose lines always name their writer
        return "a syslog line that names no writer"
    if _JOURNAL_FIELD.match(prefix.string, prefix.end()):
        return "a journal export/json-pretty field (unframed: refused)"
    return ""


def journal_json_kernel(line: str) -> tuple[str, float | None] | str:
    """A ``journalctl -o json`` line: (its message, its wall time or None) when the journal says
    the kernel wrote it, else why not (module docstring). Raises ValueError for a line that is not
    one JSON object."""
    entry = json.loads(line)
    if not isinstance(entry, dict):
        raise ValueError("not a JSON object")
    message = entry.get("MESSAGE")
    if not isinstance(message, str):  # (the journal's byte-array form never passes the pre-filter)
        raise ValueError("no MESSAGE text")
    transport, facility = entry.get("_TRANSPORT"), entry.get("SYSLOG_FACILITY", "0")
    if transport != "kernel" or facility != "0":
        return f"journal _TRANSPORT={str(transport)[:20]!r} SYSLOG_FACILITY={str(facility)[:8]!r}"
    stamp = entry.get("__REALTIME_TIMESTAMP")
    when = int(stamp) / 1e6 if isinstance(stamp, str) and stamp.isdigit() and len(stamp) <= 19 else None
    return message, when


def prefix_time(prefix: re.Match[str], boot_time: float, now: float) -> float | None:
    """Wall time of a text line: its absolute stamp, else ``boot_time`` + its kernel stamp; None
    when the line has none. Raises ValueError (or OverflowError, OSError) for a stamp that names
    no time."""
    if value := prefix.group("iso"):
        return datetime.fromisoformat(value.replace(",", ".")).timestamp()
    if value := prefix.group("syslog"):
        return syslog_time(value, now)
    if value := prefix.group("ctime"):
        return datetime.strptime(" ".join(value.split()), "%a %b %d %H:%M:%S %Y").timestamp()
    if value := prefix.group("full"):
        return _with_zone(datetime.fromisoformat(value), prefix.group("tz")).timestamp()
    if value := prefix.group("unix"):
        return float(value)
    if value := prefix.group("mono") or prefix.group("mono2"):
        return boot_time + float(value)
    return None


def syslog_time(value: str, now: float) -> float:
    """RFC 3164 has no year: take the latest year that does not put the line in the future."""
    month_name, day, clock = value.split()
    hms, _, fraction = clock.partition(".")
    hour, minute, second = (int(x) for x in hms.split(":"))
    micro = int((fraction + "000000")[:6]) if fraction else 0
    year = datetime.fromtimestamp(now).year
    for candidate in (year, year - 1):
        try:
            stamp = datetime(candidate, _MONTHS[month_name], int(day), hour, minute, second,
                             micro).timestamp()
        except ValueError:  # Feb 29 of a year without one
            continue
        if stamp <= now + FUTURE_SKEW_SECONDS:
            return stamp
    raise ValueError(f"no year puts {value!r} before now")


def _with_zone(moment: datetime, zone: str | None) -> datetime:
    """journalctl short-full's zone: UTC/GMT or a numeric offset; anything else is local time."""
    if zone in ("UTC", "GMT", "Z"):
        return moment.replace(tzinfo=timezone.utc)
    if zone and zone[0] in "+-" and zone[1:].isdigit():
        minutes = int(zone[1:3]) * 60 + int(zone[3:5])
        return moment.replace(tzinfo=timezone(timedelta(minutes=-minutes if zone[0] == "-" else minutes)))
    return moment


# -- bytes ----------------------------------------------------------------------------------------

def decode_text(data: bytes, tally: ErrorTally, where: str) -> str:
    """``data`` as UTF-8; undecodable bytes are replaced and counted ``decode`` (one per line)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        bad = sum(1 for line in text.split("\n") if "\ufffd" in line)
        tally.count("decode", f"{where}: {bad} line(s) with bytes that are not UTF-8 (replaced)", n=max(bad, 1))
        return text

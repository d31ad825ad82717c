"""A kernel-log file as a busy or hostile host leaves it: rotated while the agent was down, or
unreadable for any errno.

Rotation while down: the agent stops with lines of ``kern.log`` unread, logrotate renames the file
to ``kern.log.1`` and starts a new ``kern.log``, the agent starts again from its saved cursor
(through JSON, as the state file keeps it). The renamed file is found by the inode the cursor
remembers and its unread end read before the new file: every line once, none twice. Real files
under a tmp host root throughout; the verdict comes from the real classifier.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import pytest

from healthagent.config import load_settings
from healthagent.model import Action, Collection
from healthagent.sources.kernel_log.cursor import KmsgCursor
from healthagent.sources.kernel_log.source import KmsgSource
from healthagent.wiring import build_classifier
from tests.support.kmsg_host import NOW, make_host, record, xid_text


def text_line(second: int, text: str) -> str:
    """A dmesg-style line stamped ``second`` s after boot (this boot's)."""
    return f"[{second:5d}.000000] {text}\n"


def noise(second: int) -> str:
    return text_line(second, f"eth0: link up at {second}")


def xid_line(second: int, xid: int) -> str:
    return text_line(second, xid_text(xid))


@pytest.fixture
def host(tmp_path: Path) -> Path:
    root = make_host(tmp_path / "host", kmsg_text=None)
    (root / "var" / "log").mkdir(parents=True)
    return root


def kern_log(host: Path) -> Path:
    return host / "var" / "log" / "kern.log"


def start(host: Path, saved: dict | None = None, **kw) -> KmsgSource:
    """The agent starting, from a cursor saved as the state file keeps it."""
    cursor = KmsgCursor.from_dict(saved) if saved is not None else None
    return KmsgSource(str(host), kernel_log=str(kern_log(host)), cursor=cursor, **kw)


def stop(source: KmsgSource) -> dict:
    """The agent stopping: its cursor through JSON, its files closed."""
    saved = json.loads(json.dumps(source.cursor.to_dict()))
    source.close()
    return saved


def append(path: Path, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)


def rotate(log: Path, new_text: str = "", to: str = ".1") -> Path:
    """logrotate's default: rename the log away, start a new one at the path."""
    renamed = log.with_name(log.name + to)
    log.rename(renamed)
    log.write_text(new_text)
    return renamed


def read_one_line_and_stop(host: Path) -> dict:
    """An agent that read the log's one line and stopped: its saved cursor."""
    kern_log(host).write_text(noise(100))
    source = start(host)
    assert len(source.collect(NOW).xids) == 0
    return stop(source)


def judge(*results):
    classifier = build_classifier(load_settings(env={}, flags={}))
    verdict = None
    for result in results:
        verdict = classifier.observe(Collection(timestamp=NOW, xids=result.xids, health=(result.health,))).verdict
    return verdict


# -- rotated while the agent was down --------------------------------------------------------------

THREE = [noise(101), xid_line(102, 13), xid_line(103, 94)]  # the last written before the rotation


@pytest.mark.parametrize("read_before_stop", [0, 1, 2])
def test_lines_of_a_log_rotated_while_down_are_read_once(host, read_before_stop):
    log = kern_log(host)
    log.write_text(noise(100))  # what the agent had read before these lines
    first = start(host)
    append(log, "".join(THREE[:read_before_stop]))
    before = first.collect(NOW)
    assert [e.xid for e in before.xids] == ([13] if read_before_stop == 2 else [])
    saved = stop(first)
    append(log, "".join(THREE[read_before_stop:]))
    rotate(log, new_text=xid_line(104, 31))
    second = start(host, saved)
    after = second.collect(NOW)
    unread_xids = [13, 94] if read_before_stop < 2 else [94]
    assert [e.xid for e in after.xids] == unread_xids + [31]  # the renamed file's end, then the new file
    assert after.health.up and after.health.errors == {"rotated": 1}
    assert judge(before, after).action is Action.REPLACE_NODE
    assert second.collect(NOW).xids == ()
    third = start(host, stop(second))  # and a later restart reads nothing again
    assert third.collect(NOW).xids == ()
    assert third.cursor.inode == log.stat().st_ino


def test_three_lines_written_then_stopped_rotated_and_restarted_reach_replace_node(host):
    log = kern_log(host)
    log.write_text("")
    first = start(host)
    empty = first.collect(NOW)
    assert empty.health.up and empty.xids == ()  # an empty log: the cursor holds its inode only
    append(log, "".join(THREE))
    saved = stop(first)
    assert saved["offset"] == 0 and saved["inode"] == log.stat().st_ino
    rotate(log)
    second = start(host, saved)
    result = second.collect(NOW)
    assert [e.xid for e in result.xids] == [13, 94]
    assert judge(result).action is Action.REPLACE_NODE
    append(log, noise(200))
    assert start(host, stop(second)).collect(NOW).xids == ()


def test_kmsg_records_rotated_while_down_in_the_same_boot(tmp_path):
    host = make_host(tmp_path / "host", kmsg_text=record(1, "eth0: link up") + record(2, xid_text(79), priority=4))
    log = host / "dev" / "kmsg"
    first = KmsgSource(str(host))
    assert [e.seq for e in first.collect(NOW).xids] == [2]
    saved = json.loads(json.dumps(first.cursor.to_dict()))
    first.close()
    append(log, record(3, xid_text(94), priority=4) + record(4, "eth0: link down"))
    rotate(log, new_text=record(5, xid_text(48), priority=4))
    second = KmsgSource(str(host), cursor=KmsgCursor.from_dict(saved))
    assert [(e.seq, e.xid) for e in second.collect(NOW).xids] == [(3, 94), (5, 48)]


def test_a_second_restart_while_the_renamed_file_is_still_being_read_loses_nothing(host):
    log = kern_log(host)
    saved = read_one_line_and_stop(host)
    append(log, "".join(xid_line(200 + n, 13 if n % 2 else 31) for n in range(10)))
    rotate(log, new_text=xid_line(300, 94))
    second = start(host, saved, max_records_per_cycle=4)
    got = [e.xid for e in second.collect(NOW).xids]
    assert len(got) == 4
    third = start(host, stop(second), max_records_per_cycle=4)  # stopped with 6 lines of it unread
    for _ in range(5):
        got += [e.xid for e in third.collect(NOW).xids]
    assert got == [13 if n % 2 else 31 for n in range(10)] + [94]


def test_an_old_cursor_without_inode_or_fingerprint_still_loads(host):
    log = kern_log(host)
    log.write_text(noise(100) + xid_line(101, 13))
    saved = {"boot_id": "", "seq": None, "path": str(log), "offset": len(noise(100))}  # an older agent's
    rotate(log, new_text=xid_line(102, 94))
    source = start(host, saved)
    result = source.collect(NOW)
    assert result.health.up and [e.xid for e in result.xids] == [94]  # the renamed file cannot be told
    assert result.health.errors == {"rotated": 1}
    assert source.cursor.inode == log.stat().st_ino and source.cursor.fingerprint


def test_a_cursor_without_a_fingerprint_finds_the_renamed_log_by_inode_and_size(host):
    log = kern_log(host)
    log.write_text(noise(100))
    saved = {"path": str(log), "inode": log.stat().st_ino, "offset": len(noise(100))}  # before fingerprints
    append(log, xid_line(101, 94))
    rotate(log)
    assert [e.xid for e in start(host, saved).collect(NOW).xids] == [94]


@pytest.mark.parametrize("how", ["compressed", "rewritten", "deleted", "a link"])
def test_a_renamed_log_that_is_not_the_same_file_is_not_read(host, how):
    log = kern_log(host)
    saved = read_one_line_and_stop(host)
    append(log, xid_line(101, 94))
    renamed = rotate(log, new_text=noise(102))
    if how == "compressed":  # logrotate's compress: another inode, and not text
        with gzip.open(renamed.with_name("kern.log.1.gz"), "wb") as fh:
            fh.write(renamed.read_bytes())
        renamed.unlink()
    elif how == "rewritten":  # the same inode, other bytes before the offset
        renamed.write_text(xid_line(900, 13) * 3)
    elif how == "deleted":
        renamed.unlink()
    else:  # a link named like a rotation, pointing at the log it stopped in, is not that file
        elsewhere = host / "elsewhere.log"
        renamed.rename(elsewhere)
        os.symlink(elsewhere, renamed)
    result = start(host, saved).collect(NOW)
    assert result.health.up and result.xids == ()
    assert result.health.errors == {"rotated": 1}


def test_only_entries_named_after_the_log_are_looked_at(host):
    log = kern_log(host)
    saved = read_one_line_and_stop(host)
    append(log, xid_line(101, 94))
    log.rename(log.with_name("syslog.1"))  # renamed away under another name: not logrotate's
    log.write_text("")
    assert start(host, saved).collect(NOW).xids == ()


def test_a_directory_that_cannot_be_listed_leaves_the_lines_unread_and_says_why(host, monkeypatch, caplog):
    log = kern_log(host)
    saved = read_one_line_and_stop(host)
    append(log, xid_line(101, 94))
    rotate(log, new_text=xid_line(102, 13))
    real_scandir = os.scandir

    def eio(path="."):
        if str(path) == str(log.parent):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", eio)
    with caplog.at_level("WARNING", logger="healthagent.sources.kmsg"):
        result = start(host, saved).collect(NOW)
    assert result.health.up and [e.xid for e in result.xids] == [13]
    assert result.health.errors == {"rotated": 1}
    assert any("EIO" in r.getMessage() and "rotated_while_down" in r.getMessage() for r in caplog.records)


# -- a kernel log that cannot be read ------------------------------------------------------------

def loop(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(path.name, path.with_name("other"))
    os.symlink("other", path)


@pytest.mark.parametrize("where", ["--kernel-log", "the host's dev/kmsg"])
def test_a_looping_kernel_log_is_unobserved_with_its_errno(tmp_path, where):
    host = make_host(tmp_path / "host", kmsg_text=None)
    path = kern_log(host) if where == "--kernel-log" else host / "dev" / "kmsg"
    loop(path)
    source = KmsgSource(str(host), kernel_log=str(path) if where == "--kernel-log" else None)
    result = source.collect(NOW)
    assert result.health.up is False and "ELOOP" in result.health.detail
    assert result.health.errors == {"unreadable": 1}
    verdict = judge(result)
    assert "kernel_log" in verdict.unobserved and verdict.action is Action.NONE

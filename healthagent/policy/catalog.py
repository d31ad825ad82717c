"""NVIDIA's XID catalog with the agent's default action for each row, merged with the operator's overrides.

``xid_catalog.csv`` holds one row per XID of NVIDIA's catalog for Ampere and newer GPUs
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, 172 rows): ``name`` is NVIDIA's
"MNEMONIC - Description", ``nvidia_resolution`` NVIDIA's immediate resolution bucket with the
investigatory one in parentheses, ``action`` ours, ``note`` why a row departs from the rule below.

The mapping rule (NVIDIA's immediate bucket -> our action), also in docs/findings.md:

- RESTART_APP -> restart_app; RESET_GPU -> reset_gpu; RESTART_BM / RESTART_VM -> reboot_node;
  IGNORE -> monitor.
- CONTACT_SUPPORT, UPDATE_SWFW, CHECK_MECHANICALS, CHECK_UVM -> monitor: the remedy is a person's
  investigation the agent cannot perform, and NVIDIA names no recovery that frees the GPU, so the
  node is not taken out on that signal alone (the finding is raised, never dropped).
- WORKFLOW_XID_48 (DBE) and WORKFLOW_NVLINK_ERR (XID 74) -> reset_gpu: both workflows say "a GPU
  reset or node reboot is needed to clear this error"; the row-remap, retired-page and XID 154
  signals escalate beyond that.
- WORKFLOW_NVLINK5_ERR (XID 144-150) -> reset_gpu: the workflow decodes IntrInfo/error status into
  IGNORE or RESET_GPU; the agent does not decode subcodes and takes the RESET_GPU branch.
- WORKFLOW_XID_45 -> monitor: a sympathetic teardown; NVIDIA says follow the other XID.
- XID_154 -> monitor in the table; the classifier reads the driver's recovery action from the
  message (``recovery_action``), which is what decides.
- A blank bucket (XID 162-172) -> the row's note reads NVIDIA's trigger text.

Departures, each stated in the row's note, which says what the default policy does and what
NVIDIA's catalog says: XID 63, 64, 94 and 95 replace the node (memory remapping events and memory
errors take the node out of the job for good); the XIDs NVIDIA's k8s-device-plugin ignores as
application errors (13, 31, 43, 45, 68, 109) are at most restart_app, so they never take a node
out on their own. A policy file can map any of them to NVIDIA's action instead.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, replace
from importlib import resources

from healthagent.model import FALLEN_OFF_BUS_XID, Action, XidEvent
from healthagent.policy.settings import Policy

# NVIDIA's immediate bucket -> our action (the documented rule above).
BUCKET_ACTIONS: dict[str, Action] = {
    "RESTART_APP": Action.RESTART_APP,
    "RESET_GPU": Action.RESET_GPU,
    "RESTART_BM": Action.REBOOT_NODE,
    "RESTART_VM": Action.REBOOT_NODE,
    "IGNORE": Action.MONITOR,
    "CONTACT_SUPPORT": Action.MONITOR,
    "UPDATE_SWFW": Action.MONITOR,
    "CHECK_MECHANICALS": Action.MONITOR,
    "CHECK_UVM": Action.MONITOR,
    "WORKFLOW_XID_48": Action.RESET_GPU,
    "WORKFLOW_NVLINK_ERR": Action.RESET_GPU,
    "WORKFLOW_NVLINK5_ERR": Action.RESET_GPU,
    "WORKFLOW_XID_45": Action.MONITOR,
    "XID_154": Action.MONITOR,
}

RECOVERY_XID = 154

# NVSwitch SXids by the severity the driver prints ("SXid (PCI:...): 20034, Fatal, ..." or
# "Non-fatal"; a lone detail line says "Severity 1" / "Severity 0", the driver's
# NVSWITCH_ERROR_SEVERITY_FATAL / _NONFATAL). NVIDIA's Fabric Manager user guide: a fatal NVSwitch
# error needs the GPUs and NVSwitches reset, which on an HGX board under Fabric Manager is a node
# reboot; a non-fatal one leaves the fabric working (DCGM: "Monitor the NVSwitch. It can still
# perform workload."). A line without a readable severity is monitor: raised, never dropped.
SXID_ACTIONS: dict[str, Action] = {"fatal": Action.REBOOT_NODE, "non-fatal": Action.MONITOR, "": Action.MONITOR}
SXID_WORDS = {"fatal": "fatal SXid", "non-fatal": "non-fatal SXid", "": "SXid without a stated severity"}
SXID_WHY = {
    "fatal": "Fabric Manager guide: a fatal NVSwitch error needs the GPUs and NVSwitches reset, a node reboot",
    "non-fatal": "the fabric keeps working; watch for repeats",
    "": "the line does not say Fatal or Non-fatal",
}
_SXID_SEVERITY = re.compile(r"SXid\s{0,4}(?:\([^)\n]{0,64}\))?\s{0,4}:\s{0,4}\d{1,9}\s{0,4},\s{0,4}"
                            r"(?:(non-fatal|fatal)\b|severity\s{1,4}(\d))", re.IGNORECASE)


def sxid_severity(text: str) -> str:
    """"fatal", "non-fatal" or "" (not stated) for an SXid report line."""
    match = _SXID_SEVERITY.search(text or "")
    if match is None:
        return ""
    if match.group(1):
        return match.group(1).lower()
    return {"1": "fatal", "0": "non-fatal"}.get(match.group(2), "")


def immediate_bucket(nvidia_resolution: str) -> str:
    """"RESTART_APP (investigatory: CONTACT_SUPPORT)" -> "RESTART_APP"."""
    return re.split(r"[\s(]", nvidia_resolution.strip(), maxsplit=1)[0]


@dataclass(frozen=True)
class CatalogEntry:
    """One XID as the agent treats it. ``catalog_action`` is the bundled row's; ``action`` wins."""

    xid: int
    name: str
    description: str
    action: Action
    nvidia_resolution: str
    note: str = ""
    catalog_action: Action | None = None  # None: not in NVIDIA's catalog
    overridden: bool = False

    @property
    def known(self) -> bool:
        return self.catalog_action is not None

    @property
    def bucket(self) -> str:
        return immediate_bucket(self.nvidia_resolution)

    def decided_by(self) -> str:
        """The rule or override that decided ``action``, in words (for ``explain`` and evidence)."""
        if self.overridden:
            was = self.catalog_action.value if self.catalog_action else "monitor (unknown XID)"
            return f"operator override in the policy file (the catalog says {was})"
        if not self.known:
            return "not in NVIDIA's catalog: reported as monitor with its number, never dropped"
        if self.note:
            return self.note
        return f"rule: NVIDIA bucket {self.bucket} -> {BUCKET_ACTIONS[self.bucket].value}"

    def reason(self) -> str:
        """``decided_by`` in a few words, for a finding's evidence line."""
        if self.overridden:
            return f"operator override ({self.action.value})"
        if not self.known:
            return "not in NVIDIA's catalog (monitor)"
        if self.note:
            return self.note.split(":")[0]
        return f"NVIDIA bucket {self.bucket}"


def _split_name(text: str) -> tuple[str, str]:
    mnemonic, _, description = text.partition(" - ")
    return mnemonic.strip(), description.strip()


def read_bundled_rows() -> list[dict[str, str]]:
    """The bundled catalog rows (read once per ``load_catalog``)."""
    text = resources.files("healthagent.policy").joinpath("xid_catalog.csv").read_text(encoding="utf-8")
    return list(csv.DictReader(io.StringIO(text)))


class Catalog:
    """XID -> CatalogEntry, with the operator's XID and SXid overrides applied."""

    def __init__(self, entries: dict[int, CatalogEntry], xid_overrides: dict[int, Action],
                 sxid_overrides: dict[int, Action]) -> None:
        self._entries = entries
        self._xid_overrides = xid_overrides
        self._sxid_overrides = sxid_overrides

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CatalogEntry]:
        return [self._entries[x] for x in sorted(self._entries)]

    def lookup(self, xid: int) -> CatalogEntry:
        entry = self._entries.get(xid)
        if entry is not None:
            return entry
        override = self._xid_overrides.get(xid)
        return CatalogEntry(
            xid=xid, name=f"UNKNOWN_XID_{xid}", description="not in NVIDIA's catalog",
            action=override or Action.MONITOR, nvidia_resolution="", overridden=override is not None,
        )

    def lookup_sxid(self, sxid: int, severity: str = "") -> CatalogEntry:
        """NVSwitch SXids: no bundled catalog. The driver's severity decides (``SXID_ACTIONS``:
        fatal -> reboot_node, non-fatal or not stated -> monitor) unless the operator maps the SXid."""
        override = self._sxid_overrides.get(sxid)
        return CatalogEntry(
            xid=sxid, name=f"SXID_{sxid}", description="NVSwitch error (see the Fabric Manager guide)",
            action=override or SXID_ACTIONS[severity], nvidia_resolution="", overridden=override is not None,
        )

    def decide(self, event: XidEvent) -> tuple[CatalogEntry, Action, str]:
        """The entry, the action and why, for one event (XID 154 reads the driver's text)."""
        if event.kind == "sxid":
            severity = sxid_severity(event.message or event.line)
            entry = self.lookup_sxid(event.xid, severity)
            if entry.overridden:
                return entry, entry.action, f"{SXID_WORDS[severity]}; {entry.reason()}"
            return entry, entry.action, f"{SXID_WORDS[severity]} ({SXID_WHY[severity]})"
        xid = FALLEN_OFF_BUS_XID if event.kind == "fallen_off_bus" else event.xid
        entry = self.lookup(xid)
        if xid == RECOVERY_XID and not entry.overridden:
            action, why = recovery_action(f"{event.message} {event.line}")
            return entry, action, why
        return entry, entry.action, entry.reason()


def load_catalog(policy: Policy) -> Catalog:
    """The bundled catalog merged with the policy's XID overrides (the CSV is read here, once)."""
    entries: dict[int, CatalogEntry] = {}
    for row in read_bundled_rows():
        xid = int(row["xid"])
        mnemonic, description = _split_name(row["name"])
        action = Action.parse(row["action"])
        entries[xid] = CatalogEntry(
            xid=xid, name=mnemonic, description=description, action=action,
            nvidia_resolution=row["nvidia_resolution"], note=row["note"], catalog_action=action,
        )
    for xid, action in policy.xid_actions.items():
        if xid in entries:
            entries[xid] = replace(entries[xid], action=action, overridden=True)
    return Catalog(entries, dict(policy.xid_actions), dict(policy.sxid_actions))


# -- XID 154: the driver's own recovery action ------------------------------------------------------

# Text the driver prints after "to 0xN (...)"; first match wins, so the longer phrases come first.
# NVIDIA's catalog lists None, Drain P2P, Drain and Reset, GPU Reset Required, Node Reboot Required;
# drivers also print "OS Reboot" and "PF FLR" (a function-level reset of the GPU).
_RECOVERY_TEXT: tuple[tuple[str, Action], ...] = (
    ("drain and reset", Action.RESET_GPU),
    ("drain p2p", Action.RESTART_APP),
    ("node reboot", Action.REBOOT_NODE),
    ("os reboot", Action.REBOOT_NODE),
    ("system reboot", Action.REBOOT_NODE),
    ("reboot", Action.REBOOT_NODE),
    ("gpu reset", Action.RESET_GPU),
    ("bus reset", Action.RESET_GPU),
    ("flr", Action.RESET_GPU),
    ("reset", Action.RESET_GPU),
    ("none", Action.MONITOR),
)
# NVML's nvmlDeviceGpuRecoveryAction_t values, used when the text is missing but the code is there.
_RECOVERY_CODES: dict[int, Action] = {
    0: Action.MONITOR, 1: Action.RESET_GPU, 2: Action.REBOOT_NODE, 3: Action.RESTART_APP,
    4: Action.RESET_GPU, 6: Action.RESET_GPU, 7: Action.REBOOT_NODE,
}
_RECOVERY_RE = re.compile(r"\bto\s+(0x[0-9a-fA-F]+|\d+)?\s*(?:\(([^)]*)\))?", re.IGNORECASE)


def recovery_action(text: str) -> tuple[Action, str]:
    """XID 154's "recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)" -> action.

    Drain P2P means "stop every process doing peer-to-peer traffic" (restart_app); Drain and Reset
    and GPU Reset Required mean reset_gpu; Node Reboot Required means reboot_node; None means the
    other XIDs need nothing more. Unreadable text is monitor, quoted, never dropped.
    """
    for match in _RECOVERY_RE.finditer(text or ""):
        code_text, words = match.group(1), (match.group(2) or "").strip()
        if words:
            lowered = words.lower()
            for phrase, action in _RECOVERY_TEXT:
                if phrase in lowered:
                    return action, f"XID 154: the driver's recovery action is {words!r} -> {action.value}"
        if code_text:
            code = int(code_text, 16) if code_text.lower().startswith("0x") else int(code_text)
            if code in _RECOVERY_CODES:
                action = _RECOVERY_CODES[code]
                return action, f"XID 154: the driver's recovery action code {code_text} -> {action.value}"
    quoted = " ".join((text or "").split())[:160]
    return Action.MONITOR, f"XID 154: recovery action not recognised in {quoted!r} -> monitor"

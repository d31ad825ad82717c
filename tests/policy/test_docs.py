"""docs/findings.md is the runbook alerts link to: every code and every threshold must be there."""

import re
from pathlib import Path

from healthagent.policy.findings import FINDING_CODES, FINDINGS
from healthagent.policy.settings import THRESHOLDS

DOC_PATH = Path(__file__).parents[2] / "docs" / "findings.md"
DOC = DOC_PATH.read_text(encoding="utf-8")

# The stable finding codes (docs, alerts and dashboards use them).
STABLE_CODES = """GPU_XID NVSWITCH_SXID GPU_ECC_DBE GPU_SBE_STORM GPU_ROW_REMAP_FAILURE GPU_ROW_REMAP_PENDING
GPU_RETIRED_PAGES GPU_RETIRED_PAGES_PENDING GPU_LOST GPU_MISSING GPU_INIT_FAILED GPU_NVLINK_ERRORS GPU_PCIE_REPLAY
GPU_THERMAL_THROTTLE GPU_POWER_THROTTLE EFA_DEVICE_MISSING EFA_ADMIN_QUEUE_STUCK EFA_CMD_ERRORS
EFA_UNRESPONSIVE_REMOTE EFA_IMPAIRED_REMOTE EFA_RETRANS_TIMEOUT EFA_RX_DROPS EFA_WR_ERRORS
RDMA_PORT_DOWN RDMA_PORT_DEGRADED RDMA_LINK_FLAPPING RDMA_SYMBOL_ERRORS RDMA_LINK_ERRORS RDMA_RCV_ERRORS
RDMA_XMIT_DISCARDS RDMA_DEVICE_MISSING RDMA_ADAPTER_EVENT""".split()


def sections() -> dict[str, str]:
    parts = re.split(r"^## (\S+)\s*$", DOC, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_the_stable_codes_stay():
    """A code is a contract: none of these may be renamed or dropped (new ones join the catalog)."""
    assert set(STABLE_CODES) <= set(FINDING_CODES)


def test_every_code_has_a_section_with_meaning_evidence_action_runbook():
    found = sections()
    for code in FINDING_CODES:
        assert code in found, f"docs/findings.md has no '## {code}' heading"
        body = found[code]
        for part in ("**Meaning.**", "**Evidence.**", "**Action.**", "**Runbook.**"):
            assert part in body, f"{code} lacks {part}"
        assert FINDINGS[code].runbook == f"docs/findings.md#{code.lower()}"


def test_every_threshold_is_in_the_settings_reference_with_its_default():
    """The runbook links the generated settings reference, which lists each threshold's default."""
    assert "(reference/settings.md#thresholds)" in DOC
    reference = (DOC_PATH.parent / "reference" / "settings.md").read_text()
    for name, spec in THRESHOLDS.items():
        if spec.default is not None:
            assert f"- `{name}` (" in reference and f"default `{spec.default:,g}`" in reference, name


def test_no_port_down_rule_is_explained():
    assert "no port-down rule" in sections()["EFA_DEVICE_MISSING"]

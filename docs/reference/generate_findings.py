"""Write docs/reference/findings.md from the finding catalog (healthagent/policy/findings.csv) and
the thresholds (healthagent/policy/thresholds.csv).

    python docs/reference/generate.py                    # rewrite every reference page, this one too
    python docs/reference/generate_findings.py           # rewrite docs/reference/findings.md only
    python docs/reference/generate_findings.py --check   # exit 1 when the file is stale

Generated, not written by hand: a copy of the catalog drifts. The output is deterministic, so the
test suite renders it and compares it with the committed file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from page_text import COMMAND, first_line, item, row as table_row

from healthagent.effects.conditions import VOCABULARIES
from healthagent.policy.debounce import BUILT_IN
from healthagent.policy.finding_catalog import CATALOG_FILE, CatalogRow, catalog_rows
from healthagent.policy.threshold_catalog import THRESHOLDS, THRESHOLDS_FILE

TARGET = Path(__file__).with_name("findings.md")
HEADER = f"""{first_line(f"`healthagent/policy/{CATALOG_FILE}`")}

# Finding codes (generated)

Generated from `healthagent/policy/{CATALOG_FILE}` and `healthagent/policy/{THRESHOLDS_FILE}` by
`{COMMAND}`; do not edit by hand. The runbook of each code is its section in
[findings.md](../findings.md); `healthagent explain CODE` prints the same row with the policy in force.

The table: each code, what it means, the action it demands (`per event`: the XID or ConnectX
catalog decides) and when it opens by default (the `findings:` rule of the policy file). Below it,
per code: the node condition it turns (default vocabulary / `eks`), its condition reason under
`eks` (the default vocabulary's reason is the code), SageMaker HyperPod's `fault-types` value and
the `thresholds:` keys its rule reads.
"""


def _condition(row: CatalogRow) -> str:
    area = "network" if row.condition == "network" else "gpu"
    return " / ".join(f"`{vocab.type_of(area)}`" for vocab in VOCABULARIES.values())


def _line(row: CatalogRow) -> str:
    return table_row((f"[`{row.code}`](../{row.runbook.removeprefix('docs/')})", row.title,
                      f"`{row.action}`" if row.action else "per event", BUILT_IN[row.code].rule.words()))


def _detail(row: CatalogRow) -> str:
    reason = f"`{row.eks_reason}`" + (" (coined)" if row.eks_reason_from == "coined" else "")
    keys = " ".join(f"`{key}`" for key in row.thresholds) or "none"
    return item(f"`{row.code}`:", f"condition {_condition(row)}; eks reason {reason}; HyperPod "
                                   f"{row.hyperpod_fault_type}; thresholds {keys}.")


def render() -> str:
    rows = catalog_rows()
    lines = [HEADER, "| code | meaning | action | opens |", "| --- | --- | --- | --- |"]
    lines += [_line(row) for row in rows]
    lines += ["", "## Per code", ""] + [_detail(row) for row in rows]
    lines += ["", "## Thresholds", "",
              "The `thresholds:` keys of the policy file: the default, its kind (`seconds`; `count`: a whole",
              "number of at least 1; `number`: 0 or more; `factor`: at least 1), what it means, where the",
              "default comes from, and the codes whose rules read it.", ""]
    for name, spec in THRESHOLDS.items():
        codes = " ".join(f"`{row.code}`" for row in rows if name in row.thresholds) or "none"
        default = "from the `findings:` table" if spec.default is None else f"{spec.default:g}"
        lines.append(item(f"`{name}` ({spec.kind}, default {default}):",
                          f"{spec.help}. Source: {spec.source or '-'}. Read by {codes}."))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The finding catalog is the one table of finding codes: every code a rule produces has its row,
every row has a rule, the views agree with the rows, and the generated reference is current."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import healthagent.policy
from healthagent.effects.conditions import EKS_REASONS, NETWORK_AREA, area_of
from healthagent.effects.hyperpod import fault_type_of
from healthagent.model import Action
from healthagent.policy.debounce import BUILT_IN
from healthagent.policy.finding_catalog import COLUMNS, CatalogError, catalog, catalog_rows, parse_catalog
from healthagent.policy.findings import FINDINGS
from healthagent.policy.threshold_catalog import COLUMNS as THRESHOLD_COLUMNS
from healthagent.policy.threshold_catalog import KINDS as THRESHOLD_KINDS
from healthagent.policy.threshold_catalog import THRESHOLDS, parse_thresholds

ROOT = Path(__file__).parents[2]
POLICY_DIR = Path(healthagent.policy.__file__).parent
CODE_SHAPE = re.compile(r"(?:GPU|NVSWITCH|EFA|RDMA|PCIE)_[A-Z0-9_]+")


def policy_modules() -> dict[str, object]:
    return {info.name: importlib.import_module(f"healthagent.policy.{info.name}")
            for info in pkgutil.iter_modules([str(POLICY_DIR)])}


def rule_modules() -> dict[str, tuple[str, ...]]:
    """Every policy module that declares the codes its rules produce."""
    return {name: tuple(module.PRODUCES) for name, module in policy_modules().items() if hasattr(module, "PRODUCES")}


def test_every_code_a_rule_produces_has_a_row_and_every_row_a_rule():
    produced = [code for codes in rule_modules().values() for code in codes]
    assert len(produced) == len(set(produced)), "a code is declared by two rule modules"
    assert set(produced) - set(catalog()) == set(), "codes produced by a rule without a catalog row"
    assert set(catalog()) - set(produced) == set(), "catalog rows that no rule produces"


def test_a_module_that_raises_findings_declares_what_it_produces():
    """A rule module builds Signals (or opens incidents in the book): it must declare PRODUCES, and
    every code-shaped literal in it must be one it declares."""
    declared = rule_modules()
    for path in sorted(POLICY_DIR.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "Signal(" not in source and "Incident(" not in source:
            continue
        if path.stem in ("book", "incidents_state"):
            continue  # the book defines Signal and Incident; it raises nothing by itself
        assert path.stem in declared, f"{path.name} raises findings but declares no PRODUCES"
        literals = {node.value for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and CODE_SHAPE.fullmatch(node.value)}
        assert literals <= set(declared[path.stem]), f"{path.name}: {sorted(literals - set(declared[path.stem]))}"


def test_the_views_are_the_rows():
    rows = catalog()
    assert list(FINDINGS) == list(rows) == list(BUILT_IN) == list(EKS_REASONS)
    for code, row in rows.items():
        info = FINDINGS[code]
        assert (info.title, info.next_steps, info.runbook) == (row.title, row.next_steps, row.runbook)
        assert info.action == (Action.parse(row.action) if row.action else None)
        built_in = BUILT_IN[code]
        assert (built_in.reads, built_in.condition) == (row.reads, row.kind == "condition")
        assert (built_in.rule.count, built_in.rule.window, built_in.rule.sustain,
                built_in.rule.after_boot_grace) == (row.count, row.window, row.sustain, row.after_boot_grace)
        assert EKS_REASONS[code][0] == row.eks_reason
        assert (area_of(code) == NETWORK_AREA) == (row.condition == "network")
        assert fault_type_of(code) == row.hyperpod_fault_type


def test_every_row_is_complete():
    for row in catalog_rows():
        assert row.title and row.eks_reason and row.hyperpod_fault_type, row.code
        assert row.runbook == f"docs/findings.md#{row.code.lower()}", row.code
        assert set(row.thresholds) <= set(THRESHOLDS), (row.code, set(row.thresholds) - set(THRESHOLDS))
        assert row.action == "" or Action.parse(row.action), row.code
        assert row.next_steps or row.action == "", f"{row.code}: a fixed action needs its next steps"


@pytest.mark.parametrize("text,error", [
    ("code,title\nX,y\n", "the columns must be"),
    (",".join(COLUMNS) + "\nA_B,t,gpu,monitor,gpu,event,1,,0,0,,R,nma,GPU,r,s\nA_B,t,gpu,monitor,gpu,event,1,,0,0,,R,nma,GPU,r,s\n",
     "A_B has two rows"),
    (",".join(COLUMNS) + "\nA_B,t,disk,monitor,gpu,event,1,,0,0,,R,nma,GPU,r,s\n", "condition 'disk' is not one of"),
    (",".join(COLUMNS) + "\nA_B,t,gpu,monitor,gpu,event,0,,0,0,,R,nma,GPU,r,s\n", "count must be at least 1"),
    (",".join(COLUMNS) + "\nA_B,t,gpu,monitor,gpu,event,1,-5,0,0,,R,nma,GPU,r,s\n", "window '-5' is not a duration"),
])
def test_a_malformed_catalog_is_refused_by_name(text, error):
    with pytest.raises(CatalogError, match=re.escape(error)):
        parse_catalog(text)


def test_the_runbook_page_points_at_the_generated_reference():
    """The table itself is checked with every generated page (tests/test_references_current.py)."""
    assert "reference/findings.md" in (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")


def test_a_rate_rules_threshold_is_in_its_row():
    """The thresholds column names what the rule reads: the rate rules' own keys are there."""
    from healthagent.policy import rules_efa, rules_rdma
    for code, _, key in rules_efa.RATE_RULES + rules_rdma.RATE_RULES:
        assert key in catalog()[code].thresholds, (code, key)


def test_every_threshold_a_row_names_exists_and_every_threshold_is_read_by_a_row():
    """thresholds.csv and the rows' thresholds column agree both ways: a row cannot name a key the
    policy file refuses, and a threshold no rule reads would be a setting that does nothing."""
    named = {key for row in catalog_rows() for key in row.thresholds}
    assert named - set(THRESHOLDS) == set(), "rows name thresholds that thresholds.csv lacks"
    assert set(THRESHOLDS) - named == set(), "thresholds that no row's rule reads"


def test_the_thresholds_table_states_each_default_and_its_source():
    for name, spec in THRESHOLDS.items():
        assert spec.help and spec.source, name
        assert spec.kind in THRESHOLD_KINDS, name
    # The two keys that set a field of several rows take their default from those rows.
    assert THRESHOLDS["throttle_sustain_seconds"].default == BUILT_IN["GPU_THERMAL_THROTTLE"].rule.sustain
    assert THRESHOLDS["condition_raise_evaluations"].default == BUILT_IN["GPU_LOST"].rule.count


@pytest.mark.parametrize("text,error", [
    ("name,default\nx,1\n", "the columns must be"),
    (",".join(THRESHOLD_COLUMNS) + "\nx,1,seconds,,,h,s\nx,1,seconds,,,h,s\n", "x has two rows"),
    (",".join(THRESHOLD_COLUMNS) + "\nx,1,minutes,,,h,s\n", "kind 'minutes' is not one of"),
    (",".join(THRESHOLD_COLUMNS) + "\nx,,seconds,,,h,s\n", "x: a default is needed"),
    (",".join(THRESHOLD_COLUMNS) + "\nx,-1,seconds,,,h,s\n", "default '-1' is not a number of 0 or more"),
    (",".join(THRESHOLD_COLUMNS) + "\nx,ten,seconds,,,h,s\n", "default 'ten' is not a number"),
])
def test_a_malformed_thresholds_table_is_refused_by_name(text, error):
    with pytest.raises(CatalogError, match=re.escape(error)):
        parse_thresholds(text)

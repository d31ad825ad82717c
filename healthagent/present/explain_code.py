"""``healthagent explain CODE``: what a finding code means, when it opens and where that rule came from.

An operator who tuned a rule (``findings:`` in the policy file, or one of the old threshold keys)
needs to see the rule the agent actually runs: the built-in table merged with the file, each
field saying whether it is the built-in value or which key of which file set it. During an
incident the same screen answers "why did this open now, and not at boot?".
"""

from __future__ import annotations

from healthagent.effects.conditions import EKS_REASONS, NMA
from healthagent.policy.debounce import EVENTS, FIELDS, READING_WORDS, Rule, row
from healthagent.policy.debounce_file import BUILT_IN_ORIGIN
from healthagent.policy.finding_catalog import catalog
from healthagent.policy.findings import FINDINGS, duration_words
from healthagent.policy.settings import Policy
from healthagent.policy.scope import explain_scope
from healthagent.present.explain import PERSISTENCE

# The thresholds that can end an event finding below reboot_node, first match in the row's
# thresholds (the catalog's column) wins; none of them: counter_quiet_seconds.
_QUIET_KEYS = ("xid_window_seconds", "counter_window_seconds", "mlx5_window_seconds", "counter_quiet_seconds")
# Codes whose action a catalog decides per event, and where that catalog is.
_CATALOG_ACTION = {"RDMA_ADAPTER_EVENT": "the mlx5 catalog's, per event (healthagent/policy/mlx5_events.csv; "
                                         "a policy file's `mlx5:` overrides a row)"}


def field_words(rule: Rule, name: str) -> str:
    """One field of a rule as a person reads it."""
    if name == "count":
        return "1, at once" if rule.count <= 1 else str(rule.count)
    value = getattr(rule, name)
    if name == "window" and value is None:
        return "none, the count is of readings in a row" if rule.count > 1 else "none"
    return "none" if not value else duration_words(value)


def rule_lines(code: str, policy: Policy) -> list[str]:
    """``Opens: ...`` and one line per field with where it came from."""
    rule, built_in = policy.rule(code), row(code).rule
    lines = [f"Opens: {rule.words()}" + ("" if policy.enabled(code) else "; the rule is off (disabled_rules)")]
    for name in FIELDS:
        origin = policy.rules.origin(code, name)
        where = BUILT_IN_ORIGIN if origin == BUILT_IN_ORIGIN else (
            f"policy file {policy.source}: {origin}" if policy.source else f"policy: {origin}")
        if origin != BUILT_IN_ORIGIN:
            where += f"; built-in: {field_words(built_in, name)}"
        lines.append(f"  {name}: {field_words(rule, name)} ({where})")
    return lines


def closes_words(code: str, policy: Policy) -> str:
    """How an open finding of this code closes (not debounced: as the finding's kind always did)."""
    action = FINDINGS[code].action
    if action in PERSISTENCE:
        return PERSISTENCE[action]
    if row(code).condition:
        return (f"after {policy.condition_clear_evaluations:g} readings in a row without it "
                "(condition_clear_evaluations)")
    quiet = next((k for k in _QUIET_KEYS if k in catalog()[code].thresholds), "counter_quiet_seconds")
    what = "finding" if code in _CATALOG_ACTION else "incident"
    below = (f" when below reboot_node; a reboot_node or replace_node {what} as for that action"
             if action is None else "")
    return f"{duration_words(policy.thresholds[quiet])} after its last occurrence ({quiet}){below}"


def explain_code(code: str, policy: Policy) -> str:
    info = FINDINGS[code]
    reads = row(code).reads
    kind = "a condition" if row(code).condition else "an event"
    lines = [f"{code}: {info.title}",
             "Action: " + (info.action.value if info.action is not None else _CATALOG_ACTION.get(
                 code, "the XID catalog's, per XID (`healthagent explain XID`)")),
             explain_scope(code, info.action, policy.scope),
             "Signal: " + ("an event, logged at one moment" if reads == EVENTS else
                           f"{kind}, judged at {READING_WORDS[reads]}")]
    lines += rule_lines(code, policy)
    lines.append(f"Closes: {closes_words(code, policy)}")
    lines += catalog_lines(code, policy)
    example = "count: 3, window: 10m, " + ("" if reads == EVENTS else "sustain: 5m, ") + "after_boot_grace: 15m"
    lines.append(f"To change when it opens: in the policy file (--policy-file FILE, or the policy_file setting) set "
                 f"`findings: {{{code}: {{{example}}}}}`, any of these")
    if policy.source:
        lines.append(f"Policy file: {policy.source}")
    steps = (info.next_steps.format(gpu="the GPU", index="<index>", device="the device", xid="<xid>")
             if info.next_steps else "see `healthagent explain XID` for the XID's own steps.")
    lines.append(f"What to do: {steps[:1].upper()}{steps[1:]}")
    lines.append(f"Runbook: {info.runbook}")
    return "\n".join(lines)


def catalog_lines(code: str, policy: Policy) -> list[str]:
    """The rest of the code's catalog row: the condition it turns, the thresholds its rule reads
    (with the values in force) and its reason in each vocabulary."""
    row = catalog()[code]
    lines = [f"Condition: the node's {'network' if row.condition == 'network' else 'GPU'} condition"]
    if row.thresholds:
        lines.append("Thresholds: " + ", ".join(f"{key} {policy.thresholds[key]:g}" for key in row.thresholds))
    reason, origin = EKS_REASONS[code]
    source = f"the {origin}'s" if origin == NMA else origin
    lines.append(f"Reasons: {code} (healthagent vocabulary); {reason} (eks, {source}); "
                 f"fault-types {row.hyperpod_fault_type} (SageMaker HyperPod)")
    return lines

"""What the alerts tell on-call about the agent's behaviour, checked against that behaviour.

An alert's summary and description (and its row in docs/alerts.md) say what the agent has done
to the node: which taint, with which effect, after how long, for which findings. Those words are
read here as *claims*, each found by a pattern and checked by a function against ``Behaviour``,
which derives the facts from the code itself under given settings and policy: the taint plan
(``effects.node_desired.plan_taint``, as ``effects.plan`` calls it), the findings' default actions
and rules, the XID and ConnectX catalogs, the thresholds. Nothing here is a copy of a number.

A claim needs a *situation*: the node state the alert fires in, read from its expression (the
verdict ``reboot_node``, a node held by the budget, a node past its disruptive step).

So that a new sentence cannot slip past unchecked, every *topic word* of the texts (a taint
effect, the grace, an eviction, pods staying, a finding code the agent acts on, a number of
seconds, a policy default) must lie inside some claim's match: words about behaviour that no
claim reads fail as "unchecked".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from healthagent.config import Settings
from healthagent.effects.node_desired import NO_EXECUTE, NO_SCHEDULE, TAINT_ACTIONS, TAINT_BOOT_ANNOTATION, plan_taint
from healthagent.effects.plan import decide
from healthagent.model import Action, Verdict
from healthagent.policy.catalog import load_catalog
from healthagent.policy.findings import FINDINGS
from healthagent.policy.mlx5_catalog import load_mlx5_catalog
from healthagent.policy.settings import Policy
from tests.support.observability import REPO

ALERTS_DOC = REPO / "docs" / "alerts.md"
TEMPLATE = re.compile(r"\{\{.*?\}\}", re.S)
TOPIC = re.compile(r"NoSchedule|NoExecute|\bgrace\b|\bevict\w*|keep running|pods stay|pods on it|"
                   r"takes the node out|\bXID \d+|row-remap failure|retired pages|lost GPU|\b\d+ s\b|"
                   r"policy's [A-Z_0-9]+ default|after (?:a|the) reboot")
# The example phrases an alert may give for a verdict, and the finding code each one is.
EXAMPLES = {"a row-remap failure": "GPU_ROW_REMAP_FAILURE", "too many retired pages": "GPU_RETIRED_PAGES",
            "a lost GPU": "GPU_LOST"}
# A policy default an alert copies into its expression: the thresholds that make it.
POLICY_NUMBERS = {"GPU_SBE_STORM": ("sbe_storm_per_minute", "sbe_window_seconds")}


@dataclass(frozen=True)
class Behaviour:
    """The agent's behaviour under ``settings`` and ``policy``, derived from the code."""

    settings: Settings = field(default_factory=Settings)
    policy: Policy = field(default_factory=Policy)

    @property
    def grace(self) -> float:
        return self.settings.replace_noexecute_grace_seconds

    def effect(self, action: Action, *, after_grace: bool, held: bool = False) -> str:
        """The effect of the agent's taint for ``action``: when it goes on, or once the grace has
        passed (``held``: the node has no budget slot)."""
        key = self.settings.taint_key
        if not after_grace:
            node: dict = {"spec": {"taints": []}}
            since, now = None, 0.0
        else:
            node = {"spec": {"taints": [{"key": key, "value": action.value, "effect": NO_SCHEDULE}]}}
            since, now = 0.0, self.grace + 1.0
        plan = plan_taint(action=action, node=node, taint_key=key, grace_seconds=self.grace, since=since,
                          now=now, held=held, reboot_noexecute=self.settings.reboot_node_noexecute)
        return plan.taint.effect if plan.taint else ""

    def shown_after_reboot(self, action: Action, rebooted: bool) -> Action:
        """The action the node shows with the agent's taint for ``action`` on it and no finding
        open any more: before the node reports a new boot id, and after."""
        node = {"metadata": {"annotations": {TAINT_BOOT_ANNOTATION: "boot-a"}},
                "spec": {"taints": [{"key": self.settings.taint_key, "value": action.value, "effect": NO_SCHEDULE}]},
                "status": {"nodeInfo": {"bootID": "boot-b" if rebooted else "boot-a"}}}
        return decide(Verdict.of((), 0.0), node, None, self.settings.taint_key).shown

    def code_action(self, code: str) -> Action | None:
        return FINDINGS[code].action

    def xid_action(self, xid: int) -> Action:
        return load_catalog(self.policy).lookup(xid).action

    def mlx5_actions(self) -> dict[str, Action]:
        return {e.event: e.action for e in load_mlx5_catalog(self.policy.mlx5_actions).entries()}


@dataclass(frozen=True)
class Situation:
    """The node state an alert fires in: the verdicts it covers, whether the budget holds the node."""

    actions: tuple[Action, ...] = ()
    held: bool = False


def situation_of(expr: str) -> Situation:
    verdict = re.search(r'healthagent_node_action\{action="(\w+)"\}', expr)
    if verdict:
        return Situation((Action(verdict.group(1)),))
    if "healthagent_budget_holding_taint" in expr or "healthagent_budget_slots_held" in expr:
        return Situation(tuple(TAINT_ACTIONS), held=True)
    if re.search(r'healthagent_remediation_stage\{stage=~"disrupting', expr):
        return Situation(tuple(TAINT_ACTIONS))
    return Situation()


@dataclass(frozen=True)
class Text:
    """One text on-call reads about an alert: where it is, its words (templates removed), its expression."""

    alert: str
    where: str  # "summary", "description" or "docs/alerts.md"
    words: str
    expr: str

    @property
    def situation(self) -> Situation:
        return situation_of(self.expr)


Check = Callable[[re.Match, Text, Behaviour], Iterable[str]]


@dataclass(frozen=True)
class Claim:
    name: str
    pattern: re.Pattern
    check: Check


def _needs_actions(text: Text) -> tuple[Action, ...]:
    return text.situation.actions


def _evicts_after_grace(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    if match.group("grace") and float(match.group("grace")) != facts.grace:
        yield f"says the grace is {match.group('grace')} s; it is {facts.grace:g} s"
    if not _needs_actions(text):
        yield "names a taint but fires in no state of a verdict"
    for action in _needs_actions(text):
        first = facts.effect(action, after_grace=False)
        later = facts.effect(action, after_grace=True)
        if (first, later) != (NO_SCHEDULE, NO_EXECUTE):
            yield f"says NoSchedule, then NoExecute after the grace; {action.value} gets {first}, then {later}"


def _pods_stay(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    situation = text.situation
    if not situation.actions:
        yield "says the pods stay but fires in no state of a verdict"
    for action in situation.actions:
        later = facts.effect(action, after_grace=True, held=situation.held)
        if later != NO_SCHEDULE:
            state = "held by the budget" if situation.held else "with a budget slot"
            yield f"says the pods stay on the node; {action.value} {state} gets {later} after the grace"


def _held_at_no_schedule(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    for action in TAINT_ACTIONS:
        held = facts.effect(action, after_grace=True, held=True)
        if held != NO_SCHEDULE:
            yield f"says the budget holds the node at NoSchedule; {action.value} held gets {held}"


def _evicted(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    if not any(facts.effect(a, after_grace=True) == NO_EXECUTE for a in _needs_actions(text)):
        yield "says the pods are evicted; no verdict it covers gets NoExecute"


def _takes_out(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    code, named = match.group("code"), match.group("action")
    if code not in FINDINGS:
        yield f"names {code}, which is no finding code"
        return
    if code == "RDMA_ADAPTER_EVENT":
        events = set(re.findall(r"[a-z0-9_]+", (re.search(r'event=~"([^"]*)"', text.expr) or [None, ""])[1]))
        actions = {facts.mlx5_actions().get(e) for e in events} or {None}
    else:
        actions = {facts.code_action(code)}
    for action in actions:
        if action not in TAINT_ACTIONS:
            yield f"says {code} takes the node out; its action is {action.value if action else 'unknown'}"
        elif named and action.value != named:
            yield f"says {code} is {named}; its action is {action.value}"


def _sustain(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    code, seconds = match.group("code"), float(match.group("seconds"))
    sustain = facts.policy.rule(code).sustain
    if sustain != seconds:
        yield f"says {code} opens after {seconds:g} s; its rule's sustain is {sustain:g} s"


def _xids(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    for number in re.findall(r"\d+", match.group("xids")):
        action = facts.xid_action(int(number))
        if (action,) != _needs_actions(text):
            yield f"gives XID {number} as an example; its catalog action is {action.value}"


def _example(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    code = EXAMPLES[match.group(0)]
    action = facts.code_action(code)
    if (action,) != _needs_actions(text):
        yield f"gives {match.group(0)!r} ({code}) as an example; its action is {action.value if action else None}"


def _repeat(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    if facts.policy.mlx5_repeat_seconds <= 0:
        yield "says a repeat after a reboot is replace_node; mlx5_repeat_seconds is 0 (never)"


def _clears_after_reboot(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    for action in _needs_actions(text):
        before, after = facts.shown_after_reboot(action, False), facts.shown_after_reboot(action, True)
        if (before, after) != (action, Action.NONE):
            yield (f"says the taint clears after the reboot once the checks pass; {action.value} with no finding "
                   f"shows {before.value} before the reboot and {after.value} after it")


def _policy_default(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    code = match.group("code")
    if code not in POLICY_NUMBERS:
        yield f"says it uses the policy's {code} default, which the claims do not know"
        return
    per_minute, window = (facts.policy.thresholds[k] for k in POLICY_NUMBERS[code])
    if not re.search(rf"\* 60 > {per_minute:g}\b", text.expr):
        yield f"says it is {code}'s default; the expression's rate is not > {per_minute:g} per minute"
    if f"[{window / 60:g}m]" not in text.expr:
        yield f"says it is {code}'s default; the expression's window is not {window / 60:g} minutes"


def _threshold(match: re.Match, text: Text, facts: Behaviour) -> Iterable[str]:
    if not re.search(rf"> {match.group('seconds')}\b", text.expr):
        yield f"says more than {match.group('seconds')} s; the expression does not compare with it"


CLAIMS = (
    Claim("NoSchedule, then NoExecute after the grace", re.compile(
        r"taint(?:s|ed)? the node NoSchedule and, after its grace"
        r"(?: \((?:replace_noexecute_grace_seconds, )?(?P<grace>\d+) s by default\))?, NoExecute"),
        _evicts_after_grace),
    Claim("the pods stay on the node", re.compile(
        r"(?:taint[\w ]*? is )?NoSchedule only|pods (?:already on the node )?keep running|"
        r"(?:running|job's) pods stay|with its job's pods on it"), _pods_stay),
    Claim("the budget holds the node at NoSchedule", re.compile(
        r"holds? (?:it|node|the node)?\s?(?:back|at NoSchedule)|keeps it at NoSchedule|stays at NoSchedule"),
        _held_at_no_schedule),
    Claim("the pods are evicted", re.compile(r"its pods are evicted"), _evicted),
    Claim("a finding takes the node out", re.compile(
        r"takes the node out \((?P<code>[A-Z_0-9]+)(?:, (?P<action>[a-z_]+))?"), _takes_out),
    Claim("a finding opens after so many seconds", re.compile(
        r"\((?P<code>[A-Z_0-9]+)\) once the [\w ]+? for (?P<seconds>\d+) s\b"), _sustain),
    Claim("XIDs that lead to the verdict", re.compile(r"XID (?P<xids>\d+(?:, \d+)*(?:,? or \d+)?)"), _xids),
    Claim("findings that lead to the verdict", re.compile("|".join(map(re.escape, EXAMPLES))), _example),
    Claim("a repeat after a reboot escalates", re.compile(r"replace_node when it comes back after a reboot"),
          _repeat),
    Claim("the taint clears after the reboot", re.compile(
        r"the taint clears once the checks pass after the reboot"), _clears_after_reboot),
    Claim("the expression's own threshold", re.compile(r"more than (?P<seconds>\d+) s old"), _threshold),
    Claim("the expression is a policy default", re.compile(r"the policy's (?P<code>[A-Z_0-9]+) default"),
          _policy_default),
)


def words(text: str) -> str:
    """The text as read: templates out, whitespace and Markdown code quotes plain."""
    return re.sub(r"\s+", " ", TEMPLATE.sub(" ", text)).replace("`", "").strip()


def doc_rows(doc: str) -> dict[str, str]:
    """docs/alerts.md's table: alert name -> its "fires when" cell."""
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`Healthagent\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def texts(alerts: Iterable[Mapping], doc: str | None = None) -> list[Text]:
    """Every text of every alert: its summary, its description and its docs/alerts.md row."""
    rows = doc_rows(ALERTS_DOC.read_text(encoding="utf-8") if doc is None else doc)
    out = []
    for alert in alerts:
        annotations = alert.get("annotations") or {}
        for where in ("summary", "description"):
            out.append(Text(alert["alert"], where, words(annotations.get(where, "")), alert["expr"]))
        if alert["alert"] in rows:
            out.append(Text(alert["alert"], "docs/alerts.md", words(rows[alert["alert"]]), alert["expr"]))
    return out


def contradictions(alerts: Iterable[Mapping], facts: Behaviour, doc: str | None = None) -> list[str]:
    """Every claim that the behaviour contradicts, and every topic word no claim reads."""
    found = []
    for text in texts(alerts, doc):
        covered: list[tuple[int, int]] = []
        for claim in CLAIMS:
            for match in claim.pattern.finditer(text.words):
                covered.append(match.span())
                found += [f"{text.alert} ({text.where}): {claim.name}: {e}" for e in claim.check(match, text, facts)]
        for topic in TOPIC.finditer(text.words):
            if not any(start <= topic.start() and topic.end() <= end for start, end in covered):
                found.append(f"{text.alert} ({text.where}): unchecked claim about {topic.group(0)!r} in: "
                             f"{text.words[max(0, topic.start() - 60):topic.end() + 60]!r}")
    return found

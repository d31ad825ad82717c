"""One effects step as a pure function: ``step(state, verdict, node, budget, now, ...)``.

Everything the write side decides is here, over values: the ``EffectsState`` (``record.py``),
the verdict, the node as last seen (watch, read or a write's reply), the budget's answer, the
decision-clock time ``now`` and the wall time ``wall`` (for what the API and people read). No
I/O, no clock read, no logging: what a person should read comes back as ``notes``, the Events as
``EventSpec``s. ``effects/kube.py`` is the driver that reads the node, runs ``step`` once, makes
the one budget exchange the step asks for (``TAKE`` a slot when the plan has a disruptive step
ahead and the node holds none, ``CONFIRM`` the slot right before the disruptive step), writes the
plan that answer selects (``Step.under``: each answer's plan is made here, so a refused exchange
needs no second step), and keeps the state the API server confirmed.

A step has two outcomes: ``observed``, what the node told (kept whether or not the write lands:
an adopted taint, a recreated Node object, a taint removed by hand, another writer of a
condition), and ``state``, the state once the plan is on the node (the taint recorded with the
time its grace started, an applied operator clear, the budget episode).

What the node tells (``observe``): a recreated object (new uid) forgets the applied taint; the
agent's taint on the node is adopted (its grace starting at first sight on the decision clock
when the state has none: ``node_desired.grace_start``); the agent's confirmed taint gone while
the agent still wants it is an operator's clear,
which the step writes to the node as the clear annotation ("taint-removed-<time>") so that it is
a fact about the node like any other clear; a condition of the agent's types that another writer
owns is noticed once and left alone.

An operator's clear is carried out only with a verdict that accounts for it (``Verdict.
clear_token``): the loop reads the clear from the node and policy decides what it closes; until
then the plan holds the node as it is (``plan.hold_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from healthagent.effects.conditions import Vocabulary
from healthagent.effects.events import (
    NORMAL,
    EventSpec,
    budget_held_event,
    condition_taken_back_event,
    escalation_event,
    finding_event,
    foreign_condition_event,
    hyperpod_kept_event,
)
from healthagent.effects.node_desired import (
    CLEAR_ANNOTATION,
    NO_EXECUTE,
    NO_SCHEDULE,
    TAINT_ACTIONS,
    carries_no_execute,
    grace_start,
    owned_taints,
    reboot_outstanding,
)
from healthagent.effects.plan import (
    TAINT_REMOVED,
    Budget,
    ClearRequest,
    NodePlan,
    PlanSettings,
    blind_to,
    clear_request,
    needs_budget,
    plan_node,
)
from healthagent.effects.other_writers import left_alone, track
from healthagent.effects.record import AppliedTaint, EffectsState
from healthagent.model import Action, Finding, SourceHealth, Verdict

WARNING, INFO = "warning", "info"


@dataclass(frozen=True)
class StepContext:
    """What a step depends on besides the state, the verdict and the node."""

    node_name: str
    settings: PlanSettings
    vocab: Vocabulary
    health: tuple[SourceHealth, ...] = ()
    budget_note: str = ""  # the budget's last look in words (the held Event's text)
    budget_limits: str = ""  # the budget settings in words


@dataclass(frozen=True)
class Note:
    """A line for the log: its level and text (the driver logs it)."""

    level: str
    text: str


TAKE, CONFIRM = "take", "confirm"  # the budget exchanges a step may ask for before its write
LATER = "later"  # no exchange now: the take follows in the next reconcile, at once, once the NoSchedule is on
BUDGET_WORDS = "<the budget's answer>"  # in a held report until the exchange has answered (``Step.told``)


@dataclass(frozen=True)
class Step:
    observed: EffectsState  # what the node told: kept whether or not the plan lands
    state: EffectsState  # the state once the plan is on the node
    plan: NodePlan
    noticed: tuple[EventSpec, ...]  # Events about what was observed
    events: tuple[EventSpec, ...]  # Events once the plan lands
    notes: tuple[Note, ...]  # the observation's lines, then those once the plan lands
    seen_notes: tuple[Note, ...] = ()  # the observation's lines alone (the plan did not land)
    # The one budget exchange this step asks for before its write: "" (none), ``TAKE`` (a slot,
    # for a disruptive step ahead), ``CONFIRM`` (the slot held, right before the disruptive
    # step) or ``LATER`` (none now: the NoSchedule first, the take in the next reconcile). This step is what to write when the exchange allows; ``refused`` what to write
    # under each other answer.
    exchange: str = ""
    refused: "tuple[tuple[Budget, Step], ...]" = ()

    def under(self, answer: Budget) -> "Step":
        """What to write once the exchange answered ``answer``."""
        return next((s for budget, s in self.refused if budget is answer), self)

    def told(self, words: str) -> "Step":
        """This step with the budget's answer in words in its held report (the exchange's look)."""
        if not any(BUDGET_WORDS in e.note for e in self.events) and not any(BUDGET_WORDS in n.text
                                                                             for n in self.notes):
            return self
        return replace(self, events=tuple(replace(e, note=e.note.replace(BUDGET_WORDS, words)) for e in self.events),
                       notes=tuple(replace(n, text=n.text.replace(BUDGET_WORDS, words)) for n in self.notes))


def report_findings(state: EffectsState, findings: Iterable[Finding], wall: float,
                    node_name: str) -> tuple[EffectsState, tuple[EventSpec, ...], tuple[Note, ...]]:
    """The Event that first reports each new finding, and one for each finding whose action became
    more severe than the one last reported (XID 79 then 94 on one GPU: one incident, reboot_node
    then replace_node). A finding whose action falls back is not reported again."""
    specs, notes = [], []
    for finding in findings:
        try:
            before: Action | None = Action(state.reported_action(finding.key))
        except ValueError:  # never reported, or an action this version does not know
            before = None
        if before is None:
            specs.append(finding_event(finding, wall))
        elif finding.action.severity > before.severity:
            notes.append(Note(WARNING, f"effects node={node_name} finding={finding.code} escalated "
                                       f"from={before.value} to={finding.action.value}"))
            specs.append(escalation_event(finding, before, wall))
        else:
            continue
        state = state.with_reported(finding.key, finding.action.value)
    return state, tuple(specs), tuple(notes)


def due_at(state: EffectsState, grace_seconds: float, recheck_at: float | None) -> float | None:
    """When the effects next act by themselves, on the decision clock: the end of the grace of the
    agent's NoSchedule on the node (NoExecute, HyperPod's pending value and a gated condition are
    written then), or a held node's next look at the budget (``recheck_at``), whichever comes
    first. A time already past is the caller's to ignore: a step due then did not happen (held)."""
    times = [recheck_at] if recheck_at is not None else []
    if state.taint is not None and state.taint.effect == NO_SCHEDULE and grace_seconds > 0:
        times.append(state.taint.since + grace_seconds)
    return min(times) if times else None


def asks_budget(state: EffectsState, verdict: Verdict | None, node: dict, settings: PlanSettings) -> bool:
    """Would the plan take a disruptive step, now or after the grace, that a slot must cover?"""
    return needs_budget(verdict, node, state.taint, settings, state.clear_to_write)


def observe(state: EffectsState, node: dict, verdict: Verdict | None, now: float, wall: float,
            ctx: StepContext) -> tuple[EffectsState, tuple[EventSpec, ...], tuple[Note, ...]]:
    """What the node tells the agent about operators and other writers (see the module text)."""
    events: list[EventSpec] = []
    notes: list[Note] = []
    writers, changes = track(state.foreign, node, ctx.vocab, now, ctx.settings.foreign_quiet_seconds)
    state = replace(state, foreign=writers)
    for change in changes:
        other = change.writer
        if change.kind == "noticed":
            notes.append(Note(WARNING, f"effects node={ctx.node_name} condition={other.type} left_alone=1 "
                                       f"reason={other.reason or '-'}: {other.why}; the agent does not write it "
                                       "while the other writer does (one writer per condition)"))
            events.append(foreign_condition_event(other.type, other.why, wall))
        else:
            notes.append(Note(WARNING, f"effects node={ctx.node_name} condition={other.type} taken_back=1: its "
                                       f"other writer has been quiet for {change.quiet_seconds:.0f} s"))
            events.append(condition_taken_back_event(other.type, change.quiet_seconds, wall))
    uid = str((node.get("metadata") or {}).get("uid") or "")
    if uid and state.node_uid and uid != state.node_uid and state.taint is not None:
        notes.append(Note(WARNING, f"effects node={ctx.node_name} object recreated (uid {state.node_uid} -> "
                                   f"{uid}); the applied taint is forgotten and decided again"))
        state = replace(state, taint=None)
    if uid:
        state = replace(state, node_uid=uid)
    ours = owned_taints(node, ctx.settings.taint_key)
    if ours:
        state = replace(state, removing=False) if state.removing else state  # that removal did not land
        state, adopted = _adopt(state, node, ours, now, ctx.settings.taint_key)
        if adopted:
            notes.append(Note(INFO, f"effects node={ctx.node_name} adopted taint from the node "
                                    f"value={state.taint.value if state.taint else '-'}"))
    elif state.taint is not None and state.removing:
        state = replace(state, taint=None, removing=False)  # its own removal, whose reply was lost
    elif state.taint is not None and verdict is not None:
        # gone while the agent still wanted it (a replace taint, a taint action, or a reboot taint
        # held while unobserved): someone removed it by hand
        wanted = Action.most_severe([f.action for f in verdict.findings])
        awaited = state.taint.value == Action.REBOOT_NODE.value and reboot_outstanding(node)
        pending = clear_request(node)
        if pending is not None:  # removed with a clear the node carries already: that clear's, no second one
            state = replace(state, taint=None)
            notes.append(Note(WARNING, f"effects node={ctx.node_name} taint removed by hand with the clear "
                                       f"{CLEAR_ANNOTATION}={pending.token} on the node"))
        elif state.taint.value == Action.REPLACE_NODE.value or wanted in TAINT_ACTIONS \
                or blind_to(verdict, state.taint.code) or awaited:
            token = f"{TAINT_REMOVED}{int(wall)}"
            state = replace(state, taint=None, clear_to_write=token)
            notes.append(Note(WARNING, f"effects node={ctx.node_name} taint removed by hand: an operator's "
                                       f"clear, written to the node as {CLEAR_ANNOTATION}={token}"))
        else:
            state = replace(state, taint=None)  # our own removal whose reply was lost
    return state, tuple(events), tuple(notes)


def _adopt(state: EffectsState, node: dict, ours: list[dict], now: float,
           taint_key: str) -> tuple[EffectsState, bool]:
    main = max(ours, key=lambda t: (t.get("value") == Action.REPLACE_NODE.value, t.get("effect") == NO_EXECUTE))
    value, effect = str(main.get("value") or ""), str(main.get("effect") or "")
    recorded = state.taint
    if recorded is None or recorded.value != value:
        since = grace_start(node, taint_key, recorded.since if recorded else None, now)
        return replace(state, taint=AppliedTaint(value, effect, now if since is None else since)), True
    if recorded.effect != effect:
        return replace(state, taint=replace(recorded, effect=effect)), False
    return state, False


def cleared(clear: ClearRequest, wall: float, node_name: str) -> tuple[EventSpec, Note]:
    """An operator's clear carried out (policy closed what it covers): say so once."""
    how = ("the healthagent.io/clear annotation" if clear.via == "annotation"
           else "removing the agent's taint by hand")
    note = Note(WARNING, f"effects node={node_name} operator_clear={clear.token} via={clear.via} applied")
    spec = EventSpec(
        key=f"cleared/{clear.token}", type=NORMAL, reason="Cleared", action="Cleared",
        note=f"An operator cleared the node ({how}, token {clear.token}); the open findings it covered "
             "are closed, and the agent removed its taint and labels where nothing else needs them.", at=wall)
    return spec, note


def plan_for(state: EffectsState, verdict: Verdict | None, node: dict, budget: Budget, now: float,
             wall: float, ctx: StepContext) -> NodePlan:
    """The plan against ``node`` for an already observed state."""
    return plan_node(verdict, node, state.taint, budget, ctx.settings, now, ctx.health, left_alone(state.foreign),
                     wall, state.clear_to_write)


def landed(state: EffectsState, plan: NodePlan, basis: dict, verdict: Verdict | None, now: float,
           wall: float, ctx: StepContext) -> tuple[EffectsState, tuple[EventSpec, ...], tuple[Note, ...]]:
    """The state once ``plan`` (made against ``basis``) is on the node."""
    events: list[EventSpec] = []
    notes: list[Note] = []
    if plan.clear is not None:
        spec, note = cleared(plan.clear, wall, ctx.node_name)
        events.append(spec)
        notes.append(note)
        state = replace(state, taint=None)  # taken off with the clear, or decided again below
    if state.clear_to_write and plan.desired.annotations.get(CLEAR_ANNOTATION) == state.clear_to_write:
        state = replace(state, clear_to_write="")  # on the node now: a node fact like any clear
    had_taint = bool(owned_taints(basis, ctx.settings.taint_key))
    want = plan.taint.taint
    recorded = state.taint
    if want is None:
        if had_taint:
            state = replace(state, taint=None)
            notes.append(Note(INFO, f"effects node={ctx.node_name} taint=removed reason="
                                    f"{plan.clear.via if plan.clear else 'healthy'}"))
            if plan.clear is None:
                events.append(EventSpec(
                    key=f"cleared/{now:.3f}", type=NORMAL, reason="Cleared", action="Cleared",
                    note="Checks pass again: the agent removed its taint from the node.", at=wall))
    elif recorded is None or recorded.value != want.value:
        # an escalation (reboot_node, then replace_node) keeps the grace the first taint started
        since = recorded.since if recorded is not None and had_taint else now
        state = replace(state, taint=AppliedTaint(want.value, want.effect, since, plan.leading_code))
        notes.append(Note(WARNING, f"effects node={ctx.node_name} taint=added value={want.value} "
                                   f"effect={want.effect} finding={plan.leading_code or '-'}"))
    elif recorded.effect != want.effect:
        state = replace(state, taint=replace(recorded, effect=want.effect))
        notes.append(Note(WARNING, f"effects node={ctx.node_name} taint=changed value={want.value} "
                                   f"effect={want.effect} since_taint_seconds={now - recorded.since:.0f}"))
    if plan.hyperpod_kept:  # said once per finding and value: the ledger delivers a key once
        events.append(hyperpod_kept_event(plan.hyperpod_kept, plan.shown, plan.leading_code, plan.leading_key,
                                          wall))
    state, spec, note = _budget_episode(state, plan, wall, ctx)
    events.extend(spec)
    notes.extend(note)
    return replace(state, rollback=False), tuple(events), tuple(notes)  # a plan made under it landed


def _budget_episode(state: EffectsState, plan: NodePlan, wall: float,
                    ctx: StepContext) -> tuple[EffectsState, tuple[EventSpec, ...], tuple[Note, ...]]:
    """Held by the budget: counted and reported once per episode; released: said once."""
    if not plan.taint.budget_blocked:
        if not state.budget_blocked:
            return state, (), ()
        return (replace(state, budget_blocked=False), (),
                (Note(INFO, f"effects node={ctx.node_name} budget=released"),))
    if state.budget_blocked:
        return state, (), ()
    state = replace(state, budget_blocked=True, budget_blocked_total=state.budget_blocked_total + 1)
    note = Note(WARNING, f"effects node={ctx.node_name} budget=blocked action={plan.shown.value} "
                         f"{ctx.budget_note} {ctx.budget_limits}")
    spec = budget_held_event(plan.leading_key, plan.shown, plan.leading_code,
                             f"{ctx.budget_note} ({ctx.budget_limits})", wall)
    return state, (spec,), (note,)


def step(state: EffectsState, verdict: Verdict | None, node: dict, budget: Budget, now: float, wall: float,
         ctx: StepContext) -> Step:
    """Observe ``node``, plan against it, and say what the state is once the plan lands, and which
    budget exchange the plan needs first. Pure: the same inputs give the same ``Step``.

    ``budget`` is what the driver knows without asking: ``ALLOWS`` (the node holds a slot),
    ``ROLLBACK`` (its slot was reclaimed before its taint landed), ``UNASKED`` (no slot) or
    ``HOLDS``. With no slot and a disruptive step ahead, a node without the agent's taint gets its
    NoSchedule first and asks ``LATER`` (the next reconcile, at once: a burst of faults cordons
    every node before any budget traffic); one with it asks to ``TAKE`` a slot; holding one with
    the disruptive step in this write, to ``CONFIRM`` it. Each answer's plan is made here, so
    the driver steps once and writes what the answer selects (``Step.under``)."""
    observed, noticed, seen_notes = observe(state, node, verdict, now, wall, ctx)

    def planned(answer: Budget) -> Step:
        basis = replace(observed, rollback=True) if answer is Budget.ROLLBACK else observed
        plan = plan_for(basis, verdict, node, answer, now, wall, ctx)
        after, events, notes = landed(basis, plan, node, verdict, now, wall, ctx)
        return Step(observed=basis, state=after, plan=plan, noticed=noticed, events=events,
                    notes=seen_notes + notes, seen_notes=seen_notes)

    if budget is Budget.UNASKED and asks_budget(observed, verdict, node, ctx.settings):
        first = planned(Budget.FIRST)
        if first.plan.taint.adds_taint:  # cordon first: the NoSchedule never waits for the budget
            return replace(first, exchange=LATER)
        return replace(planned(Budget.ALLOWS), exchange=TAKE, refused=((Budget.HOLDS, planned(Budget.HOLDS)),))
    chosen = planned(budget)
    taint = chosen.plan.taint
    if budget is Budget.ALLOWS and taint.disruptive_ready and chosen.plan.writes and \
            not carries_no_execute(node, ctx.settings.taint_key):
        return replace(chosen, exchange=CONFIRM, refused=((Budget.HOLDS, planned(Budget.HOLDS)),
                                                          (Budget.ROLLBACK, planned(Budget.ROLLBACK))))
    return chosen

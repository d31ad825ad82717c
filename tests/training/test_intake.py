"""The training intake: validation, per-job aggregation, scaling events, goodput, job limits."""

from __future__ import annotations

import json
import math
import threading

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from healthagent.training.intake import TrainingIntake, scaling_reason_from_text
from healthagent.training.schema import REJECT_REASONS
from tests.telemetry.harness import FakeClock

T0 = 1_760_000_000.0


def step(job="llama", rank=0, world_size=8, step=1, tokens=1000, samples=10, step_seconds=2.0, **extra):
    report = {"type": "step", "job": job, "rank": rank, "world_size": world_size, "step": step,
              "tokens": tokens, "samples": samples, "step_seconds": step_seconds}
    report.update(extra)
    return report


def rendezvous(job="llama", world_size=None, reason=None, **extra):
    report = {"type": "rendezvous", "job": job, **extra}
    if world_size is not None:
        report["world_size"] = world_size
    if reason is not None:
        report["reason"] = reason
    return report


class Harness:
    """A TrainingIntake on an injected clock, fed JSON bodies, read back as parsed samples."""

    def __init__(self, **options) -> None:
        self.clock = FakeClock(T0)
        self.intake = TrainingIntake(clock=self.clock, **options)

    def post(self, *reports, raw: bytes | None = None):
        body = raw if raw is not None else json.dumps(list(reports) if len(reports) != 1 else reports[0]).encode()
        return self.intake.submit(body)

    def samples(self) -> dict[tuple, float]:
        class Registry:
            collect = self.intake.collect

        out = {}
        for family in text_string_to_metric_families(generate_latest(Registry()).decode()):
            for s in family.samples:
                out[(s.name.removeprefix("healthagent_"), tuple(sorted(s.labels.items())))] = s.value
        return out

    def value(self, name: str, **labels) -> float:
        return self.samples()[(name, tuple(sorted(labels.items())))]

    def job_values(self, job: str = "llama") -> dict[str, float]:
        return {name: value for (name, labels), value in self.samples().items() if labels == (("job", job),)}


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_valid_step_reports_give_exact_job_series(h):
    reply = h.post(step(step=1, timestamp=T0 - 1), step(step=2, tokens=2000, samples=20, step_seconds=3.0))
    assert (reply.status, reply.body) == (202, {"accepted": 2})
    values = h.job_values()
    assert values["training_steps_total"] == 2
    assert values["training_tokens_total"] == 3000
    assert values["training_samples_total"] == 30
    assert values["training_productive_seconds_total"] == 5.0
    assert values["training_world_size"] == 8
    assert values["training_last_step_timestamp_seconds"] == T0  # the report without timestamp: now
    assert values["training_step_seconds_count"] == 2
    assert values["training_step_seconds_sum"] == 5.0
    assert h.value("training_step_seconds_bucket", job="llama", le="2.0") == 1
    assert h.value("training_step_seconds_bucket", job="llama", le="5.0") == 2
    assert h.value("training_jobs") == 1


def test_a_step_counts_once_however_many_local_ranks_report_it(h):
    for rank in range(8):
        h.post(step(rank=rank, step=7, tokens=4096))
    for rank in (3, 0, 5):
        h.post(step(rank=rank, step=8, tokens=4096))
    values = h.job_values()
    assert (values["training_steps_total"], values["training_tokens_total"]) == (2, 8192)
    assert values["training_productive_seconds_total"] == 4.0


def test_steps_redone_after_a_restart_from_an_older_checkpoint_are_not_productive(h):
    for n in range(1, 11):
        h.post(step(step=n))
    h.post(rendezvous())
    for n in range(6, 13):  # restored step 5: 6..10 are re-done, 11 and 12 are new progress
        h.post(step(step=n))
    values = h.job_values()
    assert values["training_steps_total"] == 12
    assert values["training_productive_seconds_total"] == 24.0
    assert values["training_rendezvous_total"] == 1


def test_goodput_arithmetic_with_injected_time(h):
    # Step 1 (2 s) reported at t=2: wall starts when it began, at t=0.
    h.clock.now = T0 + 2
    h.post(step(step=1))
    h.clock.now = T0 + 4
    h.post(step(step=2))
    values = h.job_values()
    assert (values["training_productive_seconds_total"], values["training_wall_seconds_total"]) == (4.0, 4.0)
    # A 100 s stall (a re-rendezvous), then two more steps: wall 108, productive 8 -> goodput 8/108.
    h.clock.now = T0 + 104
    h.post(rendezvous(world_size=8))
    h.clock.now = T0 + 106
    h.post(step(step=3))
    h.clock.now = T0 + 108
    h.post(step(step=4))
    values = h.job_values()
    assert values["training_productive_seconds_total"] == 8.0
    assert values["training_wall_seconds_total"] == 108.0
    assert math.isclose(values["training_productive_seconds_total"] / values["training_wall_seconds_total"],
                        8 / 108)


def test_a_backlog_delivered_late_spans_the_time_it_took_not_its_arrival(h):
    """The client queued 300 one-second steps while this agent restarted; they arrive at once."""
    h.clock.now = T0 + 600
    h.post(*[step(step=n, step_seconds=1.0, timestamp=T0 + n) for n in range(1, 301)])
    values = h.job_values()
    assert values["training_productive_seconds_total"] == 300.0
    assert values["training_wall_seconds_total"] == 600.0  # from step 1's start (T0) to now
    assert values["training_last_step_timestamp_seconds"] == T0 + 300


def test_wall_advances_at_render_time_up_to_the_cap_and_the_rest_lands_on_resume():
    h = Harness(open_stall_cap_seconds=300.0)
    h.post(step(step=1, step_seconds=10.0))  # wall starts at T0 - 10
    h.clock.advance(50)
    assert h.job_values()["training_wall_seconds_total"] == 60.0  # advanced by a render
    h.clock.advance(1000)
    assert h.job_values()["training_wall_seconds_total"] == 310.0  # open stall capped at 300 s
    h.clock.advance(5)
    h.post(step(step=2, step_seconds=5.0))  # the job is back: the whole stall was real
    values = h.job_values()
    assert values["training_wall_seconds_total"] == 1065.0
    assert values["training_productive_seconds_total"] == 15.0


def test_end_report_stops_the_wall_clock_and_a_new_run_counts_from_step_zero(h):
    h.post(step(step=100, step_seconds=4.0))
    h.clock.advance(6)
    h.post({"type": "end", "job": "llama"})
    h.clock.advance(600)
    assert h.job_values()["training_wall_seconds_total"] == 10.0  # 4 s step + 6 s, nothing after end
    h.post(step(step=0, step_seconds=1.0))
    values = h.job_values()
    assert values["training_steps_total"] == 2  # step 0 of the new run counts
    assert values["training_wall_seconds_total"] == 11.0


def test_world_size_change_is_one_scaling_event_with_reason_unknown(h):
    h.post(step(world_size=64, step=1))
    for rank in range(8):  # eight local ranks all report the new size: still one event
        h.post(step(world_size=56, rank=rank, step=2))
    assert h.value("scaling_events_total", job="llama", direction="down", reason="unknown") == 1
    assert h.value("scaling_events_total", job="llama", direction="up", reason="unknown") == 0
    assert h.job_values()["training_world_size"] == 56


@pytest.mark.parametrize("fault_age,direction,reason_text,expected", [
    (60.0, "down", None, "fault"),           # this agent took a node out a minute ago
    (60.0, "down", "scale_down", "fault"),   # our own knowledge wins over the report's word
    (2000.0, "down", None, "unknown"),       # a fault long ago is not the cause
    (None, "down", "node-failure", "fault"),  # the report says so
    (None, "up", "HPA", "capacity"),
    (None, "up", "scale-up", "capacity"),
    (60.0, "up", None, "unknown"),           # a fault does not grow a job
    (None, "down", "because", "unknown"),
])
def test_scaling_reason(h, fault_age, direction, reason_text, expected):
    h.post(rendezvous(world_size=32))
    if fault_age is not None:
        h.intake.note_fault(h.clock.now - fault_age)
    h.post(rendezvous(world_size=24 if direction == "down" else 40, reason=reason_text))
    events = {key: v for key, v in h.samples().items() if key[0] == "scaling_events_total" and v}
    assert events == {("scaling_events_total", (("direction", direction), ("job", "llama"),
                                                ("reason", expected))): 1.0}


def test_a_late_report_from_the_old_world_does_not_flap_the_size(h):
    h.post(step(world_size=16, step=1, timestamp=T0 - 10))
    h.post(rendezvous(world_size=8, timestamp=T0 - 5))
    h.post(step(world_size=16, step=2, timestamp=T0 - 9))  # sent before the change, arrived after
    h.post(step(world_size=8, step=3, timestamp=T0 - 1))
    assert h.job_values()["training_world_size"] == 8
    events = {k[1]: v for k, v in h.samples().items() if k[0] == "scaling_events_total" and v}
    assert list(events.values()) == [1.0]


def test_scaling_series_exist_at_zero_for_every_direction_and_reason(h):
    h.post(step())
    events = [k for k in h.samples() if k[0] == "scaling_events_total"]
    assert len(events) == 6


@pytest.mark.parametrize("report,reason,words", [
    (step(job=None), "missing_field", "'job' is required"),
    ({k: v for k, v in step().items() if k != "step_seconds"}, "missing_field", "'step_seconds'"),
    ({k: v for k, v in step().items() if k != "type"}, "missing_field", "'type' is required"),
    (step(step="7"), "wrong_type", "'step' must be a number"),
    (step(rank=True), "wrong_type", "'rank' must be a number"),
    (step(tokens=1.5), "wrong_type", "'tokens' must be an integer"),
    (step(job=7), "wrong_type", "'job' must be a string"),
    (step(step=-1), "negative", "'step' must not be negative"),
    (step(step_seconds=-0.5), "negative", "'step_seconds'"),
    (step(step_seconds=float("nan")), "not_finite", "finite"),
    (step(step_seconds=float("inf")), "not_finite", "finite"),
    (step(tokens=10**13), "out_of_range", "'tokens' must be between"),
    (step(world_size=0), "out_of_range", "'world_size'"),
    (step(world_size=10**7), "out_of_range", "'world_size'"),
    (step(rank=8, world_size=8), "out_of_range", "rank 8 is not below world_size 8"),
    (step(step_seconds=90_000.0), "out_of_range", "'step_seconds'"),
    (step(timestamp=1.7e12), "out_of_range", "'timestamp'"),  # milliseconds, not seconds
    (step(job=""), "bad_job", "1-128 printable"),
    (step(job="x" * 129), "bad_job", "1-128 printable"),
    (step(job="evil\njob"), "bad_job", "control characters"),
    (step(job="nul\x00"), "bad_job", "control characters"),
    (rendezvous(reason="x" * 200), "out_of_range", "'reason'"),
    ({"type": "checkpoint", "job": "llama"}, "unknown_type", "use one of: step, rendezvous, end"),
    ([1, 2], "not_an_object", "must be a JSON object"),
])
def test_every_bad_report_kind_is_a_400_with_a_message_and_a_count(h, report, reason, words):
    body = json.dumps([report] if not isinstance(report, list) else [report]).encode()
    reply = h.post(raw=body)
    assert reply.status == 400
    assert reply.body["reason"] == reason
    assert words in reply.body["error"]
    assert reply.body["accepted"] == 0
    assert h.value("training_reports_rejected_total", reason=reason) == 1
    assert h.intake.jobs() == []


@pytest.mark.parametrize("raw,reason", [
    (b"{not json", "malformed_json"),
    (b"\xff\xfe", "malformed_json"),
    (json.dumps([step()] * 1001).encode(), "batch_too_large"),
    (b"42", "not_an_object"),
])
def test_bad_bodies(h, raw, reason):
    reply = h.post(raw=raw)
    assert (reply.status, reply.body["reason"]) == (400, reason)
    assert h.value("training_reports_rejected_total", reason=reason) == 1


def test_a_batch_applies_its_good_reports_and_names_the_bad_ones(h):
    reply = h.post(step(step=1), step(step=-2), step(step=3), {"type": "nope", "job": "x"})
    assert reply.status == 400
    assert (reply.body["accepted"], reply.body["rejected"]) == (2, 2)
    assert [(e["index"], e["reason"]) for e in reply.body["errors"]] == [(1, "negative"), (3, "unknown_type")]
    assert h.job_values()["training_steps_total"] == 2


def test_every_reject_reason_is_exported_from_the_start(h):
    rejected = {dict(k[1])["reason"] for k in h.samples() if k[0] == "training_reports_rejected_total"}
    assert rejected == set(REJECT_REASONS)


def test_unknown_fields_are_ignored(h):
    assert h.post(step(loss=2.31, lr=3e-4)).status == 202


def test_job_cap_evicts_the_least_recently_active_job():
    h = Harness(max_jobs=3)
    for name in ("a", "b", "c"):
        h.post(step(job=name))
        h.clock.advance(1)
    h.post(step(job="a", step=2))  # a is active again; b is now the oldest idle job
    h.post(step(job="d"))
    assert sorted(h.intake.jobs()) == ["a", "c", "d"]
    assert h.value("training_jobs_evicted_total") == 1
    assert h.value("training_jobs") == 3
    assert not [k for k in h.samples() if dict(k[1]).get("job") == "b"]


def test_idle_jobs_expire():
    h = Harness(idle_seconds=600.0)
    h.post(step(job="old"))
    h.clock.advance(300)
    h.post(step(job="young"))
    h.clock.advance(301)
    assert h.intake.jobs() == ["young"]  # expiry happens at render time too
    assert h.value("training_jobs_evicted_total") == 0  # expiry is not eviction


def test_concurrent_reports_and_scrapes_are_consistent():
    h = Harness(max_jobs=64)
    errors = []

    def report(rank: int) -> None:
        try:
            for n in range(1, 201):
                h.post(step(job=f"job{rank % 4}", rank=rank, step=n))
        except Exception as exc:  # pragma: no cover - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=report, args=(rank,)) for rank in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        h.samples()
    for t in threads:
        t.join()
    assert errors == []
    for job in ("job0", "job1", "job2", "job3"):
        assert h.job_values(job)["training_steps_total"] == 200


@pytest.mark.parametrize("text,expected", [
    ("fault", "fault"), ("Node Failure", "fault"), ("xid", "fault"), ("capacity", "capacity"),
    ("scale_up", "capacity"), ("Spot", "capacity"), ("", "unknown"), ("whatever", "unknown"),
])
def test_scaling_reason_words(text, expected):
    assert scaling_reason_from_text(text) == expected


def test_note_fault_keeps_the_latest_fault(h):
    h.post(rendezvous(world_size=16))
    h.intake.note_fault(h.clock.now - 100)
    h.intake.note_fault(h.clock.now - 5000)  # an older decision arriving late changes nothing
    h.post(rendezvous(world_size=8))
    assert h.value("scaling_events_total", job="llama", direction="down", reason="fault") == 1


@pytest.mark.integration
def test_reports_over_http_become_metrics(agent):
    reply = agent.post_json(json.dumps([step(step=1), step(step=2)]))
    assert reply.status == 202
    bad = agent.post_json(json.dumps(step(step_seconds=-1)))
    assert bad.status == 400 and "must not be negative" in json.loads(bad.body)["error"]
    text = agent.scrape().text
    assert 'healthagent_training_steps_total{job="llama"} 2.0' in text
    assert 'healthagent_training_reports_rejected_total{reason="negative"} 1.0' in text

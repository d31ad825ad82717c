"""The exposition's encode cache: a scrape reuses the bytes of what did not change, and is still
byte for byte what prometheus_client's negotiated encoder writes for the whole registry."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from prometheus_client.exposition import choose_encoder

from healthagent.telemetry import encode_cache, metrics
from healthagent.telemetry.metrics import Telemetry
from tests.telemetry.snapshots import NOW, demo_snapshot, uuid


@pytest.mark.parametrize("accept", ["", "text/plain; version=0.0.4",
                                    "application/openmetrics-text; version=1.0.0"])
def test_cached_exposition_equals_encoding_the_whole_registry(accept):
    telemetry = Telemetry("1")
    telemetry.observe_collect("efa", 0.02)
    telemetry.publish(demo_snapshot())
    encoder, content_type = choose_encoder(accept)
    assert telemetry.exposition(encoder, content_type) == encoder(telemetry.registry)
    telemetry.observe_collect("efa", 0.03)  # the live part changes, the snapshot part is cached
    assert telemetry.exposition(encoder, content_type) == encoder(telemetry.registry)
    telemetry.publish(demo_snapshot(timestamp=NOW + 10))
    assert telemetry.exposition(encoder, content_type) == encoder(telemetry.registry)


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0"])
def test_a_part_is_encoded_again_only_when_its_input_changed(monkeypatch, accept):
    """The loop publishes a new snapshot every cycle with the same GPU/EFA sample objects until a
    source collects again: those parts are reused, and any change is encoded (byte-identical)."""
    calls: Counter = Counter()

    def counted(name: str):
        real = getattr(metrics, name)

        def render(*args):
            calls[name] += 1
            return real(*args)
        return render

    for name in ("_gpu_families", "_efa_families", "_other_families"):
        monkeypatch.setattr(metrics, name, counted(name))
    telemetry = Telemetry("1")
    encoder, content_type = choose_encoder(accept)
    first = demo_snapshot()

    def scrape_matches_full_encode() -> bytes:
        body = telemetry.exposition(encoder, content_type)
        assert body == encoder(telemetry.registry)
        return body

    telemetry.publish(first)
    scrape_matches_full_encode()
    calls.clear()
    # Next cycles: new snapshot objects, same gpus tuple, an equal (not identical) efa tuple.
    for cycle in range(1, 4):
        telemetry.publish(replace(first, timestamp=NOW + cycle / 10, efa=tuple(first.efa)))
        telemetry.exposition(encoder, content_type)
    assert calls == Counter({"_other_families": 3})
    # NVML collected again and one temperature moved: the GPU part (only) is encoded again.
    gpus = first.gpus[:2] + (replace(first.gpus[2], temperature_c=91.0),) + first.gpus[3:]
    telemetry.publish(replace(first, timestamp=NOW + 1, gpus=gpus))
    calls.clear()
    body = scrape_matches_full_encode()
    assert calls["_gpu_families"] >= 1 and calls["_efa_families"] == 1  # the full encode renders both once
    assert f'healthagent_gpu_temperature_celsius{{gpu="2",uuid="{uuid(2)}"}} 91.0'.encode() in body
    # EFA counters moved: that part follows.
    efa = (replace(first.efa[0], counters={**first.efa[0].counters, "rx_drops": 424242}),) + first.efa[1:]
    telemetry.publish(replace(first, timestamp=NOW + 2, gpus=gpus, efa=efa))
    body = scrape_matches_full_encode()
    assert b'healthagent_efa_rx_drops_total{efa_device="rdmap16s0",port="1"} 424242.0' in body


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0; escaping=underscores"])
def test_within_a_changed_part_only_the_families_that_changed_are_encoded_again(accept):
    """After an EFA collection only a few traffic counters move: those families are encoded again,
    the other ~40 EFA families (and their ~1,000 samples) are reused byte for byte."""
    real_encoder, content_type = choose_encoder(accept)
    encoded: Counter = Counter()

    def encoder(registry) -> bytes:
        for family in registry.collect():
            encoded[family.name] += 1
        return real_encoder(registry)

    telemetry = Telemetry("1")
    first = demo_snapshot()
    telemetry.publish(first)
    telemetry.exposition(encoder, content_type)
    efa_families = {n for n in encoded if n.startswith("healthagent_efa_")}
    assert len(efa_families) > 10
    encoded.clear()
    moved = tuple(replace(s, counters={**s.counters, "rx_bytes": s.counters["rx_bytes"] + 4096})
                  for s in first.efa)
    telemetry.publish(replace(first, timestamp=NOW + 10, efa=moved))
    body = telemetry.exposition(encoder, content_type)
    assert body == real_encoder(telemetry.registry)
    assert {n for n in encoded if n.startswith("healthagent_efa_")} == {"healthagent_efa_rx_bytes"}
    assert "healthagent_gpu_temperature_celsius" not in encoded  # the GPU part did not change
    # A family that goes away is not served from the cache, one that comes back is encoded again.
    fewer = tuple(replace(s, counters={k: v for k, v in s.counters.items() if k != "rx_drops"})
                  for s in moved)
    telemetry.publish(replace(first, timestamp=NOW + 20, efa=fewer))
    body = telemetry.exposition(encoder, content_type)
    assert body == real_encoder(telemetry.registry) and b"healthagent_efa_rx_drops" not in body
    telemetry.publish(replace(first, timestamp=NOW + 30, efa=moved))
    assert telemetry.exposition(encoder, content_type) == real_encoder(telemetry.registry)


# The Accept header Prometheus 2.x sends on a scrape (it negotiates OpenMetrics, escaping=underscores).
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                       "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_prometheus_negotiation_takes_the_faster_encoder_with_the_same_bytes():
    """Every family the agent exports has plain names, so the OpenMetrics encoder Prometheus
    negotiates is run with allow-utf-8 escaping, and the scrape is still byte for byte what the
    negotiated encoder writes."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.openmetrics import exposition as om

    encoder, content_type = choose_encoder(PROMETHEUS_2_ACCEPT)
    assert "escaping=underscores" in content_type
    plain = encode_cache.plain_names_encoder(encoder)
    assert plain is not None and plain.keywords["escaping"] == om.ALLOWUTF8
    telemetry = Telemetry("1")
    telemetry.publish(demo_snapshot())
    telemetry.observe_collect("efa", 0.02)
    assert encode_cache.names_are_plain(telemetry.registry.collect())
    assert telemetry.exposition(encoder, content_type) == encoder(telemetry.registry)
    # A name outside the plain set is encoded as negotiated: the two escapings differ there.
    odd = GaugeMetricFamily("node:gpu_ratio", "a recording-rule style name", labels=["gpu"])
    odd.add_metric(["0"], 1.0)
    assert not encode_cache.names_are_plain([odd])
    assert encode_cache.encode_families(encoder, plain, (odd,)) == encoder(encode_cache._Families((odd,)))
    assert plain(encode_cache._Families((odd,))) != encoder(encode_cache._Families((odd,)))
    # Other encoders are left alone.
    for other in ("", "text/plain;version=0.0.4", "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8"):
        assert encode_cache.plain_names_encoder(choose_encoder(other)[0]) is None

"""DeviceTaintRule objects as the agent writes them: names, bodies and the effect due now (pure).

A rule selects one device by driver, pool and device name (``spec.deviceSelector``) and carries
one taint (``spec.taint``: the agent's taint key, the finding's code as value, an effect). It is
served as ``resource.k8s.io/v1beta2`` by Kubernetes 1.36 behind the ``DRADeviceTaints`` and
``DRADeviceTaintRules`` feature gates. The objects are cluster-scoped, so each carries the
agent's label and its node's name in ``healthagent.io/node`` where that fits a label value; the
admission policy (deploy/components/dra) holds a node's token to rules for its own pool.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from healthagent.dra.split import Quarantine

GROUP = "resource.k8s.io"
VERSION = "v1beta2"
PLURAL = "devicetaintrules"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "healthagent"
SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"


def rule_name(node_name: str, device: str) -> str:
    """``<node>.<device>.healthagent``, or a digest when that is longer than a name may be."""
    name = f"{node_name}.{device}.healthagent".lower()
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(f"{node_name}\n{device}".encode("utf-8")).hexdigest()[:16]
    return f"{node_name[:200]}.{digest}.healthagent".lower()


def effect_now(quarantine: Quarantine, since: float, now: float, grace_seconds: float) -> str:
    """NoSchedule at once; NoExecute only once the grace since ``since`` is over."""
    if quarantine.effect == "NoExecute" and now - since < grace_seconds:
        return "NoSchedule"
    return quarantine.effect


@dataclass(frozen=True)
class RuleSpec:
    name: str
    driver: str
    pool: str
    device: str
    effect: str
    value: str  # the finding's code

    def body(self, taint_key: str) -> dict:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DeviceTaintRule",
            "metadata": {"name": self.name, "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
            "spec": {
                "deviceSelector": {"driver": self.driver, "pool": self.pool, "device": self.device},
                "taint": {"key": taint_key, "value": self.value[:63], "effect": self.effect},
            },
        }


def rule_spec(node_name: str, quarantine: Quarantine, effect: str) -> RuleSpec:
    ref = quarantine.ref
    return RuleSpec(rule_name(node_name, ref.device), ref.driver, ref.pool, ref.device, effect,
                    quarantine.findings[0].code)


def spec_of(rule: dict) -> tuple[str, str, str, str, str] | None:
    """(driver, pool, device, effect, value) of a rule as read; None when not of that shape."""
    spec = rule.get("spec") if isinstance(rule, dict) else None
    selector = spec.get("deviceSelector") if isinstance(spec, dict) else None
    taint = spec.get("taint") if isinstance(spec, dict) else None
    if not isinstance(selector, dict) or not isinstance(taint, dict):
        return None
    values = (selector.get("driver"), selector.get("pool"), selector.get("device"), taint.get("effect"),
              taint.get("value", ""))
    return values if all(isinstance(v, str) for v in values) else None  # type: ignore[return-value]

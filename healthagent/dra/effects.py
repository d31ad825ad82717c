"""Per-GPU quarantine through DRA device taints: the node's effects plus one DeviceTaintRule per GPU.

``DraEffects`` wraps ``effects.kube.NodeEffects`` (the worker drives it through the same
``Effects`` protocol): each reconcile splits the verdict (``dra/split.py``), hands the node its
part, then brings the agent's DeviceTaintRules to the device part: a rule per quarantined GPU,
``NoSchedule`` at once and ``NoExecute`` once the grace is over when the finding calls for it and
the node holds a slot of the disruption budget (``dra/budget.py``; the stage ``held_by_budget``
until it does), deleted when the finding clears. An Event on the Node names the device and why.

What it learns from the API server, only while DRA is in use (a GPU-scope finding to place, a
quarantine to keep or lift, an earlier run's rules to look for): whether ``devicetaintrules`` are
served (discovery, once each time DRA comes into use; again every ``refresh_seconds`` while it
is not served) and, while a GPU-scope finding is open, the node's ResourceSlices (one LIST, then
one watch field-selected by ``spec.nodeName``: ``dra/slice_watch.py``), so a slice change reaches
the agent when it happens. A healthy node makes no DRA request and holds no watch. Where DRA is not
served or the GPU is not published, the split gives the node everything, so the node behaves
exactly as without this layer, and the fallback is said once (log, ``status()``, metrics and
``check``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any, Callable, Mapping

from healthagent.common import ErrorTally
from healthagent.dra.budget import DeviceBudget
from healthagent.dra.rules import GROUP, PLURAL, SELECTOR, VERSION, effect_now, rule_spec, spec_of
from healthagent.dra.slice_watch import SliceWatch
from healthagent.dra.slices import DeviceMap, device_map
from healthagent.dra.split import NOT_SERVED, Split, split_verdict
from healthagent.effects.backend import (AlreadyExists, ApiError, ApiRejected, ApiUnavailable, WatchStream,
                                         classify_api_exception)
from healthagent.effects.events import WARNING, EVENTS_NAMESPACE, EventSpec, event_body
from healthagent.model import KubeStatus, SourceHealth, Verdict
from healthagent.policy.scope import ScopePolicy

log = logging.getLogger(__name__)

HELD_BY_BUDGET = "held_by_budget"  # the stage of a device whose NoExecute waits for a budget slot
REFRESH_SECONDS = 60.0  # while DRA is in use but not served: ask discovery again this often
FORBIDDEN_BACKOFF_CAP_SECONDS = 3600.0  # refused DRA reads: looked at again at most this seldom
SLICE_VERSION = "v1"
WATCH_READ_SLACK_SECONDS = 30  # the watch's read timeout is the server-side timeout plus this


class DraApi:
    """The calls: discovery, ResourceSlices of one node, the agent's DeviceTaintRules, Events."""

    def __init__(self, api_client: Any, node_name: str, timeout: tuple[float, float] = (5.0, 10.0)) -> None:
        # deferred: the kubernetes client takes a third of a second to load; only a cluster mode needs it
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.events = client.EventsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.node_name = node_name
        self.timeout = timeout

    def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        # deferred: as above, the kubernetes client and its urllib3 load only in a cluster mode
        from kubernetes.client.exceptions import ApiException
        import urllib3

        try:
            response = fn(*args, _request_timeout=self.timeout, _preload_content=False, **kwargs)
            data = response.data
        except ApiException as exc:
            raise classify_api_exception(exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnavailable(f"{type(exc).__name__}: {exc}") from None
        try:
            return json.loads(data) if data else {}
        except ValueError:
            raise ApiUnavailable("the reply is not JSON") from None

    def serves_rules(self) -> bool:
        try:
            reply = self._call(self.custom.get_api_resources, GROUP, VERSION)
        except ApiRejected as exc:
            if exc.status == 404:
                return False
            raise
        resources = reply.get("resources") if isinstance(reply, dict) else None
        return any(isinstance(r, dict) and r.get("name") == PLURAL for r in resources or ())

    def slices(self) -> list:
        return self.list_slices()[0]

    def list_slices(self) -> tuple[list, str]:
        """The node's ResourceSlices and the list's resourceVersion (where a watch starts)."""
        reply = self._call(self.custom.list_cluster_custom_object, GROUP, SLICE_VERSION, "resourceslices",
                           field_selector=f"spec.nodeName={self.node_name}")
        items = reply.get("items") if isinstance(reply, dict) else None
        version = (reply.get("metadata") or {}).get("resourceVersion") if isinstance(reply, dict) else None
        if not isinstance(version, str) or not version:
            raise ApiUnavailable("ResourceSlice list reply has no resourceVersion")
        return (items if isinstance(items, list) else []), version

    def watch_slices(self, resource_version: str, timeout_seconds: int) -> WatchStream:
        """A watch on the node's ResourceSlices from ``resource_version``, with bookmarks; the
        server ends it after ``timeout_seconds``."""
        # deferred: as above, the kubernetes client and its urllib3 load only in a cluster mode
        from kubernetes.client.exceptions import ApiException
        import urllib3

        try:
            response = self.custom.list_cluster_custom_object(
                GROUP, SLICE_VERSION, "resourceslices", field_selector=f"spec.nodeName={self.node_name}",
                watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds, _preload_content=False,
                _request_timeout=(self.timeout[0], timeout_seconds + WATCH_READ_SLACK_SECONDS))
        except ApiException as exc:
            raise classify_api_exception(exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnavailable(f"{type(exc).__name__}: {exc}") from None
        return WatchStream(response)

    def rules(self) -> list:
        reply = self._call(self.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL, label_selector=SELECTOR)
        items = reply.get("items") if isinstance(reply, dict) else None
        return items if isinstance(items, list) else []

    def create(self, body: dict) -> None:
        self._call(self.custom.create_cluster_custom_object, GROUP, VERSION, PLURAL, body)

    def replace(self, name: str, body: dict) -> None:
        self._call(self.custom.patch_cluster_custom_object, GROUP, VERSION, PLURAL, name,
                   {"spec": body["spec"]})

    def delete(self, name: str) -> None:
        self._call(self.custom.delete_cluster_custom_object, GROUP, VERSION, PLURAL, name)

    def event(self, body: dict) -> None:
        self._call(self.events.create_namespaced_event, EVENTS_NAMESPACE, body)

    def annotate_node(self, key: str, value: str | None) -> None:
        """One annotation of the agent's own Node set (``None``: removed), by a merge patch."""
        self._call(self.core.patch_node, self.node_name, {"metadata": {"annotations": {key: value}}},
                   _content_type="application/merge-patch+json")


class DraEffects:
    """``NodeEffects`` plus the device quarantines (see the module's docstring)."""

    def __init__(self, inner: Any, api: DraApi | None, scope: ScopePolicy, taint_key: str,
                 grace_seconds: float, refresh_seconds: float = REFRESH_SECONDS) -> None:
        self.inner = inner
        self.api = api
        self.scope = scope
        self.taint_key = taint_key
        self.grace_seconds = grace_seconds
        self.refresh_seconds = refresh_seconds
        self._refused = 0  # 403s in a row from the DRA reads (slices, rules): the next look backs off
        self.node_name = inner.node_name
        self.served: bool | None = None  # None: not asked yet
        self.devices: DeviceMap | None = None
        self._asked_at: float | None = None  # discovery, this time DRA is in use (None: not asked yet)
        self._watch: SliceWatch | None = None
        self._since: dict[str, float] = {}  # rule name -> when its quarantine began (decision clock)
        self._announced: set[str] = set()
        self._said: set[str] = set()
        self._tally = ErrorTally("dra")
        self.quarantined: Mapping[str, str] = {}  # device path -> effect now on it
        self._shown: dict = {}  # device path -> (DeviceRef, effect)
        self.fallbacks: tuple[str, ...] = ()
        self.held: set[str] = set()  # device paths whose NoExecute the budget holds back
        self.device_budget = DeviceBudget(inner, api, taint_key, self._tally)
        self._leftovers = True  # an earlier run may have left rules: looked at until a pass finds none

    # -- the Effects protocol: the node's part delegated -------------------------------------------

    @property
    def mode(self) -> str:
        return self.inner.mode

    @property
    def ledger(self) -> Any:
        return self.inner.ledger

    @property
    def errors(self) -> dict[str, int]:
        counts = dict(self.inner.errors)
        for kind, count in self._tally.counts.items():
            counts[f"dra_{kind}"] = count
        return counts

    def __getattr__(self, name: str) -> Any:  # on_change, pending_clear, node, ...: the node's
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "on_change":
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def startup(self, now: float, boot_id: str, wall: float | None = None) -> KubeStatus:
        status = self.inner.startup(now, boot_id, wall=wall)
        self._discover(now)  # an earlier run's rules are looked for at the first reconcile
        return self._with_dra(status)

    def reconcile(self, verdict: Verdict, now: float, boot_id: str,
                  health: "tuple[SourceHealth, ...] | list[SourceHealth]" = (), wall: float | None = None) -> KubeStatus:
        # The cluster is asked only while there is something for DRA to do: a GPU-scope finding to
        # place, or a quarantine (of this run, or left by an earlier one) to keep or lift. A healthy
        # node costs the API server nothing here, as its node watch costs nothing.
        placing = bool(split_verdict(verdict, self.scope, None).fallbacks)  # GPU-scope findings to place
        if self._leftovers or self.quarantined or placing:
            self._discover(now)
        else:
            self._asked_at = None  # DRA is out of use: the next use asks discovery again
        if placing and self.served:
            self._watch_slices(now)
        else:
            self._stop_watch()
        split = split_verdict(verdict, self.scope, self.devices if self.served else None)
        status = self.inner.reconcile(split.node_verdict, now, boot_id, health=health, wall=wall)
        self._say_fallbacks(split)
        try:
            self._apply(split, now, wall if wall is not None else now)
        except ApiError as exc:  # kept as desired: the next reconcile tries again
            self._tally.count("write_failed", f"node={self.node_name} {exc}")
        return self._with_dra(status)

    def _with_dra(self, status: KubeStatus) -> KubeStatus:
        rows = tuple((path, ref.uuid, ref.pci_bus_id, HELD_BY_BUDGET if path in self.held else effect)
                     for path, (ref, effect) in sorted(self._shown.items()))
        return replace(status, gpu_quarantines=rows, dra_fallbacks=tuple(self.fallbacks),
                       budget_blocked=status.budget_blocked or bool(self.held))

    def close(self) -> None:
        self._stop_watch()
        self.inner.close()

    # -- the device part -----------------------------------------------------------------------------

    def _discover(self, now: float) -> None:
        """Whether DeviceTaintRules are served: asked once each time DRA comes into use, and again
        every ``refresh_seconds`` while the answer is no."""
        if self.api is None or self.scope.dra == "off":
            self.served = False
            return
        wait = min(FORBIDDEN_BACKOFF_CAP_SECONDS, self.refresh_seconds * 2 ** max(0, self._refused - 1))
        if self._asked_at is not None and (self.served or now - self._asked_at < wait):
            return
        try:
            self.served = self.api.serves_rules()
            self._asked_at = now
            self._leftovers = self._leftovers and bool(self.served)  # not served: no rule can exist
        except ApiRejected as exc:
            self._forbidden(exc, now)
        except ApiError as exc:  # unknown: what was known stands (or nothing: the node's behaviour)
            self._tally.count("read_failed", f"node={self.node_name} {exc}")

    def _forbidden(self, exc: ApiError, now: float) -> None:
        """403: the DRA component (its RBAC) is not installed, or not yet effective: DRA is not
        served to this agent for now. Asked again after ``refresh_seconds``, doubling with each
        refusal in a row up to an hour. Rules an earlier run left stay looked for: a refusal is no
        proof that none exists (a rule left behind would keep its GPU tainted)."""
        self.served, self.devices, self._asked_at = False, None, now
        self._refused += 1
        if "forbidden" not in self._said:
            self._said.add("forbidden")
            log.warning("dra node=%s cannot read ResourceSlices (%s): GPU findings act on the node; "
                        "install deploy/components/dra for per-GPU quarantine", self.node_name, exc)

    def _watch_slices(self, now: float) -> None:
        """The device map from the slice watch, started (with its LIST) when not running."""
        if self._watch is None:
            try:
                items, version = self.api.list_slices()  # type: ignore[union-attr]
            except ApiRejected as exc:
                self._forbidden(exc, now)
                return
            except ApiError as exc:  # unknown: the last map stands (or none: the node's behaviour)
                self._tally.count("read_failed", f"node={self.node_name} {exc}")
                return
            self._watch = SliceWatch(self.api, self.node_name, on_change=self._slices_changed, tally=self._tally)
            self._watch.start(items, version)
        self.devices = device_map(self._watch.slices(), self.node_name)

    def _slices_changed(self) -> None:
        """From the watch thread: the node's slices changed; the effects reconcile against them."""
        callback = self.inner.on_change
        if callback is not None:
            callback()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _say_fallbacks(self, split: Split) -> None:
        self.fallbacks = split.fallbacks
        for reason in split.fallbacks:
            if reason not in self._said:
                self._said.add(reason)
                words = {NOT_SERVED: "the cluster does not serve DeviceTaintRules (resource.k8s.io/v1beta2)"}
                log.warning("dra node=%s fallback=%s: GPU findings act on the node (%s)", self.node_name, reason,
                            words.get(reason, reason.replace("_", " ")))

    def _apply(self, split: Split, now: float, wall: float) -> None:
        if self.api is None:
            return
        want = {}
        for quarantine in split.quarantines:
            spec0 = rule_spec(self.node_name, quarantine, quarantine.effect)
            since = self._since.setdefault(spec0.name, now)
            want[spec0.name] = (quarantine, rule_spec(self.node_name, quarantine,
                                                      effect_now(quarantine, since, now, self.grace_seconds)))
        present = {}
        listed = bool(self.served and (want or self.quarantined or self._leftovers))
        if listed:
            try:
                rules = self.api.rules()
            except ApiRejected as exc:
                self._forbidden(exc, now)
                return
            self._refused = 0
            for rule in rules:
                spec = spec_of(rule)
                name = (rule.get("metadata") or {}).get("name")
                if spec is not None and spec[1] == self.node_name and isinstance(name, str):
                    present[name] = spec
        for name in sorted(set(present) - set(want)):
            self.api.delete(name)
            self._since.pop(name, None)
            self._announced.discard(name)
        shown, held = {}, set()
        evicting = [p[2] for n, p in present.items() if n in want and p[3] == "NoExecute"]
        for name, (quarantine, spec) in sorted(want.items()):
            was = present.get(name)
            if was is not None and was[3] == "NoExecute":
                if spec.effect != "NoExecute":
                    spec = rule_spec(self.node_name, quarantine, "NoExecute")  # an eviction is never taken back
                self.device_budget.keep(now)
            elif spec.effect == "NoExecute":
                # the Node shows the eviction before it happens; no slot (or no mark): held at NoSchedule
                marked = tuple(sorted(evicting + [spec.device]))
                if self.device_budget.allows(now) and self.device_budget.mark(marked):
                    evicting.append(spec.device)
                else:  # new claims stay off the GPU, the pods using it stay
                    spec = rule_spec(self.node_name, quarantine, "NoSchedule")
                    held.add(quarantine.ref.path)
            try:
                if was is None:
                    try:
                        self.api.create(spec.body(self.taint_key))
                    except AlreadyExists:
                        self.api.replace(name, spec.body(self.taint_key))
                elif was != (spec.driver, spec.pool, spec.device, spec.effect, spec.value[:63]):
                    self.api.replace(name, spec.body(self.taint_key))
            except ApiError:
                if spec.effect == "NoExecute" and spec.device in evicting and (was is None or was[3] != "NoExecute"):
                    # the eviction did not land: the Node's annotation and the slot held for it go back
                    self.device_budget.settle(tuple(sorted(d for d in evicting if d != spec.device)), now)
                raise
            if spec.effect == "NoExecute" and (was is None or was[3] != "NoExecute"):
                self.device_budget.written(now)
            shown[quarantine.ref.path] = (quarantine.ref, spec.effect)
            if name not in self._announced:
                self._announce(quarantine, spec.effect, wall)
                self._announced.add(name)
        self._shown = shown
        self.quarantined = {path: effect for path, (_, effect) in shown.items()}
        for path in sorted(held - self.held):
            log.info("dra node=%s device=%s NoExecute held by the disruption budget (no slot free): the rule "
                     "stays NoSchedule until a slot frees", self.node_name, path)
        self.held = held
        standing = tuple(sorted(ref.device for ref, effect in shown.values() if effect == "NoExecute"))
        self.device_budget.settle(standing, now)
        if listed:
            self._leftovers = False  # this pass listed the node's rules and removed those unwanted

    def _announce(self, quarantine: Any, effect: str, wall: float) -> None:
        first = quarantine.findings[0]
        note = (f"GPU {quarantine.ref.device} ({quarantine.ref.uuid}, {quarantine.ref.pci_bus_id}) quarantined "
                f"with a DeviceTaintRule ({effect}, {quarantine.effect} at the end of the grace): {quarantine.why}. "
                "The node stays schedulable for its other GPUs.")
        spec = EventSpec(key=f"device/{first.key}/{quarantine.ref.device}", type=WARNING, reason=first.code,
                         action="DeviceQuarantined", note=note, at=wall)
        try:
            self.api.event(event_body(spec, self.node_name))  # type: ignore[union-attr]
        except ApiError as exc:  # an Event is a courtesy: the rule is what matters
            self._tally.count("event_failed", f"node={self.node_name} {exc}")

    def status(self) -> dict:
        """For metrics and ``check``: whether DRA is served, the mapped GPUs, the quarantines, the fallbacks."""
        return {"served": bool(self.served), "devices": len(self.devices.devices) if self.devices else 0,
                "quarantined": dict(self.quarantined), "fallbacks": list(self.fallbacks),
                "held_by_budget": sorted(self.held)}


def with_dra(scope: ScopePolicy, settings: Any, effects: Any, api_client: Any) -> Any:
    """The node's effects wrapped for DRA, unless the policy file says ``scope: {dra: off}``."""
    if scope.dra == "off":
        return effects
    return DraEffects(effects, DraApi(api_client, effects.node_name), scope, settings.taint_key,
                      settings.replace_noexecute_grace_seconds)

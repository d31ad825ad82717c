"""The agent's wiring puts the DRA layer around the node's effects for a cluster mode, unless the
policy file says ``scope: {dra: off}``; on a server without the DRA gates it finds nothing served."""

from __future__ import annotations

from healthagent.dra.effects import DraEffects
from healthagent.effects.kube import NodeEffects
from healthagent.effects.state import StateStore
from healthagent.wiring import build_effects
from tests.effects.helpers import T0, settings_for


def _built(control_plane, tmp_path, **overrides):
    kubeconfig = control_plane.write_kubeconfig(tmp_path / "kubeconfig")
    settings = settings_for(tmp_path, "wiring-dra", kube="kubeconfig", kubeconfig=str(kubeconfig), **overrides)
    store = StateStore(settings.state_file)
    store.load()
    return build_effects(settings, store)


def test_cluster_modes_get_the_dra_layer_and_learn_it_is_not_served(control_plane, tmp_path):
    effects = _built(control_plane, tmp_path)
    assert isinstance(effects, DraEffects) and isinstance(effects.inner, NodeEffects)
    effects.startup(T0, "boot-1")
    assert effects.served is False
    effects.close()


def test_the_policy_file_can_turn_it_off(control_plane, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("scope: {dra: off}\n", encoding="utf-8")  # YAML's `off` is false: read as off
    effects = _built(control_plane, tmp_path, policy_file=str(policy))
    assert isinstance(effects, NodeEffects)
    effects.close()

"""The logical-axis table and the mesh builder: bad rules and meshes are refused with the culprit named, and
a state is placed by the rules it is given."""

import jax.numpy as jnp
import pytest
from flax import nnx

from ddtree_jax.layers import declare
from ddtree_jax.memory_plan import parse_mesh
from ddtree_jax.sharding import DEFAULT_RULES, ShardingRules, make_mesh, param_shardings, shard_state


def test_rules_name_only_known_axes():
    with pytest.raises(ValueError, match=r"unknown logical axes \['expert'\]"):
        ShardingRules(rules=(("expert", "model"),))
    with pytest.raises(ValueError, match="unknown mesh axis 'tensor'"):
        ShardingRules(rules=(("experts", "tensor"),))
    with pytest.raises(ValueError, match="unknown logical axis 'head'"):
        DEFAULT_RULES.mesh_axis("head")
    assert DEFAULT_RULES.mesh_axis("seq") is None and DEFAULT_RULES.mesh_axis(None) is None
    with pytest.raises(ValueError, match=r"logical axes \['vocab'\] are given more than one rule"):
        ShardingRules(rules=(("vocab", "model"), ("vocab", "data")))


def test_a_mesh_axis_shards_one_dimension_only():
    assert tuple(DEFAULT_RULES.spec(("experts", "expert_ffn", "embed"))) == ("model", None, None)
    with pytest.raises(ValueError, match=r"mesh axis 'model' used twice by logical axes \('heads', 'vocab'\)"):
        DEFAULT_RULES.spec(("heads", "vocab"))


def test_make_mesh_sizes_and_errors(host_devices):
    mesh = make_mesh(data=2, devices=host_devices)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert dict(make_mesh(data=2, model=2, devices=host_devices).shape) == {"data": 2, "model": 2}
    assert dict(make_mesh(data=1, model=8, devices=host_devices).shape) == {"data": 1, "model": 8}
    with pytest.raises(ValueError, match="8 devices do not split into data=3"):
        make_mesh(data=3, devices=host_devices)
    with pytest.raises(ValueError, match="mesh 3x3 needs 9 devices, have 8"):
        make_mesh(data=3, model=3, devices=host_devices)
    for data, model, name in ((0, None, "data"), (0, 8, "data"), (2, 0, "model"), (1.5, 2, "data")):
        with pytest.raises(ValueError, match=f"mesh axis {name} must be an int >= 1"):
            make_mesh(data=data, model=model, devices=host_devices)


def test_parse_mesh():
    assert parse_mesh("2X4") == {"data": 2, "model": 4}
    for text in ("8", "1x2x4", "0x8", "1x0", "ax8", ""):
        with pytest.raises(ValueError, match="must look like 'DATAxMODEL'"):
            parse_mesh(text)


class _Two(nnx.Module):
    def __init__(self):
        self.table = declare(None, (8, 4), ("vocab", "embed"), jnp.float32, init="zeros")
        self.stray = nnx.Param(jnp.zeros(3))  # no logical axes


def test_shardings_need_logical_axes_and_follow_the_given_rules(host_devices):
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    state = nnx.state(_Two())
    with pytest.raises(ValueError, match="parameter without logical_axes metadata"):
        param_shardings(state, mesh, DEFAULT_RULES)
    del state["stray"]
    vocab_on_data = ShardingRules(rules=(("vocab", "data"),))
    placed = shard_state(state, mesh, vocab_on_data)
    assert tuple(placed["table"].get_value().sharding.spec) == ("data", None)
    assert tuple(shard_state(state, mesh, None)["table"].get_value().sharding.spec) == ("model", None)

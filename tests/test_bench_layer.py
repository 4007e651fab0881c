"""bench_layer's one-device share of a sharded layer (``--local-of``): what it holds; how every run routes
(``uniform_routing``) and the floors that routing gives."""

import dataclasses
import gzip
import json

import jax
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.memory_plan import param_bytes, shard_shape
from ddtree_jax.sharding import DEFAULT_RULES
from experiments import bench_layer


@pytest.mark.parametrize("devices", [2, 4])
def test_local_layer_holds_one_devices_shards(devices):
    """Every array of the local layer has the shape of its shard on a 1xG mesh, so it holds exactly the planner's
    bytes per device; the attention's arrays are those of a layer built for H / G heads."""
    cfg = bench_layer.layer_config("tiny")
    _, full = bench_layer.abstract_layer(cfg)
    _, local = bench_layer.abstract_layer(cfg, devices)
    mesh_shape = {"data": 1, "model": devices}
    planned = sum(v["per_device"] for v in param_bytes(full, mesh_shape, DEFAULT_RULES).values())
    assert sum(v["per_device"] for v in param_bytes(local, {"data": 1, "model": 1}, DEFAULT_RULES).values()) \
        == planned
    full_leaves = dict(full.flat_state())
    cut = 0
    for path, variable in local.flat_state():
        axes = full_leaves[path].get_metadata()["logical_axes"]
        for whole, mine in zip(jax.tree.leaves(full_leaves[path].get_value()), jax.tree.leaves(variable.get_value())):
            assert mine.shape == shard_shape(whole.shape, axes, mesh_shape, DEFAULT_RULES)
            cut += mine.shape != whole.shape
    assert cut >= 6  # q_b, kv_b, o_proj, the experts (words and scales), the shared expert
    assert local["mlp"]["router"].get_value().shape == full["mlp"]["router"].get_value().shape
    assert local["mlp"]["w13"].get_value().packed.shape[0] == cfg.n_routed_experts // devices
    _, by_heads = bench_layer.abstract_layer(dataclasses.replace(cfg, num_heads=cfg.num_heads // devices))
    mine = dict(local["attn"].flat_state())
    for path, variable in by_heads["attn"].flat_state():
        assert variable.get_value().shape == mine[path].get_value().shape, path


def test_local_layer_refuses_a_count_that_does_not_divide():
    cfg = bench_layer.layer_config("tiny")
    with pytest.raises(ValueError, match="does not divide the 4 heads"):
        bench_layer.abstract_layer(cfg, 3)
    with pytest.raises(ValueError, match="does not divide dimension 8"):  # 8 experts over 16 devices
        bench_layer.abstract_layer(dataclasses.replace(cfg, num_heads=16), 16)


def test_busiest_device_counts_distinct_experts_then_pairs():
    # 8 experts over 4 devices (2 each): device 1 holds experts 2-3, device 3 experts 6-7
    ids = np.array([[2, 3], [2, 6], [6, 6]])
    load = bench_layer.busiest_device(ids, 8, 4)
    assert load == {"device": 1, "distinct": [0, 2, 0, 1], "pairs": [0, 3, 0, 3]}
    # a tie in distinct experts goes to the device with more pairs, then to the lowest index
    assert bench_layer.busiest_device(np.array([[0, 2], [2, 4]]), 8, 4)["device"] == 1
    assert bench_layer.busiest_device(np.array([[0, 2]]), 8, 4)["device"] == 0


TUNING = ("split", "mma_in_flight", "widths")


def spy_routed_fn(monkeypatch):
    """Replaces bench_layer's ``default_routed_fn``; returns the dict each call's ids, offset and shards go to."""
    seen = {}

    def spy(w13, expert_shards):
        def fn(x, ids, weights, w13, w2, **offset):
            seen.update(ids=np.asarray(ids), shards=expert_shards,
                        **{k: v if k in TUNING else int(v) for k, v in offset.items()})
            return np.zeros(x.shape, np.float32)
        return fn

    monkeypatch.setattr(bench_layer, "default_routed_fn", spy)
    return seen


def test_local_routing_computes_the_busiest_devices_experts(monkeypatch):
    """The local Runtime's routed_fn takes the fixed ids (not the router's) and the busiest device's offset."""
    cfg, layer = bench_layer.build_layer("tiny", 4)
    seen = spy_routed_fn(monkeypatch)
    rt, load = bench_layer.uniform_routing(cfg, layer, 5, local_of=4)
    x = np.ones((5, cfg.hidden_size), np.float32)
    rt.routed_fn(x, np.zeros((5, 2), np.int32), np.ones((5, 2), np.float32), None, None)
    np.testing.assert_array_equal(seen["ids"], bench_layer.distinct_ids(cfg, 5))
    assert all(len(set(row)) == cfg.num_experts_per_tok for row in seen["ids"])  # as a router picks them
    assert seen["expert_offset"] == load["device"] * cfg.n_routed_experts // 4 and seen["shards"] == 4
    assert sum(load["pairs"]) == 5 * cfg.num_experts_per_tok


def test_moe_tuning_reaches_the_routed_experts(tmp_path, monkeypatch, capsys):
    from experiments.bench_util import parse_settings
    assert parse_settings("split=1,mma_in_flight=None,widths=one,offset=-2") == {
        "split": 1, "mma_in_flight": None, "widths": "one", "offset": -2}
    cfg, layer = bench_layer.build_layer("tiny", 4)
    seen = spy_routed_fn(monkeypatch)
    rt, _ = bench_layer.uniform_routing(cfg, layer, 5, local_of=4, moe_tuning={"split": 1, "mma_in_flight": None})
    rt.routed_fn(np.ones((5, cfg.hidden_size), np.float32), np.zeros((5, 2), np.int32), np.ones((5, 2)), None, None)
    assert seen["split"] == 1 and seen["mma_in_flight"] is None and seen["shards"] == 4
    with pytest.raises(SystemExit):
        bench_layer.main(["--size", "tiny", "--moe-tuning", "split"])
    assert "--moe-tuning item 'split' is not KEY=VALUE" in capsys.readouterr().err
    monkeypatch.undo()  # the real routed experts: a tuned run's file is its own, and says how it was tuned
    monkeypatch.setattr(bench_layer, "measure_torch_copy_bandwidth", lambda: 1e11)
    bench_layer.main(["--size", "tiny", "--local-of", "4", "--ms", "1", "--iters", "1", "--repeats", "1",
                      "--parts", "routed_experts", "--moe-tuning", "split=1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_layer_tiny_local4_split1.json").read_text())
    assert result["config"]["moe_tuning"] == {"split": 1} and len(result["rows"]) == 1


def test_one_device_and_mesh_routing_take_the_same_ids(monkeypatch, host_devices):
    """Without --local-of the ids are the same uniform ones: on one device all experts, no offset; under a mesh
    each device's offset as ``routed_experts`` passes it, the load counted over the experts' axis."""
    from ddtree_jax.model import Runtime
    from ddtree_jax.sharding import make_mesh
    cfg, layer = bench_layer.build_layer("tiny")
    seen = spy_routed_fn(monkeypatch)
    x, dummy = np.ones((5, cfg.hidden_size), np.float32), (np.zeros((5, 2), np.int32), np.ones((5, 2), np.float32))
    rt, load = bench_layer.uniform_routing(cfg, layer, 5)
    assert rt.mesh is None and load["device"] == 0 and load["pairs"] == [5 * cfg.num_experts_per_tok]
    assert load["distinct"] == [np.unique(bench_layer.distinct_ids(cfg, 5)).size]
    rt.routed_fn(x, *dummy, None, None)
    assert seen.keys() == {"ids", "shards"} and seen["shards"] == 1
    np.testing.assert_array_equal(seen["ids"], bench_layer.distinct_ids(cfg, 5))
    mesh_rt = Runtime(mesh=make_mesh(data=1, model=4, devices=host_devices[:4]))
    rt, load = bench_layer.uniform_routing(cfg, layer, 5, mesh_rt)
    assert rt.mesh is mesh_rt.mesh and len(load["distinct"]) == 4
    rt.routed_fn(x, *dummy, None, None, expert_offset=8)
    assert seen["expert_offset"] == 8 and seen["shards"] == 4


def test_sharded_uniform_routing_equals_unsharded(host_devices):
    """The MoE part under uniform routing on a 1x4 host mesh (each device its experts, one psum) equals it on
    one device: the ids reach every device's share alike."""
    from ddtree_jax.model import Runtime
    from ddtree_jax.sharding import make_mesh, shard_state
    cfg, layer = bench_layer.build_layer("tiny")
    gdef, state = nnx.split(layer)
    x = (0.1 * jax.random.normal(jax.random.key(3), (1, 5, cfg.hidden_size))).astype(cfg.dtype)
    outs = []
    for mesh in (None, make_mesh(data=1, model=4, devices=host_devices[:4])):
        rt, _ = bench_layer.uniform_routing(cfg, layer, 5, Runtime(mesh=mesh))
        st = state if mesh is None else shard_state(state, mesh, rt.rules)
        step, aux = bench_layer.parts(cfg, layer, 5, 64, rt)["moe"]
        outs.append(np.asarray(jax.jit(lambda st, x: step(nnx.merge(gdef, st), x, aux))(st, x), np.float32))
    np.testing.assert_allclose(outs[1], outs[0], rtol=2e-2, atol=2e-3)
    assert np.abs(outs[0] - np.asarray(x, np.float32)).max() > 0  # the MoE added something


def test_local_run_writes_its_routing_weights_and_hlo(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_layer, "measure_torch_copy_bandwidth", lambda: 1e11)
    bench_layer.main(["--size", "tiny", "--local-of", "4", "--ms", "2", "--iters", "1", "--repeats", "1",
                      "--parts", "layer,routed_experts", "--out", str(tmp_path), "--hlo", "--calls", "2"])
    for part in ("layer", "routed_experts"):  # the timed chain's optimized HLO: two calls of the part
        with gzip.open(tmp_path / f"hlo_bench_layer_tiny_local4_{part}_M2.txt.gz", "rt") as f:
            assert f.read().startswith("HloModule")
    result = json.loads((tmp_path / "bench_layer_tiny_local4.json").read_text())
    assert result["config"]["local_of"] == 4
    assert result["weights_per_device"]["held"] == result["weights_per_device"]["planned_per_device"]
    rows = {r["part"]: r for r in result["rows"]}
    assert set(rows) == {"layer", "routed_experts"} and rows["layer"]["routing"] == rows["routed_experts"]["routing"]
    load = rows["layer"]["routing"]
    assert sum(load["pairs"]) == 2 * 2 and load["distinct"][load["device"]] == max(load["distinct"])
    assert all(np.isfinite(r["us"]) and r["floor_us"] > 0 for r in rows.values())


def test_one_device_run_floors_count_the_experts_its_ids_touch(tmp_path, monkeypatch):
    """Without --local-of the routed experts' floor is the bytes of the distinct experts the uniform ids touch
    (not ``expert_share``'s expectation), and the row says which."""
    from experiments.bench_engine import bytes_of
    monkeypatch.setattr(bench_layer, "measure_torch_copy_bandwidth", lambda: 1e11)
    bench_layer.main(["--size", "tiny", "--ms", "3", "--iters", "1", "--repeats", "1", "--parts", "routed_experts",
                      "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "bench_layer_tiny.json").read_text())["rows"]
    cfg, layer = bench_layer.build_layer("tiny")
    touched = np.unique(bench_layer.distinct_ids(cfg, 3)).size
    assert row["routing"]["distinct"] == [touched] and touched < cfg.n_routed_experts
    experts = bytes_of((layer.mlp.w13.get_value(), layer.mlp.w2.get_value()))
    assert row["floor_us"] == pytest.approx(1e6 * touched / cfg.n_routed_experts * experts / 1e11)


def test_a_sharded_runs_floors_are_one_devices_share(tmp_path, monkeypatch, host_devices):
    """The per-device floors of the layer sharded over a 1x4 host mesh equal those of ``--local-of 4`` (which holds
    exactly one device's shards): replicated weights counted whole, split ones by their shard, the busiest
    device's experts."""
    monkeypatch.setattr(bench_layer, "measure_torch_copy_bandwidth", lambda: 1e11)
    floors = []
    for flag, name in ((["--mesh", "1x4"], "mesh1x4"), (["--local-of", "4"], "local4")):
        bench_layer.main(["--size", "tiny", "--ms", "2", "--iters", "1", "--repeats", "1",
                          "--parts", "layer,attention,moe", "--out", str(tmp_path)] + flag)
        rows = json.loads((tmp_path / f"bench_layer_tiny_{name}.json").read_text())["rows"]
        floors.append({r["part"]: r["floor_us"] for r in rows})
    assert set(floors[0]) == {"layer", "attention", "moe"}
    for part, floor in floors[0].items():
        assert floor == pytest.approx(floors[1][part]), part


def test_local_of_refuses_a_mesh_and_one_device_and_hlo_an_out(capsys):
    for argv, says in ((["--local-of", "1"], "--local-of takes a device count of at least 2"),
                       (["--local-of", "2", "--mesh", "1x2"], "--local-of takes a device count of at least 2"),
                       (["--hlo"], "--hlo needs --out")):
        with pytest.raises(SystemExit):
            bench_layer.main(["--size", "tiny"] + argv)
        assert says in capsys.readouterr().err


def test_a_sharded_moe_layer_has_the_all_reduces_the_projection_adds(host_devices):
    """What ``--local-of`` leaves out: on a 1x4 mesh of host devices the compiled MoE layer holds exactly
    ``project_k26.ALLREDUCES_PER_LAYER`` all-reduces (the attention's output; the routed and shared experts'
    shares, summed before it), of the f32 values ``project_k26.allreduce_time`` counts, and no other collective."""
    import re

    from ddtree_jax.model import Runtime
    from ddtree_jax.sharding import make_mesh, shard_state
    from experiments.project_k26 import ALLREDUCED_ROWS_PER_TOKEN, ALLREDUCES_PER_LAYER
    cfg, layer = bench_layer.build_layer("tiny")
    mesh = make_mesh(data=1, model=4, devices=host_devices[:4])
    rt = Runtime(mesh=mesh)
    gdef, state = nnx.split(layer)
    state = shard_state(state, mesh, rt.rules)
    step, kv = bench_layer.parts(cfg, layer, 1, 64, rt)["layer"]
    x = jax.numpy.zeros((1, 1, cfg.hidden_size), cfg.dtype)
    hlo = jax.jit(lambda st, x, kv: step(nnx.merge(gdef, st), x, kv)).lower(state, x, kv).compile().as_text()
    op = r" all-reduce(?:-start)?\("  # the op, not an instruction named after it
    reduces = [line for line in hlo.splitlines() if re.search(op, line)]
    assert len(reduces) == ALLREDUCES_PER_LAYER
    # what they carry: ALLREDUCED_ROWS_PER_TOKEN f32 rows of D values for the one token
    shapes = [s for line in reduces for s in re.findall(r"(\w+)\[([\d,]*)\]", re.split(op, line)[0].split("=", 1)[1])]
    assert {dtype for dtype, _ in shapes} == {"f32"}
    assert sum(int(np.prod([int(d) for d in dims.split(",")])) for _, dims in shapes) \
        == ALLREDUCED_ROWS_PER_TOKEN * cfg.hidden_size
    assert not re.search(r"\b(all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo)



def test_every_part_is_known():
    """``PARTS`` (what --parts accepts) names exactly ``parts()``'s steps and the dispatched call."""
    cfg, layer = bench_layer.build_layer("tiny")
    assert set(bench_layer.parts(cfg, layer, 1, 16)) | {"dispatched"} == set(bench_layer.PARTS)

"""Ahead-of-time lowering of the engine's programs (``Engine.lower_prefill`` / ``lower_dispatch``) and
``experiments/compile_mesh.py``, on 8 fake CPU devices with the tiny model: the programs lowered from abstract
caches, from an abstract state and from abstract weights are the very programs the engine runs with arrays, and
the compiled arguments hold what ``memory_plan`` predicts per device."""

import json

import jax
import numpy as np
import pytest

from ddtree_jax.engine import Engine, EngineConfig, abstract_outputs
from ddtree_jax.memory_plan import plan_memory
from ddtree_jax.model import Runtime
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh
from experiments import compile_mesh
from experiments.bench_mesh import build, model_configs

MESH = {"data": 2, "model": 4}  # streams split too, so that the state's shardings are not all replicated


def _mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    return make_mesh(**MESH)


def test_programs_lowered_without_arrays_are_the_ones_the_engine_runs():
    """Abstract caches, an abstract state and abstract weights lower to the same StableHLO, shardings included,
    as the engine's arrays do; the abstract state has the shapes, dtypes and shardings of the real one."""
    mesh = _mesh()
    cfg, dcfg = model_configs("tiny", 2)
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    ecfg = EngineConfig(mode="ddtree", budget=4, max_new_tokens=8, capacity=64, prefill_chunk=8)
    real = Engine(*build(cfg, dcfg, mesh), ecfg, runtime=runtime)
    abstract = Engine(*compile_mesh.abstract_models(cfg, dcfg), ecfg, runtime=runtime)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
               for x in jax.tree.leaves(abstract.target_state))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 11)).tolist()
    requests = real.check_requests(prompts, temperature=[0.0, 0.7, 0.0, 1.0], top_p=0.9)

    lowered = real.lower_prefill(requests)
    assert lowered.as_text() == abstract.lower_prefill(requests).as_text()
    state = abstract_outputs(lowered.compile())
    ran = real.prefill_requests(requests)
    for path_leaf, leaf in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(ran)):
        path, spec = path_leaf
        assert (spec.shape, spec.dtype) == (leaf.shape, leaf.dtype), path
        assert spec.sharding.is_equivalent_to(leaf.sharding, leaf.ndim), path
    text = real.lower_dispatch(ran).as_text()
    assert text == real.lower_dispatch(state).as_text() == abstract.lower_dispatch(state).as_text()


def test_a_tiny_run_holds_the_planned_bytes(tmp_path):
    _mesh()
    rows = compile_mesh.main(["--mesh", "2x4", "--size", "tiny", "--layers", "2", "--streams", "2",
                              "--prompt-len", "12", "--new-tokens", "8", "--capacity", "64", "--budget", "4",
                              "--prefill-chunk", "8", "--out", str(tmp_path)])
    assert [(r["layers"], r["program"]) for r in rows] == [(2, "prefill"), (2, "dispatch")]
    cfg, dcfg = model_configs("tiny", 2)
    plan = plan_memory(cfg, MESH, DEFAULT_RULES, drafter_cfg=dcfg)
    planned = (sum(v["per_device"] for v in plan.weights.values())
               + sum(v["per_device"] for v in plan.drafter_weights.values()) + plan.cache_bytes(64, 2))
    dispatch = rows[1]
    assert dispatch["planned_weights_caches_GB"] == planned / 1e9
    # The rounds take every weight and both caches, plus the state's small arrays (tokens, keys, settings, ...).
    assert planned <= dispatch["argument_GB"] * 1e9 <= planned + 64 * 1024, dispatch
    for r in rows:
        assert r["compile_s"] > 0 and r["lower_s"] > 0 and r["temp_GB"] >= 0
        assert r["live_GB"] == pytest.approx(r["argument_GB"] + r["output_GB"] - r["alias_GB"] + r["temp_GB"])
    saved = json.loads((tmp_path / "compile_mesh_tiny_2x4.json").read_text())
    assert saved["mesh_shape"] == MESH and saved["devices"] == len(jax.devices()) and saved["rows"] == rows


@pytest.mark.parametrize("argv, message", [
    (["--layers", "2,x"], "integers"), (["--layers", "0"], "at least 1"), (["--programs", "prefill,verify"], "choose"),
    (["--streams", "0"], "--streams must be"), (["--mesh", "4x8"], "needs 32 devices"), (["--mesh", "8"], "DATAxMODEL"),
    (["--prefill-chunk", "-1"], "--prefill-chunk must be"),
])
def test_bad_arguments_are_refused_before_any_model_is_built(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        compile_mesh.main(["--size", "tiny", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err


def test_prefill_chunk_zero_lowers_one_block(tmp_path):
    """``--prefill-chunk 0`` is the help's "one block" (the engine's None), as in run_decode.py."""
    _mesh()
    rows = compile_mesh.main(["--mesh", "1x2", "--size", "tiny", "--layers", "1", "--streams", "1",
                              "--prompt-len", "12", "--new-tokens", "4", "--capacity", "32", "--budget", "2",
                              "--prefill-chunk", "0", "--programs", "prefill", "--out", str(tmp_path)])
    assert [(r["layers"], r["program"]) for r in rows] == [(1, "prefill")]

"""``experiments/probe_layer_scan.py``: the target's forward with its MoE layers under one ``lax.scan`` over stacked
weights gives the logits and latents of the unrolled forward (a random tree over a filled cache, INT4 experts in the
kernel layout, on one device and sharded over 8), and the probe's run reports both variants."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.cache import init_cache
from ddtree_jax.engine import place_caches
from ddtree_jax.model import KimiModel, Runtime
from ddtree_jax.moe import prepare_for_kernels
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh
from experiments import probe_layer_scan
from experiments.bench_engine import random_state, random_trees
from experiments.bench_mesh import model_configs


@pytest.mark.parametrize("sharded", [False, True])
def test_the_scanned_forward_equals_the_unrolled_one(sharded):
    if sharded and len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    mesh = make_mesh(2, 4) if sharded else None
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES) if sharded else Runtime()
    cfg, _ = model_configs("tiny", 4)
    gdef, abstract = nnx.split(nnx.eval_shape(lambda: KimiModel(cfg, nnx.Rngs(0))))
    target = prepare_for_kernels(nnx.merge(gdef, random_state(abstract, 0, mesh, DEFAULT_RULES)))
    rng = np.random.default_rng(0)
    b, t, prefix = 2, 7, 20
    depth, mask = random_trees(rng, b, t)
    cache = init_cache(cfg, b, prefix + t)
    cache = dataclasses.replace(cache, kv=jnp.asarray(rng.standard_normal(cache.kv.shape), cache.kv.dtype),
                                lengths=jnp.asarray([prefix, 13], jnp.int32))  # rows past a length: garbage
    cache, _ = place_caches(cache, None, runtime)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    positions = jnp.asarray(prefix + depth, jnp.int32)
    mask = jnp.asarray(mask)

    plain = jax.jit(lambda m, *a: m(*a, runtime=runtime))(target, tokens, positions, cache, mask)
    head, layer_def, stacked = probe_layer_scan.split_for_scan(target)
    assert len(head.layers) == cfg.first_k_dense_replace
    assert all(leaf.shape[0] == cfg.num_layers - cfg.first_k_dense_replace for leaf in jax.tree.leaves(stacked))
    scanned = jax.jit(lambda h, s, *a: probe_layer_scan.scanned_forward(h, layer_def, s, *a, runtime=runtime))(
        head, stacked, tokens, positions, cache, mask)
    np.testing.assert_allclose(scanned.logits, plain.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scanned.block_kv, plain.block_kv, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(plain.logits)).max() > 1e-3  # not a forward of zeros


def test_a_tiny_run_reports_both_variants(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    rows = probe_layer_scan.main(["--size", "tiny", "--layers", "3", "--prefix", "16", "--streams", "2",
                                  "--hlo-dir", str(tmp_path / "hlo"), "--out", str(tmp_path)])
    assert [(r["layers"], r["variant"]) for r in rows] == [(3, "unrolled"), (3, "scan")]
    assert rows[0]["argument_GB"] == rows[1]["argument_GB"] > 0  # the same weights and inputs, stacked or not
    assert all(r["compile_s"] > 0 for r in rows)
    assert (tmp_path / "probe_layer_scan_tiny_1x8.json").exists()
    for variant in ("unrolled", "scan"):
        assert (tmp_path / "hlo" / f"3_{variant}.hlo.txt").read_text().startswith("HloModule")


def test_a_tiny_timed_run_reports_both_variants_over_the_same_weights(tmp_path):
    rows = probe_layer_scan.main(["--run", "--mesh", "1x1", "--size", "tiny", "--layers", "3", "--prefix", "8",
                                  "--streams", "1", "--out", str(tmp_path)])
    assert [(r["variant"], r["streams"]) for r in rows] == [("unrolled", 1), ("scan", 1)]
    assert all(r["ms"] > 0 for r in rows)
    # the tiny MoE layer's weights other than its experts: attention, router, shared expert, norms (f32)
    assert rows[0]["dense_MB_per_layer"] == rows[1]["dense_MB_per_layer"] > 0.1
    assert rows[0]["copy_floor_ms"] > 0
    assert (tmp_path / "probe_layer_scan_run_tiny.json").exists()


@pytest.mark.parametrize("flags", [["--mock-gpus"], ["--mesh", "1x8"], ["--hlo-dir", "x"]])
def test_a_timed_run_refuses_what_it_cannot_do(flags, capsys):
    argv = ["--run", "--size", "tiny", "--layers", "3"] + (["--mesh", "1x1"] if "--mesh" not in flags else []) + flags
    with pytest.raises(SystemExit):
        probe_layer_scan.main(argv)
    assert "--run times one device's forwards" in capsys.readouterr().err

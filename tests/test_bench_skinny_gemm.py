"""The skinny-GEMM benchmark on the CPU: every variant computes the same product as the model's dot, and a
smoke run writes one row per shape, M and variant."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_skinny_gemm as bench


@pytest.mark.parametrize("variant", ["kn", "nk", "split2", "split4", "pad8"])
def test_each_variant_is_the_dot(variant):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 40)), jnp.bfloat16)
    fn, layout = bench.variant_fn(variant)
    got = np.asarray(fn(x, layout(w)).astype(jnp.float32))
    want = np.asarray(jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    with pytest.raises(ValueError, match="unknown variant"):
        bench.variant_fn("tiled")


@pytest.mark.parametrize("variant", ["kn", "pad2", "hmajor"])
def test_each_variant_of_a_batched_product(variant):
    spec, x_tail, w_shape = bench.SMOKE_SHAPES["w_uk"]
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((1, *x_tail)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.bfloat16)
    fn, layout = bench.variant_fn(variant, spec)
    got = np.asarray(fn(x, layout(w)).astype(jnp.float32))
    want = np.asarray(jnp.einsum(spec, x, w, preferred_element_type=jnp.float32))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    for dense_only in ("nk", "split2"):
        with pytest.raises(ValueError, match="unknown variant"):
            bench.variant_fn(dense_only, spec)


def test_smoke_run_writes_every_point(tmp_path):
    bench.main(["--smoke", "--ms", "1,9", "--variants", "kn,split2,hmajor", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "bench_skinny_gemm_smoke.json").read_text())
    rows = payload["rows"]
    assert payload["config"]["trace_repeats"] == 1 and all(len(r["us_repeats"]) == 1 for r in rows)
    dense = [s for s, (spec, _, _) in bench.SMOKE_SHAPES.items() if spec == bench.DENSE]
    assert {(r["shape"], r["M"], r["variant"]) for r in rows} == {
        (s, m, v) for m in (1, 9) for s, vs in [*[(d, ("kn", "split2")) for d in dense], ("w_uk", ("kn", "hmajor"))]
        for v in vs}
    for r in rows:
        assert r["max_rel_err"] < 1e-2 and math.isfinite(r["us"]) and r["us"] > 0 and r["copies"] >= 2


def test_unknown_variants_and_shapes_are_refused_up_front(capsys):
    """A typo or ``pad`` without its rows is a CLI error (it was skipped without a word and the run exited 0);
    --shapes is refused under --smoke (it was ignored there)."""
    for bad, message in ((["--variants", "kn,knn"], "unknown ['knn']"), (["--variants", "kn,pad"], "unknown ['pad']"),
                         (["--variants", "split0"], "unknown ['split0']"), (["--shapes", "q_b,qb"], "unknown ['qb']"),
                         (["--smoke", "--shapes", "q_b"], "leave out --shapes"),
                         (["--smoke", "--calls", "0"], "at least 1"),
                         (["--smoke", "--trace-repeats", "0"], "at least 1")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(bad)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, bad
    assert all(map(bench.known_variant, ("kn", "nk", "hmajor", "split8", "pad16")))


def test_a_variant_that_does_not_apply_is_skipped_with_a_note(tmp_path, capsys):
    bench.main(["--smoke", "--ms", "1", "--variants", "kn,nk,split3", "--out", str(tmp_path), "--calls", "2"])
    out = capsys.readouterr().out
    assert "w_uk: variant nk does not apply" in out and "q_b: split3 does not divide K = 64" in out
    payload = json.loads((tmp_path / "bench_skinny_gemm_smoke.json").read_text())
    rows = payload["rows"]
    assert payload["config"]["trace_repeats"] == 1 and all(len(r["us_repeats"]) == 1 for r in rows)
    assert {(r["shape"], r["variant"]) for r in rows} == {("q_b", "kn"), ("q_b", "nk"), ("shared_down", "kn"),
                                                          ("shared_down", "nk"), ("w_uk", "kn")}

"""The skinny-GEMM benchmark on the CPU: every variant computes the same product as the model's dot, and a
smoke run writes one row per shape, M and variant."""

import json
import math

import jax
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


def test_smoke_run_writes_every_point(tmp_path):
    bench.main(["--smoke", "--ms", "1,9", "--variants", "kn,split2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_skinny_gemm_smoke.json").read_text())["rows"]
    assert {(r["shape"], r["M"], r["variant"]) for r in rows} == {
        (s, m, v) for s in bench.SMOKE_SHAPES for m in (1, 9) for v in ("kn", "split2")}
    for r in rows:
        assert r["max_rel_err"] < 1e-2 and math.isfinite(r["us"]) and r["us"] > 0 and r["copies"] >= 2

"""The size-ceiling benchmark on the CPU: its ops compute what they say (so a GPU time is a time of that work),
a point yields every column, and the comparison with the op's grid names what holds each point below its goal."""

import math
import re

import numpy as np

import jax
import jax.numpy as jnp

from experiments import bench_attention_ceiling as ceil
from experiments import bench_tree_attention as bench


def small_inputs(B=2, T=3, H=4, P=96):
    q, caches, plen, tkv, mask = bench.make_inputs(jax.random.key(0), H, B, T, P, 1)
    return q, caches[0], jnp.array([P, 37], jnp.int32)[:B], tkv, mask


def test_read_sums_each_prefix_over_its_keys_only():
    q, cache, plen, tkv, mask = small_inputs()
    c = np.asarray(cache, np.float32)
    want = np.array([c[b, :int(plen[b])].sum() for b in range(c.shape[0])])
    got = np.asarray(ceil.read_prefixes(q, cache, plen, tkv, mask))
    assert got.shape == (2, 1, 1, 1)
    np.testing.assert_allclose(got[:, 0, 0, 0], want, rtol=1e-4, atol=1e-2)


def test_gemm_pair_is_the_two_products_over_each_prefix():
    q, cache, plen, tkv, mask = small_inputs()
    B, T, H, C = q.shape
    qf, cf = np.asarray(q, np.float32).reshape(B, T * H, C), np.asarray(cache, np.float32)
    s = np.einsum("bnc,bkc->bnk", qf, cf)
    s[1, :, int(plen[1]):] = 0.0
    s = np.asarray(jnp.asarray(s).astype(jnp.bfloat16), np.float32)  # the scores are handed on in bf16
    want = np.einsum("bnk,bkc->bnc", s, cf).reshape(B, T, H, C)
    got = np.asarray(ceil.gemm_pair(q, cache, plen, tkv, mask), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_a_chain_of_the_products_runs_both_in_every_call():
    """Each call's q . k^T depends on the chain (the prefix lengths): three calls over one cache copy are six
    dots, not four (XLA kept one q . k^T for all calls while the tie to the integer lengths folded away)."""
    q, caches, plen, tkv, mask = bench.make_inputs(jax.random.key(0), 2, 1, 2, 64, 1)
    hlo = bench.chained(jax.jit(ceil.gemm_pair), 3).lower(q, caches, plen, tkv, mask).compile().as_text()
    assert len(re.findall(r"= \S+ dot\(", hlo)) == 6


def test_point_row_on_the_cpu():
    row = ceil.ceiling_point(8, 2, 8, 128, bw=1e11, peak=1e12)
    assert row["bound"] == "compute" and row["ceiling_pct"] == row["gemm_pct_peak"]
    for key in ("read_ms", "read_pct_bw", "gemm_ms", "gemm_pct_peak"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["gemm_flops"] == 2 * 2 * 8 * 8 * 128 * 2 * bench.C
    assert row["read_timed"] == row["gemm_timed"] == "chain span"  # on a CPU host; on a GPU the op's kernels


def test_op_time_sums_the_op_kernels_of_every_call():
    """Kernel totals as the H200 traced them (session 37): XLA fuses the chain's first call apart, so a kernel
    can run in some calls only; the casts, masks, tie and memsets around the products are not theirs."""
    gemm = [["nvjet_sm90_tss_168x128_64x5_1x2_h_bz_TNN", 1.0, 30.25e-6], ["gemm_fusion_dot_general_17", 0.875, 25e-6],
            ["gemm_fusion_dot_general_18", 0.125, 4e-6], ["loop_convert_fusion_6", 0.875, 22.69e-6],
            ["loop_compare_fusion", 0.875, 1.07e-6], ["Memset 0", 1.0, 0.8e-6]]
    read = [["input_reduce_fusion_6", 0.875, 235.67e-6], ["input_reduce_fusion_7", 0.125, 33.9e-6],
            ["loop_add_fusion", 0.875, 0.98e-6]]
    assert math.isclose(ceil.op_seconds(gemm, "gemm"), 59.25e-6)
    assert math.isclose(ceil.op_seconds(read, "read"), 269.57e-6)
    assert ceil.op_seconds(read, "gemm") is None


def test_verdicts_name_what_holds_a_point_below_its_goal():
    def op(H, B, ms, bound="memory"):
        return dict(H=H, B=B, T=1, P=8192, bound=bound, floor_ms=0.02, ms=ms + 0.002, op_ms=ms)

    ops = [op(8, 16, 0.024), op(8, 4, 0.04), op(8, 1, 0.04), op(64, 1, 0.04, "compute"),
           dict(H=64, B=4, T=1, P=8192, error="boom", ms="ERR")]
    ceilings = [dict(H=8, B=16, T=1, P=8192, ceiling_pct=95.0), dict(H=8, B=4, T=1, P=8192, ceiling_pct=70.0),
                dict(H=8, B=1, T=1, P=8192, ceiling_pct=85.0), dict(H=64, B=1, T=1, P=8192, ceiling_pct=None),
                dict(H=64, B=4, T=1, P=8192, ceiling_pct=60.0), dict(H=8, B=2, T=1, P=8192, ceiling_pct=60.0)]
    v = {(r["H"], r["B"]): r for r in ceil.verdicts(ceilings, ops)}
    assert set(v) == {(8, 16), (8, 4), (8, 1), (64, 1)}  # a failed op point or one without an op is left out
    assert math.isclose(v[8, 16]["op_pct"], 100 * 0.02 / 0.024)
    assert [v[k]["holds"] for k in ((8, 16), (8, 4), (8, 1), (64, 1))] == ["met", "size", "kernel", "met"]
    assert ceil.verdicts([dict(H=64, B=1, T=1, P=8192, ceiling_pct=None)], [op(64, 1, 0.05, "compute")])[0]["holds"] \
        == "?"  # 40 % of peak, below 50, without a ceiling


def test_goal_map_of_ceilings():
    rows = [dict(kernel="size ceiling", H=8, T=1, P=1024, B=1, bound="memory", ceiling_pct=30.0),
            dict(kernel="size ceiling", H=8, T=32, P=1024, B=1, bound="compute", ceiling_pct=None)]
    text = bench.render_goal_map(rows, pct=lambda r: r["ceiling_pct"])
    assert "| 8 | 1 | 30 m |" in text and "| 8 | 32 | err |" in text and "Goals hold at 0 of 2 points." in text


def test_a_later_files_row_replaces_an_earlier_ones_at_the_same_point(tmp_path):
    import json

    grid = [dict(H=8, B=1, T=1, P=1024, ceiling_pct=10.0), dict(H=8, B=1, T=32, P=1024, ceiling_pct=13.6)]
    rerun = [dict(H=8, B=1, T=32, P=1024, ceiling_pct=7.9), dict(H=8, B=4, T=32, P=1024, ceiling_pct=23.3)]
    paths = []
    for name, rows in (("grid", grid), ("rerun", rerun)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(dict(rows=rows)))
    got = ceil.rows_of(paths)
    assert [(r["T"], r["B"], r["ceiling_pct"]) for r in got] == [(1, 1, 10.0), (32, 1, 7.9), (32, 4, 23.3)]
    assert ceil.rows_of([]) == []
    two_kernels = tmp_path / "kernels.json"  # op grids: one row per kernel at a point
    two_kernels.write_text(json.dumps(dict(rows=[dict(kernel=k, H=8, B=1, T=1, P=1024, ms=1.0) for k in "ab"])))
    assert [r["kernel"] for r in ceil.rows_of([two_kernels])] == ["a", "b"]


def test_against_takes_the_op_kernels_rows_only(tmp_path):
    """An A/B file holds the op's rows and a variant's at the same points; the variant's come later in the file
    and must not replace the op's."""
    import json

    path = tmp_path / "ab.json"
    path.write_text(json.dumps(dict(rows=[dict(kernel="mgpu", H=64, B=1, T=64, P=1024, op_ms=0.0235),
                                          dict(kernel="mgpu_wide", H=64, B=1, T=64, P=1024, op_ms=0.0244)])))
    assert [r["op_ms"] for r in ceil.op_rows_of([str(path)])] == [0.0235]
    assert [r["op_ms"] for r in ceil.op_rows_of([str(path)], "mgpu_wide")] == [0.0244]
    assert ceil.op_rows_of([str(path)], "triton") == []

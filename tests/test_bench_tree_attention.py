"""The tree-attention benchmark's measuring path on the CPU: a point with the profiler-trace timing and XLA's
masked attention beside it yields every column (a bug there once turned every XLA figure into an error)."""

import math

from experiments import bench_tree_attention as bench
from pallas_kernels.tree_attention import tree_attention_ref


def test_bench_point_with_trace_and_xla(monkeypatch):
    monkeypatch.setitem(bench.KERNELS, "twin", tree_attention_ref)
    row = bench.bench_point(2, 1, 3, 64, {}, bw=1e11, peak=1e12, kernel="twin", with_trace=True, check=True,
                            repeats=1)
    assert "xla_error" not in row
    for key in ("ms", "xla_ms", "speedup"):  # from the profiler's trace
        assert math.isfinite(row[key]) and row[key] > 0, key
    for key in ("ms_chained", "xla_ms_chained"):  # wall-clock differences of two chains: on a busy CPU with one
        assert math.isfinite(row[key]), key      # repeat a µs-sized op's can come out below zero (CI did once)
    assert row["rel_err"] < 1e-2  # the twin on bf16 inputs against itself in f32
    assert math.isclose(row["speedup"], row["xla_ms"] / row["ms"])


def test_kernel_names_take_integer_keywords():
    """--kernel entries: a KERNELS name as it is, or with integer keywords bound (an A/B of one kernel's options in
    one run); an unknown name or a keyword that is not k=int is an error naming the entry."""
    import functools

    import pytest

    assert bench.kernel_fn("mgpu") is bench.KERNELS["mgpu"]
    f = bench.kernel_fn("mgpu_narrow:stages=3&num_splits=4")
    base = bench.KERNELS["mgpu_narrow"]  # itself a partial, which functools flattens into this one
    assert isinstance(f, functools.partial) and f.func is base.func
    assert f.keywords == dict(base.keywords, stages=3, num_splits=4)
    with pytest.raises(ValueError, match="unknown kernel 'mgpu_nope'"):
        bench.kernel_fn("mgpu_nope:stages=3")
    with pytest.raises(ValueError, match="k=int"):
        bench.kernel_fn("mgpu:stages=three")
    g = bench.kernel_fn("mgpu_wide:tail=0&kernel.stages=3")  # 'kernel.' options go to the kernel itself
    assert g.keywords["tail"] == 0 and g.keywords["kernel"].func is bench.M.split_attention
    assert g.keywords["kernel"].keywords == {"stages": 3}
    assert bench.kernel_fn("mgpu_narrow:kernel.x=1/2").keywords["kernel"].keywords == {"x": (1, 2)}
    with pytest.raises(ValueError, match="names its kernel"):
        bench.kernel_fn("mgpu:kernel.stages=3")
    m = bench.kernel_fn("mgpu:combine.num_warps=4")  # 'combine.' options go to the split merge
    assert m.keywords["combine"].func is bench.combine_splits and m.keywords["combine"].keywords == {"num_warps": 4}
    with pytest.raises(ValueError, match="split merge"):
        bench.kernel_fn("triton:combine.num_warps=4")

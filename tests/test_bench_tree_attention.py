"""The tree-attention benchmark's measuring path on the CPU: a point with the profiler-trace timing and XLA's
masked attention beside it yields every column (a bug there once turned every XLA figure into an error)."""

import math

from experiments import bench_tree_attention as bench
from experiments import bench_util
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
    # one copy is 2·1·64·576 bytes, so 16 copies are made and the chain of 8 calls reads 8: well inside the L2
    assert (row["cache_copies"], row["chain_cache_bytes"], row["l2_fits_chain"]) == (16, 8 * 2 * 64 * 576, True)
    assert bench.chain_cache_bytes(16, 65536, bench_util.rotating_copies(2 * 16 * 65536 * 576)) == 2 * 16 * 65536 * 576


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


def test_trace_only_point_has_device_times_and_no_wall_clock(monkeypatch):
    """--trace-only: the profiler's times alone (and XLA's), no wall-clock chains; without a trace it refuses."""
    import pytest

    monkeypatch.setitem(bench.KERNELS, "twin", tree_attention_ref)
    row = bench.bench_point(2, 1, 3, 64, {}, bw=1e11, peak=1e12, kernel="twin", with_trace=True, check=False,
                            wall_clock=False)
    for key in ("ms", "xla_ms"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert not {"ms_chained", "xla_ms_chained", "ms_with_launch", "rel_err"} & set(row)
    with pytest.raises(ValueError, match="needs with_trace"):
        bench.bench_point(2, 1, 3, 64, {}, bw=1e11, peak=1e12, kernel="twin", with_trace=False, wall_clock=False)


def test_xla_entry_matches_the_twin():
    """--kernel xla: the masked XLA attention as a kernel row, checked against the twin like any kernel."""
    import pytest

    row = bench.bench_point(2, 2, 3, 64, {}, bw=1e11, peak=1e12, kernel="xla", with_trace=False, check=True,
                            with_xla=False, repeats=1)
    assert row["rel_err"] < 1e-2 and "path" not in row
    with pytest.raises(ValueError, match="GiB of scores"):  # refused before any input is made
        bench.bench_point(64, 16, 256, 65536, {}, bw=1e11, peak=1e12, kernel="xla", with_trace=False)
    with pytest.raises(ValueError, match="benchmark's scale"):
        bench.xla_kernel(None, None, None, None, None, scale=1.0, kv_lora_rank=bench.L)


def test_issue_grid_and_mgpu_paths():
    """The issue's grid is every (H, B, T, P) it names, once; the op's kernel choice per point as the library
    makes it."""
    assert len(bench.ISSUE_GRID) == len(set(bench.ISSUE_GRID)) == 2 * 6 * 3 * 3
    assert ({pt[0] for pt in bench.ISSUE_GRID} == {8, 64}
            and {pt[2] for pt in bench.ISSUE_GRID} == {1, 8, 32, 64, 128, 256})
    assert bench.mgpu_path(8, 16, 1, 8192)["path"] == "narrow"
    assert bench.mgpu_path(8, 16, 9, 8192)["path"] == "tail"
    assert bench.mgpu_path(64, 1, 1, 8192) == dict(path="tiles", num_splits=bench.M.splits_for(1, 1, 64, 8192),
                                                   merge="launch")
    assert bench.mgpu_path(64, 1, 64, 1024) == dict(path="tiles", num_splits=2, merge="kernel")
    assert bench.mgpu_path(64, 16, 256, 8192)["merge"] == "none"
    assert bench.mgpu_path(8, 1, 9, 65536)["merge"] == "launch"  # one tile and a tail


def test_goal_map_marks_where_the_goals_hold():
    rows = [dict(kernel="mgpu", H=8, T=1, P=8192, B=16, bound="memory", floor_ms=0.036, ms=0.05, op_ms=0.04),  # 90 %
            dict(kernel="mgpu", H=8, T=1, P=8192, B=1, bound="memory", floor_ms=0.002, ms=0.02),  # 10 %, no op_ms
            dict(kernel="mgpu", H=8, T=256, P=1024, B=1, bound="compute", floor_ms=0.007, ms=0.02, op_ms=0.014),  # 50
            dict(kernel="mgpu", H=64, T=1, P=8192, B=1, bound="memory", error="boom", ms="ERR"),
            dict(kernel="xla", H=8, T=1, P=8192, B=16, bound="memory", floor_ms=0.036, ms=0.1)]
    text = bench.render_goal_map(rows)
    mgpu, xla = text.split("**xla**")
    assert "| H | T | 8K, B=16 | 8K, B=1 | 1K, B=1 |" in mgpu  # longest prefix first, then most streams
    assert "| 8 | 1 | **90 m** | 10 m |  |" in mgpu and "| 8 | 256 |  |  | **50 c** |" in mgpu
    assert "| 64 | 1 |  | err |  |" in mgpu and "Goals hold at 2 of 4 points." in mgpu
    assert "| 8 | 1 | 36 m |" in xla and "Goals hold at 0 of 1 points." in xla


def test_a_point_starts_only_if_the_longest_so_far_would_end_within_the_budget():
    assert bench.next_point_fits(0.0, [], 10.0)  # the first point always starts
    assert bench.next_point_fits(70.0, [4.0, 30.0, 5.0], 100.0)
    assert not bench.next_point_fits(71.0, [4.0, 30.0, 5.0], 100.0)
    assert not bench.next_point_fits(101.0, [], 100.0)


def test_clock_samples_run_the_ops_chain_and_land_in_the_row(monkeypatch):
    """--clocks: the op's chain of 8 calls runs under the sampler, whose medians land in the row; where the
    sampler has nothing (no nvidia-smi) the row has no clock columns; without clock_s it is never called."""
    monkeypatch.setitem(bench.KERNELS, "twin", tree_attention_ref)
    seen = []

    def fake_state(fn, args, seconds):
        seen.append(seconds)
        outs = fn(*args)
        assert len(outs) == 8 and outs[0].shape == (1, 3, 2, bench.L)
        return dict(samples=3, sm_mhz=dict(median=1650.0, min=1600.0, max=1700.0),
                    power_w=dict(median=512.0, min=500.0, max=530.0))

    point = dict(H=2, B=1, T=3, P=64, cfg={}, bw=1e11, peak=1e12, kernel="twin", with_trace=False, with_xla=False,
                 check=False, repeats=1)
    row = bench.bench_point(**point, clock_s=0.25, gpu_state=fake_state)
    assert seen == [0.25] and (row["sm_mhz"], row["power_w"]) == (1650.0, 512.0) and row["clocks"]["samples"] == 3
    row = bench.bench_point(**point, clock_s=0.25, gpu_state=lambda fn, args, seconds: None)
    assert "sm_mhz" not in row and "clocks" not in row
    row = bench.bench_point(**point, gpu_state=lambda *a, **k: seen.append("called"))
    assert seen == [0.25] and "sm_mhz" not in row


def test_bad_clock_flags_are_refused(monkeypatch, capsys):
    import sys

    import pytest

    for argv, message in [(["--clocks", "-1"], "--clocks takes seconds >= 0"),
                          (["--clocks", "nan"], "--clocks takes seconds >= 0"),
                          (["--mode", "parts", "--clocks", "1"], "not --mode parts")]:
        monkeypatch.setattr(sys, "argv", ["bench_tree_attention.py", "--smoke", *argv])
        with pytest.raises(SystemExit) as exc:
            bench.main()
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_device_time_reports_the_op_kernels_median_launch(monkeypatch):
    """``device_time``'s third value: the median µs of each of the op's kernels (by the name predicate) over
    its launches, the chain's other kernels left out; none without a predicate."""
    fake = {"span_s": 2e-5, "op_span_s": 1.5e-5,
            "launches_us": {"mosaic_gpu_k": [10.0, 12.0, 11.0], "combine_splits_m": [3.0, 2.0, 4.0], "tie": [1.0] * 3}}
    monkeypatch.setattr(bench.bench_util, "traced_call_time", lambda *a, **k: fake)
    inputs = (None,) * 5
    assert bench.device_time(None, inputs, op_kernels=bench.is_mgpu_op_kernel) == (
        2e-5, 1.5e-5, {"mosaic_gpu_k": 11.0, "combine_splits_m": 3.0})
    assert bench.device_time(None, inputs)[2] == {}


def test_flags_that_would_be_ignored_are_refused(monkeypatch, capsys):
    """--smoke with another kernel (it timed Triton instead), --points / --heads with --mode sweep or both (their
    own shapes replaced them) and split factors <= 0 (clamped to one split) are errors, not silent changes."""
    import sys

    import pytest

    for argv, message in [(["--smoke", "--kernel", "mgpu"], "--smoke times the Triton kernel only"),
                          (["--smoke", "--mode", "sweep", "--points", "8,1,1,128"], "--mode sweep times its own"),
                          (["--smoke", "--mode", "both", "--heads", "8"], "--mode both times its own"),
                          (["--mode", "splits", "--split-factors", "1,0"], "--split-factors must be positive"),
                          (["--mode", "splits", "--split-factors", "-0.5"], "--split-factors must be positive")]:
        monkeypatch.setattr(sys, "argv", ["bench_tree_attention.py", *argv])
        with pytest.raises(SystemExit) as exc:
            bench.main()
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv


def test_the_flop_floor_counts_the_tree_keys_the_mask_shows(tmp_path):
    """Each node multiplies with the prefix and its ancestors-or-self, not all T tree keys (a chain's node i sees
    i + 1 of them, a star's leaves 2): rows written before session 77 counted all T, and ``rows_of`` recounts them."""
    import json

    import numpy as np

    from ddtree_jax.tree import make_tree

    H, B, T, P, C, L = 8, 2, 16, 1024, bench.C, bench.L
    chain = B * T * (T + 1) // 2
    star = B * (1 + 2 * (T - 1))
    for visible in (chain, star):
        _, flops, _, _ = bench.roofline(H, B, T, P, 1e12, 1e15, visible=visible)
        assert flops == 2 * H * (B * T * P + visible) * (C + L)
    parents = bench.tree_parents(B, T)
    mask = np.asarray(make_tree(np.zeros((B, T), np.int32), parents, max_depth=T - 1).visibility)
    assert bench.tree_visible_pairs(B, T) == int(mask.sum()) < B * T * T
    assert bench.roofline(H, B, T, P, 1e12, 1e15) == bench.roofline(H, B, T, P, 1e12, 1e15, visible=int(mask.sum()))
    # a stored row with the dense count: its floor, bound and FLOPs recounted with the file's yardsticks
    bw, peak = 4.2e12, 8.1e14
    nbytes, _, _, _ = bench.roofline(H, B, T, P, bw, peak)
    dense = 2 * B * T * H * (P + T) * (C + L)
    row = dict(kernel="mgpu", H=H, B=B, T=T, P=P, bytes=nbytes, flops=dense, bound="compute",
               floor_ms=max(nbytes / bw, dense / peak) * 1e3, op_ms=0.01)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"copy_bw_Bps": bw, "bf16_peak_flops": peak, "rows": [row]}))
    (got,) = bench.rows_of([str(path)])
    _, flops, bound, floor_s = bench.roofline(H, B, T, P, bw, peak)
    assert got["flops"] == flops < dense == got["dense_flops"] and got["bound"] == bound
    assert got["floor_ms"] == floor_s * 1e3 < row["floor_ms"]
    (again,) = bench.rows_of([str(path)])  # a row already counted this way stays as it is
    path.write_text(json.dumps({"copy_bw_Bps": bw, "bf16_peak_flops": peak, "rows": [dict(got)]}))
    assert bench.rows_of([str(path)]) == [got] and again == got

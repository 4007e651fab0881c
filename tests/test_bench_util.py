"""The benchmarks' device-time plumbing: a profiler trace of a dependent chain, read back per kernel; and
the device lease's step runner."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_util


def test_dependent_chain_feeds_each_output_into_the_next_call():
    chain = bench_util.dependent_chain(lambda x, y: x * 2.0 + y, 3)
    outs = chain(jnp.ones((2,)), jnp.zeros((2,)))
    # x0 = [1, 1]; y_i = 2 x_i; x_{i+1} = x_i with element 0 set to y_i[0]
    np.testing.assert_allclose(np.stack(outs), [[2.0, 2.0], [4.0, 2.0], [8.0, 2.0]])


def test_dispatched_chain_reads_each_whole_output_in_the_next_call(monkeypatch):
    """The traced copy's chain: n separate dispatches, each reading the whole previous output, so no two calls can
    share a read (inside one program XLA fused an elementwise chain's calls, or recomputed the element
    ``dependent_chain`` passes on); ``measure_traced_copy_bandwidth`` times its a+1 over it."""
    x = jnp.arange(8, dtype=jnp.float32)
    outs = bench_util.dispatched_chain(lambda a: a * 2.0, 3)(x)
    assert [o.tolist() for o in outs] == [(x * 2).tolist(), (x * 4).tolist(), (x * 8).tolist()]
    seen = {}

    def fake(fn, args, calls, chain=None, **kw):
        seen["chain"] = chain
        return {"span_s": 1.0}
    monkeypatch.setattr(bench_util, "traced_call_time", fake)
    assert bench_util.measure_traced_copy_bandwidth(1 << 12, 2) == 2 * (1 << 12)
    assert seen["chain"] is bench_util.dispatched_chain


def test_rotating_copies_read_past_the_l2():
    """Enough copies that together they hold more than reads_over_l2 times the L2, at least one, at most ``most``:
    the ladder's 4-block points (16 x 2K keys, 37.7 MB) take 4 copies of a 60 MiB L2, its 64-block ones 1."""
    l2 = bench_util.L2_BYTES
    assert bench_util.rotating_copies(16 * 2048 * 576 * 2) == 4
    assert bench_util.rotating_copies(16 * 32768 * 576 * 2) == 1
    assert bench_util.rotating_copies(l2) == 2 and bench_util.rotating_copies(l2 + 1) == 2
    assert bench_util.rotating_copies(l2 - 1) == 3
    assert bench_util.rotating_copies(1) == 16 and bench_util.rotating_copies(1, most=3) == 3
    assert bench_util.rotating_copies(100, reads_over_l2=4, l2_bytes=1000) == 16  # 40 wanted, capped
    assert bench_util.rotating_copies(1000, reads_over_l2=4, l2_bytes=1000) == 4
    for n in (1, 10**6, 10**8, 10**10):
        c = bench_util.rotating_copies(n)
        assert 1 <= c <= 16 and (c == 16 or c * n >= 2 * l2) and (c == 1 or (c - 1) * n < 2 * l2)
    for bad in (dict(nbytes=0), dict(nbytes=-5), dict(nbytes=10, reads_over_l2=0), dict(nbytes=10, most=0),
                dict(nbytes=10, l2_bytes=0)):
        with pytest.raises(ValueError, match="must be positive"):
            bench_util.rotating_copies(**bad)


def test_rotating_chain_reads_each_copy_in_turn():
    """``dependent_chain(rotate=True)``: call i reads copy i % copies (what the benchmarks' L2 copies rely on)."""
    copies = [jnp.full((2,), float(10 ** i)) for i in range(3)]
    outs = bench_util.dependent_chain(lambda x, w: w, 5, rotate=True)(jnp.zeros((2,)), *copies)
    assert [float(o[1]) for o in outs] == [1.0, 10.0, 100.0, 1.0, 10.0]


def test_tied_arguments_are_recomputed_in_every_call_of_a_chain():
    """Work on a fixed argument is shared by the chain's calls (XLA's CSE) unless tie_to makes it depend on
    each call's x: one sort for 4 calls untied, 4 tied."""
    def routed(x, ids):
        order = jnp.argsort(ids.reshape(-1))
        return x[order % x.shape[0]] * 2.0

    x, ids = jnp.ones((4, 8)), jnp.arange(8, dtype=jnp.int32)[::-1].reshape(4, 2)
    tied = lambda x, ids: routed(x, bench_util.tie_to(ids, x))  # noqa: E731

    def sorts(fn):
        hlo = bench_util.dependent_chain(fn, 4).lower(x, ids).compile().as_text()
        return len(re.findall(r"^\s*(?:ROOT )?%\S+ = .* sort\(", hlo, flags=re.MULTILINE))

    assert sorts(routed) == 1 and sorts(tied) == 4
    np.testing.assert_array_equal(bench_util.tie_to(ids, x), ids)

    # tied to an integer x (a chain over prefix lengths): XLA folds i != i to false, so the zero is another test
    def sorted_values(lengths, w):
        return jnp.sort(w) + lengths[0].astype(w.dtype)

    lengths, w = jnp.array([5, 7], jnp.int32), jnp.arange(16.0)[::-1]
    tied_int = lambda lengths, w: sorted_values(lengths, bench_util.tie_to(w, lengths))  # noqa: E731
    hlo = bench_util.dependent_chain(tied_int, 4).lower(lengths, w).compile().as_text()
    assert len(re.findall(r"^\s*(?:ROOT )?%\S+ = .* sort\(", hlo, flags=re.MULTILINE)) == 4
    np.testing.assert_array_equal(bench_util.tie_to(w, lengths), w)


def test_traced_call_time_reads_kernels_from_the_trace():
    x = jnp.ones((128, 128))
    r = bench_util.traced_call_time(lambda a, b: jnp.tanh(a @ b) + 1.0, (x, x), calls=4)
    assert r["calls"] == 4
    assert r["span_s"] > 0 and r["busy_s"] > 0
    assert r["kernels"] and all(n > 0 and s >= 0 for _, n, s in r["kernels"])
    assert [k[2] for k in r["kernels"]] == sorted((k[2] for k in r["kernels"]), reverse=True)


def test_traced_call_time_spans_each_device_on_its_own_clock(monkeypatch):
    """Two GPUs' timelines whose clocks differ by 1 ms: the span is the slower device's own (3 us over 2
    calls), not first-to-last across both planes; kernel times are per device."""
    skew = 1_000_000
    events = [("a", 0, 1000, "/device:GPU:0"), ("b", 2000, 4000, "/device:GPU:0"),
              ("a", skew, 1000, "/device:GPU:1"), ("b", skew + 1000, 1000, "/device:GPU:1")]
    monkeypatch.setattr(bench_util, "trace_kernel_events", lambda program, args: sorted(events, key=lambda e: e[1]))
    r = bench_util.traced_call_time(lambda a: a, (None,), calls=2, chain=lambda fn, n: fn)
    assert r["devices"] == 2
    assert r["span_s"] == pytest.approx(3e-6) and r["busy_s"] == pytest.approx(2.5e-6)
    assert r["span_per_device_s"] == pytest.approx([3e-6, 1e-6])
    assert r["kernels"] == [["b", 0.5, pytest.approx(1.25e-6)], ["a", 0.5, pytest.approx(0.5e-6)]]
    assert r["largest_gaps_us"] == [[[1.0, "a", "b"]], []]  # GPU 0 idles 1 us between a and b; GPU 1 never
    # kernels launched on every call (a and b, once per call on each of the 2 devices) launch by launch;
    # a kernel of fewer launches than calls is left out of that list
    assert r["launches_us"] == {"a": [1.0, 1.0], "b": [4.0, 1.0]}
    events.append(("once", skew + 5000, 1000, "/device:GPU:1"))
    again = bench_util.traced_call_time(lambda a: a, (None,), calls=2, chain=lambda fn, n: fn)
    assert "once" not in again["launches_us"] and again["launches_us"]["a"] == [1.0, 1.0]
    overlapping = [("x", 0, 5000), ("y", 1000, 1000), ("z", 7000, 1000)]  # y inside x: the gap is x -> z
    assert bench_util.largest_gaps(overlapping, 3) == [[2.0, "x", "z"]]


def test_op_spans_leave_out_what_runs_between_calls():
    """Two calls of an op of two kernels (k, m) with a tie kernel between calls: each call's span runs from
    its k's start to its m's end (the 1 us gap inside the op counts, the tie and the gap before k do not);
    launches that do not split evenly into the calls are an error, not a guess."""
    ev = [("k", 0, 3000), ("m", 4000, 1000), ("tie", 6000, 2000), ("k", 9000, 3000), ("m", 12000, 2000)]
    is_op = lambda n: n in ("k", "m")  # noqa: E731
    assert bench_util.op_spans(ev, is_op, 2) == pytest.approx([5e-6, 5e-6])
    assert bench_util.op_spans(ev[:-1], lambda n: n == "k", 2) == pytest.approx([3e-6, 3e-6])
    with pytest.raises(ValueError, match="do not split evenly"):
        bench_util.op_spans(ev[:-1], is_op, 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        bench_util.op_spans(ev, lambda n: n == "absent", 2)


def test_traced_call_time_reports_the_op_span(monkeypatch):
    events = [("k", 0, 3000, "/device:GPU:0"), ("tie", 3500, 1000, "/device:GPU:0"), ("k", 5000, 2000, "/device:GPU:0"),
              ("tie", 7500, 1000, "/device:GPU:0")]
    monkeypatch.setattr(bench_util, "trace_kernel_events", lambda program, args: events)
    r = bench_util.traced_call_time(lambda a: a, (None,), calls=2, chain=lambda fn, n: fn,
                                    op_kernels=lambda n: n == "k")
    assert r["span_s"] == pytest.approx(4.25e-6)
    assert r["op_span_s"] == pytest.approx(2.5e-6) and r["op_spans_us"] == [3.0, 2.0] * 3  # 3 traces' calls
    assert "op_span_s" not in bench_util.traced_call_time(lambda a: a, (None,), calls=2, chain=lambda fn, n: fn)


def test_traced_call_time_is_the_median_of_repeated_traces(monkeypatch):
    """The chain is traced ``repeats`` times: span_s is the median of the traces' spans per call (not one
    trace's), the other fields come from the median trace, and every trace's span is recorded."""
    spans_ns = iter([8000, 2000, 4000, 6000])  # span of one call's kernel, trace by trace
    monkeypatch.setattr(bench_util, "trace_kernel_events",
                        lambda program, args: [("k", 0, next(spans_ns), "/device:GPU:0")])
    built = []
    r = bench_util.traced_call_time(lambda a: a, (None,), calls=1, chain=lambda fn, n: built.append(n) or fn)
    assert built == [1] and r["repeats"] == 3  # one program, traced three times (the default)
    assert r["span_s"] == pytest.approx(4e-6) and r["span_repeats_s"] == pytest.approx([8e-6, 2e-6, 4e-6])
    assert r["busy_s"] == pytest.approx(4e-6) and r["kernels"][0][2] == pytest.approx(4e-6)  # the median trace's
    once = bench_util.traced_call_time(lambda a: a, (None,), calls=1, chain=lambda fn, n: fn, repeats=1)
    assert once["span_s"] == pytest.approx(6e-6) and once["repeats"] == 1
    even = bench_util.median_of_traces([{"span_s": s, "busy_s": s / 2} for s in (4.0, 1.0, 3.0, 2.0)])
    assert even["span_s"] == 2.5 and even["busy_s"] == 1.0  # the median's mean; the lower middle trace's fields
    ops = bench_util.median_of_traces([{"span_s": 1.0, "op_spans_us": [1.0, 5.0]}, {"span_s": 2.0,
                                                                                     "op_spans_us": [2.0, 3.0]}])
    assert ops["op_spans_us"] == [1.0, 5.0, 2.0, 3.0] and ops["op_span_s"] == pytest.approx(2.5e-6)
    with pytest.raises(ValueError, match="repeats=0"):
        bench_util.traced_call_time(lambda a: a, (None,), calls=1, chain=lambda fn, n: fn, repeats=0)


def test_traced_call_time_takes_a_chain_builder():
    built = []

    def chain(fn, n):
        built.append(n)
        return jax.jit(lambda a: [fn(a) for _ in range(n)])

    r = bench_util.traced_call_time(lambda a: jnp.tanh(a @ a), (jnp.ones((128, 128)),), calls=2, chain=chain)
    assert built == [2] and r["span_s"] > 0


def test_lease_runs_steps_in_order_and_stops_a_slow_one(tmp_path):
    from experiments import lease

    steps = [lease.parse_step(s) for s in ("first:20:echo one; echo two", "slow:1:sleep 30; echo never",
                                           "failing:20:exit 3")]
    records = lease.run_steps(steps, str(tmp_path))
    assert [(r["step"], r["rc"], r["last"]) for r in records] == [
        ("first", 0, "two"), ("slow", "timeout", ""), ("failing", 3, "")]
    assert records[1]["seconds"] < 10  # the sleep's process group was killed, not waited for
    assert (tmp_path / "first.txt").read_text() == "one\ntwo\n"
    assert json.loads((tmp_path / "lease.json").read_text()) == records
    for bad, message in (("noseconds", "NAME:SECONDS:COMMAND"), ("a b:5:echo", "step name"),
                         ("x:soon:echo", "not a number"), ("x:0:echo", "positive")):
        with pytest.raises(ValueError, match=message):
            lease.parse_step(bad)


def test_lease_packs_what_the_steps_left_into_one_archive(tmp_path):
    import tarfile

    from experiments import lease

    out = tmp_path / "out"
    rc = lease.main(["--out", str(out), "--pack", "all.tar.gz",
                     "--step", f"a:20:mkdir -p {out}/sub && echo x > {out}/sub/r.json && echo done"])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["all.tar.gz", "lease.json"]
    with tarfile.open(out / "all.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["a.txt", "sub", "sub/r.json"]
        assert tar.extractfile("a.txt").read() == b"done\n"
    for bad in ("../x.tar.gz", str(tmp_path / "x.tar.gz"), "x.tgz", str(out / "sub" / "x.tar.gz"),
                str(out / "x y.tar.gz")):
        with pytest.raises(SystemExit):
            lease.main(["--out", str(out), "--pack", bad, "--step", "a:5:true"])
    assert not (tmp_path / "x.tar.gz").exists() and not (out / "a.txt").exists()  # refused before any step ran
    # a path to the archive directly inside OUT is that name (session 66's lease wrote --pack $OUT/NAME.tar.gz)
    again = tmp_path / "again"
    assert lease.main(["--out", str(again), "--pack", str(again / "p.tar.gz"), "--step", "b:20:echo b"]) == 0
    assert sorted(p.name for p in again.iterdir()) == ["lease.json", "p.tar.gz"]
    assert lease.archive_name(f"{out}/./q.tar.gz", str(out)) == "q.tar.gz"


def test_lease_packs_on_its_own_when_the_steps_leave_more_files_than_come_back(tmp_path):
    import tarfile

    from experiments import lease

    out = tmp_path / "out"
    steps = [a for k in range(8) for a in ("--step", f"s{k}:20:echo {k}")]  # 8 logs and lease.json: 9 files
    assert lease.main(["--out", str(out), *steps]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["lease.json", "lease_pack.tar.gz"]
    with tarfile.open(out / "lease_pack.tar.gz") as tar:
        assert sorted(tar.getnames()) == [f"s{k}.txt" for k in range(8)]
    few = tmp_path / "few"
    assert lease.main(["--out", str(few), *steps[:4]]) == 0  # 3 files: left as they are
    assert sorted(p.name for p in few.iterdir()) == ["lease.json", "s0.txt", "s1.txt"]
    none = tmp_path / "none"
    assert lease.main(["--out", str(none), "--max-files", "0", *steps]) == 0
    assert len(list(none.iterdir())) == 9
    with pytest.raises(SystemExit):
        lease.main(["--out", str(none), "--max-files", "-1", *steps])


def test_nvidia_smi_samples_are_summarised_per_field():
    text = "1980, 3201, 650.5, 61\n1755, 3201, 699.9, 63\nnot, a, sample, line\n1830, 3201, 690.0, 62\n\n"
    got = bench_util.parse_smi_samples(text)
    assert got["samples"] == 3
    assert got["sm_mhz"] == dict(median=1830.0, mean=(1755.0 + 1830.0 + 1980.0) / 3, min=1755.0, max=1980.0)
    assert got["power_w"]["max"] == 699.9 and got["temp_c"]["median"] == 62.0
    assert bench_util.parse_smi_samples("[N/A], [N/A], [N/A], [N/A]\n") is None
    assert bench_util.parse_smi_samples("1980, 3201\n") is None  # too few fields: not a sample


def test_sustained_gpu_state_without_nvidia_smi_is_none(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench_util.subprocess, "Popen", missing)
    calls = []
    assert bench_util.sustained_gpu_state(lambda x: calls.append(1) or x + 1, (jnp.ones(2),), seconds=0.01) is None
    assert calls  # the warm-up call ran before the sampler was asked for


def test_parse_ncu_csv_details_and_raw():
    from experiments.ncu_kernels import parse_ncu_csv

    details = ('==PROF== Connected to process 1\ncase 0: moe\n'
               '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
               '"0","body_mosaic_gpu_kernel","SOL","Duration","nsecond","1,532,000"\n'
               '"0","body_mosaic_gpu_kernel","SOL","DRAM Throughput","%","91.5"\n'
               '"1","body_mosaic_gpu_kernel","SOL","Duration","nsecond","870"\n')
    recs = parse_ncu_csv(details)
    assert [r["id"] for r in recs] == [0, 1]
    assert recs[0]["Duration"] == 1532000.0 and recs[0]["DRAM Throughput"] == 91.5 and recs[1]["Duration"] == 870.0
    raw = ('"ID","Kernel Name","gpu__time_duration.sum","launch__grid_size"\n'
           '"","","nsecond",""\n'
           '"0","k","1,000","132"\n"1","k","2,000","264"\n')
    recs = parse_ncu_csv(raw)
    assert [(r["gpu__time_duration.sum"], r["launch__grid_size"]) for r in recs] == [(1000.0, 132.0), (2000.0, 264.0)]
    with pytest.raises(ValueError, match="no ncu CSV header"):
        parse_ncu_csv("==ERR== nothing profiled\n")


def test_summarize_ncu_source_csv(tmp_path):
    from experiments.ncu_kernels import summarize_source_csv

    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb",'
            '"stall_barrier","stall_long_sb (Not Issued)"\n')
    text = ('"Kernel Name","narrow_body_mosaic_gpu_kernel",\n' + head +
            '"0x10","  SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R17+URZ], R16","2","64","2","0","2"\n'
            '"0x20","  @!P1  BRA 0x7f00","30","64","30","0","30"\n'
            '"0x30","  HGMMA.64x8x16.F32.BF16 R32, gdesc[UR36], R32, gsb0","1","64","0","0","0"\n'
            '"0x40","  WARPGROUP.DEPBAR.LE gsb0, 0x0","7","64","0","7","0"\n'
            '"Kernel Name","body_mosaic_gpu_kernel",\n' + head +
            '"0x10","  EXIT","0","1","0","0","0"\n')
    first, second = summarize_source_csv(text, top=2)
    assert first["kernel"] == "narrow_body_mosaic_gpu_kernel" and first["samples"] == 40
    assert (first["hgmma"], first["warpgroup_depbar"], first["sass_instructions"]) == (1, 1, 4)
    assert first["stall_share_pct"] == {"long_sb": 80.0, "barrier": 17.5}
    assert first["top_instructions"][0] == {"sass": "@!P1  BRA 0x7f00", "after": "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, "
                                            "[R17+URZ], R16", "share_pct": 75.0, "executed": 64}
    assert second["samples"] == 0 and second["stall_share_pct"] == {}
    with pytest.raises(ValueError, match="Kernel Name"):
        summarize_source_csv('"ID","Kernel Name"\n')
    # the command line writes the summaries with the run's provenance
    from experiments.ncu_kernels import main
    src = tmp_path / "src.csv"
    src.write_text(text)
    main(["--summarize-source", str(src), "--commit", "abc1234", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "ncu_source.json").read_text())
    assert record["commit"] == "abc1234" and record["hardware"]["jax"] == jax.__version__
    assert record["kernels"] == summarize_source_csv(text)


def test_dump_isa_counts_waits_between_hgmmas():
    """dump_isa's SASS summary: instruction counts (predicated ones by their opcode), HGMMAs, and the HGMMA
    pairs with a WARPGROUP.DEPBAR between them (ptxas's serialisation shows as one after every HGMMA)."""
    from experiments.dump_isa import sass_summary

    line = "        /*{:04x}*/                   {} ;"
    ops = ["WARPGROUP.ARRIVE", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR40], RZ, !UPT", "HGMMA.64x32x16.F32.BF16 R24, "
           "gdesc[UR44], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P1 BRA `(.L_x_13)",
           "HGMMA.64x32x16.F32.BF16 R152, gdesc[UR56].tnspA, R152, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    text = "\n".join(line.format(16 * i, op) for i, op in enumerate(ops)) + "\n.L_x_13:\n"
    summary = sass_summary(text)
    assert summary["hgmma"] == 3 and summary["hgmma_pairs_with_a_wait_between"] == 1
    assert summary["ops"]["WARPGROUP.DEPBAR.LE"] == 2 and summary["ops"]["BRA"] == 1
    spill = ["STL [R1+0x8], R4", "USETMAXREG.DEALLOC.CTAPOOL 0x28", "LDL R6, [R1+0x8]",
             "USETMAXREG.TRY_ALLOC.CTAPOOL P0, 0xe8", "STL.64 [R1], R8", "LDL.64 R8, [R1]", "@P0 LDL R2, [R1+0x4]"]
    regions = sass_summary("\n".join(line.format(16 * i, op) for i, op in enumerate(spill)))["spills_by_region"]
    assert [(r["setmaxnreg"].split()[0], r["STL"], r["LDL"]) for r in regions] == [
        ("(prologue)", 1, 0), ("USETMAXREG.DEALLOC.CTAPOOL", 0, 1), ("USETMAXREG.TRY_ALLOC.CTAPOOL", 1, 2)]


def test_dump_isa_places_spills_in_loops():
    """dump_isa's regions: the highest register each names, and its loops (backward branches of at least
    LOOP_MIN_INSTRUCTIONS, by address or by nvdisasm label) with their spills; a short spin and a jump back
    from past an EXIT are not loops."""
    from experiments.dump_isa import LOOP_MIN_INSTRUCTIONS, sass_summary

    n = LOOP_MIN_INSTRUCTIONS
    body = ["FADD R200, R200, R3"] * (n - 3)
    ops = (["USETMAXREG.TRY_ALLOC.CTAPOOL P0, 0xe8", "STL [R1], R7"]
           + ["LDL R7, [R1]", *body, "@!P0 BRA 0x1234", "@P1 BRA 0x20"]            # a loop by address: 0x20 on
           + [".L_x_1:", "NOP", "@!P2 BRA `(.L_x_1)"]                               # a spin: too short
           + [".L_x_2:", "STL [R1+0x4], R9", *body, "LDL R9, [R1+0x4]", "@P3 BRA `(.L_x_2)"]  # a loop by label
           + ["EXIT", "@!P4 BRA 0x30"])                                              # a wait's jump back
    lines, addr, where = [], 0, {}
    for op in ops:
        if op.startswith(".L_x_"):
            lines.append(op)
            where[op[:-1]] = addr
        else:
            lines.append(f"        /*{addr:04x}*/                   {op} ;")
            addr += 16
    region_0, region = sass_summary("\n".join(lines))["spills_by_region"]
    assert region_0["instructions"] == 0 and region["max_register"] == 200
    assert region["STL"] == 2 and region["LDL"] == 2
    first_loop = {"first": "0x20", "last": hex(where[".L_x_1"] - 16), "instructions": n, "STL": 0, "LDL": 1}
    second_loop = {"first": hex(where[".L_x_2"]), "last": hex(where[".L_x_2"] + 16 * (n - 1)), "instructions": n,
                   "STL": 1, "LDL": 1}
    assert region["loops"] == [first_loop, second_loop]


def test_profile_floor_cases_build():
    """profile_kernels' floor cases: the tiny Mosaic GPU kernel lowers for CUDA on the CPU; the XLA read
    sums every row."""
    from experiments.profile_kernels import read_case, tiny_mgpu_case

    fn, args = tiny_mgpu_case(4)
    assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    fn, args = read_case(16, 64)
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.full(64, 16.0, np.float32))


def test_traced_bf16_peak_counts_a_products_flops_over_its_traced_time(monkeypatch):
    """2 n^3 FLOPs over the traced span per call, the best over sizes."""
    spans = {64: 1e-6, 128: 4e-6}
    monkeypatch.setattr(bench_util, "traced_call_time",
                        lambda fn, args, calls: {"span_s": spans[args[0].shape[0]]})
    assert bench_util.measure_traced_bf16_peak(sizes=(64, 128)) == pytest.approx(2 * 128**3 / 4e-6)


def test_traced_bf16_peak_runs_on_the_host():
    peak = bench_util.measure_traced_bf16_peak(sizes=(64,), calls=2)
    assert np.isfinite(peak) and peak > 0


def test_int_options_parse_command_line_keywords():
    assert bench_util.int_options("a=1,b=None,c=24/240") == {"a": 1, "b": None, "c": (24, 240)}
    assert bench_util.int_options("stages=3&tail=0", "&") == {"stages": 3, "tail": 0}
    assert bench_util.int_options("") == {}
    for bad in ("a=x", "a", "a=1=2"):
        with pytest.raises(ValueError):
            bench_util.int_options(bad)


def test_int_points_parse_command_line_points():
    assert bench_util.int_points("8,16,4,8192;8,1,1,65536", 4) == [(8, 16, 4, 8192), (8, 1, 1, 65536)]
    for bad in ("8,16,4", "8,16,4,x", "8,16,4,8192;"):
        with pytest.raises(ValueError):
            bench_util.int_points(bad, 4)


def test_ncu_attention_cases_take_points_and_kernel_entries():
    """ncu_kernels' attention cases: one per point and --kernel entry, named by both; a bad point or entry is a
    usage error before anything runs."""
    from experiments.ncu_kernels import attention_cases, main

    cases = attention_cases([(1, 8, 1, 128)], ["mgpu", "mgpu_wide:kernel.stages=3"])
    assert [name for name, _ in cases] == ["att_t1_h8_b1_p128", "att_t1_h8_b1_p128_mgpu_wide:kernel.stages=3"]
    for argv in (["--what", "attention", "--att-points", "1,8,1"], ["--what", "attention", "--att-kernels", "nope"]):
        with pytest.raises(SystemExit):
            main(argv)

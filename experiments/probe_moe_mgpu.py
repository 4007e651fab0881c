"""Probe of the Mosaic GPU grouped INT4 GEMM (pallas_kernels/int4_moe_mgpu.py) at K2.6 dims on one GPU.

Checks the kernel against its twin, then times each of the two routed-expert GEMMs alone (gate+up:
O=4096, I=7168; down: O=7168, I=2048) over M tokens with top-8 uniform routing, for a few kernel
configurations. Times are per call, from jitted chains of back-to-back calls with the launch cost
differenced out (``bench_util.chained_call_time``). Bytes = INT4 weights + bf16 scales of the experts the tiles touch.

    PYTHONPATH=. python experiments/probe_moe_mgpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_util
from experiments.bench_moe import rel_err, routing
from pallas_kernels import int4_moe_mgpu as K
from pallas_kernels.moe_routing import route_narrow

E, D, F, TOPK = 384, 7168, 2048, 8
# plan width's operand values: random weights and tokens; every q = 0 (the scales stay random); every token 1.0
WIDTH_DATA = ("random", "zero_weights", "constant_tokens")
ZERO_WORD = int(np.uint32(0x88888888).view(np.int32))  # a fragment-order word of eight nibbles of 8: q = 0


def random_tiled(key, e, o, i, rows):
    """Random tiled INT4 weights and scales, generated one expert at a time (small intermediates)."""
    def one(k):
        kq, ks = jax.random.split(k)
        nib = jax.random.bits(kq, (o // rows, (i // K.STEP) * rows, K.STEP), jnp.uint8) & 0xF
        w = (nib.astype(jnp.int8) - 8).astype(jnp.int4)
        s = jax.random.uniform(ks, (o // rows, i // K.GROUP, rows), jnp.float32, 0.01, 0.03).astype(jnp.bfloat16)
        return w, s
    return jax.block_until_ready(jax.jit(lambda ks: jax.lax.map(one, ks))(jax.random.split(key, e)))


def random_fragments(key, e, o, i):
    """Random weights in the fragment order (int32 words: any bit pattern is 8 valid nibbles)."""
    def one(k):
        kw, ks = jax.random.split(k)
        w = jax.lax.bitcast_convert_type(jax.random.bits(kw, (o // 128, (i // K.STEP) * 32, 128), jnp.uint32),
                                         jnp.int32)
        s = jax.random.uniform(ks, (o // 128, i // K.GROUP, 128), jnp.float32, 0.01, 0.03).astype(jnp.bfloat16)
        return w, s
    return jax.block_until_ready(jax.jit(lambda ks: jax.lax.map(one, ks))(jax.random.split(key, e)))


def kernel_device_time(fn, args) -> float:
    """Seconds per call of the Mosaic GPU kernels in ``fn(*args)``, from a profiler trace (the whole span if
    the trace names none)."""
    trace = bench_util.traced_call_time(fn, args)
    return sum(sec for kname, _, sec in trace["kernels"] if "mosaic" in kname) or trace["span_s"]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,9,32,90,256,512,1024")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--commit", default=None, help="commit hash to record (a copied checkout may report a stale HEAD)")
    ap.add_argument("--plan", default="full", choices=["full", "flags", "stages", "fragments", "net", "anatomy",
                                                       "inflight", "chunks", "m1", "width"])
    ap.add_argument("--width-probes", default="",
                    help="plan width: comma list of probes run at every N ('full': none; default: full at every N, "
                         "stream_only at 8 and 32)")
    ap.add_argument("--width-data", default="random",
                    help=f"plan width: comma list of operand values, of {WIDTH_DATA}")
    ap.add_argument("--width-clocks", action="store_true",
                    help="plan width: sample the SM clock and power (nvidia-smi) over ~0.5 s of calls of each kernel")
    ap.add_argument("--widths", default="8,16,24,32,40,48,64",
                    help="plan width: tokens per tile N, one tile per expert (all E streamed once, whatever N)")
    ap.add_argument("--chunk", type=int, default=32,
                    help="activation chunk width (columns per wgmma) unless a plan sets it")
    ap.add_argument("--timing", default="chained", choices=["chained", "traced"],
                    help="chained: wall clock of call chains, differenced; traced: the kernel's device time from a "
                         "profiler trace (bench_util.traced_call_time)")
    args = ap.parse_args(argv)
    bad_data = [d for d in args.width_data.split(",") if d not in WIDTH_DATA]
    if bad_data:
        ap.error(f"--width-data: {bad_data} not of {WIDTH_DATA}")
    bw = bench_util.measure_torch_copy_bandwidth() or bench_util.measure_copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    # plan width's compute floor: the bf16 peak measured in this run, both ways (the larger quoted, as
    # bench_tree_attention does); at N = 64 the GEMMs' FLOPs take longer at the peak than their bytes at bw
    peaks = dict(chained=bench_util.measure_bf16_peak(), traced=bench_util.measure_traced_bf16_peak()) \
        if args.plan == "width" else {}
    peak = max(peaks.values()) if peaks else None
    if peak:
        print(f"bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    key = jax.random.key(0)
    gemms = {"gate_up": (2 * F, D), "down": (D, F)}
    weights = {}
    fragment_plans = ("fragments", "net", "anatomy", "inflight", "chunks", "m1", "width")
    for rows in (() if args.plan in fragment_plans[1:] else (64, 128)):
        for name, (o, i) in gemms.items():
            key, sub = jax.random.split(key)
            weights[name, rows] = random_tiled(sub, E, o, i, rows)
    if args.plan in fragment_plans:
        for name, (o, i) in gemms.items():
            key, sub = jax.random.split(key)
            weights[name, "fragments"] = random_fragments(sub, E, o, i)
    print("weights ready", flush=True)
    records, table = [], []

    def save(records):  # after every timing, so a run cut short keeps what it measured
        if not args.out:
            return
        payload = dict(commit=args.commit or bench_util.git_commit(), hardware=bench_util.hardware(),
                       jax=jax.__version__, copy_bandwidth=bw, plan=args.plan,
                       **({"bf16_peak_flops": peak, "bf16_peaks": peaks} if peak else {}),
                       timing=("kernel device time from a profiler trace" if args.timing == "traced"
                               else "unrolled chains, 17 vs 1 calls differenced"),
                       argv=sys.argv[1:], records=records)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_moe_mgpu.json"), "w") as fh:
            json.dump(payload, fh, indent=1, default=str)

    if args.plan == "width":
        width_sweep(args, weights, gemms, bw, peak, records, save)
        return
    # correctness: kernel vs twin on the real arrays, a few tiles incl. a skipped one
    for (name, rows), (w, s) in weights.items():
        o, i = gemms[name]
        for n in (8, 32):
            te = jnp.asarray([5, 383, -1, 5, 0][: 4 if n == 32 else 5], jnp.int32)
            x = jax.random.normal(jax.random.key(n), (te.shape[0] * n, i), jnp.float32).astype(jnp.bfloat16)
            chunk = 64 if n == 8 else 128
            xg = K.to_chunks(x, chunk)
            variant = dict(split=2 if n == 8 else 1, overlap=n == 32, chunk=chunk)
            kernel_variant = {k: v for k, v in variant.items() if k != "chunk"}
            got = jax.jit(functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, **kernel_variant))(xg, w, s, te)
            ref = K.grouped_int4_matmul_ref(xg, w, s, te, tokens_per_tile=n)
            valid = np.repeat(np.asarray(te) >= 0, n)
            err = rel_err(np.asarray(got)[:, valid], np.asarray(ref)[:, valid])
            nan = bool(np.isnan(np.asarray(got)[:, valid]).any())
            print(f"parity {name} rows={rows} N={n}: rel err {err:.2e} nan={nan}", flush=True)
            records.append(dict(kind="parity", gemm=name, rows=rows, n=n, rel_err=err, nan=nan, **variant))

    base = [(128, 2, 1, False), (128, 2, 1, True), (64, 2, 1, False), (128, 3, 1, False)]
    plan = {1: ([8], [(128, 2, 1, False), (128, 2, 1, True), (128, 2, 2, False), (128, 2, 4, False),
                      (64, 2, 4, False), (128, 3, 4, False), (128, 2, 4, True)]),
            9: ([8], [(128, 2, 1, False), (128, 2, 2, False), (128, 2, 1, True), (128, 2, 2, True)]),
            32: ([8], base), 90: ([8], base), 256: ([8, 16], base),
            512: ([16, 32], base[:2]), 1024: ([32, 64], base[:2])}
    if args.plan == "flags":  # (rows, stages, split, overlap, auto_barriers)
        flags = [(128, 2, 1, False, True), (128, 2, 1, False, False), (64, 2, 1, False, False),
                 (128, 3, 1, False, False)]
        plan = {1: ([8], flags), 32: ([8], flags), 256: ([8], flags), 1024: ([32], flags[:2])}
    if args.plan == "stages":  # stage-removed probes: (rows, stages, split, overlap, auto_barriers, probe)
        probes = [(128, 2, 1, False, True, ""), (128, 2, 1, False, True, "no_scale"),
                  (128, 2, 1, False, True, "mma_once")]
        plan = {32: ([8], probes), 256: ([8], probes), 1024: ([32], probes)}
    if args.plan == "fragments":  # the same kernel on weights in the "groups" vs the "fragments" order
        orders = [(128, 2, 1, False, True, "", "groups"), (128, 2, 1, False, True, "", "fragments")]
        plan = {1: ([8], orders), 9: ([8], orders), 32: ([8], orders), 90: ([8], orders), 256: ([8], orders),
                512: ([16], orders), 1024: ([32], orders)}
    if args.plan == "net":  # the default (fragment) order alone, with split-K where few tiles are busy
        frag = lambda split, overlap=False: (128, 2, split, overlap, True, "", "fragments")  # noqa: E731
        plan = {1: ([8], [frag(1), frag(2), frag(4), frag(1, True)]), 9: ([8], [frag(1), frag(2)]),
                32: ([8], [frag(1)]), 90: ([8], [frag(1)]), 256: ([8, 16], [frag(1)]),
                512: ([16], [frag(1)]), 1024: ([32], [frag(1)])}
    if args.plan == "anatomy":  # where the time goes: the copy pipeline alone, then stage-removed probes
        frag = lambda stages=2, split=1, overlap=False, probe="": (128, stages, split, overlap, True, probe,  # noqa: E731
                                                                    "fragments")
        probes = [frag(), frag(probe="stream_only"), frag(probe="no_scale"), frag(probe="mma_once"),
                  frag(overlap=True), frag(stages=3), frag(stages=3, probe="stream_only")]
        plan = {1: ([8], [frag(), frag(split=2), frag(split=4), frag(split=2, probe="stream_only"),
                          frag(split=4, probe="stream_only")]),
                256: ([8], probes), 512: ([16], probes[:2] + probes[4:5]), 1024: ([32], probes)}
    if args.plan == "inflight":  # wgmma groups in flight per step (registers per thread -> programs per SM)
        fl = lambda inflight, stages=2, split=1: (128, stages, split, False, True, "", "fragments", inflight)  # noqa: E731
        variants = [fl(None), fl(0), fl(1), fl(2), fl(3)]
        plan = {1: ([8], variants + [fl(1, split=2)]), 9: ([8], variants), 32: ([8], variants[:1] + variants[2:3]),
                256: ([8], variants + [fl(1, stages=3)]), 512: ([16], variants[:1] + variants[2:4]),
                1024: ([32], variants + [fl(1, stages=3)])}
    if args.plan == "chunks":  # columns per wgmma (activation chunk width) x chunks in flight
        ch = lambda chunk, inflight, n_split=1: (128, 2, n_split, False, True, "", "fragments", inflight, chunk)  # noqa: E731
        variants = [ch(32, 2), ch(64, None), ch(64, 0), ch(64, 1), ch(128, None), ch(128, 0), ch(128, 1)]
        plan = {1: ([8], [ch(32, None), ch(64, None), ch(128, None), ch(64, 1), ch(128, 0)]),
                9: ([8], variants), 256: ([8], variants), 512: ([16], variants), 1024: ([32], variants)}
    if args.plan == "m1":  # one token: deeper pipelines (more bytes in flight per SM) and split-K
        v = lambda stages, split=1, inflight=None, probe="": (128, stages, split, False, True, probe,  # noqa: E731
                                                              "fragments", inflight, 128)
        plan = {1: ([8], [v(2), v(3), v(4), v(3, inflight=0), v(4, inflight=0), v(2, split=2), v(3, split=2),
                          v(2, probe="stream_only"), v(4, probe="stream_only")])}
    if args.quick:
        plan = {m: (ns[:1], cf[:1]) for m, (ns, cf) in plan.items()}
    ms = [int(v) for v in args.ms.split(",")]
    missing = [m for m in ms if m not in plan]
    if missing:
        raise SystemExit(f"--plan {args.plan} has no configurations for M in {missing}; it covers {sorted(plan)}")
    for m in ms:
        ids, wts = routing(m, "uniform", seed=m)
        ns, configs = plan[m]
        for n in ns:
            row_token, _, tile_expert, _, _ = route_narrow(ids, wts, E, n)
            active = int(np.unique(np.asarray(tile_expert)[np.asarray(tile_expert) >= 0]).size)
            p = tile_expert.shape[0] * n
            for name, (o, i) in gemms.items():
                x = jax.random.normal(jax.random.key(1), (p, i), jnp.float32).astype(jnp.bfloat16)
                nbytes = active * (o * i // 2 + o * (i // K.GROUP) * 2)
                for rows, stages, split, overlap, *rest in configs:
                    auto = rest[0] if rest else True
                    probe = rest[1] if len(rest) > 1 else ""
                    order = rest[2] if len(rest) > 2 else "groups"
                    inflight = rest[3] if len(rest) > 3 else None
                    chunk = rest[4] if len(rest) > 4 else args.chunk
                    xg = K.to_chunks(x, chunk)
                    w, s = weights[name, "fragments" if order == "fragments" else rows]
                    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, stages=stages, split=split,
                                           mma_in_flight=inflight, overlap=overlap, auto_barriers=auto, probe=probe)
                    try:
                        if args.timing == "traced":
                            t = kernel_device_time(fn, (xg, w, s, tile_expert))
                        else:
                            t = bench_util.chained_call_time(fn, (xg, w, s, tile_expert))
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"FAILED {name} m={m} n={n} {rows}/{stages}/{split}/{overlap}: {exc!r:.300}", flush=True)
                        continue
                    rec = dict(kind="time", gemm=name, m=m, n=n, rows=rows, stages=stages, split=split,
                               overlap=overlap, auto_barriers=auto, probe=probe, order=order, mma_in_flight=inflight,
                               chunk=chunk, active=active, gb=nbytes / 1e9, ms=t * 1e3, tbps=nbytes / t / 1e12,
                               pct_copy=100 * nbytes / t / bw, floor_ms=nbytes / bw * 1e3)
                    records.append(rec)
                    table.append(rec)
                    print(f"{name:8s} M={m:5d} N={n:3d} "
                          f"{rows}/{stages}/{split}/{overlap:d}/{auto:d}/{probe or '-'}/{order}/{inflight}/c{chunk} "
                          f"active={active:3d} {t * 1e3:8.3f} ms  {rec['tbps']:.2f} TB/s  {rec['pct_copy']:5.1f} %",
                          flush=True)
                    save(records)
    save(records)
    bench_util.print_table([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "kind"}
                            for r in table],
                           ["gemm", "m", "n", "stages", "split", "probe", "mma_in_flight", "chunk", "active", "ms",
                            "floor_ms", "pct_copy"])


def width_floors(e: int, n: int, o: int, i: int, bw: float, peak: float) -> dict:
    """Floors (ms) of one width-sweep GEMM: its weight bytes (INT4 + bf16 scales of all ``e`` experts) over
    the copy bandwidth, its FLOPs (2 e n o i) over the bf16 peak, and floor_ms, the larger."""
    nbytes, flops = e * (o * i // 2 + o * (i // K.GROUP) * 2), 2 * e * n * o * i
    bytes_ms, flops_ms = nbytes / bw * 1e3, flops / peak * 1e3
    return dict(gb=nbytes / 1e9, gflop=flops / 1e9, bytes_floor_ms=bytes_ms, flops_floor_ms=flops_ms,
                floor_ms=max(bytes_ms, flops_ms))


def width_sweep(args, weights, gemms, bw, peak, records, save):
    """Kernel device time against tokens per tile N at fixed weight bytes: one tile per expert, so every
    GEMM streams all E experts once whatever N is, as the layer runs them (gate+up with the SiLU·up
    epilogue, down storing bf16 token rows; 128-column chunks, no chunk left in flight). What grows with N
    is the tensor work alone (and the token tiles' bytes, listed). "stream_only" rows run the copy
    pipeline with an empty step. ``--width-data`` runs the same kernels on other operand values
    (``WIDTH_DATA``), and ``--width-clocks`` samples the SM clock and power over ~0.5 s of back-to-back calls
    of each (``bench_util.sustained_gpu_state``): whether the width's cost is the clock that random
    operands allow (dynamic power) rather than any stage of the kernel. Each time is quoted beside its floor,
    max(bytes / bw, FLOPs / peak) (``width_floors``; at N = 64 the FLOPs' side is the larger): pct_floor;
    pct_copy is the bytes' side alone."""
    te = jnp.arange(E, dtype=jnp.int32)
    table = []
    cases = itertools.product([int(v) for v in args.widths.split(",")], args.width_data.split(","), gemms.items())
    for n, data, (name, (o, i)) in cases:
        x = jax.random.normal(jax.random.key(n), (E * n, i), jnp.float32).astype(jnp.bfloat16)
        xg = K.to_chunks(jnp.ones_like(x) if data == "constant_tokens" else x, 128)
        w, s = weights[name, "fragments"]
        if data == "zero_weights":
            w = jnp.full_like(w, ZERO_WORD)
        floors = width_floors(E, n, o, i, bw, peak)
        kw = (dict(out_layout="tokens", epilogue="silu_mul") if name == "gate_up" else
              dict(out_layout="tokens", out_dtype=jnp.bfloat16))
        probes = (args.width_probes.split(",") if args.width_probes else
                  ("", "stream_only") if n in (8, 32) else ("",))
        for probe in (p_.replace("full", "") for p_ in probes):
            fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, mma_in_flight=0, probe=probe, **kw)
            try:
                t = kernel_device_time(fn, (xg, w, s, te))
                state = bench_util.sustained_gpu_state(jax.jit(fn), (xg, w, s, te)) if args.width_clocks else None
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"FAILED {name} N={n} {data} {probe}: {exc!r:.300}", flush=True)
                continue
            rec = dict(kind="width", gemm=name, n=n, data=data, probe=probe or "-", tiles=E, **floors,
                       x_gb=x.size * 2 / 1e9, ms=t * 1e3, pct_floor=100 * floors["floor_ms"] / (t * 1e3),
                       pct_copy=100 * floors["bytes_floor_ms"] / (t * 1e3), tflops=floors["gflop"] / t / 1e3,
                       **({"sm_mhz": state["sm_mhz"]["median"], "power_w": state["power_w"]["median"],
                           "gpu_state": state} if state else {}))
            records.append(rec)
            table.append(rec)
            print(f"{name:8s} N={n:3d} {data:15s} {probe or '-':11s} {t * 1e3:8.3f} ms {rec['pct_floor']:5.1f} % "
                  f"{rec['tflops']:6.1f} TFLOP/s {rec.get('sm_mhz', '-')} MHz {rec.get('power_w', '-')} W", flush=True)
            save(records)
    save(records)
    bench_util.print_table([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "kind"}
                            for r in table],
                           ["gemm", "n", "data", "probe", "ms", "bytes_floor_ms", "flops_floor_ms", "floor_ms",
                            "pct_floor", "pct_copy", "tflops", "sm_mhz", "power_w"])


if __name__ == "__main__":
    main()

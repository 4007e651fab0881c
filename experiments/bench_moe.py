"""INT4 MoE routed experts at K2.6 dims on one GPU: the Mosaic GPU kernel ("tiled", the default kernel
layout) vs the Pallas-Triton kernel ("pallas[...]", layout "planar") vs XLA twin vs XLA ragged_dot (bf16).

    PYTHONPATH=. python3 experiments/bench_moe.py [--ms 1,9,32,90,256,512,1024] [--out DIR]
        [--tiled-configs "k=v,...;..." (fuse=0: w13 unpaired, SiLU·up in XLA; default paired, in the epilogue)]
        [--configs "k=v,...;..." --triton-ms 1,32,256]
        [--sweep "k=v,...;..." --sweep-ms 1,256]

Reports per (M, routing): ms per call, us per token, active experts, weight bytes read (INT4 words +
bf16 scales of the active experts; for the ragged_dot row their bf16 weights), effective TB/s = bytes / time,
and % of the device copy bandwidth measured in the same run: pct_copy against PyTorch's device-to-device
copy of 1 GiB (read + write counted; the yardstick of issue #5's goal), pct_xla_copy against XLA's
elementwise a+1 over 1 GiB (bench_util.measure_copy_bandwidth, lower on this machine). Timing: back-to-back calls,
blocked once at the end, median over several such batches. The Mosaic GPU rows report the device time
per call instead, from a profiler trace of an unrolled chain of dependent calls
(``bench_util.traced_call_time``: first kernel's start to last kernel's end, XLA glue included, the
routing ids tied to each call's x so that every call sorts them: before session 8 the chain sorted the
fixed ids once for all its calls, ``bench_util.tie_to``;
kernel_us: the two Mosaic launches, glue_us: the other kernels, kernels: each kernel's µs per call), with
the wall-clock chained figure (``chained_call_time``, session 5's table) and the dispatched time beside it
(ms_chained, ms_dispatched). Weights are random (words are uniformly
random nibbles, scales in [0.01, 0.03]); routing is uniform (distinct random top-8 per token) or skewed
(Zipf-like expert popularity, exponent 1.2, top-8 without replacement via Gumbel top-k).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_util
from pallas_kernels.int4_moe import Int4ExpertWeights, default_tile, int4_moe, int4_moe_ref
from pallas_kernels.int4_moe_mgpu import routed_experts_tiled, tile_layout, uses_per_pair
from pallas_kernels.int4_tiles import TiledInt4

E, D, F, K, G = 384, 7168, 2048, 8, 32


def random_weights(key, e=E, d=D, f=F):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    w13 = jax.lax.bitcast_convert_type(jax.random.bits(k1, (e, 2 * f, d // 8), jnp.uint32), jnp.int32)
    w2 = jax.lax.bitcast_convert_type(jax.random.bits(k2, (e, d, f // 8), jnp.uint32), jnp.int32)
    s13 = jax.random.uniform(k3, (e, d // G, 2 * f), jnp.float32, 0.01, 0.03).astype(jnp.bfloat16)
    s2 = jax.random.uniform(k4, (e, f // G, d), jnp.float32, 0.01, 0.03).astype(jnp.bfloat16)
    return Int4ExpertWeights(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, group_size=G,
                             w13_block_words=32, w2_block_words=32)


def routing(m, kind, seed, e=E, k=K):
    r = np.random.default_rng(seed)
    if kind == "uniform":
        logits = np.zeros((m, e))
    else:  # skewed: popularity ~ 1/(rank+1)^1.2 over a random expert permutation
        logits = np.broadcast_to(-1.2 * np.log1p(r.permutation(e)), (m, e))
    g = logits + r.gumbel(size=(m, e))
    ids = np.argsort(-g, axis=1)[:, :k].astype(np.int32)
    w = r.random((m, k)).astype(np.float32)
    w = w / w.sum(1, keepdims=True) * 2.5
    return jnp.asarray(ids), jnp.asarray(w)


def time_calls(fn, args, calls=10, batches=5, budget_s=None):
    """Median seconds per call over `batches` batches of `calls` back-to-back calls."""
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    if budget_s is not None:  # shrink to fit a time budget
        calls = max(1, min(calls, int(budget_s / max(one, 1e-6) / batches)))
    ts = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts), min(ts)


def ragged_moe_fn():
    """bf16 MoE with jax.lax.ragged_dot (gate+up fused [E, D, 2F], down [E, F, D])."""
    def fn(x, ids, w, w13, w2):
        m, k = ids.shape
        flat = ids.reshape(-1)
        order = jnp.argsort(flat)
        xs = x[order // k]
        sizes = jnp.zeros((w13.shape[0],), jnp.int32).at[flat].add(1)
        gu = jax.lax.ragged_dot(xs, w13, sizes, preferred_element_type=jnp.float32)
        g, u = gu[:, :F], gu[:, F:]
        h = (jax.nn.silu(g) * u).astype(x.dtype)
        yo = jax.lax.ragged_dot(h, w2, sizes, preferred_element_type=jnp.float32)
        ys = jnp.zeros_like(yo).at[order].set(yo).reshape(m, k, -1)
        return jnp.einsum("mkd,mk->md", ys, w).astype(x.dtype)
    return jax.jit(fn)


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,9,32,90,256,512,1024")
    ap.add_argument("--routings", default="uniform,skewed")
    ap.add_argument("--configs", default="", help="semicolon list of k=v,... Triton kernel configs for the table")
    ap.add_argument("--triton-ms", default="", help="M values at which the Triton kernel runs (default: all)")
    ap.add_argument("--tiled-configs", default="",
                    help="semicolon list of k=v,... Mosaic GPU kernel configs (tile, stages, split); 'none' skips")
    ap.add_argument("--sweep", default="", help="semicolon list of k=v,... configs timed at --sweep-ms")
    ap.add_argument("--sweep-ms", default="1,256")
    ap.add_argument("--ragged-max-m", type=int, default=256)
    ap.add_argument("--twin-max-m", type=int, default=1024)
    ap.add_argument("--budget-s", type=float, default=1.0, help="timing budget per measurement")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="bench_moe")
    ap.add_argument("--commit", default=None, help="commit hash to record (a copied checkout may report a stale HEAD)")
    ap.add_argument("--dims", default="", help="E,D,F,K override (CPU smoke tests)")
    ap.add_argument("--interpret", action="store_true", help="run the kernel in interpret mode (CPU smoke)")
    args = ap.parse_args(argv)
    global E, D, F, K
    if args.dims:
        E, D, F, K = (int(v) for v in args.dims.split(","))
    ms = [int(v) for v in args.ms.split(",")]
    routings = args.routings.split(",")

    print("devices:", jax.devices(), "jax", jax.__version__, flush=True)
    copy_bw = bench_util.measure_copy_bandwidth()
    tcopy = bench_util.measure_torch_copy_bandwidth()
    print(f"copy bandwidth: XLA a+1 {copy_bw / 1e12:.3f} TB/s; torch copy "
          f"{(tcopy or 0) / 1e12:.3f} TB/s", flush=True)

    wts = random_weights(jax.random.key(0), E, D, F)
    per_expert = wts.nbytes_per_expert()
    traced_bw = bench_util.measure_traced_copy_bandwidth() if jax.default_backend() == "gpu" else None
    print(f"copy bandwidth, traced like the kernels: {(traced_bw or 0) / 1e12:.3f} TB/s", flush=True)
    ref_bw = tcopy or copy_bw  # the goal's yardstick: the device copy (PyTorch), else XLA's a+1
    rows = []

    def parse_cfg(s):
        try:
            return bench_util.parse_settings(s, "config")
        except ValueError as e:
            ap.error(str(e))

    configs = [parse_cfg(c) for c in args.configs.split(";")] if args.configs else [{}]
    sweep = [parse_cfg(c) for c in args.sweep.split(";")] if args.sweep else []
    tiled_configs = [] if args.tiled_configs == "none" else (
        [parse_cfg(c) for c in args.tiled_configs.split(";")] if args.tiled_configs else [{}])
    triton_ms = {int(v) for v in args.triton_ms.split(",")} if args.triton_ms else set(ms)
    tiled = unpaired13 = None
    if tiled_configs:  # the same experts, repacked from compressed-tensors into the Mosaic GPU layout
        ct = wts.to_compressed_tensors()
        # w13 with gate/up rows paired (SiLU·up in the epilogue), the engine's default; fuse=0: w13 unpaired
        tiled = (TiledInt4.from_compressed_tensors(ct[0], ct[1], pair_gate_up=True),
                 TiledInt4.from_compressed_tensors(ct[2], ct[3]))
        if any(c.get("fuse", 1) == 0 for c in tiled_configs):
            unpaired13 = TiledInt4.from_compressed_tensors(ct[0], ct[1])
        del ct
    if args.interpret:
        configs = [dict(c, interpret=True) for c in configs]
        sweep = [dict(c, interpret=True) for c in sweep]

    def save():
        payload = dict(config=dict(E=E, D=D, F=F, K=K, G=G, bytes_per_expert=per_expert, ms=ms,
                                   routings=routings, configs=configs, tiled_configs=tiled_configs,
                                   triton_ms=sorted(triton_ms), sweep=sweep, argv=sys.argv[1:],
                                   routing_sorted_every_call=True),  # bench_util.tie_to (session 8 on)
                       copy_bw_Bps=copy_bw, torch_copy_bw_Bps=tcopy, traced_copy_bw_Bps=traced_bw, ref_bw_Bps=ref_bw,
                       rows=rows,
                       **({"commit": args.commit} if args.commit else {}))
        return bench_util.write_result(args.name, payload, args.out)

    def record(base, impl, t, nbytes, **extra):
        rows.append(dict(base, impl=impl, ms=t * 1e3, us_tok=t * 1e6 / base["M"], TBps=nbytes / t / 1e12,
                         pct_copy=100 * nbytes / t / ref_bw, pct_xla_copy=100 * nbytes / t / copy_bw,
                         **({"pct_traced_copy": 100 * nbytes / t / traced_bw} if traced_bw else {}), **extra))
        print({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in rows[-1].items()}, flush=True)

    twin = jax.jit(int4_moe_ref)
    ragged = ragged_moe_fn()
    state = {}

    def case(m, kind):
        ids, w = routing(m, kind, seed=m, e=E, k=K)
        x = jax.random.normal(jax.random.key(m), (m, D), jnp.float32).astype(jnp.bfloat16)
        active = int(np.unique(np.asarray(ids)).size)
        base = dict(M=m, routing=kind, active=active, GB=active * per_expert / 1e9, tile=default_tile(m, K, E))
        return x, ids, w, base, active * per_expert

    def run_kernel(cfg, x, ids, w, base, nbytes, y_ref, phase):
        name = "pallas[" + ",".join(f"{k_}={v}" for k_, v in cfg.items() if k_ != "interpret") + "]"
        try:
            fn = jax.jit(functools.partial(int4_moe, **cfg))
            t0 = time.perf_counter()
            y = jax.block_until_ready(fn(x, ids, w, wts))
            comp = time.perf_counter() - t0
            err = rel_err(y, y_ref) if y_ref is not None else float("nan")
            t, tmin = time_calls(fn, (x, ids, w, wts), calls=20, batches=5, budget_s=args.budget_s)
            record(base, name, t, nbytes, ms_min=tmin * 1e3, err=err, first_call_s=comp, phase=phase)
        except Exception as ex:  # noqa: BLE001
            print(f"{name} M={base['M']} failed: {type(ex).__name__}: {str(ex)[-1500:]}", flush=True)

    def tiled_name(cfg):
        return "mgpu[" + ",".join(f"{k_}={v}" for k_, v in cfg.items()) + "]"

    def run_tiled(cfg, x, ids, w, base, nbytes, y_ref, ref_name):
        """Times one Mosaic GPU config; returns its output (None if it failed)."""
        name = tiled_name(cfg)
        cfg = dict(cfg)
        stacks = tiled if cfg.pop("fuse", 1) else (unpaired13, tiled[1])
        try:
            fn = jax.jit(functools.partial(routed_experts_tiled, use_kernel=True, **cfg))
            t0 = time.perf_counter()
            y = jax.block_until_ready(fn(x, ids, w, *stacks))
            comp = time.perf_counter() - t0
            err = rel_err(y, y_ref) if y_ref is not None else float("nan")
            t_disp, tmin = time_calls(fn, (x, ids, w, *stacks), calls=20, batches=5, budget_s=args.budget_s)
            # the device time per call (launch and dispatch differenced out) is the table's figure; the
            # dispatched calls' time is kept beside it
            if args.interpret:
                t, extra = t_disp, {}
            else:
                # each call of the chain sorts its routing afresh (fixed ids would be sorted once per chain)
                tied = lambda x, ids, *rest: fn(x, bench_util.tie_to(ids, x), *rest)  # noqa: E731
                t_chained = bench_util.chained_call_time(tied, (x, ids, w, *stacks))
                traced = bench_util.traced_call_time(tied, (x, ids, w, *stacks))
                t = traced["span_s"]
                extra = dict(
                    ms_chained=t_chained * 1e3, ms_repeats=[round(v * 1e3, 4) for v in traced["span_repeats_s"]],
                    kernel_us=[round(u, 2) for u in next(
                        (v for k_, v in traced["launches_us"].items() if "mosaic" in k_), [])[:2]],
                    glue_us=(traced["busy_s"] - sum(s_ for k_, _, s_ in traced["kernels"] if "mosaic" in k_)) * 1e6,
                    # every kernel of a call (name, launches per call, µs per call), slowest first: the glue's parts
                    kernels=[[k_, round(n_, 2), round(s_ * 1e6, 2)] for k_, n_, s_ in traced["kernels"]])
            widths, tile = tile_layout(base["M"], K, E, cfg.get("widths"), cfg.get("tile"),
                                       uses_per_pair(base["M"], cfg.get("routing", "auto")))
            record(dict(base, tile=tile, widths=widths), name, t, nbytes, ms_min=tmin * 1e3,
                   ms_dispatched=t_disp * 1e3, err=err, err_against=ref_name, first_call_s=comp, phase="table",
                   **extra)
            return y
        except Exception as ex:  # noqa: BLE001
            print(f"{name} M={base['M']} failed: {type(ex).__name__}: {str(ex)[-1500:]}", flush=True)
            return None

    # phase 1: the table (kernel configs, twin, ragged_dot) at every M and routing
    for m in ms:
        for kind in routings:
            x, ids, w, base, nbytes = case(m, kind)
            y_ref = None
            if m <= args.twin_max_m:
                try:
                    y_ref = jax.block_until_ready(twin(x, ids, w, wts))
                    t, _ = time_calls(twin, (x, ids, w, wts), calls=2, batches=3, budget_s=args.budget_s)
                    record(base, "twin", t, nbytes, err=0.0, phase="table")
                except Exception as ex:  # noqa: BLE001
                    print(f"twin M={m} failed: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            ref, ref_name = y_ref, "twin" if y_ref is not None else None
            for cfg in tiled_configs:  # without the twin, each config's error is against the first config's output
                y = run_tiled(cfg, x, ids, w, base, nbytes, ref, ref_name)
                if ref is None and y is not None:
                    ref, ref_name = y, tiled_name(cfg)
            for cfg in configs if m in triton_ms else []:
                run_kernel(cfg, x, ids, w, base, nbytes, y_ref, "table")
            if m <= args.ragged_max_m and kind == "uniform":
                try:
                    if "w13" not in state:
                        kk = jax.random.split(jax.random.key(7))
                        state["w13"] = jax.random.normal(kk[0], (E, D, 2 * F), jnp.bfloat16) * 0.02
                        state["w2"] = jax.random.normal(kk[1], (E, F, D), jnp.bfloat16) * 0.02
                    t, _ = time_calls(ragged, (x, ids, w, state["w13"], state["w2"]), calls=2, batches=3,
                                      budget_s=args.budget_s)
                    bf16_bytes = base["active"] * 3 * D * F * 2  # this path reads bf16 experts, not INT4
                    record(dict(base, GB=bf16_bytes / 1e9), "ragged_dot_bf16", t, bf16_bytes,
                           bf16_GB=bf16_bytes / 1e9, phase="table")
                except Exception as ex:  # noqa: BLE001
                    print(f"ragged_dot M={m} failed: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            save()
    state.clear()
    # phase 2: variants (tuning and stage-removed probes) at a few M, uniform routing
    for m in [int(v) for v in args.sweep_ms.split(",") if v] if sweep else []:
        x, ids, w, base, nbytes = case(m, "uniform")
        y_ref = jax.block_until_ready(jax.jit(functools.partial(int4_moe, **configs[0]))(x, ids, w, wts))
        for cfg in sweep:
            run_kernel(cfg, x, ids, w, base, nbytes, y_ref, "sweep")
        save()

    print("wrote", save())
    print(f"copy bandwidth: torch {(tcopy or 0) / 1e12:.3f} TB/s (pct_copy), XLA a+1 {copy_bw / 1e12:.3f} TB/s")
    bench_util.print_table(rows, ["M", "routing", "impl", "active", "GB", "ms", "us_tok", "TBps", "pct_copy",
                                  "pct_traced_copy", "glue_us", "err"])


if __name__ == "__main__":
    main()

"""Where the time of a small call goes: device kernel times from a profiler trace, not wall clocks.

    PYTHONPATH=. python experiments/profile_kernels.py --out DIR            # H200
    PYTHONPATH=. python experiments/profile_kernels.py --smoke              # CPU: tiny cases, host events

For each case it runs a jitted chain of --calls dependent calls once to compile, then once under
``jax.profiler.trace``, reads the trace back (``jax.profiler.ProfileData``) and reports, per kernel name,
the number of launches and the summed device time per call, plus the span from the first kernel's
start to the last one's end, the busy time, and the idle gaps between kernels, all per call. A
span much larger than the busy time means the GPU waited for the host (launch or per-launch setup
such as Mosaic GPU's host-side TMA descriptors); a large busy time in XLA fusions means glue.

Cases (K2.6 dims): the Mosaic GPU tree attention at three small shapes where it is far from its
floor, and the routed experts of one MoE layer at M = 1 and 9 (random weights, uniform routing).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from experiments import bench_util


def device_events(path: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of the kernels in an .xplane.pb: GPU stream lines, or on a CPU
    host the XLA client's thunk events (smoke runs)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    if not events:
        for plane in data.planes:
            if plane.name == "/host:CPU":
                for line in plane.lines:
                    if "PjRtCpuClient" in line.name:
                        events += [(e.name, e.start_ns, e.duration_ns) for e in line.events
                                   if e.duration_ns > 0
                                   and not e.name.startswith(("Threadpool", "end:", "ThunkExecutor"))]
    return sorted(events, key=lambda e: e[1])


def line_names(path: str) -> list[str]:
    from jax.profiler import ProfileData

    return [f"{p.name} | {line.name}" for p in ProfileData.from_file(path).planes for line in p.lines]


def profile(fn, args, calls: int) -> dict:
    program = bench_util.dependent_chain(fn, calls)
    jax.block_until_ready(program(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(program(*args))
        path = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0]
        events, lines = device_events(path), line_names(path)
    if not events:
        return {"error": "no kernel events in the trace", "lines": lines}
    per_kernel = collections.defaultdict(lambda: [0, 0])
    for name, _, dur in events:
        per_kernel[name][0] += 1
        per_kernel[name][1] += dur
    busy = sum(d for _, _, d in events)
    span = events[-1][1] + events[-1][2] - events[0][1]
    return {"calls": calls, "span_us": span / calls / 1e3, "busy_us": busy / calls / 1e3,
            "idle_us": (span - busy) / calls / 1e3,
            "kernels": sorted(([name, n / calls, us / calls / 1e3] for name, (n, us) in per_kernel.items()),
                              key=lambda k: -k[2]),
            "lines": lines[:40]}


def attention_case(H, B, T, P, C=576, L=512):
    from ddtree_jax.tree import make_tree
    from pallas_kernels.mla_attention_mgpu import tree_attention_mgpu
    import numpy as np

    ks = jax.random.split(jax.random.key(T * 31 + B), 3)
    q = jax.random.normal(ks[0], (B, T, H, C), jnp.bfloat16)
    cache = jax.random.normal(ks[1], (B, P, C), jnp.bfloat16)
    tkv = jax.random.normal(ks[2], (B, T, C), jnp.bfloat16)
    rng = np.random.default_rng(T)
    parents = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(B)], np.int32)
    mask = make_tree(np.zeros((B, T), np.int32), parents, max_depth=T - 1).visibility
    fn = functools.partial(tree_attention_mgpu, scale=0.14468, kv_lora_rank=L)
    return (lambda q, cache, plen, tkv, mask: fn(q, cache, plen, tkv, mask)), \
        (q, cache, jnp.full((B,), P, jnp.int32), tkv, mask)


@functools.lru_cache(maxsize=1)
def tiled_experts(E, D, F):
    """Random K2.6 expert stacks in the kernel layout (made once, shared by the MoE cases)."""
    from experiments.bench_moe import random_weights
    from pallas_kernels.int4_moe_mgpu import TiledInt4

    ct = random_weights(jax.random.key(0), E, D, F).to_compressed_tensors()
    return TiledInt4.from_compressed_tensors(ct[0], ct[1]), TiledInt4.from_compressed_tensors(ct[2], ct[3])


def moe_case(m, E=384, D=7168, F=2048, K=8):
    from experiments.bench_moe import routing
    from pallas_kernels.int4_moe_mgpu import routed_experts_tiled

    w13, w2 = tiled_experts(E, D, F)
    ids, wts = routing(m, "uniform", seed=m, e=E, k=K)
    x = jax.random.normal(jax.random.key(m), (m, D), jnp.float32).astype(jnp.bfloat16)
    fn = functools.partial(routed_experts_tiled, use_kernel=True)
    return (lambda x, ids, wts, w13, w2: fn(x, ids, wts, w13, w2)), (x, ids, wts, w13, w2)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--cases", default="att_T1_H8_B16_8K,att_T1_H64_B1_8K,att_T64_H8_B4_8K,moe_M1,moe_M9")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: one tiny XLA case, host thunk events")
    args = ap.parse_args(argv)
    cases = {
        "att_T1_H8_B16_8K": lambda: attention_case(8, 16, 1, 8192),
        "att_T1_H64_B1_8K": lambda: attention_case(64, 1, 1, 8192),
        "att_T64_H8_B4_8K": lambda: attention_case(8, 4, 64, 8192),
        "moe_M1": lambda: moe_case(1),
        "moe_M9": lambda: moe_case(9),
    }
    if args.smoke:
        cases = {"xla_smoke": lambda: (lambda x, y: jnp.tanh(x @ y) + 1.0,
                                       (jnp.ones((256, 256)), jnp.ones((256, 256))))}
        names = ["xla_smoke"]
    else:
        names = args.cases.split(",")
        unknown = [n for n in names if n not in cases]
        if unknown:
            ap.error(f"unknown cases {unknown}; known: {sorted(cases)}")
    results = {}
    for name in names:
        fn, fargs = cases[name]()
        try:
            results[name] = profile(fn, fargs, args.calls)
        except Exception as e:  # noqa: BLE001 - report and go on
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r = results[name]
        print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                     if k not in ("kernels", "lines")}, flush=True)
        for kname, n, us in r.get("kernels", [])[:8]:
            print(f"    {us:9.2f} us  x{n:4.1f}  {kname[:90]}", flush=True)
        del fargs
    payload = dict(results=results, config=dict(calls=args.calls, cases=names), code_commit=args.commit)
    print("wrote", bench_util.write_result("profile_kernels" + ("_smoke" if args.smoke else ""), payload,
                                           args.out or (tempfile.gettempdir() if args.smoke else None)))
    bench_util.print_table([dict(case=n, **{k: r.get(k) for k in ("span_us", "busy_us", "idle_us")})
                            for n, r in results.items()], ["case", "span_us", "busy_us", "idle_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

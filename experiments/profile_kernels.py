"""Where the time of a small call goes: device kernel times from a profiler trace, not wall clocks.

    PYTHONPATH=. python experiments/profile_kernels.py --out DIR            # H200
    PYTHONPATH=. python experiments/profile_kernels.py --smoke              # CPU: tiny cases, host events

For each case: ``bench_util.traced_call_time`` on a jitted chain of --calls dependent calls (per kernel
name the launches and summed device time per call, every launch's time, the span from the first
kernel's start to the last one's end, busy time and idle gaps, all per call), and beside it the
wall-clock figure of the same chain with the launch differenced out (``chained_call_time``). A span
much larger than the busy time means the GPU waited inside the program; a wall figure much larger than
the span means host work per call that the GPU never waits for inside the trace (per-launch setup such
as Mosaic GPU's host-side TMA descriptors, or XLA's command-buffer updates); a large busy time in XLA
fusions means glue.

Cases (K2.6 dims): a 1 GiB XLA copy (control), the Mosaic GPU tree attention at small shapes (``att_*``:
the 64-row kernel, ``natt_*``: the narrow decode kernel) and plain XLA attention at one of them
(control), the attention kernels' copy pipeline alone (``stream*``: their ceiling), launch and read
floors (``tiny_mgpu_132``, ``read_*``), the routed experts of one MoE layer at M = 1 to 1024 (random
weights, uniform routing).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from experiments import bench_util


def profile(fn, args, calls: int, with_wall: bool) -> dict:
    """The trace's device time per call (``bench_util.traced_call_time``), and beside it the wall-clock
    figure of the same chain with the program's launch differenced out (``chained_call_time``): where the
    wall figure is larger the difference is host work that the trace's span does not hold."""
    r = bench_util.traced_call_time(fn, args, calls)
    out = {"calls": calls, "span_us": r["span_s"] * 1e6, "busy_us": r["busy_s"] * 1e6, "idle_us": r["idle_s"] * 1e6,
           "kernels": [[n, c, s * 1e6] for n, c, s in r["kernels"]], "launches_us": r["launches_us"]}
    if with_wall:
        out["wall_chained_us"] = bench_util.chained_call_time(fn, args, n_long=calls + 1) * 1e6
    return out


def attention_case(H, B, T, P, kernel="mgpu", C=576, L=512, merge="kernel", padded_tree=False):
    """The tree attention at one shape: the Mosaic GPU op (its splits merged by the one-launch
    ``combine_splits`` or, merge="xla", by its XLA twin), or (kernel="xla") plain XLA masked attention.
    ``padded_tree``: the tree latents handed over padded to whole 64-key blocks, as the model does."""
    from ddtree_jax.tree import make_tree
    from experiments.bench_tree_attention import xla_masked
    from pallas_kernels.mla_attention_mgpu import tree_attention_mgpu
    from pallas_kernels.split_combine import combine_splits, combine_splits_ref
    import numpy as np

    ks = jax.random.split(jax.random.key(T * 31 + B), 3)
    q = jax.random.normal(ks[0], (B, T, H, C), jnp.bfloat16)
    cache = jax.random.normal(ks[1], (B, P, C), jnp.bfloat16)
    tkv = jax.random.normal(ks[2], (B, T, C), jnp.bfloat16)
    if padded_tree:
        from pallas_kernels.mla_kernel_inputs import pad_tree_latents
        tkv = pad_tree_latents(tkv)
    rng = np.random.default_rng(T)
    parents = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(B)], np.int32)
    mask = make_tree(np.zeros((B, T), np.int32), parents, max_depth=T - 1).visibility
    if merge not in ("kernel", "xla"):
        raise ValueError(f"merge must be 'kernel' or 'xla', got {merge!r}")
    combine = combine_splits if merge == "kernel" else combine_splits_ref
    if kernel == "xla":
        fn = xla_masked
    else:
        from pallas_kernels.mla_attention_mgpu import split_attention
        from pallas_kernels.mla_attention_narrow import split_attention_narrow
        split = {"mgpu": split_attention, "mgpu_narrow": split_attention_narrow}[kernel]
        fn = functools.partial(tree_attention_mgpu, scale=0.14468, kv_lora_rank=L, combine=combine, kernel=split)
    # prefix_len tied to q: each chained call clamps it and builds its inputs (fixed ones: once per chain)
    return (lambda q, cache, plen, tkv, mask: fn(q, cache, bench_util.tie_to(plen, q), tkv, mask)), \
        (q, cache, jnp.full((B,), P, jnp.int32), tkv, mask)


def mla_case(B, P, T=1, H=8, kernel=None):
    """The model's attention block (``ddtree_jax.model.MLA``: projections, latent attention, output) at K2.6
    width with H heads (8: one GPU under TP-8), T new tokens over a P-token prefix: every launch around the
    attention op as the model issues it. ``kernel``: the split kernel (default: the dispatcher's choice;
    "wide" forces the 64-row kernel, which session 17's first measurement ran on its XLA-built tail)."""
    import dataclasses

    from flax import nnx

    from ddtree_jax.config import k26_config
    from ddtree_jax.model import MLA, Runtime, causal_mask
    from ddtree_jax.rope import rope_cos_sin
    from pallas_kernels.mla_attention_mgpu import split_attention, tree_attention_mgpu

    cfg = dataclasses.replace(k26_config(), num_heads=H)
    graphdef, state = nnx.split(MLA(cfg, nnx.Rngs(0)))
    attend = None if kernel is None else functools.partial(tree_attention_mgpu,
                                                            kernel={"wide": split_attention}[kernel])
    runtime = Runtime(attention_fn=attend)
    cos, sin = rope_cos_sin(jnp.full((B, T), P, jnp.int32), cfg.rope, cfg.qk_rope_head_dim)
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.hidden_size), jnp.bfloat16)
    cache = jax.random.normal(jax.random.key(2), (B, P + 64, cfg.latent_dim), jnp.bfloat16)

    def fn(x, state, cache, plen, cos, sin, mask):
        out, _ = nnx.merge(graphdef, state)(x, cos, sin, cache, bench_util.tie_to(plen, x), mask, runtime)
        return out

    return fn, (x, state, cache, jnp.full((B,), P, jnp.int32), cos, sin, causal_mask(B, T))


def tiny_mgpu_case(programs: int = 132):
    """The floor under any Mosaic GPU launch: ``programs`` programs, each a TMA round trip of 512 bytes
    (global -> shared -> global). Its traced time per call is what a kernel costs before it moves data."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, o_ref, smem, bar):
        i = jax.lax.axis_index("p")
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * 128, 128)], smem, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(smem, o_ref.at[pl.ds(i * 128, 128)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs * 128,), jnp.float32),
                          scratch_types=(plgpu.SMEM((128,), jnp.float32), plgpu.Barrier()),
                          grid=(programs,), grid_names=("p",))
    return kernel, (jnp.zeros((programs * 128,), jnp.float32),)


def stream_case(B: int, S: int, stages: int, C: int = 576, block_k: int = 64):
    """The attention kernels' copy pipeline alone, their ceiling: B streams' S cache rows in 64-row blocks
    (72 KB at C = 576), in the decode kernels' grid of (stream, split) programs with their default splits
    (``splits_for`` at T = 1, H = 8), each program a producer warpgroup of TMA copies through ``stages``
    slots and a consumer that only waits for each block and frees its slot."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels.mgpu_attention_parts import stream_key_blocks
    from pallas_kernels.mla_attention_plan import split_range, splits_for

    NS = splits_for(B, 1, 8, S, block_k)

    def body(kv_ref, o_ref, k_smem, out_smem, k_bars, consumed_bars):
        b, sp, wg = (jax.lax.axis_index(n) for n in ("stream", "split", "wg"))
        lo, _, hi = split_range(S // block_k, 0, sp, NS)

        @pl.when(wg == 1)
        def _producer():  # the kernels' own ring, over cache blocks only
            n = hi - lo
            stream_key_blocks(kv_ref, kv_ref, b, lo, 0, n, n, k_smem, k_bars, consumed_bars, stages, block_k)

        @pl.when(wg == 0)
        def _consumer():
            @pl.loop(0, hi - lo)
            def _(j):
                slot = jax.lax.rem(j, stages)
                plgpu.barrier_wait(k_bars.at[slot])
                plgpu.barrier_arrive(consumed_bars.at[slot])

            out_smem[...] = jnp.zeros((128,), jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, o_ref.at[sp, b])
            plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((NS, B, 128), jnp.float32),
        scratch_types=(plgpu.SMEM((stages, block_k, C), jnp.bfloat16,
                                  transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))),
                       plgpu.SMEM((128,), jnp.float32), plgpu.Barrier(num_barriers=stages),
                       plgpu.Barrier(num_barriers=stages)),
        grid=(B, NS), grid_names=("stream", "split"), num_threads=2, thread_name="wg")
    return kernel, (jnp.ones((B, S, C), jnp.bfloat16),)


def read_case(rows: int, cols: int = 576):
    """XLA reading ``rows`` x ``cols`` bf16 once (a sum): what streaming a small cache costs outside our
    kernels (rows 65 536: the 75 MB of one stream's 64K prefix; 8 192: 9.4 MB)."""
    return (lambda a: jnp.sum(a, axis=0, dtype=jnp.float32)), (jnp.ones((rows, cols), jnp.bfloat16),)


@functools.lru_cache(maxsize=1)
def tiled_experts(E, D, F):
    """Random K2.6 expert stacks in the kernel layout, w13 paired for the SiLU·up epilogue as
    ``prepare_for_kernels`` stores it (made once, shared by the MoE cases)."""
    from experiments.bench_moe import random_weights
    from pallas_kernels.int4_tiles import TiledInt4

    ct = random_weights(jax.random.key(0), E, D, F).to_compressed_tensors()
    return (TiledInt4.from_compressed_tensors(ct[0], ct[1], pair_gate_up=True),
            TiledInt4.from_compressed_tensors(ct[2], ct[3]))


def moe_case(m, E=384, D=7168, F=2048, K=8):
    from experiments.bench_moe import routing
    from pallas_kernels.int4_moe_mgpu import routed_experts_tiled

    w13, w2 = tiled_experts(E, D, F)
    ids, wts = routing(m, "uniform", seed=m, e=E, k=K)
    x = jax.random.normal(jax.random.key(m), (m, D), jnp.float32).astype(jnp.bfloat16)
    fn = functools.partial(routed_experts_tiled, use_kernel=True)
    # ids tied to x: each chained call sorts its routing (fixed ids would be sorted once per chain)
    return (lambda x, ids, wts, w13, w2: fn(x, bench_util.tie_to(ids, x), wts, w13, w2)), (x, ids, wts, w13, w2)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--cases", default="copy_1G,att_T1_H8_B16_8K,xla_T1_H8_B16_8K,att_T1_H64_B1_8K,"
                                        "att_T64_H8_B4_8K,moe_M1,moe_M9,moe_M256,moe_M1024")
    ap.add_argument("--no-wall", action="store_true", help="skip the wall-clock chained figure")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: one tiny XLA case, host thunk events")
    ap.add_argument("--hlo", action="store_true",
                    help="also write each case's optimized HLO (the traced chain) to OUT/hlo_CASE.txt, to read "
                         "what a fusion named in the trace computes")
    args = ap.parse_args(argv)
    if args.hlo and not args.out:
        ap.error("--hlo needs --out")
    cases = {
        "copy_1G": lambda: (lambda a: a + 1.0, (jnp.arange(1 << 28, dtype=jnp.float32),)),
        "tiny_mgpu_132": lambda: tiny_mgpu_case(132),   # a launch's floor (issue #6's few-µs points)
        "read_75M": lambda: read_case(65536),           # T=1, H=8, B=1, 64K: the prefix's bytes
        "read_9M": lambda: read_case(8192),             # T=1, H=64, B=1, 8K
        "att_T1_H8_B16_8K": lambda: attention_case(8, 16, 1, 8192),
        "natt_T1_H8_B16_8K": lambda: attention_case(8, 16, 1, 8192, kernel="mgpu_narrow"),
        "natt_T1_H8_B1_64K": lambda: attention_case(8, 1, 1, 65536, kernel="mgpu_narrow"),
        "natt_T4_H8_B1_64K": lambda: attention_case(8, 1, 4, 65536, kernel="mgpu_narrow"),
        # the tree latents padded as the model hands them over: the op is the kernel and the merge
        "natt_T1_H8_B16_8K_padded": lambda: attention_case(8, 16, 1, 8192, kernel="mgpu_narrow", padded_tree=True),
        "natt_T1_H8_B1_64K_padded": lambda: attention_case(8, 1, 1, 65536, kernel="mgpu_narrow", padded_tree=True),
        "natt_T4_H8_B16_8K_padded": lambda: attention_case(8, 16, 4, 8192, kernel="mgpu_narrow", padded_tree=True),
        # the model's attention block around the op (K2.6 width, 8 heads): the launches the model issues
        "mla_T1_H8_B16_8K": lambda: mla_case(16, 8192),
        "mla_T1_H8_B16_8K_wide": lambda: mla_case(16, 8192, kernel="wide"),
        "mla_T4_H8_B16_8K": lambda: mla_case(16, 8192, T=4),
        # the copy pipelines alone (the decode kernels' ceiling) with 2 and 3 blocks in flight
        "stream2_B1_64K": lambda: stream_case(1, 65536, 2),
        "stream3_B1_64K": lambda: stream_case(1, 65536, 3),
        "stream2_B16_8K": lambda: stream_case(16, 8192, 2),
        "stream3_B16_8K": lambda: stream_case(16, 8192, 3),
        "xla_T1_H8_B16_8K": lambda: attention_case(8, 16, 1, 8192, kernel="xla"),
        "att_T1_H64_B1_8K": lambda: attention_case(64, 1, 1, 8192),
        "att_T1_H8_B1_64K": lambda: attention_case(8, 1, 1, 65536),
        "att_T1_H8_B1_64K_xla": lambda: attention_case(8, 1, 1, 65536, merge="xla"),  # merge A/B
        "att_T1_H64_B1_8K_xla": lambda: attention_case(64, 1, 1, 8192, merge="xla"),
        "att_T8_H8_B1_64K_xla": lambda: attention_case(8, 1, 8, 65536, merge="xla"),
        "att_T1_H8_B16_8K_xla": lambda: attention_case(8, 16, 1, 8192, merge="xla"),
        "att_T8_H8_B1_64K": lambda: attention_case(8, 1, 8, 65536),
        "att_T9_H8_B1_64K": lambda: attention_case(8, 1, 9, 65536),  # 72 rows: two tiles read the prefix
        "att_T8_H8_B16_8K": lambda: attention_case(8, 16, 8, 8192),
        "att_T8_H8_B16_8K_xla": lambda: attention_case(8, 16, 8, 8192, merge="xla"),
        "att_T1_H64_B16_64K": lambda: attention_case(64, 16, 1, 65536),
        "att_T64_H8_B4_8K": lambda: attention_case(8, 4, 64, 8192),
        # the compute-bound point furthest from peak: 32 tiles x 4 splits of 5 key blocks, 8.4 MB of partials
        "att_T256_H8_B1_1K_padded": lambda: attention_case(8, 1, 256, 1024, padded_tree=True),
        "att_T256_H64_B1_1K_padded": lambda: attention_case(64, 1, 256, 1024, padded_tree=True),
        "moe_M1": lambda: moe_case(1),
        "moe_M9": lambda: moe_case(9),
        "moe_M256": lambda: moe_case(256),
        "moe_M512": lambda: moe_case(512),
        "moe_M1024": lambda: moe_case(1024),
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
        if args.hlo:
            os.makedirs(args.out, exist_ok=True)
            hlo = bench_util.dependent_chain(fn, args.calls).lower(*fargs).compile().as_text()
            with open(os.path.join(args.out, f"hlo_{name}.txt"), "w") as f:
                f.write(hlo)
        try:
            results[name] = profile(fn, fargs, args.calls, with_wall=not args.no_wall)
        except Exception as e:  # noqa: BLE001 - report and go on
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r = results[name]
        print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                     if k not in ("kernels", "launches_us")}, flush=True)
        for kname, n, us in r.get("kernels", [])[:8]:
            print(f"    {us:9.2f} us  x{n:4.1f}  {kname[:90]}", flush=True)
        del fargs
    payload = dict(results=results, config=dict(calls=args.calls, cases=names), code_commit=args.commit)
    print("wrote", bench_util.write_result("profile_kernels" + ("_smoke" if args.smoke else ""), payload,
                                           args.out or (tempfile.gettempdir() if args.smoke else None)))
    cols = ["span_us", "busy_us", "idle_us", "wall_chained_us"]
    bench_util.print_table([dict(case=n, **{k: r.get(k) for k in cols}) for n, r in results.items()], ["case"] + cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())

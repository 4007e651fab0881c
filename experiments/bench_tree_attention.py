"""Benchmark: MLA tree-verify attention (Pallas-Triton and Mosaic GPU kernels) vs XLA masked attention,
K2.6 dims.

K2.6 absorbed MLA: C = 576 (512 latent + 64 rope), L = 512, scale 0.14468, bf16 inputs, H = 64 (whole
model) or 8 (one GPU under TP-8). Every stream has the same prefix P (cache capacity S = P) and a
random tree of T nodes (random parent array -> ancestor-or-self mask).

Modes
  --mode sweep  tuning configs on a few shapes, each checked against the twin (f32) first.
  --mode grid   the trimmed grid below with the library's default config (or --cfg JSON).
  --mode parts  the Mosaic GPU op at the grid points, whole and in parts: glue (row folding, tree
                inputs), kernel alone, merge (``mgpu_parts``; the library's one-launch ``combine_splits``
                and its XLA twin beside it); says where a small problem's time goes.
  --points "H,B,T,P;..."  the points of --mode parts or splits instead of GRID / SPLIT_SHAPES; "issue": the
                issue's whole grid (ISSUE_GRID, 108 points; --heads picks one H). --render JSON... prints its goal map.
  --trace-only  (grid, GPU) time from the profiler's trace alone, without the wall-clock chains.
  --mode splits the Mosaic GPU kernel at memory-bound points (``SPLIT_SHAPES``) with its default split
                count and 1/2, 1/4, 1/8 of it (``--split-factors``): whether fewer, longer splits beat the
                merge's cost, or (factors above 1) more programs than SMs even out their ends.

``--padded-tree`` hands the ops the tree latents padded to whole 64-key blocks, as the model does.
``--clocks SECONDS`` (grid, splits; GPU) also runs each point's chain back to back for that long while
nvidia-smi samples the SM clock and power (``clocks``, ``sm_mhz``, ``power_w``), and the peak's products
once (``peak_clocks``): whether a time is the clock the load sustains under the power cap.

Timing: one jitted program runs the op n times back to back (each call's prefix_len depends on the
previous output through a NaN check, so calls cannot overlap or be elided; all outputs are returned),
rotating over cache copies (``point_inputs``). The 8 traced calls read 8 of them at most, so where one copy
(2·B·P·C bytes) is under 15 MB the caches the chain reads hold less than 2x the 60 MB L2, and where they
fit it whole (``chain_cache_bytes`` <= 60 MB, flagged ``l2_fits_chain``: B·P <= 6.8K) later calls may read them
from the L2: those points' times can lean low. In the H100 grid of session 74 the memory-bound ones reach
4-17 % of bandwidth (launch-bound) and the compute-bound ones read at under 20 % of it, so no verdict hangs on it.
``ms`` (since session 6) is the device time per call from a profiler trace of that program
(``bench_util.traced_call_time``: first kernel's start to last kernel's end, over n; glue kernels and
gaps included). ``ms_chained`` is the wall-clock figure, (median of the program - median of the same
program with one call) / (n - 1), which session 5 reported as ``ms``: it also holds host work per call
that the GPU does not wait for inside one program. ``ms_with_launch`` is the n-call median / n.
``op_ms`` (Mosaic GPU kernels, since session 22) is the op's own device time per call from the same trace
(median over calls of its attention kernel's start to its merge's end, ``bench_util.op_spans``): without
the chain's tie (a one-element copy and the NaN check, ~2 µs a call, which a model does not run) and the
launch gap before the kernel; ``pct_floor_op`` is the floor's share of it; ``op_kernels_us`` the median duration of
each of the op's kernels (the attention kernel, the merge), in µs.
Roofline: bytes = valid cache rows + q + tree_kv + output, read/written once; FLOPs = 2*B*T*H*(P+T)*(C+L).
Floors use the copy bandwidth and bf16 matmul rate measured in the same run (bench_util; the rate is the larger
of the wall-clock chained and the traced peak, both recorded).

    PYTHONPATH=. python3 experiments/bench_tree_attention.py --mode grid --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ddtree_jax.tree import make_tree  # noqa: E402
from experiments import bench_util  # noqa: E402
from pallas_kernels import mla_attention_mgpu as M  # noqa: E402
from pallas_kernels.mla_attention_mgpu import tree_attention_mgpu  # noqa: E402
from pallas_kernels.mla_attention_narrow import split_attention_narrow  # noqa: E402
from pallas_kernels.split_combine import combine_splits, combine_splits_ref  # noqa: E402
from pallas_kernels.tree_attention import (default_config, fold_rows, tree_attention,  # noqa: E402
                                           tree_attention_ref)

def xla_kernel(q, cache, plen, tkv, mask, *, scale, kv_lora_rank):
    """``xla_masked`` as a --kernel entry (its rows time XLA alone; the benchmark's dims only)."""
    if (scale, kv_lora_rank) != (SCALE, L):
        raise ValueError(f"xla_masked runs at the benchmark's scale {SCALE} and L = {L}, not {scale}, {kv_lora_rank}")
    return xla_masked(q, cache, plen, tkv, mask)


KERNELS = {"triton": tree_attention,
           "xla": xla_kernel,  # plain XLA, timed like a kernel (--kernel xla)
           "mgpu": tree_attention_mgpu,  # its default kernel: narrow for T*H <= 32 rows, else wide
           "mgpu_wide": functools.partial(tree_attention_mgpu, kernel=M.split_attention),
           "mgpu_redundant": functools.partial(tree_attention_mgpu, kernel=M.split_attention, share_scores=False),
           # decode points only (T*H a multiple of 8 up to 32): keys as wgmma's M, the query rows as N
           "mgpu_narrow": functools.partial(tree_attention_mgpu, kernel=split_attention_narrow)}
# (a kernel's options go on its name: --kernel mgpu_narrow:stages=3 -- see kernel_fn)


def kernel_fn(name: str):
    """A --kernel entry: a KERNELS name, optionally with integer keywords for it, 'mgpu_wide:num_splits=4'
    (several joined by '&'), so that one run can time a kernel's options side by side. A keyword 'kernel.k' goes
    to the Mosaic GPU entries' kernel itself, its values joined by '/' into a tuple:
    'mgpu_wide:kernel.registers=24/240'; a keyword 'combine.k' to their split merge: 'mgpu:combine.num_warps=4'."""
    base, _, opts = name.partition(":")
    if base not in KERNELS:
        raise ValueError(f"unknown kernel {base!r} in {name!r}; expected one of {sorted(KERNELS)}")
    try:
        kw = bench_util.int_options(opts, "&")
    except ValueError:
        raise ValueError(f"kernel options in {name!r} must be k=int (or k=int/int...) pairs joined by '&'") from None
    inner = {k.removeprefix("kernel."): v for k, v in kw.items() if k.startswith("kernel.")}
    merge = {k.removeprefix("combine."): v for k, v in kw.items() if k.startswith("combine.")}
    kw = {k: v for k, v in kw.items() if not k.startswith(("kernel.", "combine."))}
    fn = KERNELS[base]
    if merge:
        if not base.startswith("mgpu"):
            raise ValueError(f"{name!r}: combine.* options go to the Mosaic GPU entries' split merge")
        kw["combine"] = functools.partial(combine_splits, **merge)
    if inner:
        kernel = getattr(fn, "keywords", {}).get("kernel")
        if kernel is None:
            raise ValueError(f"{name!r}: kernel.* options need an entry that names its kernel (mgpu_wide, mgpu_narrow)")
        kw["kernel"] = functools.partial(kernel, **inner)
    return functools.partial(fn, **kw) if kw else fn


C, L, SCALE = 576, 512, 0.14468
CHAIN_CALLS = 8  # the calls of a timed chain
XLA_SCORES_LIMIT = 4 << 30  # XLA's masked attention is timed only where its f32 scores fit in this

# (H, B, T, P): trimmed from H in {64, 8} x P 1K..64K x T {1,8,32,64,128,256} x B {1,4,16}.
GRID = [  # in priority order: a run that hits its budget keeps the most useful points
    (64, 1, 1, 8192), (8, 16, 1, 8192), (64, 1, 256, 8192), (8, 4, 64, 8192),
    (8, 1, 1, 65536), (64, 16, 1, 65536), (8, 16, 8, 8192), (64, 16, 64, 8192),
    (8, 16, 256, 8192), (64, 1, 64, 8192), (64, 4, 32, 8192), (8, 1, 8, 65536),
    (64, 1, 1, 65536), (64, 16, 1, 8192), (8, 16, 1, 65536), (64, 1, 8, 65536), (64, 16, 8, 8192),
    (8, 4, 32, 8192), (8, 1, 64, 8192), (64, 4, 64, 65536), (8, 4, 128, 8192), (64, 4, 128, 8192),
    (8, 1, 256, 1024), (64, 1, 256, 1024), (64, 1, 256, 65536), (64, 16, 256, 8192),
    (8, 1, 256, 65536),
]

# The issue's whole grid (--points issue): H in {64, 8} x T {1, 8, 32, 64, 128, 256} x B {1, 4, 16} x P {1K, 8K, 64K}
ISSUE_GRID = [(H, B, T, P) for H in (8, 64) for P in (65536, 8192, 1024) for T in (1, 8, 32, 64, 128, 256)
              for B in (16, 4, 1)]

SWEEP_SHAPES = [(64, 1, 1, 32768), (8, 16, 1, 8192), (64, 1, 256, 8192), (8, 4, 64, 8192)]
SWEEP_CFGS = [
    dict(block_k=64, num_warps=8, num_stages=2), dict(block_k=32, num_warps=8, num_stages=2),
    dict(block_k=32, num_warps=4, num_stages=2),
]
# follow-up tuning points (after the grid): split-KV factor for 64-row decode, deeper pipelining
EXTRA = [((64, 1, 1, 8192), dict()), ((64, 1, 1, 8192), dict(num_splits=16)), ((64, 1, 1, 8192), dict(num_splits=64)),
         ((64, 1, 256, 8192), dict(block_k=32, num_warps=8, num_stages=3)),
         ((8, 16, 1, 8192), dict(num_splits=8)), ((8, 16, 1, 8192), dict(num_splits=32))]
# memory-bound points where the Mosaic GPU kernel's split count is swept (--mode splits)
SPLIT_SHAPES = [(8, 1, 1, 65536), (8, 1, 8, 65536), (64, 1, 1, 8192), (64, 1, 1, 65536), (8, 16, 1, 8192),
                (8, 4, 1, 65536)]
# extra split-KV variants tried on the T = 1 sweep shapes
SWEEP_SPLITS = [0.25, 4.0]


def tree_parents(B, T) -> np.ndarray:
    """The point's random trees, int32 [B, T]: node i's parent drawn uniformly from 0..i-1 (seeded by B and T)."""
    rng = np.random.default_rng(T * 1000 + B)
    return np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(B)], np.int32)


def tree_mask(B, T):
    """The point's ancestor-or-self masks, bool [B, T, T] (``tree_parents``)."""
    return make_tree(np.zeros((B, T), np.int32), tree_parents(B, T), max_depth=T - 1).visibility


@functools.lru_cache(maxsize=None)
def tree_visible_pairs(B, T) -> int:
    """The (node, tree key) pairs the point's masks let through, over its B trees."""
    return int(np.asarray(tree_mask(B, T)).sum())


def make_inputs(key, H, B, T, P, copies, padded_tree=False):
    """``padded_tree``: the tree latents padded with zeros to whole 64-key blocks, as the model hands them to
    the attention (the Mosaic GPU kernels read them in place)."""
    ks = jax.random.split(key, 4 + copies)
    q = jax.random.normal(ks[0], (B, T, H, C), jnp.bfloat16)
    tkv = jax.random.normal(ks[1], (B, T, C), jnp.bfloat16)
    if padded_tree:
        tkv = M.pad_tree_latents(tkv)
    anc = tree_mask(B, T)
    caches = [jax.random.normal(k, (B, P, C), jnp.bfloat16) for k in ks[4:]]
    plen = jnp.full((B,), P, jnp.int32)
    return q, caches, plen, tkv, anc


def point_inputs(H, B, T, P, padded_tree=False):
    """(``make_inputs`` of a point, its cache copies): enough copies that together they hold more than twice the
    L2, at most 16 (``bench_util.rotating_copies``; a chain of n calls reads min(n, copies) of them,
    ``chain_cache_bytes``); the same random inputs for a point in every benchmark."""
    copies = bench_util.rotating_copies(2 * B * P * C)
    return make_inputs(jax.random.key(H * 7 + B * 131 + T * 17 + P), H, B, T, P, copies, padded_tree), copies


def chain_cache_bytes(B, P, copies, calls=CHAIN_CALLS) -> int:
    """The bytes of the cache copies a chain of ``calls`` calls reads (each call one copy, in turn)."""
    return min(copies, calls) * 2 * B * P * C


def xla_masked(q, cache, plen, tkv, mask):
    """Plain XLA: concatenated keys, dense f32 scores, masked softmax, value einsum."""
    B, T, H, _ = q.shape
    P = cache.shape[1]
    keys = jnp.concatenate([cache, tkv[:, :T]], axis=1)
    vis_prefix = jnp.broadcast_to((jnp.arange(P)[None, :] < plen[:, None])[:, None, :], (B, T, P))
    vis = jnp.concatenate([vis_prefix, mask], axis=2)
    s = jnp.einsum("bthc,bkc->bthk", q, keys, preferred_element_type=jnp.float32) * SCALE
    s = jnp.where(vis[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bthk,bkl->bthl", p.astype(q.dtype), keys[..., :L],
                      preferred_element_type=jnp.float32).astype(q.dtype)


def chained(fn, n):
    def run(q, caches, plen, tkv, mask):
        outs, p = [], plen
        for i in range(n):
            o = fn(q, caches[i % len(caches)], p, tkv, mask)
            outs.append(o)
            p = plen + (o[0, 0, 0, 0] != o[0, 0, 0, 0]).astype(jnp.int32)
        return outs
    return jax.jit(run)


def mgpu_parts(H, B, T, S):
    """The Mosaic GPU op on the 64-row kernel in its parts (the narrow kernel, the default at T*H <= 32, takes
    the same inputs but the queries unpadded), as (prepare, step) pairs for ``chained_parts``: "glue" (row
    folding, the tree latents padded and their mask words), "kernel" (the kernel alone on prepared inputs),
    "merge" (the split merge and row unfolding on prepared kernel outputs). Each step takes (prepared,
    prefix_len) and returns an array, or a tuple of arrays (all kept), whose first array's [0, ...] element
    the next call's prefix_len depends on."""
    ns = M.splits_for(B, T, H, S)
    kw = dict(scale=SCALE, kv_lora_rank=L, num_splits=ns, valid_rows=M.valid_rows_for(T, H))

    def glue(q, cache, plen, tkv, mask):  # -> (q rows, tree keys, mask words)
        q = bench_util.tie_to(q, plen)  # tied: each call redoes it
        qr = q.reshape(B, T * H, C) if M.tail_rows_of(T * H) else fold_rows(q, M.ROWS)  # one tile and a tail
        return (qr,) + M.tree_inputs(tkv, mask, H, qr.shape[1], 64)

    def inputs_as_given(q, cache, plen, tkv, mask):
        return q, cache, tkv, mask

    def glue_step(prep, plen):
        q, cache, tkv, mask = prep
        return glue(q, cache, plen, tkv, mask)  # the rows lead: the next call depends on them

    def kernel_inputs(q, cache, plen, tkv, mask):
        qr, tree_kv, bits = glue(q, cache, plen, tkv, mask)
        return qr, cache, tree_kv, bits

    def kernel_step(prep, plen):
        qr, cache, tree_kv, bits = prep
        return M.split_attention(qr, cache, plen, tree_kv, bits, **kw)[0]

    def kernel_outputs(q, cache, plen, tkv, mask):
        qr, cache, tree_kv, bits = kernel_inputs(q, cache, plen, tkv, mask)
        return M.split_attention(qr, cache, plen, tree_kv, bits, **kw)

    def merge_step(prep, plen, combine=combine_splits):
        o, lse = prep
        bump = (plen[0] > 1 << 30).astype(jnp.float32)  # 0, but traced: the calls stay in order
        out, _ = combine(o, lse + bump, out_dtype=jnp.bfloat16) if ns > 1 else (o[0], lse[0])
        return out[:, :T * H].reshape(B, T, H, L).astype(jnp.bfloat16)

    return {"glue": (inputs_as_given, glue_step), "kernel": (kernel_inputs, kernel_step),
            "merge": (kernel_outputs, merge_step),  # the library's one-launch merge; XLA's beside it
            "merge_xla": (kernel_outputs, functools.partial(merge_step, combine=combine_splits_ref))}


def chained_parts(prepare, step, n):
    """Like ``chained`` for one part: every cache copy is prepared once and every prepared array is
    returned (the same work for any n, so it cancels in time_op's difference; unreturned preparations
    would be dead code in a short chain), then n dependent steps rotate over the copies."""
    def run(q, caches, plen, tkv, mask):
        preps = [prepare(q, c, plen, tkv, mask) for c in caches]
        given = [q, *caches, plen, tkv, mask]
        made = [x for x in jax.tree.leaves(preps) if not any(x is g for g in given)]
        outs, p = [], plen
        for i in range(n):
            o = step(preps[i % len(preps)], p)
            outs.append(o)
            lead = o[0] if isinstance(o, tuple) else o
            first = lead[(0,) * lead.ndim]
            p = plen + (first != first).astype(jnp.int32)
        return outs, made
    return jax.jit(run)


def roofline(H, B, T, P, bw, peak, visible=None):
    """(bytes, FLOPs, bound, floor seconds) of a point: the prefix, queries, tree latents and output move once;
    each head of each node multiplies its query with every prefix key and each tree key its mask shows (``visible``
    pairs, by default those of the point's trees, ``tree_visible_pairs``), 576 + 512 multiply-adds a pair. Rows
    written before session 77 counted all T tree keys of every node (``rows_of`` recounts them)."""
    visible = tree_visible_pairs(B, T) if visible is None else visible
    nbytes = 2 * (B * P * C + B * T * H * C + B * T * C + B * T * H * L)
    flops = 2 * H * (B * T * P + visible) * (C + L)
    t_mem, t_cmp = nbytes / bw, flops / peak
    return nbytes, flops, ("memory" if t_mem >= t_cmp else "compute"), max(t_mem, t_cmp)


def masked_floor(row: dict, payload: dict) -> dict:
    """A grid row of a result file (``payload``: its bandwidth and peak) with its FLOPs, bound and floor counted
    over the tree keys its mask shows (``roofline``), where it counted all T (rows before session 77:
    ``dense_flops`` then keeps the old count); other rows as they are."""
    if "flops" not in row or "bytes" not in row or "copy_bw_Bps" not in payload:
        return row
    bw, peak = payload["copy_bw_Bps"], payload["bf16_peak_flops"]
    _, flops, bound, floor_s = roofline(row["H"], row["B"], row["T"], row["P"], bw, peak)
    if flops == row["flops"]:
        return row
    return dict(row, dense_flops=row["flops"], flops=flops, bound=bound, floor_ms=floor_s * 1e3)


def time_op(fn, inputs, est_s, repeats, chain=chained):
    """(seconds per call, calls in the long chain, seconds per call with the program's launch left in):
    the per-call figure is the difference between an n-call and a 1-call chain over n - 1, so the
    program's launch and dispatch (tens of us on the H200) do not count against a small op.
    ``chain(fn, n)`` builds the chained program (``chained``, or a ``chained_parts`` partial)."""
    n = int(min(16, max(4, math.ceil(5e-3 / max(est_s, 1e-7)))))
    q, caches, plen, tkv, mask = inputs
    t_n = bench_util.time_fn(chain(fn, n), q, caches, plen, tkv, mask, repeats=repeats, warmup=1)["median_s"]
    t_1 = bench_util.time_fn(chain(fn, 1), q, caches, plen, tkv, mask, repeats=repeats, warmup=1)["median_s"]
    return (t_n - t_1) / (n - 1), n, t_n / n


def bench_parts(H, B, T, P, bw, peak, repeats=5):
    """The Mosaic GPU op and its parts (``mgpu_parts``) at one point: ms of each, whole op first."""
    nbytes, flops, bound, floor_s = roofline(H, B, T, P, bw, peak)
    inputs, copies = point_inputs(H, B, T, P)
    row = dict(H=H, B=B, T=T, P=P, bound=bound, bytes=nbytes, flops=flops, floor_ms=floor_s * 1e3, kernel="mgpu_parts",
               cache_copies=copies)
    whole = jax.jit(functools.partial(tree_attention_mgpu, scale=SCALE, kv_lora_rank=L, kernel=M.split_attention))
    row["ms"] = time_op(whole, inputs, floor_s, repeats)[0] * 1e3
    for name, (prepare, step) in mgpu_parts(H, B, T, P).items():
        chain = lambda fn, n, prepare=prepare: chained_parts(prepare, fn, n)  # noqa: E731
        row[f"{name}_ms"] = time_op(step, inputs, floor_s, repeats, chain=chain)[0] * 1e3
    row["rest_ms"] = row["ms"] - row["glue_ms"] - row["kernel_ms"] - row["merge_ms"]
    return row


_TWIN_CACHE = {}


def parity(fn, inputs, key):
    q, caches, plen, tkv, mask = inputs
    o = np.asarray(jax.jit(fn)(q, caches[0], plen, tkv, mask), np.float32)
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    if key not in _TWIN_CACHE:
        _TWIN_CACHE.clear()
        _TWIN_CACHE[key] = np.asarray(jax.jit(
            lambda *a: tree_attention_ref(*a, scale=SCALE, kv_lora_rank=L))(
            up(q), up(caches[0]), plen, up(tkv), mask))
    r = _TWIN_CACHE[key]
    if not np.all(np.isfinite(o)):
        return float("nan")
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def is_mgpu_op_kernel(name: str) -> bool:
    """The Mosaic GPU op's own kernels in a profiler trace: the attention kernel and the splits' merge."""
    return "mosaic_gpu" in name or name.startswith("combine_splits")


def device_time(fn, inputs, calls=CHAIN_CALLS, op_kernels=None):
    """(seconds per call on the device from a profiler trace of ``chained`` (the cache copies rotate), the op's
    own median span per call (``bench_util.op_spans``) or None, and {kernel name: median µs of its launches} of
    the op's kernels or {}); the last two need ``op_kernels``, a name predicate."""
    q, caches, plen, tkv, mask = inputs
    r = bench_util.traced_call_time(fn, (q, caches, plen, tkv, mask), calls, chain=chained, op_kernels=op_kernels)
    parts = {name: float(np.median(us)) for name, us in r["launches_us"].items() if op_kernels(name)} \
        if op_kernels is not None else {}
    return r["span_s"], r.get("op_span_s"), parts


def mgpu_path(H, B, T, P) -> dict:
    """The Mosaic GPU op's defaults at a point (``M.default_plan``): its kernel, split count, and where the splits
    merge."""
    return M.default_plan(B, T, H, P, C, L)


def bench_point(H, B, T, P, cfg, bw, peak, with_xla=True, check=True, repeats=5, bw_jax=None, kernel="triton",
                with_trace=None, bw_traced=None, padded_tree=False, wall_clock=True, clock_s=0.0,
                gpu_state=bench_util.sustained_gpu_state):
    """One point's row. ``wall_clock=False`` (needs ``with_trace``): the profiler's device times alone, without
    the two wall-clock chains per op (``ms_chained``, ``ms_with_launch``), which roughly halves a point's compiles.
    ``clock_s`` > 0: the op's chain of 8 calls also runs back to back for that many seconds while ``gpu_state``
    samples the SM clock and power (``clocks``; ``sm_mhz`` and ``power_w`` their medians): whether the chain's
    time is the clock it sustains."""
    nbytes, flops, bound, floor_s = roofline(H, B, T, P, bw, peak)
    scores_bytes = 4 * B * T * H * (P + T)  # XLA's f32 scores
    if kernel.split(":")[0] == "xla" and scores_bytes > XLA_SCORES_LIMIT:
        raise ValueError(f"XLA's masked attention at H={H}, B={B}, T={T}, P={P} would hold {scores_bytes / 2**30:.1f} "
                         f"GiB of scores (the benchmark's limit is {XLA_SCORES_LIMIT / 2**30:.0f} GiB)")
    inputs, copies = point_inputs(H, B, T, P, padded_tree)
    row = dict(H=H, B=B, T=T, P=P, bound=bound, bytes=nbytes, flops=flops, floor_ms=floor_s * 1e3,
               cfg=cfg, cache_copies=copies, chain_cache_bytes=chain_cache_bytes(B, P, copies),
               l2_fits_chain=chain_cache_bytes(B, P, copies) <= bench_util.L2_BYTES, kernel=kernel,
               padded_tree=padded_tree)
    # jitted once so the chained program holds one lowered kernel called n times (not n lowerings:
    # 8 Mosaic GPU kernels lowered in 4.5 s on the CPU, the jitted one in 0.6 s)
    kern = jax.jit(functools.partial(kernel_fn(kernel), scale=SCALE, kv_lora_rank=L, **cfg))
    if kernel.split(":")[0] == "mgpu":
        row.update(mgpu_path(H, B, T, P))
    if check:
        row["rel_err"] = parity(kern, inputs, (H, B, T, P))
    if with_trace is None:  # a CPU trace holds the host's thunks, not interpret mode's callbacks
        with_trace = jax.default_backend() == "gpu"
    if not (wall_clock or with_trace):
        raise ValueError("wall_clock=False times from the profiler's trace: it needs with_trace")
    if wall_clock:
        t_chained, n, t_program = time_op(kern, inputs, floor_s, repeats)
        row.update(ms_chained=t_chained * 1e3, calls_per_program=n, ms_with_launch=t_program * 1e3)
    t, t_op, op_parts = device_time(kern, inputs, op_kernels=is_mgpu_op_kernel if kernel.startswith("mgpu") else None) \
        if with_trace else (t_chained, None, {})
    row.update(ms=t * 1e3, tflops=flops / t / 1e12, tbps=nbytes / t / 1e12,
               pct_bw=100 * nbytes / t / bw, pct_peak=100 * flops / t / peak,
               pct_floor=100 * floor_s / t)
    if t_op is not None:
        row.update(op_ms=t_op * 1e3, pct_floor_op=100 * floor_s / t_op)
    if op_parts:
        row["op_kernels_us"] = op_parts
    if bw_jax:
        row["pct_bw_jaxcopy"] = 100 * nbytes / t / bw_jax
    if bw_traced:
        row["pct_bw_traced"] = 100 * nbytes / t / bw_traced
    if clock_s > 0:
        state = gpu_state(chained(kern, 8), inputs, seconds=clock_s)
        if state is not None:
            row.update(clocks=state, sm_mhz=state["sm_mhz"]["median"], power_w=state["power_w"]["median"])
    if with_xla and scores_bytes <= XLA_SCORES_LIMIT:
        try:
            if wall_clock:
                tx, _, _ = time_op(xla_masked, inputs, floor_s, repeats)
                row["xla_ms_chained"] = tx * 1e3
            tx = device_time(jax.jit(xla_masked), inputs)[0] if with_trace else tx
            row.update(xla_ms=tx * 1e3, speedup=tx / t)
        except jax.errors.JaxRuntimeError as e:  # out of device memory: the row says so, the grid goes on
            row["xla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del inputs
    return row


def rows_of(paths) -> list[dict]:
    """The rows of result files, one per kernel and point (``kernel``, H, B, T, P): a later file's row replaces an
    earlier one's (a rerun of some points after a whole grid), in the order the points first appear; each grid
    row's floor counted over the tree keys its mask shows (``masked_floor``)."""
    latest = {}
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        for r in payload["rows"]:
            latest[(r.get("kernel"), r["H"], r["B"], r["T"], r["P"])] = masked_floor(r, payload)
    return list(latest.values())


def next_point_fits(elapsed_s: float, walls_s, budget_s: float) -> bool:
    """Whether a run that has used ``elapsed_s`` of its ``budget_s`` starts another point: only if the longest
    point so far (``walls_s``, seconds each) would still end within the budget. A point is never cut short, so
    one that ends past the budget runs into the time limit of the lease step around the run."""
    return elapsed_s + max(walls_s, default=0.0) <= budget_s


# the issue's goals: % of the copy where memory-bound, of the bf16 peak where compute-bound
GOALS = {"memory": 80.0, "compute": 50.0}


def prefix_label(P: int) -> str:
    return f"{P // 1024}K" if P % 1024 == 0 else str(P)


def floor_share(r) -> float | None:
    """A grid row's floor over its op's time (``op_ms`` where traced, else ``ms``), in %; None without a time."""
    t = r.get("op_ms", r.get("ms"))
    return 100 * r["floor_ms"] / t if isinstance(t, float) else None


def render_goal_map(rows, pct=floor_share) -> str:
    """Markdown goal maps of grid rows, one per kernel: a row per (H, T), a column per (P, B); each cell
    ``pct(row)`` (by default the floor's share of the op's time, ``floor_share``) in %, "m" memory-bound (% of the
    copy) or "c" compute-bound (% of the bf16 peak), bold where the issue's goal holds; "err" for a failed point
    or one without a value. A last line counts the points where the goals hold."""
    out = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        cells = {(r["H"], r["T"], r["P"], r["B"]): r for r in rows if r["kernel"] == kernel}
        cols = sorted({(P, B) for _, _, P, B in cells}, key=lambda c: (-c[0], -c[1]))
        lines = [f"**{kernel}**", "", "| H | T | " + " | ".join(f"{prefix_label(P)}, B={B}" for P, B in cols) + " |",
                 "|--:|--:|" + "--:|" * len(cols)]
        met = total = 0
        for H, T in sorted({(H, T) for H, T, _, _ in cells}, key=lambda k: (-k[0], k[1])):
            row = []
            for P, B in cols:
                r = cells.get((H, T, P, B))
                if r is None:
                    row.append("")
                elif "error" in r or not isinstance(value := pct(r), float):
                    row.append("err")
                    total += 1
                else:
                    ok = value >= GOALS[r["bound"]]
                    met, total = met + ok, total + 1
                    text = f"{value:.0f} {r['bound'][0]}"
                    row.append(f"**{text}**" if ok else text)
            lines.append(f"| {H} | {T} | " + " | ".join(row) + " |")
        lines += ["", f"Goals hold at {met} of {total} points."]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def main():
    global GRID, SWEEP_SHAPES, SWEEP_CFGS, SWEEP_SPLITS  # --smoke shrinks them
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["sweep", "grid", "both", "parts", "splits"], default="grid",
                    help="parts: the Mosaic GPU op split into glue, kernel and merge at the grid points")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--cfg", default=None, help="JSON dict of tuning overrides for grid mode (Triton kernel)")
    ap.add_argument("--kernel", default=None,
                    help=f"comma-separated kernels the grid times side by side in one run, of {sorted(KERNELS)}, "
                         "each optionally with integer keywords: mgpu_wide:num_splits=4&stages=2 (default "
                         "triton,mgpu; --smoke runs triton only)")
    ap.add_argument("--no-xla", action="store_true", help="grid mode: skip XLA's masked attention (an A/B of kernels)")
    ap.add_argument("--mgpu-cfg", default=None, help="JSON dict of tuning overrides for the Mosaic GPU kernel")
    ap.add_argument("--name", default=None, help="result file name (default from the mode)")
    ap.add_argument("--start", type=int, default=0, help="skip the first N grid points")
    ap.add_argument("--points", default=None,
                    help="'H,B,T,P;...': the points of --mode parts / splits / grid (instead of their defaults), or "
                         "'issue': the issue's whole grid (ISSUE_GRID)")
    ap.add_argument("--heads", type=int, default=None, help="only the points with this many heads")
    ap.add_argument("--trace-only", action="store_true",
                    help="grid mode: time from the profiler's trace alone (no wall-clock chains; GPU)")
    ap.add_argument("--render", nargs="+", default=None, metavar="JSON",
                    help="print the goal map (markdown) of grid results and exit; no device work (a later file's row "
                         "replaces an earlier one's at the same kernel and point)")
    ap.add_argument("--extra-s", type=float, default=0.0,
                    help="after the grid, this many seconds of EXTRA tuning points (sweep rows)")
    ap.add_argument("--commit", default=None,
                    help="code commit to record (the device copy of the tree has no .git)")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke: tiny shapes, interpret mode")
    ap.add_argument("--no-check-above", type=int, default=8192, help="skip parity for P above this")
    ap.add_argument("--split-factors", type=lambda v: [float(f) for f in v.split(",")], default=[1, 0.5, 0.25, 0.125],
                    help="--mode splits: the split counts timed, as factors of the default (above 1: more programs "
                         "than one wave of SMs)")
    ap.add_argument("--clocks", type=float, default=0.0, metavar="SECONDS",
                    help="grid / splits: per point, also sample the SM clock and power for SECONDS under the op's "
                         "chain (and under the peak's products once)")
    ap.add_argument("--padded-tree", action="store_true",
                    help="hand the ops tree latents padded to whole 64-key blocks, as the model does")
    args = ap.parse_args()
    if args.render:
        print(render_goal_map(rows_of(args.render)))
        return 0
    try:
        points = ISSUE_GRID if args.points == "issue" else bench_util.int_points(args.points, 4) if args.points \
            else None
    except ValueError:
        ap.error(f"--points takes integers 'H,B,T,P;...' or 'issue', got {args.points!r}")
    if args.heads is not None:
        points = [pt for pt in (points or GRID) if pt[0] == args.heads]
        if not points:
            ap.error(f"no point has H = {args.heads}")
    if args.trace_only and (args.smoke or args.mode != "grid"):
        ap.error("--trace-only times grid points on a GPU from the profiler's trace")
    if not (math.isfinite(args.clocks) and args.clocks >= 0):
        ap.error(f"--clocks takes seconds >= 0, got {args.clocks}")
    if args.clocks and args.mode not in ("grid", "splits"):
        ap.error(f"--clocks samples grid or splits points, not --mode {args.mode}")
    if args.smoke and args.kernel is not None and args.kernel != "triton":
        ap.error("--smoke times the Triton kernel only (the Mosaic GPU kernels have no CPU interpret mode): "
                 "leave out --kernel or give --kernel triton")
    if args.mode in ("sweep", "both") and (args.points is not None or args.heads is not None):
        ap.error(f"--mode {args.mode} times its own sweep shapes (and the default grid): --points and --heads "
                 "apply to --mode grid, parts and splits")
    if not all(math.isfinite(f) and f > 0 for f in args.split_factors):
        ap.error(f"--split-factors must be positive, got {args.split_factors}")
    t_start = time.time()
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    if args.smoke:
        GRID, SWEEP_SHAPES = [(8, 1, 1, 128), (8, 2, 8, 128)], [(8, 1, 1, 128)]
        SWEEP_CFGS, SWEEP_SPLITS = [dict(block_k=32, interpret=True), dict(block_k=16, interpret=True)], []
        tbw, bw, chained_peak, traced_peak, traced_bw = None, 1e11, 1e12, None, None
        EXTRA.clear()
    else:
        on_gpu = jax.default_backend() == "gpu"
        tbw = bench_util.measure_torch_copy_bandwidth()
        bw = bench_util.measure_copy_bandwidth()
        chained_peak = bench_util.measure_bf16_peak()
        traced_peak = bench_util.measure_traced_bf16_peak() if on_gpu else None
        traced_bw = bench_util.measure_traced_copy_bandwidth() if on_gpu else None
    # the clock the peak's products sustain, beside the points' (--clocks)
    peak_clocks = None
    if args.clocks and not args.smoke:
        peak_clocks = bench_util.sustained_gpu_state(jax.jit(jnp.dot), bench_util.square_operands(16384),
                                                     seconds=args.clocks)
    # Compute ceiling: the larger of the two measured matmul peaks (a ceiling is the best seen)
    peak = max(chained_peak, traced_peak or 0.0)
    print(f"copy bw (jax) {bw/1e12:.2f} TB/s, torch copy {(tbw or 0)/1e12:.2f} TB/s, traced XLA copy "
          f"{(traced_bw or 0)/1e12:.2f} TB/s, bf16 peak {chained_peak/1e12:.0f} TFLOP/s chained, "
          f"{(traced_peak or 0)/1e12:.0f} traced", flush=True)
    # Bandwidth ceiling: the larger of the two measured copies (bench_util's jitted a+1 measured
    # 2.08 TB/s on the H200 against PyTorch's 4.24 TB/s device copy, so it would flatter us).
    bw_jax = bw
    bw = max(bw, tbw or 0.0)
    rows = []
    extra = json.loads(args.cfg) if args.cfg else {}
    if args.smoke:
        extra["interpret"] = True

    def save():
        name = args.name or (f"bench_tree_attention_{args.mode}" + (f"_from{args.start}" if args.start else ""))
        payload = dict(mode=args.mode, copy_bw_Bps=bw, jax_copy_bw_Bps=bw_jax, torch_copy_bw_Bps=tbw,
                       traced_copy_bw_Bps=traced_bw, bf16_peak_flops=peak,
                       chained_bf16_peak_flops=chained_peak, traced_bf16_peak_flops=traced_peak,
                       peak_clocks=peak_clocks,
                       dims=dict(C=C, L=L, scale=SCALE), code_commit=args.commit, rows=rows)
        bench_util.write_result(name, payload, out_dir=args.out)

    mgpu_cfg = json.loads(args.mgpu_cfg) if args.mgpu_cfg else {}
    kernels = (args.kernel or "triton,mgpu").split(",")
    for k in kernels:
        try:
            kernel_fn(k)
        except ValueError as e:
            ap.error(str(e))
    if args.smoke:
        kernels = ["triton"]  # the Mosaic GPU kernel has no CPU interpret mode

    def measure(make_row, point, **tags):
        """One point: the row ``make_row()`` gives, or on failure ``point`` with the error; with its wall
        seconds and ``tags``, appended, printed and saved (a run cut short keeps what it measured)."""
        t0 = time.time()
        try:
            row = make_row()
        except Exception as e:  # noqa: BLE001 - record and go on
            row = dict(point, error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=2)
        row.update(wall_s=round(time.time() - t0, 1), **tags)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "default_cfg"}, default=str), flush=True)
        save()
        return row

    def fits(budget):
        if next_point_fits(time.time() - t_start, [r["wall_s"] for r in rows], budget):
            return True
        print("budget reached; skipping the rest", flush=True)
        return False

    def run_points(points, mode, budget):
        todo = [(pt, cfg, "triton") for pt, cfg in points] if mode == "sweep" else \
            [(pt, cfg if k == "triton" else mgpu_cfg, k) for pt, cfg in points for k in kernels]
        for (H, B, T, P), cfg, kernel in todo:
            if not fits(budget):
                break
            check = (mode == "sweep" or P <= args.no_check_above)
            with_xla = mode == "grid" and kernel == kernels[0] and not args.no_xla
            measure(lambda: bench_point(H, B, T, P, cfg, bw, peak, with_xla=with_xla,
                                        check=check, bw_jax=bw_jax, kernel=kernel, bw_traced=traced_bw,
                                        padded_tree=args.padded_tree, wall_clock=not args.trace_only,
                                        clock_s=args.clocks),
                    dict(H=H, B=B, T=T, P=P, cfg=cfg, kernel=kernel), mode=mode,
                    **({"default_cfg": default_config(B, T, H, P, C, L)} if kernel == "triton" else {}))

    if args.mode == "parts":
        for H, B, T, P in (points or GRID)[args.start:]:
            if not fits(args.budget_s):
                break
            measure(lambda: bench_parts(H, B, T, P, bw, peak), dict(H=H, B=B, T=T, P=P, kernel="mgpu_parts"),
                    mode="parts")
        bench_util.print_table([r for r in rows if "error" not in r],
                               ["H", "B", "T", "P", "floor_ms", "ms", "glue_ms", "kernel_ms", "merge_ms",
                                "merge_xla_ms", "rest_ms"])
        return 0
    if args.mode == "splits":  # the Mosaic GPU kernel at its default split count times --split-factors
        if args.smoke or jax.default_backend() != "gpu":
            ap.error("--mode splits times the Mosaic GPU kernel, which runs on a Hopper GPU only")
        for H, B, T, P in (points or SPLIT_SHAPES)[args.start:]:
            default = M.splits_for(B, T, H, P)
            for ns in sorted({max(1, int(default * f)) for f in args.split_factors}, reverse=True):
                if not fits(args.budget_s):
                    break
                cfg = dict(mgpu_cfg, num_splits=ns)
                measure(lambda: bench_point(H, B, T, P, cfg, bw, peak, with_xla=False, check=P <= args.no_check_above,
                                            bw_jax=bw_jax, kernel="mgpu", bw_traced=traced_bw,
                                            padded_tree=args.padded_tree, clock_s=args.clocks),
                        dict(H=H, B=B, T=T, P=P, cfg=cfg, kernel="mgpu"), mode="splits", num_splits=ns,
                        default_splits=default)
        bench_util.print_table([r for r in rows if "error" not in r],
                               ["H", "B", "T", "P", "num_splits", "default_splits", "ms", "op_ms", "floor_ms",
                                "pct_bw", "pct_floor_op", "rel_err"] + (["sm_mhz", "power_w"] if args.clocks else []))
        return 0
    if args.mode == "both":  # sweep first, then the grid with the best sweep config per regime
        sweep_budget = args.budget_s * 0.45
        run_points([(shape, cfg) for shape in SWEEP_SHAPES for cfg in SWEEP_CFGS], "sweep", sweep_budget)
        best = {}
        for regime in ("decode", "tree"):
            scores = {}
            for r in rows:
                if "ms" in r and r.get("rel_err", 1) < 2e-2 and (r["T"] == 1) == (regime == "decode"):
                    k = json.dumps(r["cfg"], sort_keys=True)
                    scores.setdefault(k, []).append(r["pct_floor"])
            if scores:
                best[regime] = json.loads(max(scores, key=lambda k: sum(scores[k]) / len(scores[k])))
        print("best configs", best, flush=True)
        grid_pts = [(shape, dict(best.get("decode" if shape[2] <= 8 else "tree", {}), **extra))
                    for shape in GRID[args.start:]]
        run_points(grid_pts, "grid", args.budget_s)
        points = []
    elif args.mode == "sweep":
        points = [(shape, cfg) for shape in SWEEP_SHAPES for cfg in SWEEP_CFGS]
        for (H, B, T, P) in SWEEP_SHAPES:
            if T == 1 and not args.smoke:
                ns = default_config(B, T, H, P, C, L)["num_splits"]
                for f in SWEEP_SPLITS:
                    points.append(((H, B, T, P), dict(block_k=64, num_warps=8, num_stages=2,
                                                      num_splits=max(1, min(128, round(ns * f))))))
    else:
        points = [(shape, dict(extra)) for shape in (points or GRID)[args.start:]]
    run_points(points, args.mode, args.budget_s)
    if args.extra_s > 0:
        run_points(EXTRA, "sweep", args.budget_s + args.extra_s)
    save()
    cols = ["kernel", "H", "B", "T", "P", "bound", "path", "num_splits", "merge", "ms", "op_ms", "floor_ms", "pct_bw",
            "pct_floor_op", "pct_peak", "tflops", "tbps", "xla_ms", "speedup", "rel_err", "wall_s"] + \
        (["sm_mhz", "power_w"] if args.clocks else [])
    for r in rows:
        if "error" in r:
            r["ms"] = "ERR"
    swept = [r for r in rows if r.get("mode") == "sweep"]
    if swept:
        for r in swept:
            r["cfg_s"] = json.dumps(r.get("cfg", {})).replace(" ", "").replace('"', "")
        bench_util.print_table(swept, ["H", "B", "T", "P", "cfg_s", "ms", "pct_bw", "pct_peak", "rel_err",
                                       "wall_s"])
        print()
    gridded = [r for r in rows if r.get("mode") == "grid"]
    if gridded:
        bench_util.print_table(gridded, cols)
    for r in rows:
        if "error" in r:
            print("error", r.get("kernel"), r["H"], r["B"], r["T"], r["P"], r["cfg"], r["error"][:200])
    return 0


if __name__ == "__main__":
    sys.exit(main())

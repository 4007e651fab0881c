"""Log-sum-exp combine of split-KV attention partials in one kernel launch (Pallas-Triton) + its twin.

    combine_splits(o_parts, lse_parts, *, split_axis=0, out_dtype=None, interpret=False)
    combine_splits_ref(...)        # same signature: XLA's ``merge_lse`` and a cast

Dimension letters: NS splits, B streams, V rows (heads folded in), L value width; LB columns of one
row per program, CH splits per chunk.

A split program of the attention kernels writes its normalised output o_s and log-sum-exp lse_s per
row. The result is sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max_s lse_s), and its LSE is
max + log(sum_s w_s). In XLA that is a max, an exp-sum, a weighted sum and a cast: four small fusions,
each a launch of 1-2 µs at B = 1 on the H200 (``profile_kernels_s11_merge.json``). Here one program per
(stream, row, LB >= 64 columns) loads the LSEs of all splits (padded to a power of two, masked to -inf)
and its [NS, LB] slab of partials (>= 128 contiguous bytes per split: whole DRAM sectors), and writes the
bf16 (``out_dtype``) output and the f32 LSE. More than ``_CHUNK`` splits are taken in chunks: a first
pass finds the max, a second sums. (Earlier forms, measured on the H200: 8 rows x 8 columns a program
read 16-byte pieces and took 8.8 µs for the 8.4 MB of partials at T = 8, H = 8, B = 1, 64K; 64 columns
whatever the split count made 8 192 tiny programs at B = 16, 9.6 µs. ``experiments/RESULTS.md``.)

A row whose splits are all empty (lse -inf everywhere) gets output 0 and LSE -inf, as in ``merge_lse``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["combine_splits", "combine_splits_ref", "combine_blocks", "merge_lse"]

_CHUNK = 128          # splits loaded at once (power of two)
_COLS = 64            # value columns of one program, at least: 128 contiguous bytes of bf16 per split
_SLAB = 8192          # partials one program holds per chunk (4 warps: 64 f32 each)


def _check(o_parts, lse_parts, split_axis: int):
    if split_axis not in (0, 1):
        raise ValueError(f"split_axis must be 0 ([NS, B, V, L]) or 1 ([B, NS, V, L]), got {split_axis}")
    if o_parts.ndim != 4 or lse_parts.shape != o_parts.shape[:3]:
        raise ValueError(f"o_parts must be 4-D with lse_parts its first three dims, got {o_parts.shape} and "
                         f"{lse_parts.shape}")
    if lse_parts.dtype != jnp.float32:
        raise ValueError(f"lse_parts must be float32, got {lse_parts.dtype}")
    NS = o_parts.shape[split_axis]
    B, V, L = (o_parts.shape[1], *o_parts.shape[2:]) if split_axis == 0 else (o_parts.shape[0], *o_parts.shape[2:])
    if NS < 1:
        raise ValueError("o_parts holds no split")
    return NS, B, V, L


def combine_blocks(NS: int, L: int) -> tuple[int, int]:
    """(LB value columns, CH splits per chunk) of one program (one row): at least 64 columns (whole
    128-byte pieces), more while a chunk stays within ``_SLAB`` elements, so that few splits do not make
    many tiny programs; ValueError where the kernel cannot tile L."""
    chunk = min(_CHUNK, 1 << max(0, NS - 1).bit_length())
    lb = max(_COLS, _SLAB // chunk)
    while lb > 8 and L % lb:
        lb //= 2
    if L % lb:
        raise ValueError(f"combine_splits needs the value width L={L} to be a multiple of 8")
    return lb, chunk


def combine_warps(CH: int, LB: int) -> int:
    """Warps of one program holding a [CH, LB] slab: 4 (64 values a thread at the full ``_SLAB``), 2 where the
    slab is half of that or less. With few splits a program takes whole rows (LB = L = 512). Our reading (the
    Triton layouts were not dumped): at 2 warps its threads lie along the columns (2 x 32 threads x 8 values),
    so the sum over splits stays in each thread, where at 4 warps the splits are spread over warps and summed
    through shared memory. On the H200
    2 warps took the merge from 2.5-4.0 to 2.0-2.9 µs at 4-8 splits (B = 16, 8K; T = 256, 1K), and were no
    faster at 128 splits (``bench_split_combine_s27a/b.json``)."""
    return 4 if CH * LB > _SLAB // 2 else 2


def _kernel(lse_ref, o_ref, out_ref, lse_out_ref, *, NS, LB, CH, split_axis):
    b, row, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # chunks [start, start + CH) of the split axis, each taking the splits from ``first`` on: with one
    # chunk, lanes past NS are masked (never read); with several, the last one ends at NS and masks the
    # splits the one before it took
    chunks = [(0, 0)] if NS <= CH else \
        [(s, s) for s in range(0, NS - CH, CH)] + [(NS - CH, (NS - 1) // CH * CH)]

    def at(ref, start, *rest):
        idx = (pl.ds(start, CH), b) if split_axis == 0 else (b, pl.ds(start, CH))
        return ref.at[idx + (row,) + rest]

    def lse_chunk(start, first):
        split = lax.broadcasted_iota(jnp.int32, (CH,), 0) + start
        valid = (split >= first) & (split < NS)
        return pltriton.load(at(lse_ref, start), mask=valid, other=-jnp.inf), valid

    top = None
    for start, first in chunks:
        m = lse_chunk(start, first)[0].max()
        top = m if top is None else jnp.maximum(top, m)
    top = jnp.where(top > -jnp.inf, top, 0.0)  # all splits empty: weights exp(-inf) = 0
    tot = jnp.zeros((), jnp.float32)
    acc = jnp.zeros((LB,), jnp.float32)
    for start, first in chunks:
        lse, valid = lse_chunk(start, first)
        w = jnp.exp(lse - top)
        o = pltriton.load(at(o_ref, start, pl.ds(c * LB, LB)), mask=jnp.broadcast_to(valid[:, None], (CH, LB)),
                          other=0.0).astype(jnp.float32)
        tot += w.sum()
        acc += (w[:, None] * o).sum(0)
    out_ref[...] = (acc / jnp.where(tot > 0, tot, 1.0)).astype(out_ref.dtype)
    lse_out_ref[...] = jnp.broadcast_to(top + jnp.log(tot), (1,))


def _tiling(NS: int, L: int, block_cols, num_warps):
    """(LB, CH, num_warps) of :func:`combine_splits`: the defaults, or the overrides checked."""
    LB, CH = combine_blocks(NS, L)
    if block_cols is not None:
        if block_cols < 8 or block_cols & (block_cols - 1) or L % block_cols:
            raise ValueError(f"block_cols={block_cols} must be a power of two >= 8 dividing L={L}")
        LB = block_cols
    if num_warps is None:
        num_warps = combine_warps(CH, LB)
    elif num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be 1, 2, 4 or 8")
    return LB, CH, num_warps


def combine_splits(o_parts, lse_parts, *, split_axis=0, out_dtype=None, interpret=False, block_cols=None,
                   num_warps=None):
    """Combine split partials in one Pallas-Triton launch.

    o_parts [NS, B, V, L] (``split_axis`` 0) or [B, NS, V, L] (1), any float dtype; lse_parts the same
    without L, f32 natural log (-inf: an empty split). L % 8 == 0. Returns (out [B, V, L] in
    ``out_dtype`` (default o_parts.dtype), lse [B, V] f32). ``interpret=True`` runs the Pallas
    interpreter (CPU tests). Tiling overrides for A/Bs (``experiments/bench_split_combine.py``):
    ``block_cols`` LB (a power of two >= 8 dividing L) and ``num_warps`` per program (1, 2, 4 or 8);
    by default :func:`combine_blocks` and :func:`combine_warps`.
    """
    NS, B, V, L = _check(o_parts, lse_parts, split_axis)
    LB, CH, num_warps = _tiling(NS, L, block_cols, num_warps)
    out_dtype = jnp.dtype(out_dtype or o_parts.dtype)
    kernel = functools.partial(_kernel, NS=NS, LB=LB, CH=CH, split_axis=split_axis)
    return pl.pallas_call(
        kernel,
        grid=(B, V, L // LB),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((None, None, LB), lambda b, r, c: (b, r, c)),
                   pl.BlockSpec((None, 1), lambda b, r, c: (b, r))],
        out_shape=[jax.ShapeDtypeStruct((B, V, L), out_dtype), jax.ShapeDtypeStruct((B, V), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="combine_splits",
    )(lse_parts, o_parts)


def merge_lse(o_parts, lse_parts):
    """Log-sum-exp combine of normalised partial attention outputs (XLA; the core of the twin).

    o_parts [NS, ..., L] (any float dtype), lse_parts [NS, ...] f32 natural-log (-inf: an empty part).
    Returns (out f32 [..., L], lse f32 [...]); a row whose parts are all empty gets out 0 and lse -inf.
    """
    top = lse_parts.max(0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse_parts - top)
    tot = w.sum(0)
    acc = jnp.einsum("s...,s...l->...l", w, o_parts.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return acc / jnp.where(tot > 0, tot, 1.0)[..., None], top + jnp.log(tot)


def combine_splits_ref(o_parts, lse_parts, *, split_axis=0, out_dtype=None, interpret=False, block_cols=None,
                       num_warps=None):
    """Pure-JAX twin of :func:`combine_splits`, same signature (``merge_lse``, then the cast; ``interpret`` unused,
    the tiling overrides checked as the kernel checks them, then unused)."""
    del interpret
    NS, _, _, L = _check(o_parts, lse_parts, split_axis)
    _tiling(NS, L, block_cols, num_warps)
    if split_axis == 1:
        o_parts, lse_parts = jnp.moveaxis(o_parts, 1, 0), jnp.moveaxis(lse_parts, 1, 0)
    out, lse = merge_lse(o_parts, lse_parts)
    return out.astype(out_dtype or o_parts.dtype), lse

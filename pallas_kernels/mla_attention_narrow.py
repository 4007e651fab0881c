"""MLA decode attention for few query rows on Hopper, reading the prefix and the tree in place.

The 64-row kernel (``mla_attention_mgpu.split_attention``) with wgmma's A and B swapped, for V query rows
(``valid_rows``, a multiple of 8 up to ``NARROW_MAX_ROWS``; or one 64-row tile of which the first V are
real): a decode step of T = 1 at H = 8 heads (tensor parallelism over 8 GPUs) is 8 rows. ``tree_attention_mgpu``
uses it by default for such steps. The 64-row kernel computes q·kᵀ and p·v for all 64 rows, 7/8 of it
padding at V = 8 (Nsight Compute: the tensor pipe 43-52 % busy at T = 1, H = 8; ``experiments/RESULTS.md``,
session 15). Here the keys are wgmma's M and the V rows its N:

* sᵀ [BK, V] = k [BK, C] · qᵀ: the key block from shared memory as A, the V query rows as B;
* the online softmax reduces over sᵀ's rows (keys, across the warpgroup's warps): the max per key block,
  the denominators once after the loop (kept as a running [BK, V] array until then);
* oᵀ [L, V] += vᵀ [L, BK] · pᵀ [BK, V]: the value columns of the key block, transposed, as A; pᵀ as B,
  written into the block's rope columns, which q·kᵀ has read and p·v does not.

Its inputs are those of the 64-row kernel (the prefix read in place from the cache, the partial block masked
and its value rows past the prefix zeroed in shared memory, the tree latents padded to whole blocks with
their mask words: ``mla_attention_mgpu``'s module docstring), except that the queries are the V real rows
as they are (or one 64-row tile). At T = 1 the op is this kernel and the split merge: two launches.

Two warpgroups: a producer of TMA copies (``stream_key_blocks``, as in ``split_attention``) and one
consumer. The query tile is V x C (9 KB at V = 8 instead of 72); the output tile and the LSE row reuse it.
Three 72 KB key blocks would fit at V = 8 (``narrow_smem_bytes``), but the copy pipeline alone is no faster
with three than with two, nor is the kernel, so two it is. Its twin is ``mla_attention_mgpu.split_attention_ref``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mgpu_attention_parts import (PARTIAL, SMEM_LIMIT, TREE, WHOLE, WORD, plgpu, profiler_params,
                                                 region_scope, store_swapped_output, stream_key_blocks,
                                                 swapped_scores, swapped_softmax, zero_rows_from)
from pallas_kernels.mla_attention_plan import ROWS, block_steps
from pallas_kernels.mla_kernel_inputs import check_in_place_inputs
from pallas_kernels.tree_attention import _LOG2E

__all__ = ["split_attention_narrow", "narrow_smem_bytes", "NARROW_MAX_ROWS"]

NARROW_MAX_ROWS = 32
SMEM_ALIGNMENT = 1024  # Mosaic GPU starts every shared-memory buffer on this boundary
# Shared memory for the reductions across the consumer's 4 warps (the max and sum over keys), per 8 query rows
# (sᵀ's columns): Mosaic GPU reduces one [64 keys, 8 rows] register slice per 1024 bytes of scratch between two
# warpgroup barriers, so V/8 KB reduce all V rows in one round (at V = 32: 2 barriers a key block, not 8; within
# 1 % of the 8-row rounds at T = 2-4, H = 8: experiments/results/bench_tree_attention_s20d.json).
REDUCTION_SCRATCH_PER_8_ROWS = 1024


def reduction_scratch_bytes(V: int) -> int:
    return REDUCTION_SCRATCH_PER_8_ROWS * (V // 8)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def narrow_smem_bytes(V: int, C: int, block_k: int, stages: int, L: int = 512) -> int:
    """Shared memory of one program as Mosaic GPU counts it (every buffer starts on a 1024-byte boundary):
    ``stages`` key blocks, the V-row query tile or in its place the output tile and the LSE row, the
    reduction scratch and the barriers. pᵀ lives in a key block's rope columns and the tail's mask words
    are read from global memory, so neither takes a buffer."""
    barriers = 8 * (1 + 2 * stages)
    q_or_out = max(_aligned(2 * V * C), _aligned(2 * V * L) + _aligned(4 * V))
    return stages * _aligned(2 * block_k * C) + q_or_out + _aligned(reduction_scratch_bytes(V)) + barriers


def _check_rows(q_rows, valid_rows):
    rows, V = q_rows.shape[1], valid_rows
    if V is None or not (0 < V <= NARROW_MAX_ROWS and V % 8 == 0) or rows not in (V, ROWS):
        raise ValueError(f"split_attention_narrow takes V query rows, or one {ROWS}-row tile of which the first V "
                         f"are real, with valid_rows V a multiple of 8 up to {NARROW_MAX_ROWS}; got {rows} rows, "
                         f"valid_rows={V}")
    return V


def split_attention_narrow(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, *, scale, kv_lora_rank, block_k=64,
                           stages=2, num_splits=1, share_scores=True, valid_rows=None, profile_dir=None,
                           profile_regions=0, profile_names=None):
    """``mla_attention_mgpu.split_attention`` (same inputs, outputs and twin, ``split_attention_ref``) for
    V <= ``NARROW_MAX_ROWS`` query rows (module docstring).

    q_rows [B, R, C] bf16 with R = V (``tree_attention_mgpu`` hands over exactly the real rows: no padded
    copy of the queries) or R = 64 (rows V.. are ignored), cache_kv [B, S, C] bf16, prefix_len [B]
    int32 in [0, S] (``tree_attention_mgpu`` clamps it), tree_kv [B, TP, C] bf16 and tree_bits int32
    [B, TP/32, R] (``tree_inputs``). Split s takes the blocks ``split_range(NBP, TP/64, s, NS)`` gives it.
    Returns (o [NS, B, V, L] bf16, lse [NS, B, V] f32, natural log), each split normalised on its own; a row
    that sees no key in a split has o = 0 and lse = -inf there. ``share_scores`` is accepted for the common
    signature and unused (one consumer).

    ``profile_dir`` (a diagnostic): Mosaic GPU's on-device profiler records up to ``profile_regions`` named
    regions per warpgroup (the consumer's ``q_wait``, then per block ``k_wait``, ``scores``, ``softmax``,
    ``pv``, then ``epilogue`` of ``normalize``, ``store_smem``, ``store_gmem``; the producer's ``slot_wait``)
    and writes a Chrome trace of each call into that folder (``experiments/profile_timeline.py`` reads
    it). Without it the kernel is the same, byte for byte. ``profile_names``: record only these regions (by
    default all)."""
    del share_scores
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available in this JAX")
    BK, NS = int(block_k), int(num_splits)
    V = _check_rows(q_rows, valid_rows)
    if BK != 64:
        raise ValueError(f"block_k={BK}: the narrow kernel reads 64-key blocks")
    B, _, C, S, TP = check_in_place_inputs(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, BK,
                                           "split_attention_narrow")
    L = kv_lora_rank
    WB = BK // WORD
    if C % 64 or L % 64 or L + BK > C:
        raise ValueError(f"C={C}, L={L}: C and L must be multiples of 64 with L + {BK} <= C (pᵀ takes a key "
                         f"block's last {BK} columns)")
    if stages < 2 or NS < 1:
        raise ValueError(f"stages={stages} must be >= 2 and num_splits={NS} >= 1")
    smem = narrow_smem_bytes(V, C, BK, stages, L)
    if smem > SMEM_LIMIT:
        raise ValueError(f"valid_rows={V}, stages={stages} need {smem} bytes of shared memory (limit {SMEM_LIMIT})")
    profile = profiler_params(profile_dir, profile_regions, smem, 2, "split_attention_narrow", profile_names)
    region = region_scope(profile_names)
    scale_log2 = float(scale) * _LOG2E
    TB = TP // BK
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # a [V] vector along sᵀ's and oᵀ's columns

    def narrow_body(plen_ref, q_ref, kv_ref, tkv_ref, bits_ref, o_ref, lse_ref, q_or_out, k_smem, q_bar, k_bars,
                    consumed_bars):
        q_smem, (o_smem, lse_smem) = q_or_out  # the output tile and LSE row reuse the query tile's memory
        b = lax.axis_index("stream")
        sp = lax.axis_index("split")
        wg = lax.axis_index("wg")
        rem, nbp, lo, n_whole, n_cache, n_all = block_steps(plen_ref[b], TB, sp, NS, BK)

        @pl.when(wg == 1)
        def _producer():
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(0, V)], q_smem, q_bar)

            stream_key_blocks(kv_ref, tkv_ref, b, lo, nbp, n_cache, n_all, k_smem, k_bars, consumed_bars, stages, BK,
                              region=region)

        @pl.when(wg == 0)
        def _consumer():
            with region("q_wait"):
                plgpu.barrier_wait(q_bar)
            m0 = plgpu.layout_cast(jnp.full((V,), -jnp.inf, jnp.float32), col_layout)
            # the softmax's denominators, summed over keys only after the loop: per block one reduction across
            # the warps (the max) instead of two
            l0 = plgpu.layout_cast(jnp.full((BK, V), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def scores(j, slot, kind):  # sᵀ [BK, V], log2 units
                def row_words():  # the tree block's mask words, straight from global memory (two per row)
                    t = lo + j - nbp
                    return [plgpu.load(bits_ref, (b, t * WB + w, pl.ds(0, V)), layout=col_layout, optimized=False)
                            for w in range(WB)]

                return swapped_scores(k_smem.at[slot], q_smem, kind, rem, scale_log2, row_words)

            def flash_loop(acc_ref):  # oᵀ [L, V] starts at zero
                def step(kind, j, carry):
                    m, l = carry
                    slot = lax.rem(j, stages)
                    with region("k_wait"):
                        plgpu.barrier_wait(k_bars.at[slot])
                    with region("scores"):
                        if kind == PARTIAL:  # its value rows past the prefix: NaN-safe p·v
                            zero_rows_from(k_smem.at[slot, :, pl.ds(0, L)], rem, BK)
                        s = scores(j, slot, kind)
                    with region("softmax"):
                        # pᵀ goes to the block's rope columns, which q·kᵀ has read and p·v does not
                        p_smem = k_smem.at[slot, pl.ds(0, V), pl.ds(C - BK, BK)]
                        m_new, alpha, l = swapped_softmax(s, m, l, p_smem)
                    with region("pv"):
                        acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [1])
                        plgpu.wgmma(acc_ref, plgpu.transpose_ref(k_smem.at[slot, :, pl.ds(0, L)], (1, 0)),
                                    plgpu.transpose_ref(p_smem, (1, 0)))
                        plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed_bars.at[slot])
                    return m_new, l

                carry = lax.fori_loop(0, n_whole, functools.partial(step, WHOLE), (m0, l0))
                carry = lax.fori_loop(n_whole, n_cache, functools.partial(step, PARTIAL), carry)  # 0 or 1 block
                carry = lax.fori_loop(n_cache, n_all, functools.partial(step, TREE), carry)
                return (acc_ref[...],) + carry

            acc, m, l = pl.run_scoped(flash_loop, plgpu.ACC((L, V), jnp.float32))
            with region("epilogue"):
                # a row that saw only masked keys in this split is empty
                store_swapped_output(acc, m, l, o_smem, lse_smem, region)  # its regions "normalize" and "store_smem"
                with region("store_gmem"):
                    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, b])
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[sp, b])
                    plgpu.wait_smem_to_gmem(0)

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        narrow_body,
        out_type=(jax.ShapeDtypeStruct((NS, B, V, L), jnp.bfloat16), jax.ShapeDtypeStruct((NS, B, V), jnp.float32)),
        scratch_types=(
            plgpu.RefUnion(plgpu.SMEM((V, C), jnp.bfloat16, transforms=swizzled),
                           (plgpu.SMEM((V, L), jnp.bfloat16), plgpu.SMEM((V,), jnp.float32))),
            plgpu.SMEM((stages, BK, C), jnp.bfloat16, transforms=swizzled),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ),
        grid=(B, NS), grid_names=("stream", "split"),
        num_threads=2, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=reduction_scratch_bytes(V),
                                             **profile),
    )
    return kernel(prefix_len.astype(jnp.int32), q_rows, cache_kv, tree_kv, tree_bits)  # lse in natural log


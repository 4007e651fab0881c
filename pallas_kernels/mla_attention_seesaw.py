"""MLA attention of whole 64-row query tiles on Hopper, both consumers scoring key blocks in turn ("seesaw").

The 64-row kernel (``mla_attention_mgpu.split_attention``) puts all the scoring on consumer 0: per key block it
runs q·kᵀ over C = 576 columns, the online softmax, the hand-over of p, then its half of p·v, while consumer 1
waits for p and multiplies its half. On the H200 that sequence (~2.0 µs a block, ``experiments/RESULTS.md``,
session 26) is about the DRAM's pace per block when 128 programs stream at once (~2.2 µs), so a late block is
never made up, and at the compute-bound sizes the softmax leaves the tensor cores idle. Here the consumers
take the blocks in turn, as FlashMLA's Hopper kernel does: consumer c scores the blocks j with j % 2 == c.

For its block j consumer c

* computes s = q·kⱼᵀ (and masks it) while the other consumer still runs the softmax of block j - 1;
* waits for block j - 1's softmax state (running max m, denominator l, rescale alpha: the other consumer's
  ``stat`` row, behind its ``ready`` barrier), issues its own half of block j - 1's p·v (p from that block's
  rope columns) and, while the tensor cores run it, the softmax of block j from that state;
* hands p of block j to the other consumer in block j's rope columns (which only its own q·kᵀ read), with m, l
  and alpha in its ``stat`` row, then adds its half of block j's p·v (p from registers).

The only chain from block to block is the softmax state (wait, softmax, hand-over); q·kᵀ and p·v of the two
consumers overlap it. Each consumer does one q·kᵀ and two halves of p·v every two blocks, so the tensor work
per block is the 64-row kernel's. With two slots, block j always lands in slot j % 2: consumer c reads the
mask words of slot c only. Consumer 1 hands over an initial state (m = -inf, l = 0) as block -1, so block
0's softmax is no special case; the last block's owner leaves the final m and l in its ``stat`` row.

Inputs, outputs and twin are ``split_attention``'s (``split_attention_ref``), for whole 64-row tiles (or one
tile of which the first ``valid_rows`` are real); it needs block_k = 64, two stages and L + 64 <= C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mla_attention_mgpu import (MASKED, PARTIAL, ROWS, SMEM_LIMIT, TREE, WHOLE, WORD, _block_steps,
                                               _check_valid_rows, check_in_place_inputs, mask_tree_scores,
                                               profiler_params, stream_key_blocks, zero_rows_from)
from pallas_kernels.tree_attention import _LN2, _LOG2E

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["split_attention_seesaw", "seesaw_smem_bytes"]

STAGES = 2  # block j in slot j % 2, scored by consumer j % 2 (three 72 KB slots do not fit beside the queries)


def seesaw_smem_bytes(C: int, block_k: int = 64) -> int:
    """Shared memory of one program, as Mosaic GPU allocates it (whole 1024-byte units): the query tile (its
    memory reused by the output tile), two key blocks, their mask words, the two consumers' softmax states, the
    LSE row and the barriers. p travels in the key blocks' rope columns, so it takes no buffer."""
    def unit(nbytes):
        return -(-nbytes // 1024) * 1024
    barriers = 8 * (1 + 3 * STAGES + 1 + 2)
    return (unit(2 * ROWS * C) + STAGES * unit(2 * block_k * C) + unit(STAGES * (block_k // WORD) * ROWS * 4)
            + unit(2 * 3 * ROWS * 4) + unit(4 * ROWS) + barriers)


def split_attention_seesaw(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, *, scale, kv_lora_rank, block_k=64,
                           stages=STAGES, num_splits=1, share_scores=True, valid_rows=None, profile_dir=None,
                           profile_regions=0):
    """``mla_attention_mgpu.split_attention`` (same inputs, outputs and twin, ``split_attention_ref``) for whole
    64-row tiles, the two consumers scoring the key blocks in turn (module docstring).

    q_rows [B, R, C] bf16 with R % 64 == 0, cache_kv [B, S, C] bf16, prefix_len [B] int32 in [0, S]
    (``tree_attention_mgpu`` clamps it), tree_kv [B, TP, C] bf16, tree_bits int32 [B, TP/32, R]
    (``tree_inputs``). Returns (o [NS, B, V, L] bf16, lse [NS, B, V] f32, natural log), each split normalised
    on its own; a row that sees no key in a split has o = 0 and lse = -inf there. ``share_scores`` is accepted
    for the common signature (the scores are always computed once).

    ``profile_dir``: Mosaic GPU's on-device profiler (as in ``split_attention``), regions per consumer ``q_wait``,
    per own block ``k_wait``, ``scores``, ``state_wait`` (the other's softmax state), ``softmax`` (with the
    other's p·v issued), ``handoff``, ``pv``; then ``drain`` and ``epilogue``; the producer's ``slot_wait``."""
    del share_scores
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available in this JAX")
    BK, NS, L = int(block_k), int(num_splits), kv_lora_rank
    if BK != 64 or stages != STAGES:
        raise ValueError(f"block_k={BK}, stages={stages}: the seesaw kernel reads 64-key blocks through {STAGES} "
                         f"slots (block j in slot j % 2, scored by consumer j % 2)")
    if NS < 1:
        raise ValueError(f"num_splits={NS} must be >= 1")
    B, Np, C, S, TP = check_in_place_inputs(q_rows, cache_kv, tree_kv, tree_bits, BK, "split_attention_seesaw")
    if Np % ROWS:
        raise ValueError(f"split_attention_seesaw takes whole {ROWS}-row query tiles, got {Np} rows")
    if C % 64 or L % 128 or L + BK > C:
        raise ValueError(f"C={C}, L={L}: C % 64 == 0, L % 128 == 0 and L + {BK} <= C (p takes a key block's last "
                         f"{BK} columns)")
    smem = seesaw_smem_bytes(C, BK)
    if smem > SMEM_LIMIT:
        raise ValueError(f"C={C}: one program needs {smem} bytes of shared memory (limit {SMEM_LIMIT})")
    profile = profiler_params(profile_dir, profile_regions, smem, 3, "split_attention_seesaw")
    V = _check_valid_rows(valid_rows, Np)
    scale_log2 = float(scale) * _LOG2E
    n_tiles, TB, LH, WB = Np // ROWS, TP // BK, L // 2, BK // WORD
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(plen_ref, q_ref, kv_ref, tkv_ref, bits_ref, o_ref, lse_ref, qo_smem, k_smem, bits_smem, stat_smem,
             lse_smem, q_bar, k_bars, bits_bars, consumed_bars, done_bar, ready_bars):
        q_smem, o_smem = qo_smem  # the output tile reuses the query tile's memory
        b = lax.axis_index("stream")
        tile = lax.axis_index("tile")
        sp = lax.axis_index("split")
        wg = lax.axis_index("wg")
        rem, nbp, lo, n_whole, n_cache, n_all = _block_steps(plen_ref[b], TB, sp, NS, BK)
        partial_step = jnp.where(n_cache > n_whole, n_whole, -1)  # the step of the partial cache block, if any
        probs = lambda slot: k_smem.at[slot, :, pl.ds(C - BK, BK)]  # noqa: E731  p [64 rows, 64 keys]

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(tile * ROWS, ROWS)], q_smem, q_bar)

            def copy_mask_words(t, slot):
                plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t * WB, WB), pl.ds(tile * ROWS, ROWS)],
                                        bits_smem.at[slot], bits_bars.at[slot])

            stream_key_blocks(kv_ref, tkv_ref, b, lo, nbp, n_cache, n_all, k_smem, k_bars, consumed_bars, STAGES, BK,
                              on_tree_block=copy_mask_words)

        def consumer(c):
            other = 1 - c
            plgpu.set_max_registers(232, action="increase")
            values = lambda slot: k_smem.at[slot, :, pl.ds(c * LH, LH)]  # noqa: E731  this consumer's half

            if c == 1:  # block -1: the softmax's initial state, for consumer 0's first block
                stat_smem[1, 0] = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
                stat_smem[1, 1] = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
                stat_smem[1, 2] = plgpu.layout_cast(jnp.full((ROWS,), 1.0, jnp.float32), row_layout)
                plgpu.barrier_arrive(ready_bars.at[1])
            with jax.named_scope("q_wait"):
                plgpu.barrier_wait(q_bar)

            def other_state(i):  # row i (0 m, 1 l, 2 alpha) of the other consumer's latest block
                return plgpu.load(stat_smem.at[other, i], (), layout=row_layout)

            def scores(slot, kind):  # s [64 rows, 64 keys] = q·kᵀ in log2 units, masked
                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, BK), jnp.float32)) * scale_log2
                if kind == WHOLE:
                    return s
                col = plgpu.broadcasted_iota(jnp.int32, (ROWS, BK), 1, layout=plgpu.Layout.WGMMA)
                if kind == PARTIAL:
                    return jnp.where(col < rem, s, MASKED)
                plgpu.barrier_wait(bits_bars.at[slot])
                return mask_tree_scores(s, col, lambda w: plgpu.load(bits_smem.at[slot, w], (), layout=row_layout),
                                        row_dim=0)

            def zero_if_partial(j, slot):  # the partial block's value rows past the prefix, this consumer's half
                @pl.when(j == partial_step)
                def _():
                    zero_rows_from(values(slot), rem, BK)

            def add_pv(acc_ref, alpha, p, slot):  # acc = acc * alpha + p · v (this half), issued, not awaited
                acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                plgpu.wgmma(acc_ref, p, values(slot))

            def flash_loop(acc_ref):
                def own_block(kind, j):
                    slot = lax.rem(j, STAGES)
                    prev = lax.rem(j + 1, STAGES)  # block j - 1's slot
                    with jax.named_scope("k_wait"):
                        plgpu.barrier_wait(k_bars.at[slot])
                    with jax.named_scope("scores"):
                        s = scores(slot, kind)
                    with jax.named_scope("state_wait"):
                        plgpu.barrier_wait(ready_bars.at[other])
                    with jax.named_scope("softmax"):
                        m_prev, l_prev, alpha_prev = (other_state(i) for i in range(3))

                        @pl.when(j > 0)  # the other's block j - 1: this half of its p·v, beside this softmax
                        def _():
                            plgpu.barrier_wait(k_bars.at[prev])
                            zero_if_partial(j - 1, prev)
                            add_pv(acc_ref, alpha_prev, probs(prev), prev)

                        m_new = jnp.maximum(m_prev, s.max(axis=1))
                        alpha = jnp.exp2(m_prev - m_new)
                        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                        l_new = l_prev * alpha + p.sum(axis=1)
                        p16 = p.astype(jnp.bfloat16)
                    with jax.named_scope("handoff"):
                        probs(slot)[...] = p16  # block j's rope columns: only this consumer's q·kᵀ read them
                        stat_smem[c, 0] = m_new
                        stat_smem[c, 1] = l_new
                        stat_smem[c, 2] = alpha
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(ready_bars.at[c])
                    with jax.named_scope("pv"):
                        plgpu.wgmma_wait(0)

                        @pl.when(j > 0)
                        def _():
                            plgpu.barrier_arrive(consumed_bars.at[prev])

                        zero_if_partial(j, slot)
                        add_pv(acc_ref, alpha, p16, slot)
                        plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed_bars.at[slot])

                def own_blocks(kind, start, stop):  # the steps j in [start, stop) with j % 2 == c
                    first = start + lax.rem(start + c, 2)

                    @pl.loop(0, jnp.maximum(0, (stop - first + 1) // 2))
                    def _(i):
                        own_block(kind, first + 2 * i)

                own_blocks(WHOLE, 0, n_whole)
                own_blocks(PARTIAL, n_whole, n_cache)  # 0 or 1 block
                own_blocks(TREE, n_cache, n_all)

                @pl.when((n_all > 0) & (lax.rem(n_all + 1, 2) == other))  # the other's last block: this half
                def _():
                    last = n_all - 1
                    slot = lax.rem(last, STAGES)
                    with jax.named_scope("drain"):
                        plgpu.barrier_wait(ready_bars.at[other])
                        alpha = other_state(2)
                        plgpu.barrier_wait(k_bars.at[slot])
                        zero_if_partial(last, slot)
                        add_pv(acc_ref, alpha, probs(slot), slot)
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(consumed_bars.at[slot])
                return acc_ref[...]

            acc = pl.run_scoped(flash_loop, plgpu.ACC((ROWS, LH), jnp.float32))
            with jax.named_scope("epilogue"):
                # both consumers are done with the query tile and the hand-overs: the last block's owner (or
                # consumer 1's initial state, with no block) holds the final m and l
                plgpu.barrier_arrive(done_bar)
                plgpu.barrier_wait(done_bar)
                owner = lax.rem(n_all + 1, 2)
                m = plgpu.load(stat_smem.at[owner, 0], (), layout=row_layout)
                l = plgpu.load(stat_smem.at[owner, 1], (), layout=row_layout)
                l = jnp.where(m < 0.5 * MASKED, 0.0, l)  # a row that saw only masked keys in this split is empty
                empty = l == 0.0
                inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
                o_smem[c] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
                if c == 0:
                    lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * _LN2)
                plgpu.commit_smem()
                if V < ROWS:  # one tile, of which only the first V rows are real
                    plgpu.copy_smem_to_gmem(o_smem.at[c, pl.ds(0, V)], o_ref.at[sp, b, :, pl.ds(c * LH, LH)])
                    if c == 0:
                        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, V)], lse_ref.at[sp, b])
                else:
                    plgpu.copy_smem_to_gmem(o_smem.at[c], o_ref.at[sp, b, pl.ds(tile * ROWS, ROWS), pl.ds(c * LH, LH)])
                    if c == 0:
                        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[sp, b, pl.ds(tile * ROWS, ROWS)])
                plgpu.wait_smem_to_gmem(0)

        for c in range(2):
            pl.when(wg == c)(lambda c=c: consumer(c))

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((NS, B, V, L), jnp.bfloat16), jax.ShapeDtypeStruct((NS, B, V), jnp.float32)),
        scratch_types=(
            plgpu.RefUnion(plgpu.SMEM((ROWS, C), jnp.bfloat16, transforms=swizzled),
                           plgpu.SMEM((2, ROWS, LH), jnp.bfloat16, transforms=swizzled)),
            plgpu.SMEM((STAGES, BK, C), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((STAGES, WB, ROWS), jnp.int32),
            plgpu.SMEM((2, 3, ROWS), jnp.float32),  # per consumer, its latest block's m, l, alpha
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=STAGES),
            plgpu.Barrier(num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_barriers=2),
        ),
        grid=(B, n_tiles, NS), grid_names=("stream", "tile", "split"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **profile),
    )
    return kernel(prefix_len.astype(jnp.int32), q_rows, cache_kv, tree_kv, tree_bits)  # lse in natural log

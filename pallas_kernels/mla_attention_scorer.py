"""MLA tree-verify attention on Hopper with a warpgroup that only scores: whole 64-row tiles.

``mla_attention_mgpu.split_attention`` with its consumers specialised further. There, consumer 0 computes
s = q·kᵀ, the online softmax and then its own half of p·v, while consumer 1 waits for p; a key block takes
consumer 0 q·kᵀ + softmax + hand-over + p·v in sequence (~2.0 µs at 64 rows on the H200 against ~1.5 µs of
tensor work; ``experiments/RESULTS.md``, session 26). Here four warpgroups share a program:

* the producer (``stream_key_blocks``, as there) copies the query tile once, then the key blocks through a
  ring of ``stages`` slots, and a tree block's mask words;
* the scorer computes s = q·kᵀ over the full C columns (both operands in shared memory), masks the partial
  and tree blocks, runs the online softmax in f32 registers (exp2) and writes the bf16 probabilities and the
  rescale factor to shared memory for the block; it holds no accumulator;
* two value warpgroups each rescale their [64, L/2] f32 accumulator and add p·v over their half of the
  value columns (zeroing their half of a partial block's rows past the prefix first, as there).

So the scorer's q·kᵀ of block j + 1 runs while the value warpgroups multiply block j's p by its values:
a block costs the scorer q·kᵀ + softmax + the hand-over, the p·v off its path. The probabilities are one
[64, BK] tile (the scorer waits until both value warpgroups have read block j's before it writes block
j + 1's). Registers: 512 threads leave 128 a thread at launch; ``registers`` = (producer, scorer, values)
redistributes them (producer + scorer + 2 values <= 512). Shared memory, inputs, outputs and twin
(``split_attention_ref``) are ``split_attention``'s for whole tiles (no tail rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mla_attention_mgpu import (MASKED, PARTIAL, ROWS, SMEM_LIMIT, TREE, WHOLE, WORD, _block_steps,
                                               _check_valid_rows, check_in_place_inputs, mask_tree_scores,
                                               profiler_params, smem_bytes, stream_key_blocks, zero_rows_from)
from pallas_kernels.tree_attention import _LN2, _LOG2E

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["split_attention_scorer", "DEFAULT_REGISTERS"]

SCORER, VALUES_0, VALUES_1, PRODUCER = range(4)  # the warpgroups of a program
LAUNCH_REGISTERS = 128  # per thread at launch: 65536 over 4 x 128 threads
DEFAULT_REGISTERS = (24, 120, 184)  # producer, scorer, each value warpgroup (its accumulator alone is 128)
VALUE_CHUNK = 128  # value columns per wgmma of p.v (values_warpgroup)


def _check_registers(registers) -> tuple[int, int, int]:
    regs = tuple(int(r) for r in registers)
    if len(regs) != 3 or any(r % 8 or not 24 <= r <= 256 for r in regs) or regs[0] + regs[1] + 2 * regs[2] > 512:
        raise ValueError(f"registers={registers} must be (producer, scorer, values), multiples of 8 in [24, 256] "
                         f"with producer + scorer + 2 * values <= 512")
    return regs


def _set_registers(n: int):
    if n != LAUNCH_REGISTERS:
        plgpu.set_max_registers(n, action="increase" if n > LAUNCH_REGISTERS else "decrease")


def split_attention_scorer(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, *, scale, kv_lora_rank, block_k=64,
                           stages=2, num_splits=1, share_scores=True, valid_rows=None,
                           registers=DEFAULT_REGISTERS, first_block_alone=False, profile_dir=None,
                           profile_regions=0):
    """``split_attention`` (same inputs, outputs and split ranges) on whole 64-row tiles, with a scoring warpgroup
    (module docstring).

    q_rows [B, R, C] bf16 (R % 64 == 0), cache_kv [B, S, C] bf16, prefix_len [B] int32 in [0, S], tree_kv
    [B, TP, C] bf16, tree_bits int32 [B, TP/32, R]. Returns (o [NS, B, V, L] bf16, lse [NS, B, V] f32, natural
    log), each split normalised on its own; a row that sees no key in a split has o = 0 and lse = -inf there.
    ``share_scores`` must be True (the scorer is the only warpgroup that scores). ``profile_dir`` as there:
    regions ``q_wait``, per block ``k_wait``, the scorer's ``scores``, ``softmax``, ``handoff``, the value
    warpgroups' ``p_wait`` and ``pv``, then ``epilogue``; the producer's ``slot_wait``.
    """
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available in this JAX")
    BK, NS = int(block_k), int(num_splits)
    L = kv_lora_rank
    LH = L // 2
    WB = BK // WORD
    regs = _check_registers(registers)
    if BK not in (64, 128, 256):
        raise ValueError(f"block_k={BK} must be 64, 128 or 256")
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    if NS < 1:
        raise ValueError(f"num_splits={NS} must be >= 1")
    if LH % VALUE_CHUNK:
        raise ValueError(f"kv_lora_rank={L} must be a multiple of {2 * VALUE_CHUNK}")
    if not share_scores:
        raise ValueError("split_attention_scorer: share_scores=False has no meaning here (one warpgroup scores)")
    if q_rows.shape[1] % ROWS:
        raise ValueError(f"split_attention_scorer: q_rows must hold whole {ROWS}-row tiles, got {q_rows.shape[1]}")
    smem = smem_bytes(q_rows.shape[-1], BK, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"block_k={BK}, stages={stages} need {smem} bytes of shared memory (limit {SMEM_LIMIT})")
    profile = profiler_params(profile_dir, profile_regions, smem, 4, "split_attention_scorer")
    B, Np, C, S, TP = check_in_place_inputs(q_rows, cache_kv, tree_kv, tree_bits, BK, "split_attention_scorer")
    scale_log2 = float(scale) * _LOG2E
    n_tiles, TB = Np // ROWS, TP // BK
    V = _check_valid_rows(valid_rows, Np)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(plen_ref, q_ref, kv_ref, tkv_ref, bits_ref, o_ref, lse_ref, qo_smem, k_smem, bits_smem, p_smem,
             stat_smem, q_bar, k_bars, bits_bars, consumed_bars, done_bar, p_ready, p_free):
        lse_smem = stat_smem.at[2]  # stat rows: 0 the block's alpha, 1 the final l, 2 the LSE
        q_smem, o_smem = qo_smem  # the output tile reuses the query tile's shared memory
        b = lax.axis_index("stream")
        tile = lax.axis_index("tile")
        sp = lax.axis_index("split")
        wg = lax.axis_index("wg")
        rem, nbp, lo, n_whole, n_cache, n_all = _block_steps(plen_ref[b], TB, sp, NS, BK)

        def block_loops(step, carry):  # whole cache blocks, the partial one (0 or 1), the tree's
            carry = lax.fori_loop(0, n_whole, functools.partial(step, WHOLE), carry)
            carry = lax.fori_loop(n_whole, n_cache, functools.partial(step, PARTIAL), carry)
            return lax.fori_loop(n_cache, n_all, functools.partial(step, TREE), carry)

        @pl.when(wg == PRODUCER)
        def _producer():
            _set_registers(regs[0])
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(tile * ROWS, ROWS)], q_smem, q_bar)

            def copy_mask_words(t, slot):
                plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t * WB, WB), pl.ds(tile * ROWS, ROWS)],
                                        bits_smem.at[slot], bits_bars.at[slot])

            stream_key_blocks(kv_ref, tkv_ref, b, lo, nbp, n_cache, n_all, k_smem, k_bars, consumed_bars, stages, BK,
                              on_tree_block=copy_mask_words, first_block_alone=first_block_alone)

        @pl.when(wg == SCORER)
        def _scorer():
            _set_registers(regs[1])
            with jax.named_scope("q_wait"):
                plgpu.barrier_wait(q_bar)

            def step(kind, j, carry):
                m, l = carry
                slot = lax.rem(j, stages)
                with jax.named_scope("k_wait"):
                    plgpu.barrier_wait(k_bars.at[slot])
                with jax.named_scope("scores"):
                    def qk(s_ref):
                        plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                        return s_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((ROWS, BK), jnp.float32)) * scale_log2
                    if kind != WHOLE:
                        col = plgpu.broadcasted_iota(jnp.int32, (ROWS, BK), 1, layout=plgpu.Layout.WGMMA)
                    if kind == PARTIAL:
                        s = jnp.where(col < rem, s, MASKED)
                    elif kind == TREE:
                        plgpu.barrier_wait(bits_bars.at[slot])
                        s = mask_tree_scores(s, col, lambda w: plgpu.load(bits_smem.at[slot, w], (),
                                                                          layout=row_layout), row_dim=0)
                with jax.named_scope("softmax"):
                    m_new = jnp.maximum(m, s.max(axis=1))
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l = l * alpha + p.sum(axis=1)
                    p16 = p.astype(jnp.bfloat16)
                with jax.named_scope("handoff"):
                    @pl.when(j > 0)
                    def _():
                        plgpu.barrier_wait(p_free)

                    p_smem[...] = p16
                    stat_smem[0] = alpha
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready)
                return m_new, l

            m, l = block_loops(step, (plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
                                      plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)))
            with jax.named_scope("epilogue"):
                l = jnp.where(m < 0.5 * MASKED, 0.0, l)  # a row that saw only masked keys in this split is empty
                empty = l == 0.0
                stat_smem[1] = l
                lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * _LN2)
                plgpu.commit_smem()
                plgpu.barrier_arrive(done_bar)  # the query tile is free and l is written
                if V < ROWS:
                    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, V)], lse_ref.at[sp, b])
                else:
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[sp, b, pl.ds(tile * ROWS, ROWS)])
                plgpu.wait_smem_to_gmem(0)

        def values_warpgroup(half):
            _set_registers(regs[2])
            # ptxas compiles every instruction within the launch's 128 registers a thread: one wgmma into a
            # [64, 256] f32 accumulator (128 of them) does not fit, so each half is VALUE_CHUNK-column pieces
            chunks = range(LH // VALUE_CHUNK)
            values = lambda slot, c: k_smem.at[slot, :, pl.ds(half * LH + c * VALUE_CHUNK, VALUE_CHUNK)]  # noqa: E731

            def accumulate(*acc_refs):
                def step(kind, j, carry):
                    slot = lax.rem(j, stages)
                    with jax.named_scope("k_wait"):
                        plgpu.barrier_wait(k_bars.at[slot])
                    # a partial block: this half's value rows past the prefix zeroed before p.v reads them (the
                    # scorer's q.k may read them meanwhile: rows < rem are rewritten unchanged, the others masked)
                    if kind == PARTIAL:
                        zero_rows_from(k_smem.at[slot, :, pl.ds(half * LH, LH)], rem, BK)
                    with jax.named_scope("p_wait"):
                        plgpu.barrier_wait(p_ready)
                    with jax.named_scope("pv"):
                        alpha = plgpu.load(stat_smem.at[0], (), layout=row_layout)
                        for c, acc_ref in zip(chunks, acc_refs):
                            acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                            plgpu.wgmma(acc_ref, p_smem, values(slot, c))
                        plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(p_free)
                    plgpu.barrier_arrive(consumed_bars.at[slot])
                    return carry

                block_loops(step, ())
                return tuple(acc_ref[...] for acc_ref in acc_refs)

            accs = pl.run_scoped(accumulate, *[plgpu.ACC((ROWS, VALUE_CHUNK), jnp.float32) for _ in chunks])
            with jax.named_scope("epilogue"):
                plgpu.barrier_wait(done_bar)
                l = plgpu.load(stat_smem.at[1], (), layout=row_layout)
                empty = l == 0.0
                inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
                for c, acc in zip(chunks, accs):
                    o_smem[half, :, pl.ds(c * VALUE_CHUNK, VALUE_CHUNK)] = (
                        acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
                plgpu.commit_smem()
                if V < ROWS:  # one tile, of which only the first V rows are real
                    plgpu.copy_smem_to_gmem(o_smem.at[half, pl.ds(0, V)], o_ref.at[sp, b, :, pl.ds(half * LH, LH)])
                else:
                    plgpu.copy_smem_to_gmem(o_smem.at[half],
                                            o_ref.at[sp, b, pl.ds(tile * ROWS, ROWS), pl.ds(half * LH, LH)])
                plgpu.wait_smem_to_gmem(0)

        for half, which in enumerate((VALUES_0, VALUES_1)):
            pl.when(wg == which)(functools.partial(values_warpgroup, half))

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((NS, B, V, L), jnp.bfloat16),
                  jax.ShapeDtypeStruct((NS, B, V), jnp.float32)),
        scratch_types=(
            plgpu.RefUnion(plgpu.SMEM((ROWS, C), jnp.bfloat16, transforms=swizzled),
                           plgpu.SMEM((2, ROWS, LH), jnp.bfloat16, transforms=swizzled)),
            plgpu.SMEM((stages, BK, C), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((stages, WB, ROWS), jnp.int32),
            plgpu.SMEM((ROWS, BK), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((3, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # consumed: both value warpgroups
            plgpu.Barrier(),                                     # done: the scorer
            plgpu.Barrier(),                                     # p_ready: the scorer
            plgpu.Barrier(num_arrivals=2),                       # p_free: both value warpgroups
        ),
        grid=(B, n_tiles, NS), grid_names=("stream", "tile", "split"),
        num_threads=4, thread_name="wg",
        # the row reductions (max, sum) of the WGMMA layout stay within a warp: no scratch for them
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0, **profile),
    )
    return kernel(prefix_len.astype(jnp.int32), q_rows, cache_kv, tree_kv, tree_bits)  # lse in natural log

"""MLA tree-verify attention on Hopper: one Pallas Mosaic GPU kernel over the prefix and the tree.

Same entry semantics as ``pallas_kernels.tree_attention`` (whose pure-JAX twin, ``tree_attention_ref``,
is this kernel's twin too; the kernel on prepared rows, :func:`split_attention`, has
:func:`split_attention_ref`; the inputs both kernels take, prepared in XLA, come from
``pallas_kernels.mla_kernel_inputs`` and are re-exported here)::

    tree_attention_mgpu(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                        interpret=False, return_lse=False, block_k=64, stages=None, num_splits=None,
                        share_scores=True, num_sms=132, kernel=None, combine=combine_splits, tail=True)

(``stages`` None: the kernel's own; ``kernel`` None: the narrow kernel for at most 32 real rows, else
:func:`split_attention`, merging two splits itself where it can: :func:`tree_attention_mgpu`.)

Dimension letters: B streams, T tree nodes, H heads, S cache slots, C latent+rope width (576),
L latent width = value width (512), N = T*H query rows, Np rows padded to whole 64-row tiles (or one
tile and a tail of 8),
BK keys per block, NB = prefix_len // BK whole prefix blocks, NBP = ceil(prefix_len / BK) cache blocks
read, TP tree keys padded to whole blocks (TB = TP / BK blocks), NS splits.

Design:

* **Rows.** Heads are folded into query rows (row = node*H + head), so one 64-row tile is 64 / H
  nodes, or one node and 64 of its heads.
* **Keys, in place.** Each stream's key sequence is NBP cache blocks read straight from the cache, the
  last one partial when BK does not divide prefix_len, then TB tree blocks of the tree latents padded to
  whole blocks (``tree_inputs``; the model hands them over padded, ``pad_tree_latents``). The partial
  block is masked to its prefix_len % BK keys, and the rows past the prefix are zeroed in shared memory
  before p·v reads them, so NaN garbage there cannot leak; where it reaches past the cache's S rows the
  TMA unit reads zeros. Tree blocks are masked per row by mask words (``tree_bits``: they depend on the
  tree mask alone, so in the model XLA computes them once per step; at T = 1 they are a constant).
* **Kernel.** Split s of NS takes a contiguous run of a stream's blocks (``mla_attention_plan``: the rows,
  splits and shares of a call, which the kernels, their twin and the op share). One program
  per (stream, 64-row tile, split), three warpgroups: a producer issues the TMA copies (the tile's
  queries once, then key blocks, and for tree blocks their mask words, through a ring of ``stages``
  slots). Consumer 0 computes s = q·kᵀ over the full C = 576 columns (wgmma, both operands in shared
  memory), masks the partial and tree blocks, runs the online softmax in f32 registers (exp2), and
  hands the bf16 probabilities and the rescale factor to consumer 1 through shared memory
  (``share_scores``, as FlashMLA does; without it both compute the same scores, 1.53x the tensor work).
  Each consumer multiplies p by its own half of the L = 512 value columns into a [64, 256] f32
  accumulator (the value is the first L columns of the key block already in shared memory; each zeroes
  its half of a partial block first); consumer 0 issues its product before it writes p out (``pv_first``).
  Each program writes its normalised output (bf16) and log-sum-exp (f32) into the query tile's memory, consumer 0
  its half as soon as its loop ends (``store_early``); ~226 KiB of shared memory, so one program per SM.
* **Merge.** With one split (the compute-bound trees) the kernel's output is the result. With two splits
  of whole tiles, split 1 merges split 0's output into its own inside the kernel (``peer_merge``: split 0
  signals a per-tile counter in global memory once it has stored). With more (long prefixes, few rows) one
  more launch (``split_combine.combine_splits``) combines the splits by their log-sum-exp. A decode step of
  fewer than 64 query rows (e.g. T = 1, H = 8) writes and merges the partials of its real rows only
  (``valid_rows_for``). Up to 32 such rows go by
  default to ``mla_attention_narrow``, the same program with the keys as wgmma's M and the rows as N
  (8x less tensor work at T = 1, H = 8), on the same inputs.
* **Tail rows.** T*H = 72 (a budget-8 tree under 8-way tensor parallelism: 9 nodes x 8 heads) would be
  two tiles, the second 56 rows of padding, so each program walks its blocks twice. Instead one program
  takes a 64-row tile and a tail of ``TAIL_ROWS`` = 8 rows (``tail_rows_of``): consumer 1, which waits for
  consumer 0's probabilities anyway, runs the tail as ``mla_attention_narrow`` does (sᵀ = k·qᵀ with the keys
  as wgmma's M, the softmax over keys across its warps, oᵀ += vᵀ·pᵀ into an [L, 8] accumulator) beside its
  half of the tile's p·v. To fit the tail's 9 KB of queries in shared memory, consumer 0 holds the
  queries' last 64 columns in registers (loaded once from global memory; q·kᵀ is two wgmmas) and hands p
  to consumer 1 in the key block's rope columns, once the tail's q·kᵀ has read them (``rope_free``). The
  tail's output and LSE reuse its queries' memory (1.1-1.3x faster than two tiles on the H200, session 25).

Registers: consumer 0 uses 229 of its 232 (ptxas, whole tiles), and code added elsewhere can tip its loop over
whole blocks into spilling, even code in the producer (session 45: merge work in consumer 0; session 49: a fetch in
the producer; each 7-11 % slower over 8K). Check a change with ``experiments/dump_isa.py attention``
(``spills_by_region``) before timing it.

Masked scores are set to a large finite negative (not -inf), so a row that has seen only masked keys
so far carries finite placeholder weights, which the first visible key rescales to exactly zero; a
row that sees no key in a split is reported empty (output 0, LSE -inf). The same kernel serves plain
decode (T = 1), DFlash chains and trees. It takes bf16 q, cache and tree latents; C % 64 == 0,
L % 128 == 0, L <= 512, S % 8 == 0 (a TMA tiling rule) and the shared memory of one program within
227 KB (``unsupported_reason``). prefix_len values outside [0, S] are refused where prefix_len is concrete and
clamped where it is traced (under jit nothing can raise), as in ``tree_attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mgpu_attention_parts import (MASKED, PARTIAL, SMEM_LIMIT, TREE, WHOLE, WORD, async_proxy_fence,
                                                 mask_tree_scores, plgpu, profiler_params, region_scope,
                                                 store_swapped_output, stream_key_blocks, swapped_scores,
                                                 swapped_softmax, zero_rows_from)
from pallas_kernels.mla_attention_plan import (ROWS, TAIL_ROWS, block_steps, check_valid_rows,  # some re-exported
                                              default_splits, peer_merge_fits, split_range, splits_for, tail_rows_of,
                                              valid_rows_for)
from pallas_kernels.mla_kernel_inputs import (check_in_place_inputs, pack_bits, pad_tree_latents, tree_inputs,
                                              unpack_bits)
from pallas_kernels.split_combine import combine_splits, merge_lse
from pallas_kernels.tree_attention import _LN2, _LOG2E, _NUM_SMS_H200, _check_shapes, fold_rows
from pallas_kernels.tuning import tuning_int

__all__ = ["tree_attention_mgpu", "split_attention", "split_attention_ref", "tree_inputs", "pad_tree_latents",
           "check_in_place_inputs", "default_splits", "dense_split_partials", "pack_bits", "unpack_bits",
           "splits_for", "unsupported_reason", "smem_bytes", "valid_rows_for", "tail_rows_of", "peer_merge_fits",
           "uses_peer_merge", "default_plan",
           "TAIL_ROWS"]

MERGE_COLUMNS = 64     # (peer_merge) output columns merged at a time


def smem_bytes(C: int, block_k: int, stages: int, share_scores: bool = True, tail: int = 0,
               peer_merge: bool = False) -> int:
    """Shared memory of one program: the query tile, ``stages`` key blocks and mask-word slots, three
    stat rows, barriers, and with ``share_scores`` the probability tile. With ``tail`` rows (module
    docstring, "Tail rows") the query tile leaves out its last 64 columns (consumer 0 holds them in
    registers) and the probabilities go to a key block's rope columns; the tail's query rows (whose memory
    its output and LSE reuse), its pᵀ tile and the reduction scratch of its softmax take their place. With
    ``peer_merge``, three barriers more. Each buffer counts whole 1024-byte units, as Mosaic GPU allocates them."""
    def unit(nbytes):
        return -(-nbytes // 1024) * 1024
    words = unit(stages * (block_k // WORD) * ROWS * 4)
    if tail:
        barriers = 8 * (2 + 3 * stages + 1 + 3)
        return (unit(2 * ROWS * (C - 64)) + stages * unit(2 * block_k * C) + words + unit(12 * ROWS)
                + unit(max(2 * tail * C, unit(2 * tail * (C - 64)) + 4 * tail)) + unit(2 * tail * 64)
                + tail_scratch_bytes(tail) + barriers)
    barriers = 8 * (1 + 3 * stages + 1 + (2 if share_scores else 0) + (3 if peer_merge else 0))
    shared = unit(2 * ROWS * block_k) if share_scores else 0
    return unit(2 * ROWS * C) + stages * unit(2 * block_k * C) + words + unit(12 * ROWS) + barriers + shared


def tail_scratch_bytes(tail: int) -> int:
    """The reduction scratch of the tail rows' softmax (a max and a sum over keys across consumer 1's four
    warps): 1024 bytes per 8 rows reduce them all in one round (``mla_attention_narrow``)."""
    return 1024 * (tail // 8)


def unsupported_reason(q_shape, cache_shape, kv_lora_rank, *dtypes) -> str | None:
    """Why the Mosaic GPU kernel cannot take these dims / dtypes (of q, the cache, the tree latents), or
    None when it can (at the default block_k = 64, stages = 2)."""
    C, L, S = q_shape[-1], kv_lora_rank, cache_shape[1]
    for dtype in dtypes:
        if jnp.dtype(dtype) != jnp.bfloat16:
            return f"dtype {jnp.dtype(dtype)} (the kernel takes bf16)"
    if C % 64 or L % 128 or L > 512:
        return f"C={C}, L={L} (the kernel needs C % 64 == 0, L % 128 == 0 and L <= 512)"
    if S == 0 or S % 8:
        return f"cache capacity S={S} (the kernel's TMA copies need S % 8 == 0 and S > 0)"
    if smem_bytes(C, 64, 2) > SMEM_LIMIT:
        return f"C={C} (one program's shared memory, {smem_bytes(C, 64, 2)} bytes, exceeds {SMEM_LIMIT})"
    return None


def check_peer_merge(peer_merge, num_splits: int, rows: int, valid_rows, share_scores) -> bool:
    """``peer_merge`` as a bool, or a ValueError where :func:`split_attention` cannot merge its splits itself."""
    if peer_merge and not peer_merge_fits(num_splits, bool(tail_rows_of(rows)), share_scores,
                                          check_valid_rows(valid_rows, rows) == rows):
        raise ValueError(f"peer_merge merges two splits of whole 64-row tiles with shared scores; got num_splits="
                         f"{num_splits}, {rows} rows, valid_rows={valid_rows}, share_scores={share_scores}")
    return bool(peer_merge)


def check_split_tuning(block_k, stages, num_splits) -> tuple[int, int]:
    """(BK, NS): :func:`split_attention`'s block_k, stages and num_splits, checked as the kernel needs them (its
    twin, :func:`split_attention_ref`, checks them alike); a ValueError naming the one that fails."""
    block_k, stages, num_splits = (tuning_int(name, value) for name, value in
                                   (("block_k", block_k), ("stages", stages), ("num_splits", num_splits)))
    # p.v's K (the keys) spans whole 128-byte swizzle groups; 32-key blocks need 64-byte swizzles on every wgmma
    # operand, and were 10-43 % slower (experiments/RESULTS.md, session 50)
    if block_k not in (64, 128, 256):
        raise ValueError(f"block_k={block_k} must be 64, 128 or 256")
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    return block_k, num_splits


def check_tuning(*, block_k=64, stages=None, num_splits=None, num_sms=_NUM_SMS_H200, **rest) -> None:
    """:func:`tree_attention_mgpu`'s tuning keywords, checked before any lowering (``mla_attention`` calls this on
    every platform, as it checks Triton's): block_k, stages and num_splits as :func:`check_split_tuning` needs
    them (None: the kernel's own), num_sms a positive int; a keyword it does not take is a TypeError."""
    unknown = sorted(set(rest) - {"share_scores", "kernel", "combine", "tail"})
    if unknown:
        raise TypeError(f"tree_attention_mgpu takes no tuning keyword {', '.join(map(repr, unknown))}")
    check_split_tuning(block_k, 2 if stages is None else stages, 1 if num_splits is None else num_splits)
    tuning_int("num_sms", num_sms, positive=True)


def split_attention(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, *, scale, kv_lora_rank, block_k=64,
                    stages=2, num_splits=1, share_scores=True, valid_rows=None, profile_dir=None, profile_regions=0,
                    profile_names=None, first_block_alone=None, pv_first=True, store_early=True, peer_merge=False):
    """The Mosaic GPU kernel: attention of 64-row query tiles over each stream's prefix, read in place from
    the cache, and its tree, in NS splits.

    q_rows [B, R, C] bf16: whole 64-row tiles (R % 64 == 0), or one tile and a tail of 8 rows (R = 72;
    module docstring, "Tail rows"); cache_kv [B, S, C] bf16, prefix_len [B] int32, which must lie
    in [0, S] (``tree_attention_mgpu`` clamps it; a larger value would read past the cache), tree_kv
    [B, TP, C] bf16 and tree_bits int32 [B, TP/32, R] (``tree_inputs``; TP % BK == 0). Each stream's keys
    are NBP = ceil(prefix_len / BK) cache blocks, the last one partial when BK does not divide prefix_len
    (masked to its prefix_len % BK keys, its value rows past the prefix zeroed in shared memory: NaN there
    cannot leak), then TP / BK tree blocks masked per row by the bits. Split s takes the blocks
    ``split_range(NBP, TP / BK, s, NS)`` gives it. Returns (o [NS, B, V, L] bf16, lse [NS, B, V] f32,
    natural log), each split normalised on its own; a row that sees no key in a split has o = 0 and lse =
    -inf there. V = ``valid_rows``: R by default, or with one 64-row tile the first V rows (a multiple of
    8), so that a decode step of few heads writes and merges only its real rows' partials.

    ``profile_dir`` (a diagnostic): Mosaic GPU's on-device profiler records up to ``profile_regions`` named
    regions per warpgroup (``q_wait``; per key block ``k_wait``, then consumer 0's ``scores``, ``softmax``, ``handoff``
    (p and alpha to consumer 1) and ``pv``, consumer 1's ``tail_scores`` and ``tail_softmax`` (with a tail),
    ``p_wait`` and ``pv``; then ``epilogue``, its ``store_smem`` and ``store_gmem`` after the wait for the other
    consumer; with ``peer_merge`` split 1's ``peer_wait`` (for split 0's counter), ``peer_lse`` (its LSE's load),
    ``peer_copy`` (its output's copy) and ``merge``; the producer's ``slot_wait``) and writes a Chrome trace of each
    call into that folder (``experiments/profile_timeline.py`` reads it). Without it the kernel is the same.
    ``profile_names``: record only these regions (by default all), so that a program's many key blocks fit
    the 944 bytes its shared memory leaves at T*H = 64 (19 regions a warpgroup).

    Options (each default measured on the H200, ``experiments/RESULTS.md``): ``pv_first``, consumer 0 issues its
    half of p·v before it hands p to consumer 1 (session 40: 2-7 % faster where compute-bound). ``store_early``
    (with ``share_scores``), consumer 0 writes its half of the output as soon as its loop ends and consumer 1
    waits only for its final l, as only consumer 0 reads the query tile the output reuses (session 41: up to 3 %).
    ``first_block_alone`` (``stream_key_blocks``), the second key block's copy waits for the first; by default
    with a tail only (session 28).

    ``peer_merge`` (two splits of whole tiles, shared scores; ``tree_attention_mgpu``'s choice there): no merge
    launch follows. Split 0 takes the last (total - 1) // 2 blocks, at least one fewer than split 1
    (``split_range``: its store then lands before split 1's loop ends; 5 % faster than equal shares at T = 128,
    H = 8, B = 4 over 1K, session 47), stores its partial into the outputs and, once its copies are complete,
    each of its consumers adds 1 to the tile's counter in global memory
    (``pl.get_global``). Split 1's consumer 1 waits until the counter reaches 2 and takes 2 back (0 again for the
    next call), copies split 0's output into the query tile's memory and computes the weights from the LSEs
    (with that work in consumer 0 its block loop spilled, session 45). Each consumer merges its half with its
    accumulator (f32, 64 columns at a time) and stores it over split 0's: the outputs are the merged o [1, B, V,
    L] and lse [1, B, V]. Split 0 never waits, and a tile's two splits launch side by side, split 0 first.
    """
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available in this JAX")
    BK, NS = check_split_tuning(block_k, stages, num_splits)
    L = kv_lora_rank
    LH = L // 2
    WB = BK // WORD  # mask words per block
    R, C = q_rows.shape[1], q_rows.shape[-1]
    tail = tail_rows_of(R)
    if R % ROWS and not tail:
        raise ValueError(f"q_rows must hold whole {ROWS}-row tiles, or one tile and {TAIL_ROWS} rows, got {R} rows")
    if tail and (BK != 64 or not share_scores or L + 64 > C):
        raise ValueError(f"{R} query rows (one tile and a tail) need block_k=64, share_scores and L + 64 <= C; got "
                         f"block_k={BK}, share_scores={share_scores}, L={L}, C={C}")
    smem = smem_bytes(C, BK, stages, share_scores, tail, peer_merge)
    if smem > SMEM_LIMIT:
        raise ValueError(f"block_k={BK}, stages={stages} need {smem} bytes of shared memory (limit {SMEM_LIMIT})")
    profile = profiler_params(profile_dir, profile_regions, smem, 3, "split_attention", profile_names)
    region = region_scope(profile_names)
    B, Np, C, S, TP = check_in_place_inputs(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, BK, "split_attention")
    scale_log2 = float(scale) * _LOG2E
    n_tiles, TB = Np // ROWS, TP // BK
    first_block_alone = bool(tail) if first_block_alone is None else bool(first_block_alone)
    V = check_valid_rows(valid_rows, Np)
    store_early = bool(store_early) and share_scores  # without shared scores both consumers read the query tile
    peer_merge = check_peer_merge(peer_merge, NS, R, valid_rows, share_scores)
    CQ = C - 64 if tail else C  # query columns in shared memory (with a tail, consumer 0 holds the last 64)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # a vector along the tail's sᵀ and oᵀ columns (its rows)

    def attention_body(plen_ref, q_ref, kv_ref, tkv_ref, bits_ref, o_ref, lse_ref, qo_smem, k_smem, bits_smem,
                       p_smem, stat_smem, tail_smem, pt_smem, q_bar, k_bars, bits_bars, consumed_bars, done_bar,
                       p_ready, p_free, qt_bar, rope_free, merge_bars, weights_bar):
        # stat rows: 0 the step's alpha, 1 the final l (shared scores), 2 the LSE; with peer_merge in split 1, 1 and 3
        # the merge's weights
        lse_smem = stat_smem.at[2]
        q_smem, o_smem = qo_smem  # the output tile reuses the query tile's shared memory
        qt_smem, (ot_smem, lset_smem) = tail_smem if tail else (None, (None, None))
        b = lax.axis_index("stream")
        tile = lax.axis_index("tile")
        sp = lax.axis_index("split")
        wg = lax.axis_index("wg")
        osp = 0 if peer_merge else sp  # this program's split in the outputs
        # split 0's two consumers signal the tile's counter once their halves are stored; split 1 waits for both
        counters = pl.get_global(plgpu.SemaphoreType.REGULAR((B * n_tiles,))) if peer_merge else None
        tile_counter = lambda: counters.at[b * n_tiles + tile]  # noqa: E731
        rem, nbp, lo, n_whole, n_cache, n_all = block_steps(plen_ref[b], TB, sp, NS, BK, peer_merge)
        # with a tail, consumer 0 hands p to consumer 1 in the key block's rope columns, which both have read
        probs = (lambda slot: k_smem.at[slot, :, pl.ds(C - 64, 64)]) if tail else (lambda slot: p_smem)  # noqa: E731

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(tile * ROWS, ROWS), pl.ds(0, CQ)], q_smem, q_bar)
            if tail:
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(ROWS, tail)], qt_smem, qt_bar)

            def copy_mask_words(t, slot):
                plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t * WB, WB), pl.ds(tile * ROWS, ROWS)],
                                        bits_smem.at[slot], bits_bars.at[slot])

            stream_key_blocks(kv_ref, tkv_ref, b, lo, nbp, n_cache, n_all, k_smem, k_bars, consumed_bars, stages, BK,
                              on_tree_block=copy_mask_words, first_block_alone=first_block_alone, region=region)

        def consumer(half):
            scores_here = half == 0 or not share_scores  # this warpgroup computes q.k and the softmax
            plgpu.set_max_registers(232, action="increase")
            # with a tail, the queries' last 64 columns in registers, from global memory: loaded before anything
            # waits, so that the load does not queue behind the key blocks' copies
            q_rope = None
            if tail and scores_here:
                q_rope = plgpu.load(q_ref, (b, pl.ds(0, ROWS), pl.ds(CQ, 64)), layout=plgpu.Layout.WGMMA,
                                    optimized=False)
            with region("q_wait"):
                plgpu.barrier_wait(q_bar)
                if tail and not scores_here:
                    plgpu.barrier_wait(qt_bar)
            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
            values = lambda slot: k_smem.at[slot, :, pl.ds(half * LH, LH)]  # noqa: E731

            def scores(slot, kind):
                def qk(s_ref):
                    keys = lambda c0, n: plgpu.transpose_ref(k_smem.at[slot, :, pl.ds(c0, n)], (1, 0))  # noqa: E731
                    plgpu.wgmma(s_ref, q_smem, keys(0, CQ))
                    if tail:
                        plgpu.wgmma(s_ref, q_rope, keys(CQ, 64))
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

            def online_softmax(s, m, l):
                """Online-softmax update for scores s (log2 units) -> (p16, alpha, m, l)."""
                with region("softmax"):
                    m_new = jnp.maximum(m, s.max(axis=1))
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l = l * alpha + p.sum(axis=1)
                    return p.astype(jnp.bfloat16), alpha, m_new, l

            def hand_over(j, slot, p16, alpha):
                """With share_scores, p and alpha to consumer 1 through shared memory."""
                if share_scores:
                    with region("handoff"):
                        @pl.when(j > 0)
                        def _():
                            plgpu.barrier_wait(p_free)

                        if tail:  # the tail's q.k has read the rope columns that p overwrites
                            plgpu.barrier_wait(rope_free)
                        probs(slot)[...] = p16
                        stat_smem[0] = alpha
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(p_ready)

            def accumulate(acc_ref, slot, alpha, p16):
                acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                plgpu.wgmma(acc_ref, p16, values(slot))

            def tail_scores(j, slot, kind):  # the tail rows' sᵀ [BK, tail] (their mask words from global memory)
                def row_words():
                    t = lo + j - nbp
                    return [plgpu.load(bits_ref, (b, t * WB + w, pl.ds(ROWS, tail)), layout=col_layout,
                                       optimized=False) for w in range(WB)]

                return swapped_scores(k_smem.at[slot], qt_smem, kind, rem, scale_log2, row_words,
                                      after_qk=lambda: plgpu.barrier_arrive(rope_free))

            def flash_loop(acc_ref, tail_acc_ref=None):  # the [64, L/2] (and tail [L, tail]) accumulators start at 0
                def step(kind, j, carry):
                    m, l = carry[:2]
                    slot = lax.rem(j, stages)
                    with region("k_wait"):
                        plgpu.barrier_wait(k_bars.at[slot])
                    # a partial block: this warpgroup's value columns past the prefix zeroed before its p.v reads
                    # them (consumer 0's q.k may read them meanwhile: rows < rem are rewritten unchanged, and
                    # the scores of the others are masked)
                    if kind == PARTIAL:
                        zero_rows_from(k_smem.at[slot, :, pl.ds(half * LH, LH)], rem, BK)
                    if tail and not scores_here:  # the tail rows' softmax, as in mla_attention_narrow
                        mt, lt = carry[2:]
                        with region("tail_scores"):
                            st = tail_scores(j, slot, kind)
                        with region("tail_softmax"):
                            mt, alpha_t, lt = swapped_softmax(st, mt, lt, pt_smem)
                        carry = (m, l, mt, lt)
                    issued = pv_first and scores_here  # this warpgroup's p·v issued before the hand-over
                    if scores_here:
                        with region("scores"):
                            s = scores(slot, kind)
                        p16, alpha, m, l = online_softmax(s, m, l)
                        if issued:
                            accumulate(acc_ref, slot, alpha, p16)
                        hand_over(j, slot, p16, alpha)
                    else:
                        with region("p_wait"):
                            plgpu.barrier_wait(p_ready)
                        alpha = plgpu.load(stat_smem.at[0], (), layout=row_layout)
                        p16 = probs(slot)
                    with region("pv"):
                        if not issued:
                            accumulate(acc_ref, slot, alpha, p16)
                        if tail and not scores_here:  # oᵀ [L, tail] += vᵀ [L, BK] · pᵀ [BK, tail]
                            tail_acc_ref[...] = tail_acc_ref[...] * lax.broadcast_in_dim(alpha_t, tail_acc_ref.shape,
                                                                                           [1])
                            plgpu.wgmma(tail_acc_ref, plgpu.transpose_ref(k_smem.at[slot, :, pl.ds(0, L)], (1, 0)),
                                        plgpu.transpose_ref(pt_smem, (1, 0)))
                        plgpu.wgmma_wait(0)
                    if not scores_here:
                        plgpu.barrier_arrive(p_free)
                    plgpu.barrier_arrive(consumed_bars.at[slot])
                    return (m, l) + carry[2:]

                carry = (m, l)
                if tail and not scores_here:
                    carry += (plgpu.layout_cast(jnp.full((tail,), -jnp.inf, jnp.float32), col_layout),
                              plgpu.layout_cast(jnp.full((BK, tail), 0.0, jnp.float32), plgpu.Layout.WGMMA))
                # whole cache blocks, the partial one (0 or 1), the tree's (the other warpgroup masks nothing
                # of its 64 rows)
                carry = lax.fori_loop(0, n_whole, functools.partial(step, WHOLE), carry)
                carry = lax.fori_loop(n_whole, n_cache, functools.partial(step, PARTIAL), carry)
                carry = lax.fori_loop(n_cache, n_all, functools.partial(step, TREE if scores_here or tail else WHOLE),
                                      carry)
                return (acc_ref[...],) + carry + ((tail_acc_ref[...],) if tail_acc_ref is not None else ())

            if tail and not scores_here:
                acc, m, l, mt, lt, tail_acc = pl.run_scoped(flash_loop, plgpu.ACC((ROWS, LH), jnp.float32),
                                                            plgpu.ACC((L, tail), jnp.float32))
            else:
                acc, m, l = pl.run_scoped(flash_loop, plgpu.ACC((ROWS, LH), jnp.float32))
            if scores_here:  # a row that saw only masked keys in this split is empty here
                l = jnp.where(m < 0.5 * MASKED, 0.0, l)

            def wait_for_stats():
                # the query tile's memory is reused for the output once no warpgroup reads it (and the shared
                # stats are written): with store_early consumer 0, its only reader, goes on at once
                if not store_early:
                    plgpu.barrier_arrive(done_bar)
                    plgpu.barrier_wait(done_bar)
                elif half == 0:
                    plgpu.barrier_arrive(done_bar)
                else:
                    plgpu.barrier_wait(done_bar)

            def copy_out():  # this warpgroup's half of o_smem (and consumer 0's LSE) to the outputs
                with region("store_gmem"):
                    if V < ROWS:  # one tile, of which only the first V rows are real
                        plgpu.copy_smem_to_gmem(o_smem.at[half, pl.ds(0, V)], o_ref.at[osp, b, :, pl.ds(half * LH, LH)])
                        if half == 0:
                            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, V)], lse_ref.at[osp, b])
                    else:
                        plgpu.copy_smem_to_gmem(o_smem.at[half],
                                                o_ref.at[osp, b, pl.ds(tile * ROWS, ROWS), pl.ds(half * LH, LH)])
                        if half == 0:
                            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[osp, b, pl.ds(tile * ROWS, ROWS)])
                    if tail and not scores_here:  # the tail's output and LSE reuse its query rows' memory
                        store_swapped_output(tail_acc, mt, lt, ot_smem, lset_smem, region)
                        plgpu.copy_smem_to_gmem(ot_smem, o_ref.at[osp, b, pl.ds(ROWS, tail)])
                        plgpu.copy_smem_to_gmem(lset_smem, lse_ref.at[osp, b, pl.ds(ROWS, tail)])
                    plgpu.wait_smem_to_gmem(0)

            def store_split():  # this split's normalised output and LSE
                if share_scores and half == 0:
                    stat_smem[1] = l
                with region("epilogue"):
                    wait_for_stats()
                    with region("store_smem"):  # after the barrier: its wait
                        final_l = l if scores_here else plgpu.load(stat_smem.at[1], (), layout=row_layout)
                        empty = final_l == 0.0
                        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, final_l))
                        o_smem[half] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
                        if half == 0:
                            lse_smem[...] = jnp.where(empty, -jnp.inf,
                                                      (m + jnp.log2(jnp.where(empty, 1.0, final_l))) * _LN2)
                        plgpu.commit_smem()
                    copy_out()

            def merge_with_split_0():  # (peer_merge, split 1) the tile's output, merged with split 0's
                # consumer 1 does the waiting and the LSE arithmetic: consumer 0's loop has no registers to spare
                rows = pl.ds(tile * ROWS, ROWS)
                with region("epilogue"):
                    if half == 0:  # its l and LSE (log2 units) for consumer 1
                        stat_smem[1] = l
                        lse_smem[...] = m + jnp.log2(jnp.where(l == 0.0, 1.0, l))
                        plgpu.commit_smem()
                    wait_for_stats()
                    if half == 1:  # once split 0 has stored both halves: its LSE, and its output into o_smem
                        with region("peer_wait"):  # (and back to 0 for the next call)
                            plgpu.semaphore_wait(tile_counter(), 2, memory_scope="gpu")
                        async_proxy_fence()
                        for h in range(2):
                            plgpu.copy_gmem_to_smem(o_ref.at[0, b, rows, pl.ds(h * LH, LH)], o_smem.at[h],
                                                    merge_bars.at[h])
                        with region("peer_lse"):
                            theirs = plgpu.load(lse_ref, (0, b, rows), layout=row_layout, optimized=False) * _LOG2E
                        l0 = plgpu.load(stat_smem.at[1], (), layout=row_layout)
                        mine_empty = l0 == 0.0
                        mine = jnp.where(mine_empty, -jnp.inf, plgpu.load(lse_smem, (), layout=row_layout))
                        top = jnp.maximum(mine, theirs)
                        top = jnp.where(top == -jnp.inf, 0.0, top)  # both empty
                        e_mine, e_theirs = jnp.exp2(mine - top), jnp.exp2(theirs - top)
                        total = e_mine + e_theirs
                        gone = total == 0.0
                        total_safe = jnp.where(gone, 1.0, total)
                        # weights of this split's unnormalised accumulator and of split 0's normalised output
                        stat_smem[1] = jnp.where(mine_empty | gone, 0.0,
                                                 e_mine / (jnp.where(mine_empty, 1.0, l0) * total_safe))
                        stat_smem[3] = jnp.where(gone, 0.0, e_theirs / total_safe)
                        lse_smem[...] = jnp.where(gone, -jnp.inf, (top + jnp.log2(total_safe)) * _LN2)
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(weights_bar)
                    else:
                        plgpu.barrier_wait(weights_bar)
                    with region("store_smem"):
                        w_mine = plgpu.load(stat_smem.at[1], (), layout=row_layout)
                        w_theirs = plgpu.load(stat_smem.at[3], (), layout=row_layout)
                        with region("peer_copy"):
                            plgpu.barrier_wait(merge_bars.at[half])
                        with region("merge"):
                            for c in range(0, LH, MERGE_COLUMNS):  # in column chunks: few registers beside acc
                                cols = pl.ds(c, MERGE_COLUMNS)
                                mine_c = acc[:, c:c + MERGE_COLUMNS]
                                theirs_c = plgpu.load(o_smem.at[half, :, cols], (), layout=plgpu.Layout.WGMMA)
                                o_smem[half, :, cols] = (
                                    mine_c * lax.broadcast_in_dim(w_mine, mine_c.shape, [0])
                                    + theirs_c.astype(jnp.float32) * lax.broadcast_in_dim(w_theirs, mine_c.shape, [0])
                                ).astype(jnp.bfloat16)
                            plgpu.commit_smem()
                    copy_out()

            if not peer_merge:
                store_split()
            else:
                @pl.when(sp == 0)
                def _store_and_signal():
                    store_split()
                    async_proxy_fence()  # its TMA stores are complete: ordered before the signal
                    plgpu.semaphore_signal(tile_counter(), 1, memory_scope="gpu")

                pl.when(sp == 1)(merge_with_split_0)

        for half in range(2):
            pl.when(wg == half)(functools.partial(consumer, half))

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    tail_scratch = (None, None, None, None)
    if tail:
        tail_scratch = (
            plgpu.RefUnion(plgpu.SMEM((tail, C), jnp.bfloat16, transforms=swizzled),
                           (plgpu.SMEM((tail, L), jnp.bfloat16), plgpu.SMEM((tail,), jnp.float32))),
            plgpu.SMEM((tail, 64), jnp.bfloat16, transforms=swizzled),
            plgpu.Barrier(),
            plgpu.Barrier(),
        )
    kernel = plgpu.kernel(
        attention_body,
        out_type=(jax.ShapeDtypeStruct((1 if peer_merge else NS, B, V, L), jnp.bfloat16),
                  jax.ShapeDtypeStruct((1 if peer_merge else NS, B, V), jnp.float32)),
        scratch_types=(
            plgpu.RefUnion(plgpu.SMEM((ROWS, CQ), jnp.bfloat16, transforms=swizzled),
                           plgpu.SMEM((2, ROWS, LH), jnp.bfloat16, transforms=swizzled)),
            plgpu.SMEM((stages, BK, C), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((stages, WB, ROWS), jnp.int32),
            plgpu.SMEM((ROWS, BK), jnp.bfloat16, transforms=swizzled) if share_scores and not tail else None,
            plgpu.SMEM((4 if peer_merge else 3, ROWS), jnp.float32),
            tail_scratch[0],
            tail_scratch[1],
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1 if store_early else 2),
            plgpu.Barrier() if share_scores else None,
            plgpu.Barrier() if share_scores else None,
            tail_scratch[2],
            tail_scratch[3],
            plgpu.Barrier(num_barriers=2) if peer_merge else None,
            plgpu.Barrier() if peer_merge else None,
        ),
        grid=(B, n_tiles, NS), grid_names=("stream", "tile", "split"),
        num_threads=3, thread_name="wg",
        # the row reductions (max, sum) of the WGMMA layout stay within a warp: no smem scratch for them; the
        # tail's (over keys, across consumer 1's warps) need some
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=tail_scratch_bytes(tail),
                                             **profile),
    )
    return kernel(prefix_len.astype(jnp.int32), q_rows, cache_kv, tree_kv, tree_bits)  # lse in natural log


def split_attention_ref(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, *, scale, kv_lora_rank, block_k=64,
                        stages=2, num_splits=1, share_scores=True, valid_rows=None, profile_dir=None,
                        profile_regions=0, profile_names=None, first_block_alone=None, pv_first=True,
                        store_early=True, peer_merge=False):
    """Pure-JAX twin of :func:`split_attention` and ``mla_attention_narrow.split_attention_narrow`` (same
    signature and outputs, split ranges, bf16 partials and the -inf LSE of empty rows included). With
    ``peer_merge`` (checked as the kernel checks it) the two splits take the kernel's shares and are merged: o
    [1, B, V, L], lse [1, B, V]. The profiler and the schedule's options (``stages``, ``share_scores``,
    ``profile_*``, ``first_block_alone``, ``pv_first``, ``store_early``) do not change the outputs and are unused;
    ``block_k``, ``stages`` and ``num_splits`` are checked as :func:`split_attention` checks them
    (``check_split_tuning``). Dense [NS, B, R, S + TP] f32 scores: for tests and small shapes."""
    del profile_dir, profile_regions, profile_names, first_block_alone, pv_first, store_early
    BK, NS = check_split_tuning(block_k, stages, num_splits)
    B, R, C, S, TP = check_in_place_inputs(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, BK, "split_attention_ref")
    peer_merge = check_peer_merge(peer_merge, NS, R, valid_rows, share_scores)
    plen = jnp.clip(prefix_len.astype(jnp.int32), 0, S)  # a traced prefix_len, which cannot be checked
    nbp = -(-plen // BK)                                                            # [B] cache blocks read
    lo, mid, hi = split_range(nbp[None], TP // BK, jnp.arange(NS)[:, None], NS, peer_merge)  # [NS, B]
    cache_block = jnp.arange(S) // BK
    in_cache = (cache_block >= lo[..., None]) & (cache_block < mid[..., None]) \
        & (jnp.arange(S) < plen[:, None])                                           # [NS, B, S]
    tree_block = nbp[None, :, None] + jnp.arange(TP) // BK
    in_tree = (tree_block >= mid[..., None]) & (tree_block < hi[..., None])         # [NS, B, TP]
    sees = jnp.concatenate([jnp.broadcast_to(in_cache[:, :, None, :], (NS, B, R, S)),
                            in_tree[:, :, None, :] & unpack_bits(tree_bits, TP)[None]], axis=-1)
    keys = jnp.concatenate([cache_kv, tree_kv.astype(cache_kv.dtype)], axis=1)     # [B, S + TP, C]
    readable = jnp.concatenate([in_cache, in_tree], axis=-1).any(0)
    o, lse = dense_split_partials(q_rows, keys, sees, readable, scale=scale, kv_lora_rank=kv_lora_rank,
                                  valid_rows=valid_rows)
    if peer_merge:
        o, lse = merge_lse(o, lse)
        o, lse = o[None].astype(jnp.bfloat16), lse[None]
    return o, lse


def dense_split_partials(q_rows, keys, sees, readable, *, scale, kv_lora_rank, valid_rows=None):
    """The twins' dense core: each split's normalised attention of the rows over the keys it sees.

    q_rows [B, Np, C], keys [B, K, C], sees bool [NS, B, Np, K], readable bool [B, K] (the keys some split
    reads; the rest are zeroed first, so NaN garbage there cannot leak) -> (o [NS, B, V, L] bf16, lse
    [NS, B, V] f32, natural log; a row that sees nothing in a split: o = 0, lse = -inf)."""
    L = kv_lora_rank
    keys = jnp.where(readable[..., None], keys, jnp.zeros((), keys.dtype))
    s = jnp.einsum("bnc,bkc->bnk", q_rows, keys, preferred_element_type=jnp.float32) * scale
    s = jnp.where(sees, s[None], -jnp.inf)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1)
    o = jnp.einsum("xbnk,bkl->xbnl", p, keys[..., :L].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    empty = l == 0.0
    o = jnp.where(empty[..., None], 0.0, o / jnp.where(empty, 1.0, l)[..., None]).astype(jnp.bfloat16)
    lse = jnp.where(empty, -jnp.inf, m[..., 0] + jnp.log(jnp.where(empty, 1.0, l)))
    V = check_valid_rows(valid_rows, q_rows.shape[1])
    return o[:, :, :V], lse[:, :, :V]


def default_kernel_name(T: int, H: int, C: int, L: int, block_k: int = 64) -> str:
    """Which kernel :func:`tree_attention_mgpu` runs by default for T nodes x H heads: "narrow"
    (``mla_attention_narrow``, at most NARROW_MAX_ROWS real rows), "tail" (:func:`split_attention`, one 64-row
    tile and a tail of 8 rows) or "tiles" (:func:`split_attention`, whole 64-row tiles)."""
    from pallas_kernels.mla_attention_narrow import NARROW_MAX_ROWS  # it imports this module
    keys_as_m = block_k == 64 and L + 64 <= C  # both need a block's rope columns free for p
    valid_rows = valid_rows_for(T, H)
    if keys_as_m and valid_rows is not None and valid_rows <= NARROW_MAX_ROWS:
        return "narrow"
    return "tail" if keys_as_m and tail_rows_of(T * H) else "tiles"


def uses_peer_merge(kernel, num_splits: int, tail: bool, share_scores: bool, valid_rows) -> bool:
    """Whether :func:`tree_attention_mgpu`, choosing its kernel, merges the splits inside it: wherever
    :func:`split_attention` runs and :func:`peer_merge_fits`. On the H200 that was 0.6-5 % faster than the merge
    launch at all six two-split points of the issue's grid timed over 1K and 8K (session 45)."""
    return kernel is split_attention and peer_merge_fits(num_splits, tail, share_scores, valid_rows is None)


def _kernel_plan(B, T, H, S, C, L, block_k, num_sms, kernel, num_splits, share_scores, tail):
    """What :func:`tree_attention_mgpu` runs for its arguments: (the kernel, whether it takes the T*H query rows
    as they are (the narrow kernel, or one tile and a tail) rather than whole 64-row tiles, the split count,
    whether it merges its splits itself). With ``kernel`` None: the narrow kernel or :func:`split_attention`
    (``default_kernel_name``), the latter with ``peer_merge`` where it merges two splits itself
    (:func:`uses_peer_merge`)."""
    from pallas_kernels.mla_attention_narrow import split_attention_narrow  # it imports this module
    default = default_kernel_name(T, H, C, L, block_k)
    chosen = kernel is None
    if chosen:
        kernel = split_attention_narrow if default == "narrow" else split_attention
    base = getattr(kernel, "func", kernel)  # a partial of a kernel
    with_tail = bool(tail) and share_scores and base in (split_attention, split_attention_ref) and default == "tail"
    if num_splits is None:
        num_splits = splits_for(B, T, H, S, block_k, num_sms, tail=with_tail)
    peer = chosen and uses_peer_merge(base, int(num_splits), with_tail, share_scores, valid_rows_for(T, H))
    if peer:
        kernel = functools.partial(split_attention, peer_merge=True)
    return kernel, base is split_attention_narrow or with_tail, int(num_splits), peer


def default_plan(B: int, T: int, H: int, S: int, C: int, L: int, block_k: int = 64,
                 num_sms: int = _NUM_SMS_H200) -> dict:
    """:func:`tree_attention_mgpu`'s choices at its defaults, for a cache of S rows: ``path`` (its kernel,
    ``default_kernel_name``), ``num_splits``, and ``merge``: "none" with one split, "kernel" where the kernel
    merges two itself (``peer_merge``), else "launch" (``split_combine.combine_splits``)."""
    _, _, splits, peer = _kernel_plan(B, T, H, S, C, L, block_k, num_sms, None, None, True, True)
    return dict(path=default_kernel_name(T, H, C, L, block_k), num_splits=splits,
                merge="none" if splits == 1 else "kernel" if peer else "launch")


def tree_attention_mgpu(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                        interpret=False, return_lse=False, block_k=64, stages=None, num_splits=None,
                        share_scores=True, num_sms=_NUM_SMS_H200, kernel=None, combine=combine_splits, tail=True):
    """MLA tree-verify attention on the Mosaic GPU kernel (module docstring).

    q [B, T, H, C] bf16, cache_kv [B, S, C] bf16, prefix_len [B] int32 (values outside [0, S]: refused
    where concrete, clamped where traced), tree_kv [B, T, C] bf16, tree_mask [B, T, T] bool (diagonal
    True). Returns out [B, T, H, L] bf16 (and lse [B, T, H] f32 with ``return_lse``). ``num_splits`` defaults
    to :func:`splits_for` on ``num_sms`` SMs. ``kernel`` is :func:`split_attention`,
    ``mla_attention_narrow.split_attention_narrow`` (keys as wgmma's M, for at most 32 real rows; by default
    where T*H <= 32, block_k = 64 and C >= L + 64), or their twin :func:`split_attention_ref` (CPU tests of
    everything around the kernel); by default, with two splits of whole tiles, :func:`split_attention` merges
    them itself (``peer_merge``, :func:`uses_peer_merge`). tree_kv may carry padding rows past T
    (``tree_attention``'s contract): latents padded to whole blocks (``pad_tree_latents``, as the model hands
    them over) are read as they are. ``stages`` defaults to the kernel's own. ``combine`` merges the splits
    the kernel leaves: ``split_combine.combine_splits`` (one Pallas-Triton launch), or its XLA twin
    ``combine_splits_ref`` (CPU tests; the A/B of ``profile_kernels``). ``tail``:
    where T*H = 72 rows (and :func:`split_attention` runs, with block_k = 64 and shared scores), one tile and
    a tail of 8 rows (module docstring) rather than two tiles. ``interpret=True`` is refused: JAX's Mosaic
    GPU interpreter (0.10) has neither register-operand wgmma nor accumulator stores; CPU tests lower the
    kernel for CUDA.
    """
    if interpret:
        raise NotImplementedError("the Mosaic GPU kernel has no interpret mode here; pass "
                                  "kernel=split_attention_ref to run the rest on the CPU")
    B, T, H, C, S = _check_shapes(q, cache_kv, prefix_len, tree_kv, tree_mask, kv_lora_rank)
    problem = unsupported_reason(q.shape, cache_kv.shape, kv_lora_rank, q.dtype, cache_kv.dtype, tree_kv.dtype)
    if problem:
        raise ValueError(f"tree_attention_mgpu cannot take {problem}; use tree_attention_ref")
    L, N = kv_lora_rank, T * H
    plen = jnp.clip(prefix_len.astype(jnp.int32), 0, S)
    valid_rows = valid_rows_for(T, H)
    kernel, rows_as_is, num_splits, _ = _kernel_plan(B, T, H, S, C, L, block_k, num_sms, kernel, num_splits,
                                                     share_scores, tail)
    # the narrow kernel takes the V real rows as they are (no padded copy of q), as does one tile and a tail;
    # the others whole 64-row tiles
    qr = q.reshape(B, N, C) if rows_as_is else fold_rows(q, ROWS)
    keys, bits = tree_inputs(tree_kv, tree_mask, H, qr.shape[1], block_k)
    stage_kw = {} if stages is None else {"stages": stages}
    o, lse = kernel(qr, cache_kv, plen, keys, bits, scale=scale, kv_lora_rank=L, block_k=block_k,
                    num_splits=num_splits, share_scores=share_scores, valid_rows=valid_rows, **stage_kw)
    if o.shape[0] == 1:  # one split, or two merged in the kernel; every row sees its own node: lse is finite
        out, lse = o[0], lse[0]
    else:
        out, lse = combine(o, lse, out_dtype=q.dtype)
    out = out[:, :N].reshape(B, T, H, L).astype(q.dtype)
    return (out, lse[:, :N].reshape(B, T, H)) if return_lse else out

"""MLA tree-verify attention on Hopper: a Pallas Mosaic GPU prefix kernel + an XLA tree tail.

Same entry semantics as ``pallas_kernels.tree_attention`` (whose pure-JAX twin, ``tree_attention_ref``,
is this kernel's twin too; the prefix kernel alone has ``prefix_attention_ref``)::

    tree_attention_mgpu(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                        interpret=False, return_lse=False, block_k=64, stages=2, num_splits=None,
                        share_scores=True, overlap_qk=False, num_sms=132, prefix=prefix_attention)

Dimension letters: B streams, T tree nodes, H heads, S cache slots, C latent+rope width (576),
L latent width = value width (512), N = T*H query rows, Np rows padded to whole 64-row tiles,
BK keys per block, NS prefix splits.

Design (a cascade, as in sglang's tree verify on MLA backends):

* **Prefix** (the bulk of the bytes and FLOPs): the whole blocks ``[0, prefix_len // BK)`` of each
  stream's cache, no mask at all. One Mosaic GPU program per (stream, 64-row tile, split). Heads are
  folded into rows (row = node*H + head), so one tile is 64 / H nodes, or one node and 64 of its heads.
  Three warpgroups: a producer issues the TMA copies (the tile's queries once, then the key blocks
  through a ring of ``stages`` slots). Consumer 0 computes s = q·kᵀ over the full C = 576 columns
  (wgmma, both operands in shared memory) and the online softmax in f32 registers (exp2), and hands the
  bf16 probabilities and the rescale factor to consumer 1 through shared memory (``share_scores``, as
  FlashMLA does; without it both compute the same scores, 1.53x the tensor work). Each consumer then
  multiplies p by its own half of the L = 512 value columns into a [64, 256] f32 accumulator (a whole
  [64, 512] one would not fit one warpgroup's registers; the value is the first L columns of the key
  block already in shared memory). Each program writes its normalised partial output (bf16) and
  log-sum-exp (f32); ~225 KiB of shared memory, so one program per SM.
* **Tail** in XLA: the last partial block of the prefix (< BK keys, masked by position, rows beyond
  prefix_len zeroed so NaN garbage there cannot leak) and the T tree keys under ``tree_mask``.
* **Merge** in XLA: a log-sum-exp combine of the NS prefix partials and the tail.

The kernel itself never masks, so plain decode (T = 1), DFlash chains and trees share it unchanged.
It takes bf16 q, cache and tree latents; C % 64 == 0, L % 128 == 0, L <= 512 and the shared memory of
one program within 227 KB (``unsupported_reason``). prefix_len values outside [0, S] are clamped (it is
traced, so it cannot raise), as in ``tree_attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.tree_attention import _LN2, _LOG2E, _NUM_SMS_H200, _check_shapes, fold_rows, merge_lse

try:  # Mosaic GPU Pallas (present in the JAX versions this repo supports; guarded for clarity)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["tree_attention_mgpu", "prefix_attention", "prefix_attention_ref", "default_splits",
           "unsupported_reason", "smem_bytes"]

ROWS = 64              # query rows per program (one wgmma M tile)
SMEM_LIMIT = 227 * 1024
MAX_SPLITS = 64        # beyond this the merge's traffic outgrows what the extra programs save


def smem_bytes(C: int, block_k: int, stages: int, share_scores: bool = True) -> int:
    """Shared memory of one program: the query tile, ``stages`` key blocks, the LSE row, barriers, and
    with ``share_scores`` the probability tile and two stat rows."""
    barriers = 8 * (1 + 2 * stages + 1 + (2 if share_scores else 0))
    shared = 2 * ROWS * block_k if share_scores else 0
    return 2 * ROWS * C + stages * 2 * block_k * C + 12 * ROWS + barriers + shared


def unsupported_reason(q_shape, kv_lora_rank, *dtypes) -> str | None:
    """Why the Mosaic GPU kernel cannot take these dims / dtypes (of q, the cache, the tree latents), or
    None when it can (at the default block_k = 64, stages = 2)."""
    C, L = q_shape[-1], kv_lora_rank
    for dtype in dtypes:
        if jnp.dtype(dtype) != jnp.bfloat16:
            return f"dtype {jnp.dtype(dtype)} (the kernel takes bf16)"
    if C % 64 or L % 128 or L > 512:
        return f"C={C}, L={L} (the kernel needs C % 64 == 0, L % 128 == 0 and L <= 512)"
    if smem_bytes(C, 64, 2) > SMEM_LIMIT:
        return f"C={C} (one program's shared memory, {smem_bytes(C, 64, 2)} bytes, exceeds {SMEM_LIMIT})"
    return None


def default_splits(B: int, n_tiles: int, S: int, block_k: int, num_sms: int = _NUM_SMS_H200) -> int:
    """Prefix splits so that the programs fill at most one wave of SMs (one program per SM; a program
    past the wave runs alone afterwards), with at least 2 key blocks per split at full capacity S and at
    most MAX_SPLITS. (Sized from the capacity, which is static; a short prefix in a large cache leaves
    splits empty, each costing one small program.)"""
    progs = max(1, B * n_tiles)
    return max(1, min(num_sms // progs, (S // block_k) // 2, MAX_SPLITS))


def prefix_attention(q_rows, cache_kv, prefix_len, *, scale, kv_lora_rank, block_k=64, stages=2,
                     num_splits=1, share_scores=True, overlap_qk=False):
    """The Mosaic GPU prefix pass over whole key blocks.

    q_rows [B, Np, C] bf16 (Np % 64 == 0), cache_kv [B, S, C] bf16, prefix_len [B] int32, which must
    lie in [0, S] (``tree_attention_mgpu`` clamps it; a larger value would read past the cache).
    Returns (o [NS, B, Np, L] bf16, lse [NS, B, Np] f32, natural log): split s attends to whole blocks
    ``[s*per, min((s+1)*per, nb))`` with nb = prefix_len // block_k, per = ceil(nb / NS); an empty split
    has o = 0 and lse = -inf. ``overlap_qk`` (experimental, needs ``share_scores``; lowered and tested
    on CPU, not yet run on a GPU): consumer 0 issues block j+1's q.k before block j's softmax. With
    two stages (all that fits at C = 576) it first waits for block j+1's copy, which needs consumer 1 to
    be done with block j-1, so the copy latency may show where the softmax hid it before.
    """
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available in this JAX")
    B, Np, C = q_rows.shape
    S = cache_kv.shape[1]
    L = kv_lora_rank
    LH = L // 2
    BK, NS = int(block_k), int(num_splits)
    if Np % ROWS:
        raise ValueError(f"q_rows must hold whole {ROWS}-row tiles, got {Np} rows")
    if BK not in (64, 128, 256):  # Mosaic's wgmma needs K (keys, for p.v) % 64 == 0
        raise ValueError(f"block_k={BK} must be 64, 128 or 256")
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    if NS < 1:
        raise ValueError(f"num_splits={NS} must be >= 1")
    if overlap_qk and not share_scores:
        raise ValueError("overlap_qk needs share_scores (one warpgroup computes the scores)")
    smem = smem_bytes(C, BK, stages, share_scores)
    if smem > SMEM_LIMIT:
        raise ValueError(f"block_k={BK}, stages={stages} need {smem} bytes of shared memory (limit {SMEM_LIMIT})")
    scale_log2 = float(scale) * _LOG2E
    n_tiles = Np // ROWS
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(plen_ref, q_ref, kv_ref, o_ref, lse_ref, qo_smem, k_smem, p_smem, stat_smem, q_bar, k_bars,
             consumed_bars, done_bar, p_ready, p_free):
        lse_smem = stat_smem.at[2]  # stat rows: 0 the step's alpha, 1 the final l (shared scores), 2 the LSE
        q_smem, o_smem = qo_smem  # the output tile reuses the query tile's shared memory
        b = lax.axis_index("stream")
        tile = lax.axis_index("tile")
        sp = lax.axis_index("split")
        wg = lax.axis_index("wg")
        nb = plen_ref[b] // BK
        per = (nb + NS - 1) // NS
        lo = jnp.minimum(sp * per, nb)
        steps = jnp.minimum(lo + per, nb) - lo

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(tile * ROWS, ROWS)], q_smem, q_bar)

            @pl.loop(0, steps)
            def _(j):
                slot = lax.rem(j, stages)

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(consumed_bars.at[slot])

                plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds((lo + j) * BK, BK)], k_smem.at[slot],
                                        k_bars.at[slot])

        def consumer(half):
            scores_here = half == 0 or not share_scores  # this warpgroup computes q.k and the softmax
            # with overlap_qk, consumer 0 also holds the next block's scores in flight
            plgpu.set_max_registers((240 if half == 0 else 224) if overlap_qk else 232, action="increase")
            plgpu.barrier_wait(q_bar)
            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
            values = lambda slot: k_smem.at[slot, :, pl.ds(half * LH, LH)]  # noqa: E731

            def issue_qk(s_ref, slot):  # s_ref += q.k^T (asynchronous)
                plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))

            def softmax_share(j, s, m, l):
                """Online-softmax update for scores s (log2 units); with share_scores, p and alpha go to
                consumer 1 through shared memory."""
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(jnp.bfloat16)
                if share_scores:
                    @pl.when(j > 0)
                    def _():
                        plgpu.barrier_wait(p_free)

                    p_smem[...] = p16
                    stat_smem[0] = alpha
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready)
                return p16, alpha, m_new, l

            def accumulate(acc_ref, slot, alpha, p16):
                acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                plgpu.wgmma(acc_ref, p16, values(slot))
                plgpu.wgmma_wait(0)
                if not scores_here:
                    plgpu.barrier_arrive(p_free)
                plgpu.barrier_arrive(consumed_bars.at[slot])

            def flash_loop(acc_ref):  # the [64, L/2] accumulator starts at zero
                def step(j, carry):
                    m, l = carry
                    slot = lax.rem(j, stages)
                    plgpu.barrier_wait(k_bars.at[slot])
                    if scores_here:
                        def qk(s_ref):
                            issue_qk(s_ref, slot)
                            return s_ref[...]

                        s = pl.run_scoped(qk, plgpu.ACC((ROWS, BK), jnp.float32)) * scale_log2
                        p16, alpha, m, l = softmax_share(j, s, m, l)
                    else:
                        plgpu.barrier_wait(p_ready)
                        alpha = plgpu.load(stat_smem.at[0], (), layout=row_layout)
                        p16 = p_smem
                    accumulate(acc_ref, slot, alpha, p16)
                    return m, l

                m_, l_ = lax.fori_loop(0, steps, step, (m, l))
                return acc_ref[...], m_, l_

            def flash_loop_overlapped(acc_ref, s_even, s_odd):
                """Consumer 0 with overlap_qk: block j+1's q.k is issued before block j's softmax, so the
                tensor cores work while the softmax runs. Unrolled by two (one score accumulator each)."""
                zeros = plgpu.layout_cast(jnp.zeros((ROWS, BK), jnp.float32), plgpu.Layout.WGMMA)

                @pl.when(steps > 0)
                def _():
                    plgpu.barrier_wait(k_bars.at[0])
                    issue_qk(s_even, 0)

                def step(j, carry, cur, nxt):
                    m, l = carry
                    slot = lax.rem(j, stages)
                    s = cur[...] * scale_log2          # waits for block j's q.k
                    cur[...] = zeros                    # wgmma accumulates: clear for block j + 2

                    @pl.when(j + 1 < steps)
                    def _():
                        nslot = lax.rem(j + 1, stages)
                        plgpu.barrier_wait(k_bars.at[nslot])
                        issue_qk(nxt, nslot)

                    p16, alpha, m, l = softmax_share(j, s, m, l)
                    accumulate(acc_ref, slot, alpha, p16)
                    return m, l

                def pair(i, carry):
                    return step(2 * i + 1, step(2 * i, carry, s_even, s_odd), s_odd, s_even)

                carry = lax.fori_loop(0, steps // 2, pair, (m, l))
                carry = lax.cond(steps % 2 == 1, lambda c: step(steps - 1, c, s_even, s_odd), lambda c: c, carry)
                return (acc_ref[...],) + tuple(carry)

            if overlap_qk and half == 0:
                acc, m, l = pl.run_scoped(flash_loop_overlapped, plgpu.ACC((ROWS, LH), jnp.float32),
                                          plgpu.ACC((ROWS, BK), jnp.float32), plgpu.ACC((ROWS, BK), jnp.float32))
            else:
                acc, m, l = pl.run_scoped(flash_loop, plgpu.ACC((ROWS, LH), jnp.float32))
            if share_scores and half == 0:
                stat_smem[1] = l
            # both warpgroups are done reading the query tile (and the shared stats are written):
            # reuse the query tile's memory for the output
            plgpu.barrier_arrive(done_bar)
            plgpu.barrier_wait(done_bar)
            if not scores_here:
                l = plgpu.load(stat_smem.at[1], (), layout=row_layout)
            empty = l == 0.0
            inv = 1.0 / jnp.where(empty, 1.0, l)
            o_smem[half] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
            if half == 0:
                lse_smem[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[half],
                                    o_ref.at[sp, b, pl.ds(tile * ROWS, ROWS), pl.ds(half * LH, LH)])
            if half == 0:
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[sp, b, pl.ds(tile * ROWS, ROWS)])
            plgpu.wait_smem_to_gmem(0)

        for half in range(2):
            pl.when(wg == half)(functools.partial(consumer, half))

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((NS, B, Np, L), jnp.bfloat16),
                  jax.ShapeDtypeStruct((NS, B, Np), jnp.float32)),
        scratch_types=(
            plgpu.RefUnion(plgpu.SMEM((ROWS, C), jnp.bfloat16, transforms=swizzled),
                           plgpu.SMEM((2, ROWS, LH), jnp.bfloat16, transforms=swizzled)),
            plgpu.SMEM((stages, BK, C), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((ROWS, BK), jnp.bfloat16, transforms=swizzled) if share_scores else None,
            plgpu.SMEM((3, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier() if share_scores else None,
            plgpu.Barrier() if share_scores else None,
        ),
        grid=(B, n_tiles, NS), grid_names=("stream", "tile", "split"),
        num_threads=3, thread_name="wg",
        # the row reductions (max, sum) of the WGMMA layout stay within a warp: no smem scratch for them
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    o, lse2 = kernel(prefix_len.astype(jnp.int32), q_rows, cache_kv)
    return o, lse2 * _LN2


def prefix_attention_ref(q_rows, cache_kv, prefix_len, *, scale, kv_lora_rank, block_k=64, stages=2,
                         num_splits=1, share_scores=True, overlap_qk=False):
    """Pure-JAX twin of :func:`prefix_attention` (same signature and outputs, including the split
    ranges, bf16 partials and -inf LSE of empty splits; the scheduling flags ``stages``, ``share_scores``, ``overlap_qk`` unused). Dense
    [NS, B, Np, S] f32 scores: meant for tests and small shapes."""
    del stages, share_scores, overlap_qk
    B, Np, C = q_rows.shape
    S = cache_kv.shape[1]
    L, BK, NS = kv_lora_rank, int(block_k), int(num_splits)
    nb = jnp.clip(prefix_len.astype(jnp.int32), 0, S) // BK
    per = (nb + NS - 1) // NS
    lo = jnp.minimum(jnp.arange(NS)[:, None] * per[None], nb[None]) * BK        # [NS, B]
    hi = jnp.minimum(lo + per[None] * BK, nb[None] * BK)
    pos = jnp.arange(S)
    inside = (pos >= lo[..., None]) & (pos < hi[..., None])                      # [NS, B, S]
    kv = jnp.where(inside[..., None], cache_kv[None], jnp.zeros((), cache_kv.dtype))  # NaN-safe
    s = jnp.einsum("bnc,xbkc->xbnk", q_rows, kv, preferred_element_type=jnp.float32) * scale
    s = jnp.where(inside[:, :, None, :], s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1)
    o = jnp.einsum("xbnk,xbkl->xbnl", p, kv[..., :L].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    empty = l == 0.0
    o = jnp.where(empty[..., None], 0.0, o / jnp.where(empty, 1.0, l)[..., None]).astype(jnp.bfloat16)
    lse = jnp.where(empty, -jnp.inf, m[..., 0] + jnp.log(jnp.where(empty, 1.0, l)))
    return o, lse


def _tail_scores(qc, cache_kv, plen, tree_kv, tree_mask, *, scale, block_k):
    """Scores [B, T, H, BK + T] f32 of the rows against the prefix's last partial block and the tree
    keys (masked entries -inf), and those keys [B, BK + T, C] (invalid rows zeroed); plen in [0, S]."""
    B, S, C = cache_kv.shape
    start = (plen // block_k) * block_k
    pos = start[:, None] + jnp.arange(block_k)[None, :]                         # [B, BK]
    valid = pos < plen[:, None]
    rows = jnp.take_along_axis(cache_kv, jnp.minimum(pos, max(S - 1, 0))[..., None], axis=1) if S else \
        jnp.zeros((B, block_k, C), cache_kv.dtype)
    rows = jnp.where(valid[..., None], rows, jnp.zeros((), cache_kv.dtype))
    keys = jnp.concatenate([rows, tree_kv.astype(cache_kv.dtype)], axis=1)     # [B, BK + T, C]
    s = jnp.einsum("bthc,bkc->bthk", qc, keys, preferred_element_type=jnp.float32) * scale
    T = tree_kv.shape[1]
    see = jnp.concatenate([jnp.broadcast_to(valid[:, None, :], (B, T, block_k)), tree_mask], axis=2)
    return jnp.where(see[:, :, None, :], s, -jnp.inf), keys


def tree_attention_mgpu(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                        interpret=False, return_lse=False, block_k=64, stages=2, num_splits=None,
                        share_scores=True, overlap_qk=False, num_sms=_NUM_SMS_H200, prefix=prefix_attention):
    """MLA tree-verify attention: Mosaic GPU prefix kernel, XLA tail and merge (module docstring).

    q [B, T, H, C] bf16, cache_kv [B, S, C] bf16, prefix_len [B] int32 (values outside [0, S] are
    clamped), tree_kv [B, T, C] bf16, tree_mask [B, T, T] bool (diagonal True). Returns out [B, T, H, L]
    bf16 (and lse [B, T, H] f32 with ``return_lse``). ``num_splits`` defaults to :func:`default_splits`
    for ``num_sms`` SMs. ``prefix`` is the prefix pass: the kernel, or its twin :func:`prefix_attention_ref`
    (CPU tests of the tail and merge). ``interpret=True`` is refused: JAX's Mosaic GPU interpreter (0.10)
    has neither register-operand wgmma nor accumulator stores; CPU tests lower the kernel for CUDA.
    """
    if interpret:
        raise NotImplementedError("the Mosaic GPU kernel has no interpret mode here; pass "
                                  "prefix=prefix_attention_ref to run the rest on the CPU")
    B, T, H, C, S = _check_shapes(q, cache_kv, prefix_len, tree_kv, tree_mask, kv_lora_rank)
    problem = unsupported_reason(q.shape, kv_lora_rank, q.dtype, cache_kv.dtype, tree_kv.dtype)
    if problem:
        raise ValueError(f"tree_attention_mgpu cannot take {problem}; use tree_attention_ref")
    L = kv_lora_rank
    N = T * H
    qr = fold_rows(q, ROWS)
    plen = jnp.clip(prefix_len.astype(jnp.int32), 0, S)
    ns = default_splits(B, qr.shape[1] // ROWS, S, block_k, num_sms) if num_splits is None else int(num_splits)
    o_p, lse_p = prefix(qr, cache_kv, plen, scale=scale, kv_lora_rank=L, block_k=block_k,
                        stages=stages, num_splits=ns, share_scores=share_scores, overlap_qk=overlap_qk)
    o_p = o_p[:, :, :N].reshape(ns, B, T, H, L)
    lse_p = lse_p[:, :, :N].reshape(ns, B, T, H)

    s_t, keys = _tail_scores(q, cache_kv, plen, tree_kv, tree_mask, scale=scale, block_k=block_k)
    m_t = s_t.max(-1)                                   # finite: every node sees itself
    p_t = jnp.exp(s_t - m_t[..., None])
    l_t = p_t.sum(-1)
    o_t = jnp.einsum("bthk,bkl->bthl", p_t, keys[..., :L].astype(jnp.float32),
                     precision=lax.Precision.HIGHEST) / l_t[..., None]
    out, lse = merge_lse(o_p, lse_p, o_t, m_t + jnp.log(l_t))
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out

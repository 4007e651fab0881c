"""MLA tree-verify attention over the absorbed latent cache (Pallas-Triton kernel + pure-JAX twin).

Absorbed ("MQA-mode") MLA: every token stores one C-wide latent key row (C = L latent + rope; 512 + 64
= 576 for K2.6), shared by all H query heads; its value is the first L dims of the same row. Verifying
T new tokens (a draft tree, a DFlash chain, or one decode token) means each new token attends to

* the committed prefix, rows ``[0, prefix_len[b])`` of the per-stream cache, without any mask, and
* the T new tokens' own latents (``tree_kv``), restricted by ``tree_mask`` (ancestor-or-self).

Dimension letters: B streams, T tree nodes, H heads, S cache slots (capacity), C latent+rope width,
L latent width (``kv_lora_rank``, the value width).

Entry points (all share one signature)::

    tree_attention(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                   interpret=False, return_lse=False, **tuning)      # Pallas-Triton kernel
    tree_attention_ref(...)                                           # pure-JAX twin (any platform)
    mla_attention(...)                                                # kernel on CUDA, twin elsewhere

Arguments
    q          [B, T, H, C]  absorbed queries (bf16 or f32).
    cache_kv   [B, S, C]     latent cache; only rows < prefix_len[b] are read into the result (rows
                             beyond may hold anything, NaN included).
    prefix_len [B] int32     committed length per stream, 0 <= prefix_len <= S: a concrete array outside
                             that range is refused (ValueError); a traced one (under jit, where nothing
                             can raise) is clamped to it.
    tree_kv    [B, T, C]     latents of the T new tokens; or [B, T', C], T' > T, followed by padding rows,
                             which must be finite (zeros): the model pads to whole 64-key blocks so
                             that the Mosaic GPU decode kernel reads them in place.
    tree_mask  [B, T, T]     bool, tree_mask[b, i, j]: node i may see node j. The diagonal must be True (a
                             concrete mask with a False there is refused, as that node's row would be empty).
    scale      float         softmax scale applied to the full C-wide dot (K2.6: 0.14468, not C^-0.5).
    kv_lora_rank int         L; the value is the first L dims of each key row.
Returns
    out [B, T, H, L] in q.dtype, and with ``return_lse`` also lse [B, T, H] f32 (natural log).

Kernel design (Pallas-Triton backend; the Mosaic GPU kernel, ``pallas_kernels.mla_attention_mgpu``, is
the dispatcher's default on CUDA wherever it can run; this one serves the dims it cannot take, explicit
``backend="triton"`` or tuning keywords, and the interpreter):

* Heads are folded into query rows: q becomes [B, T*H, C], row = node*H + head. A tile of R rows
  (R = 64 by default, 16..64) holds R/H nodes x H heads (H <= R) or one node and R heads (H >= R),
  so the tree mask of a tile is one [R/H, block] slab broadcast over heads (one key vector per tile
  when H >= R).
* The C-wide dot is split as L + rope (Triton needs power-of-two tiles): s = q_lat.k_lat + q_rope.k_rope,
  and the value dot reuses the k_lat tile already loaded (V = first L dims of K).
* The prefix is streamed in blocks of ``block_k`` keys without any mask; only the one partial block
  at the end of a ragged prefix is masked, with the key/value rows zeroed so NaN garbage beyond
  prefix_len cannot reach the result. The tree tail is a second short loop with the mask.
* Split-KV (flash-decoding): with few query tiles and a long prefix the prefix is cut into
  ``num_splits`` contiguous ranges (per stream, from its own prefix_len), each program writes a
  normalised partial output (16-bit inputs: in that dtype) and its f32 LSE, and one more launch
  (``split_combine.combine_splits``) merges them by log-sum-exp. The tree
  tail and the ragged last block are done by the last split.
* Online softmax in f32 with exp2 (scale*log2(e) folded into the scores); p is cast to the input
  dtype for the value dot, as in flash attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mla_kernel_inputs import check_prefix_len
from pallas_kernels.split_combine import combine_splits
from pallas_kernels.tuning import tuning_int

__all__ = ["tree_attention", "tree_attention_ref", "mla_attention", "default_config", "kernel_config",
           "check_tuning", "kernel_supports", "fold_rows", "TUNING_KEYWORDS"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) finite when a whole key block
# is masked out for some row (no -inf - -inf = NaN).
_NEG_BIG = -1e30
_NUM_SMS_H200 = 132


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _is_pow2(x: int) -> bool:
    return isinstance(x, (int, np.integer)) and x > 0 and (x & (x - 1)) == 0


def _empty_result(B, T, H, L, dtype, return_lse):
    """The outputs when there is nothing to attend (B, T or H is 0)."""
    out = jnp.zeros((B, T, H, L), dtype)
    return (out, jnp.zeros((B, T, H), jnp.float32)) if return_lse else out


def fold_rows(q, multiple: int) -> jax.Array:
    """q [B, T, H, C] -> query rows [B, Np, C] (row = node*H + head), zero-padded to whole tiles of
    ``multiple`` rows (padded rows are dropped from the results)."""
    B, T, H, C = q.shape
    n = T * H
    rows = q.reshape(B, n, C)
    pad = -(-n // multiple) * multiple - n
    return jnp.pad(rows, ((0, 0), (0, pad), (0, 0))) if pad else rows


def _check_shapes(q, cache_kv, prefix_len, tree_kv, tree_mask, kv_lora_rank):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, C], got {q.shape}")
    B, T, H, C = q.shape
    if cache_kv.ndim != 3 or cache_kv.shape[0] != B or cache_kv.shape[2] != C:
        raise ValueError(f"cache_kv must be [B, S, C]={B, 'S', C}, got {cache_kv.shape}")
    S = cache_kv.shape[1]
    check_prefix_len(prefix_len, B, S, "tree attention")
    if tree_kv.ndim != 3 or tree_kv.shape[0] != B or tree_kv.shape[1] < T or tree_kv.shape[2] != C:
        raise ValueError(f"tree_kv must be [B, T, C]={(B, T, C)} (or [B, T', C] with T' > T padding rows), "
                         f"got {tree_kv.shape}")
    if tree_mask.shape != (B, T, T) or tree_mask.dtype != jnp.bool_:
        raise ValueError(f"tree_mask must be [B, T, T]={(B, T, T)} bool, got {tree_mask.shape} {tree_mask.dtype}")
    if not isinstance(tree_mask, jax.core.Tracer):  # concrete: every node must see itself (else its row is empty)
        blind = np.argwhere(~np.diagonal(np.asarray(tree_mask, bool), axis1=1, axis2=2))
        if blind.size:
            raise ValueError(f"tree_mask's diagonal must be True (a node sees itself); False at (stream, node) "
                             f"{blind[:8].tolist()}")
    if not 0 < kv_lora_rank <= C:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be in (0, C={C}]")
    return B, T, H, C, S


# ----------------------------------------------------------------------------------------------
# Pure-JAX twin
# ----------------------------------------------------------------------------------------------

def _twin_chunk(B, T, H, S, budget_bytes=1 << 28):
    """Prefix chunk length so one f32 score block [B, T, H, chunk] stays under ``budget_bytes``."""
    rows = max(1, B * T * H)
    chunk = budget_bytes // (4 * rows)
    chunk = 1 << max(4, min(12, int(chunk).bit_length() - 1))
    return max(1, min(chunk, S))


def tree_attention_ref(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                       interpret=False, return_lse=False, chunk=None, **tuning):
    """Pure-JAX twin of :func:`tree_attention` (same signature). ``interpret`` is ignored; the kernel's tuning
    keywords (``TUNING_KEYWORDS``) that are given are checked as the kernel checks them (:func:`check_tuning`)
    and do not change the result; other keywords are ignored.

    Memory: the prefix is scanned in chunks of ``chunk`` slots (default: the largest power of two,
    16..4096, with an f32 score block [B, T, H, chunk] <= 256 MiB) with an online softmax, up to the
    longest prefix in the batch (a while loop with a data-dependent trip count), so it never
    materialises [B, H, T, S] scores. The tree tail is one dense [B, T, H, T] masked block. Dots take
    the inputs' dtype with f32 accumulation (HIGHEST precision for f32 inputs); softmax is f32.
    Rows at or beyond prefix_len are zeroed before use, so NaN garbage there cannot leak. A row that sees
    no key (possible only under jit, with a traced mask) gets out 0 and lse -inf, as in the kernels, but for the
    Mosaic GPU op at T = 1, which takes the one-node mask as [[True]], the only valid one (``tree_inputs``).
    """
    del interpret
    B, T, H, C, S = _check_shapes(q, cache_kv, prefix_len, tree_kv, tree_mask, kv_lora_rank)
    L = kv_lora_rank
    check_tuning(H, **{name: value for name, value in tuning.items() if name in TUNING_KEYWORDS})
    if chunk is not None:
        chunk = tuning_int("chunk", chunk)
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
    if B * T * H == 0:
        return _empty_result(B, T, H, L, q.dtype, return_lse)
    f32 = jnp.float32
    prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    plen = jnp.clip(prefix_len.astype(jnp.int32), 0, S)
    chunk = chunk or _twin_chunk(B, T, H, S)
    chunk = min(chunk, S) if S > 0 else 1
    cdt = cache_kv.dtype
    qc = q.astype(cdt)

    m0 = jnp.full((B, T, H), _NEG_BIG, f32)
    l0 = jnp.zeros((B, T, H), f32)
    a0 = jnp.zeros((B, T, H, L), f32)

    def update(carry, s, v):
        # s: [B, T, H, K] f32 scores (masked entries -inf); v: [B, K, L] or [B, T?, K, L]
        m, l, acc = carry
        m_new = jnp.maximum(m, s.max(-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum("bthk,bkl->bthl", p, v.astype(f32), precision=lax.Precision.HIGHEST)
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    def body(i, carry):
        start = jnp.minimum(i * chunk, S - chunk)  # dynamic_slice clamps; do it explicitly
        kc = lax.dynamic_slice_in_dim(cache_kv, start, chunk, axis=1)  # [B, chunk, C]
        pos = start + jnp.arange(chunk)
        # a clamped last chunk overlaps rows already counted: keep only pos >= i*chunk
        valid = (pos[None, :] >= i * chunk) & (pos[None, :] < plen[:, None])  # [B, chunk]
        kc = jnp.where(valid[..., None], kc, jnp.zeros((), cdt))
        s = jnp.einsum("bthc,bkc->bthk", qc, kc, preferred_element_type=f32, precision=prec) * scale
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        return update(carry, s, kc[..., :L])

    carry = (m0, l0, a0)
    if S > 0:
        n_chunks = (jnp.max(plen, initial=0) + chunk - 1) // chunk
        carry = lax.fori_loop(0, n_chunks, body, carry)

    tk = tree_kv[:, :T].astype(cdt)  # padding rows, if any, dropped
    s_t = jnp.einsum("bthc,bkc->bthk", qc, tk, preferred_element_type=f32, precision=prec) * scale
    s_t = jnp.where(tree_mask[:, :, None, :], s_t, -jnp.inf)
    m, l, acc = update(carry, s_t, tk[..., :L])

    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = (acc / l_safe[..., None]).astype(q.dtype)
    if return_lse:
        return out, jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
    return out


# ----------------------------------------------------------------------------------------------
# Pallas-Triton kernel
# ----------------------------------------------------------------------------------------------

def default_config(B, T, H, S, C, L, dtype=jnp.bfloat16, num_sms=_NUM_SMS_H200, block_rows=None):
    """Heuristic tuning for :func:`tree_attention` (all values can be overridden by keyword).

    block_rows: query rows per program (heads folded into rows), 64 unless T*H is smaller (min 16); a given
    ``block_rows`` is kept, and the rest (splits, warps, block_k) are derived for it.
    block_k: prefix keys per step. block_t: tree-tail keys per step (<= 64, >= 16).
    num_splits: split-KV factor so that programs >= ~2 waves of SMs, each split >= 4 blocks (64-row
    tiles) or 8 blocks (smaller tiles).
    """
    N = T * H
    block_rows = min(64, max(16, _pow2_ceil(N))) if block_rows is None else tuning_int("block_rows", block_rows)
    if not (_is_pow2(block_rows) and block_rows >= 16 and (H % block_rows == 0 or block_rows % H == 0)):
        raise ValueError(f"block_rows={block_rows} must be a power of two >= 16 dividing or divided by H={H}")
    # H200 sweep (experiments/bench_tree_attention.py): 64-row tiles want 8 warps (the 64x512 f32
    # accumulator is split over two warpgroups) and 64-key blocks; 16-row decode tiles 4 warps, 32 keys.
    wide = block_rows >= 64
    block_k = (64 if wide else 32) if jnp.dtype(dtype).itemsize <= 2 else 32
    tiles = -(-N // block_rows)
    progs = max(1, tiles * B)
    nblk = max(1, S // block_k)
    min_blocks = 4 if wide else 8
    num_splits = max(1, min(-(-2 * num_sms // progs), nblk // min_blocks, 64))
    return dict(block_rows=block_rows, block_k=block_k, block_t=min(64, max(16, _pow2_ceil(T))),
                num_splits=num_splits, num_warps=8 if wide else 4, num_stages=2)


TUNING_KEYWORDS = ("block_rows", "block_k", "block_t", "num_splits", "num_warps", "num_stages")


def check_tuning(H, *, block_rows=None, block_k=None, block_t=None, num_splits=None, num_warps=None,
                 num_stages=None) -> dict:
    """The tuning keywords of :func:`tree_attention` that are given (not None), checked as the kernel needs them
    for H heads (a ValueError naming the one that fails): block_rows a power of two >= 16 that H divides or
    divides, block_k and block_t powers of two >= 16, num_splits, num_warps and num_stages ints >= 1. Returns
    them as ints; an unknown keyword is a TypeError."""
    given = dict(block_rows=block_rows, block_k=block_k, block_t=block_t, num_splits=num_splits,
                 num_warps=num_warps, num_stages=num_stages)
    given = {name: tuning_int(name, value) for name, value in given.items() if value is not None}
    rows = given.get("block_rows")
    if rows is not None and not (_is_pow2(rows) and rows >= 16 and (H % rows == 0 or rows % H == 0)):
        raise ValueError(f"block_rows={rows} must be a power of two >= 16 dividing or divided by H={H}")
    for name in ("block_k", "block_t"):
        if not (_is_pow2(given.get(name, 16)) and given.get(name, 16) >= 16):
            raise ValueError(f"{name}={given[name]} must be a power of two >= 16")
    for name in ("num_splits", "num_warps", "num_stages"):
        if given.get(name, 1) < 1:
            raise ValueError(f"{name}={given[name]} must be >= 1")
    return given


def kernel_config(B, T, H, S, C, L, dtype=jnp.bfloat16, **tuning) -> dict:
    """:func:`tree_attention`'s configuration: :func:`default_config` with the tuning keywords given in their
    place, each checked by :func:`check_tuning`."""
    given = check_tuning(H, **tuning)
    return {**default_config(B, T, H, S, C, L, dtype, block_rows=given.get("block_rows")), **given}


def _kernel(plen_ref, q_ref, cache_ref, tkv_ref, mask_ref, *out_refs, R, H, L, RD, BK, BT, NT,
            NS, scale_log2):
    """One program: R query rows (R/H nodes x H heads, or 1 node x R heads) of one stream, one split.

    Refs (leading stream dim squeezed): plen [1]; q [R, C]; cache [S, C]; tkv [Tk, C] (Tk = NT*BT);
    mask [Tn, Tk] int32; outputs o [R, L] (+ lse [R]) or partial o [R, L] f32 + lse [R] f32.
    """
    o_ref, lse_ref = out_refs
    t = pl.program_id(0)
    s_id = pl.program_id(1)
    f32 = jnp.float32
    dt = q_ref.dtype

    q_lat = q_ref[:, pl.ds(0, L)]
    q_rope = q_ref[:, pl.ds(L, RD)]
    plen = plen_ref[0]

    def scores(k_lat, k_rope):
        dn = (((1,), (1,)), ((), ()))
        s = lax.dot_general(q_lat, k_lat, dn, preferred_element_type=f32)
        s = s + lax.dot_general(q_rope, k_rope, dn, preferred_element_type=f32)
        return s * scale_log2

    def online(carry, s, v):
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + lax.dot_general(
            p.astype(dt), v, (((1,), (0,)), ((), ())), preferred_element_type=f32)
        return m_new, l, acc

    # --- prefix: full blocks of this split, no mask ---
    n_full = plen // BK
    rem = plen - n_full * BK
    per = (n_full + NS - 1) // NS
    lo = jnp.minimum(s_id * per, n_full)
    hi = jnp.minimum(lo + per, n_full)

    def prefix_block(j, carry):
        k0 = pl.multiple_of(j * BK, BK)
        k_lat = cache_ref[pl.ds(k0, BK), pl.ds(0, L)]
        k_rope = cache_ref[pl.ds(k0, BK), pl.ds(L, RD)]
        return online(carry, scores(k_lat, k_rope), k_lat)

    carry = (jnp.full((R,), _NEG_BIG, f32), jnp.zeros((R,), f32), jnp.zeros((R, L), f32))
    carry = lax.fori_loop(lo, hi, prefix_block, carry)

    is_last = s_id == NS - 1

    # --- ragged last prefix block (last split only): zero rows >= plen, mask their scores ---
    def partial_block(_, carry):
        k0 = pl.multiple_of(n_full * BK, BK)
        valid = (lax.broadcasted_iota(jnp.int32, (BK,), 0) < rem)
        k_lat = cache_ref[pl.ds(k0, BK), pl.ds(0, L)]
        k_rope = cache_ref[pl.ds(k0, BK), pl.ds(L, RD)]
        k_lat = jnp.where(valid[:, None], k_lat, jnp.zeros((), dt))
        k_rope = jnp.where(valid[:, None], k_rope, jnp.zeros((), dt))
        s = jnp.where(valid[None, :], scores(k_lat, k_rope), -jnp.inf)
        return online(carry, s, k_lat)

    # loop bounds must share one integer type in scf.for: derive both from int32 scalars
    zero = jnp.minimum(plen, 0)
    n_part = (is_last & (rem > 0)).astype(jnp.int32)
    carry = lax.fori_loop(zero, n_part, partial_block, carry)

    # --- tree tail (last split only), with the ancestor mask ---
    npt = max(1, R // H)          # nodes per tile
    n0 = (t * R) // H             # first node of this tile

    def tail_block(j, carry):
        j0 = pl.multiple_of(j * BT, BT)
        k_lat = tkv_ref[pl.ds(j0, BT), pl.ds(0, L)]
        k_rope = tkv_ref[pl.ds(j0, BT), pl.ds(L, RD)]
        mk = mask_ref[pl.ds(n0, npt), pl.ds(j0, BT)] != 0                     # [npt, BT]
        mk = jnp.broadcast_to(mk[:, None, :], (npt, R // npt, BT)).reshape(R, BT)
        s = jnp.where(mk, scores(k_lat, k_rope), -jnp.inf)
        return online(carry, s, k_lat)

    n_tail = is_last.astype(jnp.int32) * NT
    m, l, acc = lax.fori_loop(zero, n_tail, tail_block, carry)

    # --- write ---
    l_safe = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse = jnp.where(l == 0.0, -jnp.inf, (m + jnp.log2(l_safe)) * _LN2)
    lse_ref[...] = lse


def tree_attention(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                   interpret=False, return_lse=False, block_rows=None, block_k=None, block_t=None,
                   num_splits=None, num_warps=None, num_stages=None):
    """MLA tree-verify attention, Pallas-Triton kernel. Shapes and semantics: module docstring.

    Tuning keywords (defaults from :func:`default_config`, checked by :func:`kernel_config`): block_rows (a power
    of two >= 16, by default at most 64; H must divide it or be a multiple of it), block_k (prefix keys per step),
    block_t (tail keys per step), num_splits (split-KV factor >= 1; 1 = no combine pass), num_warps, num_stages.
    B, T or H of 0 gives empty outputs.
    Requirements: L and C - L are powers of two >= 16 (K2.6: 512 and 64). S need not be a multiple
    of block_k (the cache is then padded, which costs a copy; keep capacity a multiple of 64).
    ``interpret=True`` runs the kernel through the Pallas HLO interpreter (CPU tests).
    """
    B, T, H, C, S = _check_shapes(q, cache_kv, prefix_len, tree_kv, tree_mask, kv_lora_rank)
    L = kv_lora_rank
    RD = C - L
    if not (_is_pow2(L) and _is_pow2(RD) and L >= 16 and RD >= 16):
        raise ValueError(f"kernel needs power-of-two L={L} and C-L={RD}, both >= 16; use the twin")
    cfg = kernel_config(B, T, H, S, C, L, cache_kv.dtype, block_rows=block_rows, block_k=block_k, block_t=block_t,
                        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    if B * T * H == 0:
        return _empty_result(B, T, H, L, q.dtype, return_lse)
    R, BK, BT, NS = cfg["block_rows"], cfg["block_k"], cfg["block_t"], cfg["num_splits"]
    dt = cache_kv.dtype
    f32 = jnp.float32

    # queries: heads folded into rows, padded to whole tiles (padded rows are dropped at the end)
    N = T * H
    qr = fold_rows(q.astype(dt), R)
    Np = qr.shape[1]
    n_tiles = Np // R
    # cache: keep S a multiple of BK so that no block reads past the array (padding copies it)
    Sp = max(BK, -(-S // BK) * BK)
    cache = cache_kv if Sp == S else jnp.pad(cache_kv, ((0, 0), (0, Sp - S), (0, 0)))
    plen = jnp.clip(prefix_len.astype(jnp.int32), 0, S)
    # tree tail: keys padded to NT*BT with zeros, mask columns beyond T are False; mask rows padded
    # to cover every tile's nodes (padded nodes see key 0 only so no row is empty)
    NT = -(-T // BT)
    Tk = NT * BT
    Tn = max(T, -(-Np // H))
    tkv = tree_kv[:, :T].astype(dt)
    if Tk != T:
        tkv = jnp.pad(tkv, ((0, 0), (0, Tk - T), (0, 0)))
    mask = tree_mask.astype(jnp.int32)
    mask = jnp.pad(mask, ((0, 0), (0, Tn - T), (0, Tk - T)))
    if Tn != T:
        mask = mask.at[:, T:, 0].set(1)

    grid = (n_tiles, NS, B)
    in_specs = [
        pl.BlockSpec((1,), lambda t, s, b: (b,)),
        pl.BlockSpec((None, R, C), lambda t, s, b: (b, t, 0)),
        pl.BlockSpec((None, Sp, C), lambda t, s, b: (b, 0, 0)),
        pl.BlockSpec((None, Tk, C), lambda t, s, b: (b, 0, 0)),
        pl.BlockSpec((None, Tn, Tk), lambda t, s, b: (b, 0, 0)),
    ]
    if NS == 1:
        out_shape = [jax.ShapeDtypeStruct((B, Np, L), q.dtype), jax.ShapeDtypeStruct((B, Np), f32)]
        out_specs = [pl.BlockSpec((None, R, L), lambda t, s, b: (b, t, 0)),
                     pl.BlockSpec((None, R), lambda t, s, b: (b, t))]
    else:
        # normalised partial outputs in the input dtype when 16-bit (halves split-KV traffic; each
        # partial is rounded once, like the final output), f32 otherwise; LSEs always f32
        part_dt = q.dtype if jnp.dtype(q.dtype).itemsize <= 2 else f32
        out_shape = [jax.ShapeDtypeStruct((B, NS, Np, L), part_dt),
                     jax.ShapeDtypeStruct((B, NS, Np), f32)]
        out_specs = [pl.BlockSpec((None, None, R, L), lambda t, s, b: (b, s, t, 0)),
                     pl.BlockSpec((None, None, R), lambda t, s, b: (b, s, t))]
    kernel = functools.partial(_kernel, R=R, H=H, L=L, RD=RD, BK=BK, BT=BT, NT=NT, NS=NS,
                               scale_log2=float(scale) * _LOG2E)
    flops = 2 * B * Np * (Sp + Tk) * (C + L)
    bytes_accessed = (B * Sp * C + B * Np * C + B * Tk * C) * jnp.dtype(dt).itemsize + \
        B * Np * L * NS * jnp.dtype(q.dtype).itemsize
    o, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"],
                                                num_stages=cfg["num_stages"]),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(B * Np * (Sp + Tk)),
                                      bytes_accessed=int(bytes_accessed)),
        name="mla_tree_attention",
    )(plen, qr, cache, tkv, mask)

    if NS > 1:  # log-sum-exp combine of the splits, one launch
        o, lse = combine_splits(o, lse, split_axis=1, out_dtype=q.dtype, interpret=interpret)
    out = o[:, :N].reshape(B, T, H, L)
    if return_lse:
        return out, lse[:, :N].reshape(B, T, H)
    return out


def kernel_supports(q_shape, kv_lora_rank, block_rows=None) -> bool:
    """Whether :func:`tree_attention` accepts these dims (else the dispatcher uses the twin)."""
    _, T, H, C = q_shape
    L, RD = kv_lora_rank, C - kv_lora_rank
    R = block_rows or min(64, max(16, _pow2_ceil(T * H)))
    return (_is_pow2(L) and _is_pow2(RD) and L >= 16 and RD >= 16 and _is_pow2(R) and R >= 16
            and (H % R == 0 or R % H == 0))


def mla_attention(q, cache_kv, prefix_len, tree_kv, tree_mask, *, scale, kv_lora_rank,
                  interpret=False, return_lse=False, backend="auto", **tuning):
    """Dispatcher: a Pallas kernel when lowered for CUDA, the pure-JAX twin on any other platform.

    The choice is made per lowering platform (``lax.platform_dependent``), not from environment or
    global state, so the same jitted function runs on a CPU host and on the H200. On CUDA, ``backend``
    "mgpu" is the Mosaic GPU kernel (``pallas_kernels.mla_attention_mgpu``), "triton" this module's
    kernel, and "auto" (default) the Mosaic GPU kernel wherever it takes the dtype and dims, else
    Triton. Tuning keywords go to the chosen kernel (their presence with "auto" picks Triton, whose
    keywords they are); they are checked on every platform (:func:`check_tuning`, or the Mosaic kernel's).
    With "auto", dims no kernel takes use the twin everywhere; an explicit backend that cannot take them
    raises. B, T or H of 0 gives empty outputs. ``interpret=True`` forces the Triton kernel through the Pallas
    interpreter on every platform (tests). Since the Mosaic kernel took the tree tail in (session 5) it
    beat Triton at every measured shape, also below 64 query rows, which it pads to one 64-row tile:
    T = 1, H = 8 at B = 16, 8K prefix 0.074 vs 0.092 ms, at B = 1, 64K 0.087 vs 0.125 ms
    (experiments/results/bench_tree_attention_mgpu_tail_h200.json).
    """
    from pallas_kernels import mla_attention_mgpu as mgpu  # lazy: that module imports this one

    if backend not in ("auto", "mgpu", "triton"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'mgpu' or 'triton'")
    kw = dict(scale=scale, kv_lora_rank=kv_lora_rank, return_lse=return_lse)
    args = (q, cache_kv, prefix_len, tree_kv, tree_mask)
    if interpret:
        if backend == "mgpu":
            raise NotImplementedError("the Mosaic GPU kernel has no interpret mode; use backend='triton'")
        return tree_attention(*args, interpret=True, **kw, **tuning)
    mgpu_problem = mgpu.unsupported_reason(q.shape, cache_kv.shape, kv_lora_rank, q.dtype, cache_kv.dtype,
                                           tree_kv.dtype)
    triton_ok = kernel_supports(q.shape, kv_lora_rank, tuning.get("block_rows"))
    if backend == "mgpu" and mgpu_problem:
        raise ValueError(f"the Mosaic GPU kernel cannot take {mgpu_problem}")
    if backend == "triton" and not triton_ok:
        raise ValueError(f"the Triton kernel cannot take q {q.shape} with kv_lora_rank={kv_lora_rank} "
                         f"(block_rows={tuning.get('block_rows')})")
    if backend == "mgpu":  # each kernel's keywords: checked on every platform, as that kernel checks them
        mgpu.check_tuning(**tuning)
    else:
        check_tuning(q.shape[2], **tuning)
    if 0 in q.shape[:3]:  # nothing to attend (B, T or H is 0): the twin's empty outputs, no kernel
        return tree_attention_ref(*args, **kw)
    if backend == "mgpu" or (backend == "auto" and not mgpu_problem and not tuning):
        kernel = functools.partial(mgpu.tree_attention_mgpu, **kw, **tuning)
    elif triton_ok:
        kernel = functools.partial(tree_attention, **kw, **tuning)
    else:
        return tree_attention_ref(*args, **kw)
    return lax.platform_dependent(*args, cuda=kernel, default=lambda *a: tree_attention_ref(*a, **kw))


# Notes (measured on one H200, JAX 0.11.2, experiments/results/bench_tree_attention_run{2,3}_*.json):
# * Backend: this kernel came first because the Triton backend (deprecated, still in 0.11.x) lowers
#   the dots to wgmma and runs in the CPU interpreter. The hand-written Mosaic GPU kernel
#   (mla_attention_mgpu.py) later beat it 1.6-1.7x where compute bounds (71 % vs 44 % of peak at
#   T = 256, H = 64) and reached 81 % of copy bandwidth at T = 1, H = 64, B = 16, 64K; this kernel
#   stays the CUDA path where the Mosaic kernel cannot run, and the interpreted one.
# * Triton's scf.for needs both loop bounds of one integer type: a Python-int bound next to a traced
#   int32 passed CPU lowering but failed the H200's Triton parse (tests verify the module on CPU now).
# * Compute-bound (T >= 32, H = 64; T >= 64, H = 8): 240-260 TFLOP/s = 41-44 % of the measured bf16
#   matmul rate; XLA's dense masked attention (cuBLAS GEMMs, materialised scores) is 1.4-2x faster
#   at these shapes. Tiles of 64 rows use 8 warps, so Triton splits N between the two warpgroups:
#   the 64-key QK product runs as n=32 wgmmas re-reading the 64x576 q tile from SMEM per key block,
#   and the softmax between the QK and PV products is not overlapped (no ping-pong as in FlashMLA).
#   4 warps (one warpgroup owning the 64x512 f32 accumulator) spills and ran 2x slower.
# * Memory-bound decode (T = 1, H = 8): 1.5-1.7 TB/s = 35-40 % of PyTorch's 4.2 TB/s device copy
#   (bench_util's jitted a+1 measured only 2.1-2.7 TB/s). Split-KV partials plus the XLA combine cost
#   a few small launches per call (~10 % at 8K prefix, ~2 % at 64K).

"""How the Mosaic GPU MLA attention op cuts a call into programs: the shapes and shares that both kernels
(``mla_attention_mgpu.split_attention``, 64-row tiles, and ``mla_attention_narrow.split_attention_narrow``),
their twin and the op's default plan (``mla_attention_mgpu.default_plan``) agree on. No kernel code here.

* rows: 64-row query tiles (``ROWS``), or one tile and a tail of ``TAIL_ROWS`` (:func:`tail_rows_of`), or the
  first V < 64 real rows of one tile (:func:`valid_rows_for`, :func:`check_valid_rows`);
* splits per stream and tile: :func:`splits_for` (one wave of SMs, :func:`default_splits`);
* each split's key blocks: :func:`split_range` and, inside a kernel, :func:`block_steps`;
* whether the 64-row kernel can merge two splits itself (:func:`peer_merge_fits`).

Dimension letters: B streams, T tree nodes, H heads, S cache slots, BK keys per block, NS splits, TB tree blocks.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.tree_attention import _NUM_SMS_H200

__all__ = ["ROWS", "TAIL_ROWS", "MAX_SPLITS", "ONE_BLOCK_CACHE", "ONE_BLOCK_ROWS", "tail_rows_of", "tail_keys",
           "default_splits", "splits_for", "block_steps", "split_range", "valid_rows_for", "peer_merge_fits",
           "check_valid_rows"]

ROWS = 64              # query rows per program (one wgmma M tile)
TAIL_ROWS = 8          # rows past one tile that its program takes with keys as wgmma's M ("Tail rows")
MAX_SPLITS = 128       # one wave of the H200 at B = 1, one tile; the merge reads NS partials per row (132
                       # splits: 8 blocks each at B = 1, 64K, not 9, and the kernel 2 µs faster, but the
                       # merge takes two chunks and 0.7 µs more: the op as fast; RESULTS.md, session 16)


def tail_rows_of(rows: int) -> int:
    """The tail of ``rows`` query rows: TAIL_ROWS when they are one 64-row tile and a tail, else 0."""
    return TAIL_ROWS if rows == ROWS + TAIL_ROWS else 0


def tail_keys(T: int, block_k: int) -> int:
    """Keys past a prefix's whole blocks, in whole blocks, at most: a partial block (< BK rows) and T tree
    keys (sizes the default split count)."""
    return -(-(block_k - 1 + T) // block_k) * block_k


def default_splits(B: int, n_tiles: int, S: int, block_k: int, num_sms: int = _NUM_SMS_H200,
                   min_blocks: int = 2) -> int:
    """Splits so that the programs fill at most one wave of SMs (one program per SM; a program past the
    wave runs alone afterwards), with at least ``min_blocks`` key blocks per split at full capacity S and at
    most MAX_SPLITS. (Sized from the capacity, which is static; a short prefix in a large cache leaves
    splits empty, each costing one small program.)"""
    progs = max(1, B * n_tiles)
    return max(1, min(num_sms // progs, (S // block_k) // min_blocks, MAX_SPLITS))


# One key block a split (not 2) where the partials are this few rows (32 rows x 512 f32 = 64 KB a split, less
# than the 72 KB of keys it reads), or where the cache is this short and one wave holds a program for every
# block. On the H200 (RESULTS.md, session 38) one block a split was 7-23 % faster over 1K with 1 and 4 streams
# and with 8 rows over 8K at one stream; 2-6 % slower with 64 rows over 8K at one stream (130 programs of one
# block); session 39: 17 splits (one block each) beat 16 and 8 at T = 1, H = 64 over 1K. Prefixes between 1K and
# 8K were not measured.
ONE_BLOCK_CACHE = 1024
ONE_BLOCK_ROWS = 32


def splits_for(B: int, T: int, H: int, S: int, block_k: int = 64, num_sms: int = _NUM_SMS_H200,
               tail: bool = True) -> int:
    """The split count ``tree_attention_mgpu`` uses by default for B streams of T nodes x H heads over a
    cache of S slots: :func:`default_splits` of its 64-row tiles (one with a tail where T*H = 72 and
    ``tail``) over the cache and tree blocks; one key block a split at least where the real rows
    (``valid_rows_for``) are at most ONE_BLOCK_ROWS, or where S <= ONE_BLOCK_CACHE and a program per block
    fits one wave of ``num_sms``; else two."""
    n_tiles = 1 if tail and tail_rows_of(T * H) else -(-T * H // ROWS)
    keys = S + tail_keys(T, block_k)
    rows = valid_rows_for(T, H)
    one_block = (rows is not None and rows <= ONE_BLOCK_ROWS) or \
        (S <= ONE_BLOCK_CACHE and B * n_tiles * (keys // block_k) <= num_sms)
    return default_splits(B, n_tiles, keys, block_k, num_sms, min_blocks=1 if one_block else 2)


def block_steps(plen, tree_blocks: int, sp, num_splits: int, block_k: int, peer_merge: bool = False):
    """A program's key blocks, inside a kernel: (rem keys of the partial cache block, nbp = cache blocks read,
    lo = its first block, then the step bounds: [0, n_whole) whole cache blocks, [n_whole, n_cache) the
    partial block (0 or 1 step), [n_cache, n_all) tree blocks)."""
    nb = plen // block_k
    rem = plen - nb * block_k
    nbp = nb + (rem > 0).astype(jnp.int32)
    lo, mid, hi = split_range(nbp, tree_blocks, sp, num_splits, peer_merge)
    return rem, nbp, lo, jnp.clip(nb, lo, mid) - lo, mid - lo, hi - lo


def split_range(nb, tree_blocks: int, sp, num_splits: int, peer_merge: bool = False):
    """Blocks of split ``sp``: [lo, hi) of the ``nb`` cache blocks and TB tree blocks (cache blocks first),
    and ``mid``, where its cache blocks end and its tree blocks begin. Each split takes ceil(total / NS) blocks
    in order, so the last splits may hold fewer or none (shares that differ by at most one block were slower
    at 12 of 15 points on the H200, session 48). With ``peer_merge`` (two splits) split 1 takes the first
    total - (total - 1) // 2 and split 0 the rest, at least one block fewer, so that its output is stored before
    split 1's loop ends."""
    total = nb + tree_blocks
    if peer_merge:
        first = jnp.minimum(total - (total - 1) // 2, total)  # split 1's share
        lo = jnp.where(sp == 1, 0, first)
        hi = jnp.where(sp == 1, first, total)
    else:
        per = (total + num_splits - 1) // num_splits
        lo = jnp.minimum(sp * per, total)
        hi = jnp.minimum(lo + per, total)
    return lo, jnp.clip(nb, lo, hi), hi


def valid_rows_for(T: int, H: int) -> int | None:
    """The kernels' valid_rows for T nodes x H heads: N = T*H when that is one partial tile (N < 64, a multiple
    of 8: the partials of only the real rows are written and merged), else None."""
    n = T * H
    return n if n < ROWS and n % 8 == 0 else None


def peer_merge_fits(num_splits: int, tail: bool, share_scores: bool, whole_tiles: bool) -> bool:
    """Whether ``mla_attention_mgpu.split_attention`` can merge its splits itself (``peer_merge``): two splits of
    whole 64-row tiles (no tail, every row written) with shared scores."""
    return num_splits == 2 and not tail and share_scores and whole_tiles


def check_valid_rows(valid_rows, rows: int) -> int:
    """V for the kernels (``valid_rows``): ``rows`` (Np) by default, else a multiple of 8 in (0, 64) with one tile."""
    if valid_rows is None or valid_rows == rows:
        return rows
    if rows != ROWS or not (0 < valid_rows < ROWS and valid_rows % 8 == 0):
        raise ValueError(f"valid_rows={valid_rows} must be Np={rows}, or a multiple of 8 below {ROWS} when q_rows "
                         f"is one {ROWS}-row tile")
    return valid_rows

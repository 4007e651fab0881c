"""Routing metadata of the grouped INT4 expert GEMMs, in XLA: shared by the kernels and their twins.

Dimension letters: M tokens, K top-k, Q = M K (token, slot) pairs, E local experts, N tokens per tile,
NT tiles, P rows.

Every router gives each busy expert a run of consecutive rows, padded to whole tiles, so that a tile
belongs to one expert. Experts' runs come in expert order, and within a run the pairs keep their flat
(token-major) order. A pair whose expert id lies outside [0, E) (held by another device under expert
parallelism) gets no row.

Two ways (``method``) compute the same layout, bit for bit:
- "sort": a stable sort of the pairs by expert, per-expert counts by scatter-add, prefix sums over E, and
  the rows' pairs by scatter. Its cost grows as Q log Q.
- "compare": [Q, Q] comparisons between pairs give each pair's rank within its expert, [E, Q] the
  counts, [E, E] the prefix sums and [P, Q] each row's pair. There is no sort, scatter or scan, so XLA
  fuses the lot into a few kernels, but the work grows as Q^2.
"auto" takes "compare" up to ``COMPARE_MAX_PAIRS`` = 4096 pairs (512 tokens at top-8). On the H200 (session 9,
traced, the whole routed-expert layer at K2.6 dims, uniform routing) the sort path's routing was a dozen
small launches at one token, one of them a 6 us fusion that recomputed two prefix sums over E inline; with
"compare" the layer took 75.4 us at M = 1 against 89.5 (glue 12 us against 25), 0.435 ms at 9 against
0.449 and 2.492 ms at 256 against 2.501 (experiments/results/bench_moe_s9.json for "sort",
bench_moe_s9_routing*.json for "compare": two runs of the same hour). Session 14 (ragged tiles, same
method): at M = 512 "compare" took the glue from 111 to 85 us (2.715 ms against 2.742; the sort's eight
4 us kernels against two reductions of 10 and 8 us: bench_moe_s14_compare512.json); at 1024 it lost,
179 against 159 us (bench_moe_s14_compare1024.json), so 8192 pairs stay with the sort.

``route_ragged`` lays the runs out in tiles as wide as the pairs need, in steps of 8 rows; ``route_per_pair``
is the layout for one token: a tile per pair in flat order, no grouping at all.
"""

from __future__ import annotations

import jax.numpy as jnp

COMPARE_MAX_PAIRS = 4096
METHODS = ("auto", "sort", "compare")


def check_moe_inputs(x, expert_ids, expert_weights, d_model: int) -> tuple[int, int, int]:
    """The routed experts' token inputs: x [M, D] with D = ``d_model``, expert_ids [M, K] integers, expert_weights
    [M, K]. Returns (M, D, K), or a ValueError naming the mismatch."""
    if x.ndim != 2 or x.shape[1] != d_model:
        raise ValueError(f"x must be [M, D] with D = d_model = {d_model}, got {tuple(x.shape)}")
    m, d = x.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != m or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids must be integers [M, K] with M = {m}, got "
                         f"{expert_ids.dtype}{tuple(expert_ids.shape)}")
    if tuple(expert_weights.shape) != tuple(expert_ids.shape):
        raise ValueError(f"expert_weights must be [M, K] = {tuple(expert_ids.shape)} like expert_ids, got "
                         f"{tuple(expert_weights.shape)}")
    return m, d, expert_ids.shape[1]


def routing_method(pairs: int, method: str = "auto") -> str:
    """The method that ``method`` resolves to for ``pairs`` pairs; ValueError for an unknown one."""
    if method not in METHODS:
        raise ValueError(f"routing method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        return "compare" if pairs <= COMPARE_MAX_PAIRS else "sort"
    return method


def max_tiles(m: int, k: int, e: int, t: int) -> int:
    """Static upper bound on sum_e ceil(count_e / t) for m*k pairs over e experts."""
    pairs = m * k
    return max(1, (pairs + min(e, pairs) * (t - 1)) // t)


def group_pairs(flat, num_experts: int, method: str):
    """flat int32 [Q] local expert ids -> (order, e, local, counts, rank): the pairs in the method's order
    ("sort": by expert, stable; order int32 [Q] the flat index of each; "compare": flat order, order None),
    each pair's expert e int32 [Q] (clipped to [0, E)), local bool [Q] (id in [0, E)) and rank int32 [Q]
    (earlier pairs of the same expert), and counts int32 [E] (pairs per expert)."""
    q = flat.shape[0]
    idx = jnp.arange(q, dtype=jnp.int32)
    if method == "compare":
        e_range = jnp.arange(num_experts, dtype=jnp.int32)
        local = (flat >= 0) & (flat < num_experts)
        same = (flat[:, None] == flat[None, :]) & local[:, None]
        rank = jnp.sum(same & (idx[None, :] < idx[:, None]), axis=1, dtype=jnp.int32)
        counts = jnp.sum(flat[None, :] == e_range[:, None], axis=1, dtype=jnp.int32)
        return None, jnp.clip(flat, 0, num_experts - 1), local, counts, rank
    keyed = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # non-local pairs sort last
    order = jnp.argsort(keyed, stable=True).astype(jnp.int32)
    sorted_e = keyed[order]
    local = sorted_e < num_experts
    e = jnp.minimum(sorted_e, num_experts - 1)
    counts = jnp.zeros((num_experts,), jnp.int32).at[keyed].add(1, mode="drop")
    return order, e, local, counts, idx - exclusive_prefix(counts, method)[e]


def exclusive_prefix(v, method: str):
    """int32 [E] -> [E]: the sum of the entries before each."""
    if method == "compare":
        idx = jnp.arange(v.shape[0], dtype=jnp.int32)
        return jnp.sum(jnp.where(idx[None, :] < idx[:, None], v[None, :], 0), axis=1, dtype=jnp.int32)
    return (jnp.cumsum(v) - v).astype(jnp.int32)


def rows_of_pairs(pos, order, p: int, m: int, k: int):
    """Row ``pos`` int32 [Q] of each pair, in ``group_pairs``' order (>= P: no row) -> (row_pair int32 [P], the
    flat pair index, Q for padding rows; row_token int32 [P], M for padding rows; pair_row int32 [M, K])."""
    q = m * k
    if order is None:  # "compare": pos is in flat order
        hit = pos[None, :] == jnp.arange(p, dtype=jnp.int32)[:, None]  # [P, Q]: a row holds at most one pair
        row_pair = jnp.sum(jnp.where(hit, jnp.arange(q, dtype=jnp.int32)[None, :] - q, 0), axis=1,
                           dtype=jnp.int32) + q
        pair_row = pos
    else:
        row_pair = jnp.full((p,), q, jnp.int32).at[pos].set(order, mode="drop")
        pair_row = jnp.zeros((q,), jnp.int32).at[order].set(pos)
    row_token = jnp.where(row_pair < q, row_pair // k, m).astype(jnp.int32)
    return row_pair, row_token, pair_row.reshape(m, k)


def run_owners(run_end, nt: int):
    """Expert of each of ``nt`` tiles laid out as consecutive runs (run_end int32 [E]: cumulative tiles per
    expert), -1 past the last run (no while loop)."""
    tidx = jnp.arange(nt, dtype=jnp.int32)
    owner = jnp.sum(run_end[None, :] <= tidx[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(tidx < run_end[-1], owner, -1)


def route_narrow(expert_ids, expert_weights, num_experts: int, tile: int, method: str = "auto"):
    """Pads each expert's run to a multiple of ``tile`` rows.

    expert_ids int32 [M, K] local ids, expert_weights [M, K]. Returns row_token int32 [P] (M for padding
    rows), row_weight f32 [P] (0 for padding rows), tile_expert int32 [NT] (-1 for unused tiles),
    num_tiles int32 [] and pair_row int32 [M, K] (the row of each pair; P for pairs with no row);
    P = NT N with NT = ``max_tiles``.
    """
    m, k = expert_ids.shape
    nt = max_tiles(m, k, num_experts, tile)
    p = nt * tile
    method = routing_method(m * k, method)
    order, e, local, counts, rank = group_pairs(expert_ids.reshape(-1).astype(jnp.int32), num_experts, method)
    tiles = (counts + tile - 1) // tile
    start = exclusive_prefix(tiles, method)
    pos = jnp.where(local, start[e] * tile + rank, p)
    row_pair, row_token, pair_row = rows_of_pairs(pos, order, p, m, k)
    w_flat = jnp.concatenate([expert_weights.reshape(-1).astype(jnp.float32), jnp.zeros((1,), jnp.float32)])
    return row_token, w_flat[row_pair], run_owners(start + tiles, nt), jnp.sum(tiles), pair_row


def ragged_rows_bound(pairs: int, num_experts: int) -> int:
    """Rows P of ``route_ragged``: the pairs plus at most 7 padding rows per busy expert (only an expert's
    last tile is partial, and it is rounded up to a multiple of 8), rounded up to 8."""
    return -(-(pairs + 7 * min(num_experts, pairs)) // 8) * 8


def route_ragged(expert_ids, num_experts: int, tile: int, method: str = "auto"):
    """Tiles as wide as the pairs need: an expert with c pairs gets c // N full tiles of N = ``tile`` rows
    and, if N does not divide c, one more of (c mod N) rows rounded up to a multiple of 8, so that it is fed
    to the tensor cores in ceil(c / N) passes, each no wider than its pairs plus at most 7 padding rows
    (``grouped_int4_matmul(tile_rows=)``). Runs are consecutive in expert order; no run is padded to N.

    expert_ids int32 [M, K] (local ids; others get no row). Returns row_token int32 [P] (M for padding
    rows; P = ``ragged_rows_bound``), tile_expert int32 [NT] (-1 for unused tiles; NT = ``max_tiles``),
    tile_rows int32 [2, NT] (each tile's first row and width; 0 and 8 for unused tiles) and pair_row int32
    [M, K] (P for pairs with no row).
    """
    if tile % 8 or tile < 8:
        raise ValueError(f"tile={tile} must be a positive multiple of 8")
    m, k = expert_ids.shape
    pairs = m * k
    nt, p = max_tiles(m, k, num_experts, tile), ragged_rows_bound(pairs, num_experts)
    method = routing_method(pairs, method)
    order, e, local, counts, rank = group_pairs(expert_ids.reshape(-1).astype(jnp.int32), num_experts, method)
    tiles = (counts + tile - 1) // tile
    padded = (counts // tile) * tile + (counts % tile + 7) // 8 * 8
    row_start, tile_start = exclusive_prefix(padded, method), exclusive_prefix(tiles, method)
    _, row_token, pair_row = rows_of_pairs(jnp.where(local, row_start[e] + rank, p).astype(jnp.int32), order, p,
                                           m, k)
    tile_expert = run_owners(tile_start + tiles, nt)
    owner = jnp.maximum(tile_expert, 0)
    j = jnp.arange(nt, dtype=jnp.int32) - tile_start[owner]  # the tile's place in its expert's run
    first = row_start[owner] + j * tile
    width = jnp.minimum(tile, (counts[owner] - j * tile + 7) // 8 * 8)
    used = tile_expert >= 0
    tile_rows = jnp.stack([jnp.where(used, first, 0), jnp.where(used, width, 8)]).astype(jnp.int32)
    return row_token, tile_expert, tile_rows, pair_row


def route_per_pair(expert_ids, num_experts: int, tile: int):
    """One tile per pair, in flat order: tile q holds pair q in its first row, the other N - 1 rows are
    padding. Nothing is grouped (no comparisons, sort or prefix sums), so the routing is a handful of
    elementwise ops. For one token, whose K experts are distinct, this is the grouped layout's tile count
    and traffic; pairs that share an expert each stream its weights (correct, but only worth it where they
    cannot share, as at M = 1).

    expert_ids int32 [M, K] local ids. Returns row_token int32 [P = Q N] (M for padding rows), tile_expert
    int32 [Q] (-1 for a pair held elsewhere: its tile is skipped) and pair_row int32 [M, K] (P for pairs
    with no row). With no pairs (Q = 0) there is one idle tile (tile_expert [-1]), as the kernels take no
    empty grid.
    """
    m, k = expert_ids.shape
    q = m * k
    nt = max(q, 1)
    p = nt * tile
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    local = (flat >= 0) & (flat < num_experts)
    rows = jnp.arange(p, dtype=jnp.int32)
    row_token = jnp.where((rows % tile == 0) & (rows < q * tile), rows // (tile * max(k, 1)), m).astype(jnp.int32)
    pair_row = jnp.where(local, jnp.arange(q, dtype=jnp.int32) * tile, p).reshape(m, k)
    tile_expert = jnp.concatenate([jnp.where(local, flat, -1), jnp.full((nt - q,), -1, jnp.int32)])
    return row_token, tile_expert, pair_row

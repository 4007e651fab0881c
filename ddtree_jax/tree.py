"""Device-side draft trees: DDTree build, DFlash chain, lossless acceptance walk.

Everything here is pure JAX with static shapes and jit-able; nothing syncs with the host.
Dimension letters: B streams, T tree nodes (root included), Dp draft depth (= block_size - 1),
W vocabulary, D the tree's static maximum depth (``Tree.max_depth``).

One verify/accept path serves every mode:

* AR:            ``chain_tree(draft_tokens[B, 0], root)``  -> T = 1, D = 0.
* DFlash chain:  ``chain_tree(draft_tokens[B, Dp], root)`` -> T = Dp + 1, D = Dp (causal).
* DDTree:        ``build_tree(draft_logprobs, root, budget)`` -> T = budget + 1, D = min(Dp, budget).

DDTree build (notes §3.2-3.3). The tree is the ``budget`` highest-probability prefixes of the
factorised draft distribution Q(y_1..y_Dp) = prod_d q_d(y_d); a prefix's score is the float32 sum
of its per-depth log-probabilities, accumulated root-to-leaf (``score(child) = score(parent) +
lp``). It is computed without a sequential heap: a per-depth beam of width ``budget`` (depth d
candidates = beam(d-1) x top-``budget`` tokens of q_d, pruned to pairs whose ranks satisfy
``(i+1)(j+1) <= budget``, since every pair dominating (i, j) ranks before it) followed by one
global top-``budget`` over all depths. Log-probs are clamped to <= 0, so a child never scores
above its parent and the set is prefix-closed.

**Tie rule** (deterministic; the heap reference in tests/test_tree.py uses the same key).
Prefixes are ranked by the key ``(-score, depth, parent_rank, token_rank)`` ascending, where
``parent_rank`` is the rank of the parent among all prefixes of the parent's depth under the same
rule (the root has rank 0) and ``token_rank`` is the token's rank at its depth by
``(-log_prob, token_id)``. I.e. higher score first; on equal score the shallower prefix; then the
one whose parent ranks better; then the token with the higher own log-prob, then the smaller token
id. (With a finite parent score, equal score and equal parent imply equal own log-prob, so the
last step is simply "smaller token id"; the own log-prob only matters under a -inf parent, where
every child scores -inf.) NaN log-probs are treated as -inf; -inf prefixes are ordinary
(lowest-scoring) prefixes and fill the budget when fewer finite prefixes exist. Per-depth token
ranking relies on ``lax.top_k``'s documented contract that equal values come out lower index
first, which ``ddtree_jax.topk.top_k`` keeps by every method (on a GPU, ``lax.top_k`` sorts whole rows
once k > 16: ~100 us a round for 7 rows of a 163 840 vocabulary, ~1.1 ms for 28; its "chunked" method reads
the rows once and sorts only small arrays).

Node order: node 0 is the root; node n >= 1 is the n-th best prefix under the key above (the
order a best-first heap pops them). Hence parents precede children, ``logprob`` is
non-increasing along the node axis, and the first k+1 nodes of a budget-B tree are the budget-k
tree.

Acceptance (notes §3.6). One target token per node (argmax at temperature 0; one independent sample from
softmax(logits / temperature) otherwise, truncated by top-k / top-p when asked: ``sampling``); from the root
follow the child whose token equals the target's token at the current node; the target's token at the last
accepted node is the new bonus token. Every emitted token is then a target sample given exactly the committed
prefix, so the output distribution equals the target's (lossless). Do NOT use min(1, p/q) with draft marginals.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddtree_jax.checks import as_int32
from ddtree_jax.sampling import check_hot_temperature, scaled_logits, truncate
from ddtree_jax.topk import top_k

MAX_BUDGET = 4096
"""Largest supported DDTree node budget (T = MAX_BUDGET + 1 nodes; visibility is [B, T, T])."""

PAD = -1
"""Padding value of ``Acceptance.path``, ``accepted_tokens``, ``emitted`` past the accepted length."""


# --------------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tree:
    """A verify tree for B streams, T nodes each; node 0 is the root (the bonus token, depth 0).

    Fields (all jax arrays except ``max_depth``):
      tokens:     [B, T] int32  token of each node (node 0 = root token).
      parents:    [B, T] int32  parent node index, ``parents[:, t] < t``; ``parents[:, 0] == -1``.
      depths:     [B, T] int32  depth of each node; root 0, ``depths[parent] + 1 == depths[t]``.
      logprob:    [B, T] f32    cumulative draft log-probability of the node's prefix (root 0;
                                zeros for chains built without draft log-probs).
      visibility: [B, T, T] bool ``visibility[b, i, j]``: node j is an ancestor of node i or i itself
                                (the ancestor-only attention mask of the tree block).
      max_depth:  static int D  upper bound on ``depths`` (the acceptance walk runs D steps).
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    logprob: jax.Array
    visibility: jax.Array
    max_depth: int

    @property
    def num_nodes(self) -> int:
        """T, static."""
        return self.tokens.shape[1]

    def positions(self, start: jax.Array) -> jax.Array:
        """RoPE positions of the nodes: ``start[:, None] + depths`` -> [B, T] int32.

        ``start`` [B] int32 is the position of the root (the bonus token) in each stream. Siblings
        share a position.
        """
        return as_int32("start", start)[:, None] + self.depths


jax.tree_util.register_dataclass(
    Tree,
    data_fields=["tokens", "parents", "depths", "logprob", "visibility"],
    meta_fields=["max_depth"],
)


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Result of the acceptance walk over a Tree with static max depth D.

    Fields:
      num_accepted:    [B] int32       drafted nodes accepted, 0..D (the root is not counted).
      path:            [B, D+1] int32  node indices of the accepted path, ``path[:, 0] == 0``
                                       (root), ``path[:, k]`` is the accepted node of depth k for
                                       k <= num_accepted, PAD (-1) after.
      next_token:      [B] int32       target's token at the last accepted node: the new bonus.
      accepted_tokens: [B, D] int32    tokens of path[:, 1:], PAD after num_accepted.
      emitted:         [B, D+1] int32  tokens committed this round: accepted_tokens then
                                       next_token at index num_accepted, PAD after; the round
                                       emits ``num_accepted + 1`` tokens (tau).
      target_tokens:   [B, T] int32    the target's token (argmax or sample) at every node.
    """

    num_accepted: jax.Array
    path: jax.Array
    next_token: jax.Array
    accepted_tokens: jax.Array
    emitted: jax.Array
    target_tokens: jax.Array


jax.tree_util.register_dataclass(
    Acceptance,
    data_fields=["num_accepted", "path", "next_token", "accepted_tokens", "emitted", "target_tokens"],
    meta_fields=[],
)


# --------------------------------------------------------------------------------------------------
# Budget validation
# --------------------------------------------------------------------------------------------------


def _num_prefixes_at_least(depth: int, vocab: int, needed: int) -> bool:
    """Whether sum_{d=1..depth} vocab**d >= needed (without building huge integers)."""
    total, layer = 0, 1
    for _ in range(depth):
        layer *= vocab
        total += layer
        if total >= needed:
            return True
    return total >= needed


def check_budget(budget, depth: int | None = None, vocab: int | None = None) -> int:
    """Validate a DDTree node budget; returns it as int or raises ValueError.

    ``budget`` must be a Python int (static) with 1 <= budget <= MAX_BUDGET. When ``depth`` (Dp)
    and ``vocab`` (W) are given it must also not exceed the number of distinct draft prefixes
    sum_{d=1..Dp} W**d (the tree has exactly ``budget`` distinct non-root nodes).
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(
            f"DDTree budget must be a static Python int in [1, {MAX_BUDGET}], got {budget!r} "
            f"({type(budget).__name__})"
        )
    budget = int(budget)
    if budget < 1:
        raise ValueError(
            f"DDTree budget must be >= 1 (number of drafted nodes besides the root), got {budget}; "
            "for plain autoregressive decoding use chain_tree with zero draft tokens"
        )
    if budget > MAX_BUDGET:
        raise ValueError(
            f"DDTree budget {budget} exceeds the supported maximum MAX_BUDGET = {MAX_BUDGET}"
        )
    if depth is not None and vocab is not None:
        if depth < 1 or vocab < 1:
            raise ValueError(f"DDTree needs draft depth >= 1 and vocab >= 1, got Dp={depth}, W={vocab}")
        if not _num_prefixes_at_least(depth, vocab, budget):
            raise ValueError(
                f"DDTree budget {budget} exceeds the number of distinct draft prefixes for "
                f"Dp={depth}, W={vocab} (sum of W**d for d=1..Dp)"
            )
    return budget


# --------------------------------------------------------------------------------------------------
# Tree construction
# --------------------------------------------------------------------------------------------------


def _check_parents(parents: np.ndarray, max_depth: int) -> None:
    """A concrete parents array [B, T] describes trees: the root's parent is -1, every other node's parent an
    earlier node, and no node deeper than ``max_depth``; ValueError naming the first (stream, node) that is not."""
    b, t = parents.shape
    bad_root = np.flatnonzero(parents[:, 0] != -1)
    if bad_root.size:
        raise ValueError(f"parents[:, 0] must be -1 (node 0 is the root); stream {bad_root[0]} has "
                         f"{parents[bad_root[0], 0]}")
    nodes = np.arange(t)
    bad = np.argwhere((parents[:, 1:] < 0) | (parents[:, 1:] >= nodes[1:]))
    if bad.size:
        s, n = bad[0][0], bad[0][1] + 1
        raise ValueError(f"parents[:, t] must lie in [0, t) for t >= 1; stream {s} node {n} has {parents[s, n]}")
    depths = np.zeros((b, t), np.int64)
    for n in range(1, t):
        depths[:, n] = depths[np.arange(b), parents[:, n]] + 1
    if depths.max(initial=0) > max_depth:
        s, n = np.unravel_index(np.argmax(depths), depths.shape)
        raise ValueError(f"max_depth={max_depth} is less than the trees' depth: stream {s} node {n} is at depth "
                         f"{depths[s, n]}")


def _ancestry(parents: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """Depths [B, T] and ancestor-or-self visibility [B, T, T] by pointer chasing ``max_depth`` steps."""
    b, t = parents.shape
    cols = jnp.arange(t, dtype=jnp.int32)
    anc = jnp.broadcast_to(cols, (b, t))
    vis = anc[:, :, None] == cols
    depths = jnp.zeros((b, t), jnp.int32)
    for _ in range(max_depth):
        up = jnp.take_along_axis(parents, jnp.maximum(anc, 0), axis=1)
        anc = jnp.where(anc >= 0, up, -1)
        depths = depths + (anc >= 0).astype(jnp.int32)
        vis = vis | (anc[:, :, None] == cols)
    return depths, vis


def make_tree(tokens, parents, max_depth: int, logprob=None) -> Tree:
    """Build a Tree from node tokens and parents; depths and visibility are derived.

    Args:
      tokens:    [B, T] int  node tokens, node 0 = root.
      parents:   [B, T] int  parent indices with ``parents[:, t] < t`` and ``parents[:, 0] == -1``.
      max_depth: static int D >= every node depth. May exceed the true depth, e.g. to keep Acceptance
                 shapes fixed.
      logprob:   optional [B, T] f32 cumulative draft log-probs (default zeros).
    Concrete parents are checked (``parents`` as above, no node deeper than D); traced ones cannot be, and a
    node deeper than D would get a wrong depth and visibility.
    """
    tokens, parents = as_int32("tokens", tokens), as_int32("parents", parents)
    if tokens.ndim != 2 or tokens.shape != parents.shape:
        raise ValueError(f"tokens and parents must both be [B, T], got {tokens.shape}, {parents.shape}")
    max_depth = int(max_depth)
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if not isinstance(parents, jax.core.Tracer):
        _check_parents(np.asarray(parents), max_depth)
    if logprob is None:
        logprob = jnp.zeros(tokens.shape, jnp.float32)
    logprob = jnp.asarray(logprob, jnp.float32)
    if logprob.shape != tokens.shape:
        raise ValueError(f"logprob must be [B, T] = {tokens.shape} like tokens, got {logprob.shape}")
    depths, vis = _ancestry(parents, max_depth)
    return Tree(tokens, parents, depths, logprob, vis, max_depth)


def chain_tree(draft_tokens, root_token, token_logprobs=None) -> Tree:
    """The DFlash chain (or AR when Dp = 0) as a Tree: T = Dp + 1 nodes, node t at depth t.

    Args:
      draft_tokens:   [B, Dp] int  drafted tokens for depths 1..Dp (Dp may be 0: AR, T = 1).
      root_token:     [B] int      the bonus token (depth 0).
      token_logprobs: optional [B, Dp] f32 draft log-prob of each drafted token; ``logprob`` is
                      their cumulative sum (zeros when omitted).
    Returns a causal Tree with parents [-1, 0, 1, ..., Dp-1] and max_depth Dp.
    """
    draft_tokens, root_token = as_int32("draft_tokens", draft_tokens), as_int32("root_token", root_token)
    if draft_tokens.ndim != 2 or root_token.shape != draft_tokens.shape[:1]:
        raise ValueError(
            f"chain_tree expects draft_tokens [B, Dp] and root_token [B], got {draft_tokens.shape}, "
            f"{root_token.shape}"
        )
    b, dp = draft_tokens.shape
    t = dp + 1
    tokens = jnp.concatenate([root_token[:, None], draft_tokens], axis=1)
    parents = jnp.broadcast_to(jnp.arange(-1, dp, dtype=jnp.int32), (b, t))
    depths = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    vis = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    if token_logprobs is None:
        logprob = jnp.zeros((b, t), jnp.float32)
    else:
        token_logprobs = jnp.asarray(token_logprobs, jnp.float32)
        if token_logprobs.shape != draft_tokens.shape:
            raise ValueError(f"token_logprobs must be [B, Dp] = {draft_tokens.shape} like draft_tokens, "
                             f"got {token_logprobs.shape}")
        cum = jnp.cumsum(token_logprobs, axis=1)
        logprob = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), cum], axis=1)
    return Tree(tokens, parents, depths, logprob, vis, dp)


def _candidate_pairs(n_parents: int, n_tokens: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (parent rank i, token rank j) pairs with (i+1)(j+1) <= width, ordered by (i, j).

    A pair outside this set has at least ``width`` pairs (i', j') <= (i, j) componentwise that rank
    before it (score no lower, then smaller parent rank / token rank), so it cannot be in the top
    ``width`` of its depth.
    """
    pi, tj = [], []
    for i in range(n_parents):
        m = min(n_tokens, width // (i + 1))
        if m == 0:
            break
        pi.append(np.full(m, i, np.int32))
        tj.append(np.arange(m, dtype=np.int32))
    return np.concatenate(pi), np.concatenate(tj)


def build_tree(draft_logprobs, root_token, budget: int, top_k_method: str = "auto") -> Tree:
    """DDTree: the ``budget`` highest-probability draft prefixes as a Tree (see module docstring).

    Args:
      draft_logprobs: [B, Dp, W] f32 drafter log-probabilities (log_softmax at temperature 1) for
                      depths 1..Dp. Values > 0 are clamped to 0 and NaN is treated as -inf.
      root_token:     [B] int32 the bonus token (depth 0).
      budget:         static Python int, 1 <= budget <= MAX_BUDGET and <= sum_d W**d.
      top_k_method:   every ranking step's ``ddtree_jax.topk.top_k`` method (the same tree either way;
                      "auto": chunks over the vocabulary, comparisons over the small beams).
    Returns:
      Tree with T = budget + 1 nodes in best-first order (node n = n-th best prefix under the tie
      rule), ``logprob`` = prefix score, ``max_depth`` = min(Dp, budget).
    Raises:
      ValueError for a bad budget or bad shapes (at trace time).
    """
    lp = jnp.asarray(draft_logprobs)
    if lp.ndim != 3 or not jnp.issubdtype(lp.dtype, jnp.floating):
        raise ValueError(f"draft_logprobs must be [B, Dp, W] floats, got shape {lp.shape} {lp.dtype}")
    b, dp, w = lp.shape
    budget = check_budget(budget, dp, w)
    root_token = as_int32("root_token", root_token)
    if root_token.shape != (b,):
        raise ValueError(f"root_token must be [B] = [{b}], got shape {root_token.shape}")

    # Sanitize: NaN -> -inf, clamp to <= 0, -0.0 -> +0.0 so that lax.top_k (which ranks +0.0 above -0.0) sees
    # one zero. Not "+ 0.0": XLA folds that away under jit and the -0.0 stays.
    lp = lp.astype(jnp.float32)
    lp = jnp.where(jnp.isnan(lp), -jnp.inf, jnp.minimum(lp, 0.0))
    lp = jnp.where(lp == 0.0, 0.0, lp)

    max_depth = min(dp, budget)  # a depth-d node needs d nodes on its path
    n_tok = min(budget, w)
    tok_lp, tok_id = (x.reshape(b, max_depth, n_tok) for x in  # [B, D, n_tok]; ties: lower id first
                      top_k(lp[:, :max_depth].reshape(b * max_depth, w), n_tok, top_k_method))

    # Per-depth beams: the top-`budget` prefixes of each depth, in within-depth rank order.
    beam_score = jnp.zeros((b, 1), jnp.float32)  # depth 0: the root alone, rank 0
    n_prev = 1
    scores, tokens, parent_entry, depth_of = [], [], [], []
    offset_prev = -1  # entry offset of the previous depth's beam in the concatenation (-1: root)
    offset = 0
    for d in range(1, max_depth + 1):
        pi, tj = _candidate_pairs(n_prev, n_tok, budget)
        n_keep = min(budget, n_prev * n_tok)
        assert pi.size >= n_keep, (pi.size, n_keep)
        cand = beam_score[:, pi] + tok_lp[:, d - 1, tj]  # [B, C]
        _, perm = top_k(cand, n_keep, top_k_method)  # ties: smaller parent rank, then token rank
        beam_score = jnp.take_along_axis(cand, perm, axis=1)
        prank = jnp.asarray(pi)[perm]
        trank = jnp.asarray(tj)[perm]
        scores.append(beam_score)
        tokens.append(jnp.take_along_axis(tok_id[:, d - 1], trank, axis=1))
        parent_entry.append(prank + offset_prev if d > 1 else jnp.full_like(prank, -1))
        depth_of.append(np.full(n_keep, d, np.int32))
        offset_prev = offset
        offset += n_keep
        n_prev = n_keep

    # Global top-`budget` over all depths; entries are concatenated in (depth, rank) order, so
    # sorting by (-score, entry index) realises the key (-score, depth, rank).
    all_score = jnp.concatenate(scores, axis=1)  # [B, E]
    all_token = jnp.concatenate(tokens, axis=1)
    all_parent = jnp.concatenate(parent_entry, axis=1)
    all_depth = jnp.asarray(np.concatenate(depth_of))
    _, sel = top_k(all_score, budget, top_k_method)  # [B, budget]: the entries of nodes 1..budget
    # A selected entry's parent is selected too (the set is prefix-closed): only their node numbers are read.
    node_of_entry = jnp.zeros_like(all_parent).at[jnp.arange(b)[:, None], sel].set(
        jnp.arange(1, budget + 1, dtype=jnp.int32)[None, :])
    par = jnp.take_along_axis(all_parent, sel, axis=1)
    par_node = jnp.where(
        par < 0, 0, jnp.take_along_axis(node_of_entry, jnp.maximum(par, 0), axis=1)
    )

    node_tokens = jnp.concatenate([root_token[:, None], jnp.take_along_axis(all_token, sel, 1)], 1)
    node_parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par_node.astype(jnp.int32)], 1)
    node_depths = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), all_depth[sel]], axis=1)
    node_lp = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), jnp.take_along_axis(all_score, sel, 1)], 1)
    _, vis = _ancestry(node_parents, max_depth)
    return Tree(node_tokens, node_parents, node_depths, node_lp, vis, max_depth)


# --------------------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------------------


def accept_tokens(tree: Tree, target_tokens) -> Acceptance:
    """The acceptance walk given the target's token at every node.

    Args:
      tree:          Tree with T nodes and static max depth D.
      target_tokens: [B, T] int  the target's token (argmax or one sample) at each node, i.e. the
                     target's choice for the position after that node's prefix.
    From the root, repeatedly move to the child of the current node whose token equals the target
    token at the current node (the lowest-index such child if a tree had duplicate siblings; trees
    from build_tree/chain_tree have none), until no child matches. ``lax.fori_loop`` over D steps,
    O(T) work per step and stream, no host sync.
    """
    y = as_int32("target_tokens", target_tokens)
    b, t = tree.tokens.shape
    if y.shape != (b, t):
        raise ValueError(f"target_tokens must be [B, T] = {(b, t)}, got {y.shape}")
    d = tree.max_depth

    def step(k, state):
        cur, n_acc, done, path = state
        y_cur = jnp.take_along_axis(y, cur[:, None], axis=1)  # [B, 1]
        match = (tree.parents == cur[:, None]) & (tree.tokens == y_cur)  # [B, T]
        found = jnp.any(match, axis=1) & ~done
        child = jnp.argmax(match, axis=1).astype(jnp.int32)
        cur = jnp.where(found, child, cur)
        path = lax.dynamic_update_slice_in_dim(
            path, jnp.where(found, child, PAD)[:, None], k + 1, axis=1
        )
        return cur, n_acc + found.astype(jnp.int32), done | ~found, path

    path0 = jnp.full((b, d + 1), PAD, jnp.int32).at[:, 0].set(0)
    init = (jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32), jnp.zeros(b, bool), path0)
    cur, n_acc, _, path = lax.fori_loop(0, d, step, init)

    next_token = jnp.take_along_axis(y, cur[:, None], axis=1)[:, 0]
    valid = path[:, 1:] >= 0
    acc_tok = jnp.where(valid, jnp.take_along_axis(tree.tokens, jnp.maximum(path[:, 1:], 0), 1), PAD)
    k = jnp.arange(d + 1, dtype=jnp.int32)[None, :]
    acc_pad = jnp.concatenate([acc_tok, jnp.full((b, 1), PAD, jnp.int32)], axis=1)
    emitted = jnp.where(k == n_acc[:, None], next_token[:, None], acc_pad)
    return Acceptance(n_acc, path, next_token, acc_tok, emitted, y)


def accept_greedy(tree: Tree, target_logits) -> Acceptance:
    """Greedy (temperature 0) acceptance: target token per node = argmax of ``target_logits`` [B, T, W]."""
    logits = jnp.asarray(target_logits)
    return accept_tokens(tree, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def sample_target_tokens(target_logits, temperature, key, top_k=0, top_p=1.0, min_p=0.0,
                         **per_stream_top_k) -> jax.Array:
    """One independent target token per node: [B, T, W] logits -> [B, T] int32.

    ``temperature``: scalar or [B] (per stream), may be traced. Where it is > 0 the token is a
    sample from softmax(truncate(logits / temperature)); where it is <= 0 it is the argmax (greedy). A Python
    number computes only the path it takes and must be finite (ValueError for NaN / inf), where > 0 in
    ``sampling.TEMPERATURE_RANGE``; a traced one computes both, and the sample's B*T*W random draws cost far more
    than the argmax. A traced value cannot be checked under jit: NaN acts as greedy and values outside the range
    may draw wrongly (callers validate on the host, e.g. ``stream_settings.check_temperature``). The logits are
    scaled less each row's largest (``sampling.scaled_logits``).
    ``top_k`` (0: off), ``top_p`` (1: off), ``min_p`` (0: off): the filters of ``sampling.truncate`` (the sample
    only; the argmax always survives them), each a Python number or one per stream ([B], with truncate's
    ``top_k_ceiling`` and ``top_k_in_every_row`` for top_k).
    ``key``: a jax PRNG key, or one per stream ([B] typed keys: stream b's T draws come from keys[b] alone, so
    they do not depend on the batch around it); the B*T draws are independent (the same draws either way).
    """
    logits = jnp.asarray(target_logits).astype(jnp.float32)
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if not math.isfinite(temperature):
            raise ValueError(f"temperature must be finite (<= 0: greedy), got {temperature}")
        if temperature <= 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        scaled = scaled_logits(logits, jnp.float32(check_hot_temperature(temperature)))
        return _categorical(key, truncate(scaled, top_k, top_p, min_p=min_p, **per_stream_top_k)).astype(jnp.int32)
    b = logits.shape[0]
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
    hot = temp > 0
    safe = jnp.where(hot, temp, 1.0)
    sampled = _categorical(key, truncate(scaled_logits(logits, safe[:, None, None]), top_k, top_p, min_p=min_p,
                                         **per_stream_top_k))
    greedy = jnp.argmax(logits, axis=-1)
    return jnp.where(hot[:, None], sampled, greedy).astype(jnp.int32)


def _categorical(key, logits) -> jax.Array:
    """One draw per row of logits [B, T, W] -> [B, T]: from one key, or from [B] typed keys, stream by stream."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1:
        if key.shape[0] != logits.shape[0]:
            raise ValueError(f"keys must be one per stream ({logits.shape[0]}), got {key.shape[0]}")
        return jax.vmap(lambda k, rows: jax.random.categorical(k, rows, axis=-1))(key, logits)
    return jax.random.categorical(key, logits, axis=-1)


def accept_sample(tree: Tree, target_logits, temperature, key, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> Acceptance:
    """Lossless sampled acceptance: ONE target sample per node, then follow the matching child.

    Args:
      tree:          Tree (T nodes).
      target_logits: [B, T, W] target logits at every node (from one tree-verify forward).
      temperature:   scalar or [B]; <= 0 means greedy for that stream. A Python number must be finite
                     (ValueError); a traced non-finite one is not checked (see ``sample_target_tokens``).
      key:           jax PRNG key.
      top_k, top_p, min_p: the sample's filters (``sample_target_tokens``; 0, 1 and 0: off).
    Every emitted token is a target sample given exactly the committed prefix, so the output
    distribution equals sampling from the target directly (no min(1, p/q) with draft marginals).
    """
    return accept_tokens(tree, sample_target_tokens(target_logits, temperature, key, top_k, top_p, min_p))


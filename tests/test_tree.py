"""Tests for ddtree_jax.tree: DDTree build vs a heapq reference, invariants, acceptance walk,
lossless sampling (chi-square), budget validation. CPU, fast."""

from __future__ import annotations

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import tree as tr
from sampling_reference import truncated_probs

# Most tests use draft shape (3, 7, 16) and budgets from BUDGETS so build_tree compiles are shared.
build_jit = jax.jit(tr.build_tree, static_argnums=2)
greedy_jit = jax.jit(tr.accept_greedy)
make_tree_jit = jax.jit(tr.make_tree, static_argnums=2)
BUDGETS = [1, 2, 3, 8, 32, 128, 1024]
sample_jit = jax.jit(tr.accept_sample)


# --------------------------------------------------------------------------------------------------
# Plain-Python references
# --------------------------------------------------------------------------------------------------


def sanitize(lp):
    """Same input sanitation as build_tree: NaN -> -inf, clamp to <= 0, -0.0 -> +0.0 (float32)."""
    lp = np.asarray(lp, np.float32)
    lp = np.where(np.isnan(lp), np.float32(-np.inf), np.minimum(lp, np.float32(0)))
    return (lp + np.float32(0)).astype(np.float32)


def ref_build(lp, root, budget):
    """Best-first heap over draft prefixes of ONE stream (lp [Dp, W] float32).

    Pops prefixes in order of the key (-score, depth, parent_rank, -token_lp, token_id), where score
    is the float32 sum of log-probs along the path (root to leaf), parent_rank is the parent's pop
    rank among the nodes of its depth (root: 0) and token_lp the token's own log-prob at its depth
    (it only matters under a -inf parent; otherwise equal score and parent imply equal token_lp).
    Every popped prefix pushes all its W children.
    Returns tokens, parents, depths, logprob (node 0 = root) in pop order.
    """
    lp = sanitize(lp)
    dp, w = lp.shape
    tokens, parents, depths, scores = [int(root)], [-1], [0], [np.float32(0)]
    rank_count = [1] + [0] * dp  # nodes popped so far per depth (root has rank 0)
    heap = []

    def push_children(node, score, depth, rank):
        if depth == dp:
            return
        for tok in range(w):
            s = np.float32(score + lp[depth, tok])
            heapq.heappush(heap, (-float(s), depth + 1, rank, -float(lp[depth, tok]), tok, node, s))

    push_children(0, np.float32(0), 0, 0)
    while len(tokens) < budget + 1:
        _, depth, _, _, tok, parent, s = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        depths.append(depth)
        scores.append(s)
        rank = rank_count[depth]
        rank_count[depth] += 1
        push_children(node, s, depth, rank)
    return (np.array(tokens), np.array(parents), np.array(depths), np.array(scores, np.float32))


def ref_walk(tokens, parents, target):
    """Greedy/sampled acceptance walk for ONE stream: returns (path, next_token)."""
    cur, path = 0, [0]
    while True:
        kids = [c for c in range(len(tokens)) if parents[c] == cur and tokens[c] == target[cur]]
        if not kids:
            return path, int(target[cur])
        cur = kids[0]
        path.append(cur)


def node_paths(tokens, parents):
    """Token path (tuple, root excluded) of every node of one stream."""
    paths = []
    for t in range(len(tokens)):
        p = () if parents[t] < 0 else paths[parents[t]] + (int(tokens[t]),)
        paths.append(p)
    return paths


def canonical(tokens, parents, depths):
    """Order-free form: sorted (depth, path, parent path) of all nodes."""
    paths = node_paths(tokens, parents)
    return sorted(
        (int(depths[t]), paths[t], paths[parents[t]] if parents[t] >= 0 else None)
        for t in range(len(tokens))
    )


def check_invariants(tree, lp=None):
    tokens, parents, depths = map(np.asarray, (tree.tokens, tree.parents, tree.depths))
    vis, logprob = np.asarray(tree.visibility), np.asarray(tree.logprob)
    b, t = tokens.shape
    assert vis.shape == (b, t, t)
    clean = None if lp is None else sanitize(lp)
    for s in range(b):
        assert parents[s, 0] == -1 and depths[s, 0] == 0
        for n in range(1, t):
            p = parents[s, n]
            assert 0 <= p < n
            assert depths[s, p] + 1 == depths[s, n]
            if lp is not None:
                want = np.float32(logprob[s, p] + clean[s, depths[s, n] - 1, tokens[s, n]])
                assert logprob[s, n] == want
        assert depths[s].max() <= tree.max_depth
        # visibility == naive ancestor-or-self closure
        naive = np.zeros((t, t), bool)
        for n in range(t):
            a = n
            while a >= 0:
                naive[n, a] = True
                a = parents[s, a]
        np.testing.assert_array_equal(vis[s], naive)
        # siblings carry distinct tokens
        pairs = [(parents[s, n], tokens[s, n]) for n in range(1, t)]
        assert len(set(pairs)) == len(pairs)


# --------------------------------------------------------------------------------------------------
# build_tree == heapq reference
# --------------------------------------------------------------------------------------------------


def compare_with_ref(lp, roots, budget):
    lp = np.asarray(lp, np.float32)
    tree = build_jit(jnp.asarray(lp), jnp.asarray(roots, jnp.int32), budget)
    assert tree.tokens.shape == (lp.shape[0], budget + 1)
    assert tree.max_depth == min(lp.shape[1], budget)
    check_invariants(tree, lp)
    for s in range(lp.shape[0]):
        r_tok, r_par, r_dep, r_lp = ref_build(lp[s], roots[s], budget)
        got = (np.asarray(tree.tokens[s]), np.asarray(tree.parents[s]), np.asarray(tree.depths[s]))
        assert canonical(*got) == canonical(r_tok, r_par, r_dep)  # same node set and structure
        # Same tie rule => identical best-first order, bit-identical scores.
        np.testing.assert_array_equal(got[0], r_tok)
        np.testing.assert_array_equal(got[1], r_par)
        np.testing.assert_array_equal(got[2], r_dep)
        np.testing.assert_array_equal(np.asarray(tree.logprob[s]), r_lp)
    return tree


@pytest.mark.parametrize(
    "vocab,budget", [(16, b) for b in BUDGETS] + [(64, 2), (64, 32), (64, 1024)]
)
def test_build_matches_heap_random(vocab, budget):
    for seed in range(3):
        rng = np.random.default_rng(1000 * seed + vocab + budget)
        logits = rng.normal(size=(3, 7, vocab)) * rng.uniform(0.5, 4.0, size=(3, 7, 1))
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
        roots = rng.integers(0, vocab, size=3)
        compare_with_ref(lp, roots, budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_build_matches_heap_ties(budget):
    rng = np.random.default_rng(budget)
    # (a) normalised log-probs of logits quantised to 3 levels: many equal tokens per depth.
    q = rng.integers(0, 3, size=(3, 7, 16)).astype(np.float32)
    lp_a = np.asarray(jax.nn.log_softmax(jnp.asarray(q), axis=-1))
    # (b) exact dyadic log-probs incl. 0: path sums tie across paths and across depths
    #     (a child with lp 0 ties its parent -> the depth rule decides).
    lp_b = -0.5 * rng.integers(0, 4, size=(3, 7, 16)).astype(np.float32)
    # (c) a fully uniform depth and an all-zero depth.
    lp_c = lp_b.copy()
    lp_c[:, 2] = -np.log(16.0)
    lp_c[:, 4] = 0.0
    lp_c[1, 5] = -0.0
    for lp in (lp_a, lp_b, lp_c):
        compare_with_ref(lp, rng.integers(0, 16, size=3), budget)


@pytest.mark.parametrize("budget", [1, 8, 32, 128, 1024])
def test_build_matches_heap_inf_nan_positive(budget):
    rng = np.random.default_rng(7 + budget)
    lp = np.array(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 7, 16)), jnp.float32), -1))
    lp[rng.random(lp.shape) < 0.4] = -np.inf  # many impossible tokens
    lp[0, 1, :] = -np.inf  # a whole depth impossible: every depth>=2 prefix scores -inf
    lp[1, 0, :13] = -np.inf  # only 3 possible first tokens
    lp[2, 3, 5] = np.nan  # treated as -inf
    lp[2, 4, 6] = 0.25  # > 0: clamped to 0
    tree = compare_with_ref(lp, np.array([1, 2, 3]), budget)
    assert not np.isnan(np.asarray(tree.logprob)).any()


def test_signed_zero_log_probs_tie_with_every_top_k_method():
    """-0.0 and +0.0 are one log-prob: tied tokens go smaller id first by every top-k method, as in the heap
    (``lax.top_k``, the "sort" method, would rank +0.0 above -0.0)."""
    rng = np.random.default_rng(8)
    lp = np.array(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.float32), -1))
    lp[:, :, :6] = np.array([-0.0, 0.0, -0.0, -0.0, 0.0, 0.0], np.float32)
    roots = np.array([1, 2])
    for method in ("sort", "compare", "chunked"):
        tree = jax.jit(tr.build_tree, static_argnums=(2, 3))(jnp.asarray(lp), jnp.asarray(roots), 8, method)
        for s in range(2):
            r_tok, r_par, r_dep, r_lp = ref_build(lp[s], roots[s], 8)
            np.testing.assert_array_equal(np.asarray(tree.tokens[s]), r_tok, err_msg=method)
            np.testing.assert_array_equal(np.asarray(tree.parents[s]), r_par, err_msg=method)


def test_build_budget_nesting_and_order():
    """Best-first order: the budget-k tree is the first k+1 nodes of the budget-K tree."""
    rng = np.random.default_rng(3)
    lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 7, 16)) * 2, jnp.float32), -1)
    roots = jnp.array([4, 9, 0])
    big = build_jit(lp, roots, 1024)
    assert np.all(np.diff(np.asarray(big.logprob[:, 1:]), axis=1) <= 0)
    for k in (1, 8, 32, 128):
        small = build_jit(lp, roots, k)
        for f in ("tokens", "parents", "depths", "logprob"):
            np.testing.assert_array_equal(getattr(small, f), getattr(big, f)[:, : k + 1])
        np.testing.assert_array_equal(small.visibility, big.visibility[:, : k + 1, : k + 1])


def test_build_deep_chain_when_draft_is_certain():
    """A one-hot drafter gives a chain first (children with lp 0 tie their parent: depth first)."""
    dp, w = 7, 16
    toks = (5 * np.arange(dp) + 3) % w
    lp = np.full((3, dp, w), -np.inf, np.float32)
    lp[:, np.arange(dp), toks] = 0.0
    tree = compare_with_ref(lp, np.array([3, 4, 5]), 8)
    np.testing.assert_array_equal(tree.tokens[0, 1 : dp + 1], toks)
    np.testing.assert_array_equal(tree.depths[0, : dp + 1], np.arange(dp + 1))
    np.testing.assert_array_equal(tree.parents[0, 1 : dp + 1], np.arange(dp))
    assert tree.logprob[0, dp] == 0 and tree.logprob[0, dp + 1] == -np.inf


def test_positions_and_chain_tree():
    roots = jnp.array([5, 6])
    drafts = jnp.array([[1, 2, 3], [4, 5, 6]])
    chain = tr.chain_tree(drafts, roots, token_logprobs=-jnp.ones((2, 3)))
    check_invariants(chain)
    assert chain.max_depth == 3
    np.testing.assert_array_equal(chain.tokens, [[5, 1, 2, 3], [6, 4, 5, 6]])
    np.testing.assert_array_equal(chain.visibility[0], np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(chain.logprob[1], [0, -1, -2, -3])
    np.testing.assert_array_equal(chain.positions(jnp.array([10, 20])), [[10, 11, 12, 13], [20, 21, 22, 23]])
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (3, 7, 16)), -1)
    tree = build_jit(lp, jnp.array([5, 6, 7]), 32)
    start = jnp.array([3, 7, 0])
    np.testing.assert_array_equal(tree.positions(start), start[:, None] + tree.depths)
    # make_tree derives the same depths/visibility
    again = make_tree_jit(tree.tokens, tree.parents, tree.max_depth, tree.logprob)
    np.testing.assert_array_equal(again.depths, tree.depths)
    np.testing.assert_array_equal(again.visibility, tree.visibility)
    # log-prob arguments must match the tokens' shapes
    with pytest.raises(ValueError, match=r"token_logprobs must be \[B, Dp\] = \(2, 3\).*\(2, 5\)"):
        tr.chain_tree(drafts, roots, token_logprobs=jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match=r"logprob must be \[B, T\] = \(3, 33\).*\(7,\)"):
        tr.make_tree(tree.tokens, tree.parents, tree.max_depth, jnp.zeros(7))
    # pytree round trip (the engine carries trees through jit / while_loop)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    assert len(leaves) == 5 and jax.tree_util.tree_unflatten(treedef, leaves).max_depth == tree.max_depth


# --------------------------------------------------------------------------------------------------
# Budget validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget,match",
    [
        (0, "must be >= 1"),
        (-3, "must be >= 1"),
        (tr.MAX_BUDGET + 1, "supported maximum"),
        (10**9, "supported maximum"),
        (2.0, "static Python int"),
        (True, "static Python int"),
        (None, "static Python int"),
    ],
)
def test_bad_budget(budget, match):
    lp = jnp.zeros((1, 7, 16))
    with pytest.raises(ValueError, match=match):
        tr.build_tree(lp, jnp.array([0]), budget)
    with pytest.raises(ValueError, match=match):
        tr.check_budget(budget)


def test_budget_above_distinct_prefixes():
    lp = jnp.zeros((1, 2, 2))  # 2 + 4 = 6 distinct prefixes
    assert build_jit(lp, jnp.array([0]), 6).tokens.shape == (1, 7)
    with pytest.raises(ValueError, match="distinct draft prefixes"):
        tr.build_tree(lp, jnp.array([0]), 7)
    assert tr.check_budget(tr.MAX_BUDGET, 7, 163840) == tr.MAX_BUDGET
    with pytest.raises(ValueError, match="draft_logprobs must be"):
        tr.build_tree(jnp.zeros((7, 16)), jnp.array([0]), 4)
    for depth, vocab in ((0, 16), (7, 0)):  # no prefixes at all: named as such, not as a budget overflow
        with pytest.raises(ValueError, match=f"draft depth >= 1 and vocab >= 1, got Dp={depth}, W={vocab}"):
            tr.check_budget(4, depth, vocab)


def test_malformed_tree_arguments_refused():
    """Each entry point names the argument whose shape or value is wrong (at trace time), rather than building
    a tree or a walk from mismatched arrays."""
    tokens = jnp.zeros((2, 4), jnp.int32)
    parents = jnp.array([[-1, 0, 0, 1]] * 2, jnp.int32)
    with pytest.raises(ValueError, match="tokens and parents must both be"):
        tr.make_tree(tokens, parents[:, :3], 2)
    with pytest.raises(ValueError, match="max_depth must be >= 0, got -1"):
        tr.make_tree(tokens, parents, -1)
    with pytest.raises(ValueError, match="chain_tree expects"):
        tr.chain_tree(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"root_token must be \[B\] = \[2\]"):
        tr.build_tree(jnp.zeros((2, 3, 8)), jnp.zeros((3,), jnp.int32), 4)
    tree = tr.make_tree(tokens, parents, 2)
    with pytest.raises(ValueError, match=r"target_tokens must be \[B, T\] = \(2, 4\)"):
        tr.accept_tokens(tree, jnp.zeros((2, 3), jnp.int32))


def test_float_ids_and_integer_log_probs_refused():
    """A float token id or parent would be truncated to an int, and integer log-probs are not log-probs: each entry
    point names the argument rather than converting it."""
    tokens, parents = jnp.zeros((2, 4), jnp.int32), jnp.array([[-1, 0, 0, 1]] * 2, jnp.int32)
    for args, name in (((tokens + 0.5, parents, 2), "tokens"), ((tokens, parents.astype(jnp.float32), 2), "parents")):
        with pytest.raises(ValueError, match=f"^{name} must be integers, got dtype float32"):
            tr.make_tree(*args)
    with pytest.raises(ValueError, match="draft_tokens must be integers"):
        tr.chain_tree(jnp.zeros((2, 3)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="root_token must be integers"):
        tr.chain_tree(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,)))
    with pytest.raises(ValueError, match="root_token must be integers"):
        tr.build_tree(jnp.zeros((2, 3, 8)), jnp.zeros((2,), jnp.float32), 4)
    with pytest.raises(ValueError, match=r"draft_logprobs must be \[B, Dp, W\] floats, got shape \(2, 3, 8\) int32"):
        tr.build_tree(jnp.zeros((2, 3, 8), jnp.int32), jnp.zeros((2,), jnp.int32), 4)
    tree = tr.make_tree(tokens, parents, 2)
    with pytest.raises(ValueError, match="target_tokens must be integers"):
        tr.accept_tokens(tree, jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="start must be integers"):
        tree.positions(jnp.zeros((2,)))
    assert tr.build_tree(jnp.zeros((2, 3, 8), jnp.bfloat16), np.zeros((2,), np.int64), 4).tokens.dtype == jnp.int32


@pytest.mark.parametrize("parents, max_depth, message", [
    ([[0, 0, 0, 1]], 2, r"parents\[:, 0\] must be -1 \(node 0 is the root\); stream 0 has 0"),
    ([[-1, 0, 2, 1]], 2, r"must lie in \[0, t\) for t >= 1; stream 0 node 2 has 2"),
    ([[-1, 0, 0, 1], [-1, 0, 3, 0]], 2, "stream 1 node 2 has 3"),
    ([[-1, -1, 0, 1]], 2, "stream 0 node 1 has -1"),
    ([[-1, 0, 1, 2]], 2, "max_depth=2 is less than the trees' depth: stream 0 node 3 is at depth 3"),
])
def test_concrete_parents_that_are_not_trees_refused(parents, max_depth, message):
    """A concrete parents array is checked against make_tree's contract (a traced one cannot be), so a wrong tree
    never reaches the walk or the attention mask with wrong depths."""
    parents = np.array(parents, np.int32)
    with pytest.raises(ValueError, match=message):
        tr.make_tree(np.zeros(parents.shape, np.int32), parents, max_depth)
    traced = jax.jit(tr.make_tree, static_argnums=2)(np.zeros(parents.shape, np.int32), parents, max_depth)
    assert traced.parents.shape == parents.shape  # under jit the contract is the caller's
    assert tr.make_tree(np.zeros((1, 4), np.int32), np.array([[-1, 0, 1, 2]]), 3).depths.tolist() == [[0, 1, 2, 3]]


# --------------------------------------------------------------------------------------------------
# Acceptance walk
# --------------------------------------------------------------------------------------------------


def random_tree(rng, b, t, w, max_depth):
    """Random trees (parents < index, depth <= max_depth, distinct sibling tokens) via make_tree."""
    tokens = np.zeros((b, t), np.int32)
    parents = np.full((b, t), -1, np.int32)
    for s in range(b):
        depth = [0]
        used = {}
        tokens[s, 0] = rng.integers(w)
        for n in range(1, t):
            ok = [p for p in range(n) if depth[p] < max_depth and len(used.get(p, ())) < w]
            assert ok, "tree too large for this depth / vocab"
            p = int(rng.choice(ok))
            tok = int(rng.choice([x for x in range(w) if x not in used.get(p, set())]))
            used.setdefault(p, set()).add(tok)
            parents[s, n], tokens[s, n] = p, tok
            depth.append(depth[p] + 1)
    return make_tree_jit(tokens, parents, max_depth)


def check_acceptance(tree, acc, target):
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    d = tree.max_depth
    assert acc.path.shape == (tokens.shape[0], d + 1) and acc.accepted_tokens.shape == (tokens.shape[0], d)
    for s in range(tokens.shape[0]):
        path, nxt = ref_walk(tokens[s], parents[s], target[s])
        n = len(path) - 1
        assert int(acc.num_accepted[s]) == n
        assert int(acc.next_token[s]) == nxt
        np.testing.assert_array_equal(acc.path[s], path + [tr.PAD] * (d - n))
        np.testing.assert_array_equal(acc.accepted_tokens[s], [tokens[s, c] for c in path[1:]] + [tr.PAD] * (d - n))
        np.testing.assert_array_equal(acc.emitted[s], list(acc.accepted_tokens[s, :n]) + [nxt] + [tr.PAD] * (d - n))


def forced_logits(rng, tree, w, targets):
    """Random target logits, then force the walk of stream s along root -> targets[s] (node index;
    0 = force zero acceptance by making the root's argmax a token no root child carries)."""
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    b, t = tokens.shape
    logits = rng.normal(size=(b, t, w)).astype(np.float32)
    for s, x in enumerate(targets):
        if x == 0:
            kids = {tokens[s, c] for c in range(1, t) if parents[s, c] == 0}
            logits[s, 0, min(set(range(w)) - kids)] = 50.0
        while x > 0:
            logits[s, parents[s, x], tokens[s, x]] = 50.0
            x = parents[s, x]
    return logits


def test_accept_greedy_vs_reference():
    rng = np.random.default_rng(0)
    w = 16
    lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 7, w)) * 3, jnp.float32), -1)
    tree = build_jit(lp, jnp.array([1, 2, 3]), 32)
    depths = np.asarray(tree.depths)
    assert depths.max(axis=1).min() >= 3
    deepest = [int(np.argmax(depths[s])) for s in range(3)]
    mid = [int(np.flatnonzero(depths[s] == 2)[0]) for s in range(3)]
    cases = [
        deepest,  # full acceptance to max depth on every stream
        [0, 0, 0],  # zero acceptance everywhere
        [deepest[0], 0, mid[2]],  # B>1 with different outcomes
        [mid[0], -1, deepest[2]],  # (-1: plain random target logits)
    ]
    for targets in cases:
        logits = forced_logits(rng, tree, w, [max(x, 0) for x in targets])
        for s, x in enumerate(targets):
            if x == -1:
                logits[s] = rng.normal(size=logits[s].shape)
        acc = greedy_jit(tree, jnp.asarray(logits))
        check_acceptance(tree, acc, np.argmax(logits, -1))
        for s, x in enumerate(targets):
            if x >= 0:
                assert int(acc.num_accepted[s]) >= depths[s, x]
    full = greedy_jit(tree, jnp.asarray(forced_logits(rng, tree, w, deepest)))
    np.testing.assert_array_equal(full.num_accepted, depths.max(axis=1))
    zero = greedy_jit(tree, jnp.asarray(forced_logits(rng, tree, w, [0, 0, 0])))
    np.testing.assert_array_equal(zero.num_accepted, 0)


def test_accept_greedy_random_trees_chain_and_ar():
    rng = np.random.default_rng(1)
    w = 6
    for t, d in [(1, 0), (4, 1), (7, 1), (9, 3), (33, 7)]:  # few shapes: few compiles
        for _ in range(4):
            tree = random_tree(rng, 3, t, w, d)
            check_invariants(tree)
            logits = rng.normal(size=(3, t, w)).astype(np.float32)
            logits[0, 0, tree.tokens[0, 1:][np.asarray(tree.parents[0, 1:]) == 0][:1]] = 50  # >= 1 acc
            acc = greedy_jit(tree, jnp.asarray(logits))
            check_acceptance(tree, acc, np.argmax(logits, -1))
    # DFlash chain: accept the longest prefix where draft d[i+1] == argmax at node i
    drafts = rng.integers(0, w, size=(3, 7))
    chain = tr.chain_tree(drafts, np.array([0, 1, 2]))
    logits = rng.normal(size=(3, 8, w)).astype(np.float32)
    logits[0, np.arange(7), drafts[0]] = 50  # full: tau = 8
    logits[1, np.arange(3), drafts[1, :3]] = 50  # >= 3 accepted
    acc = greedy_jit(chain, jnp.asarray(logits))
    check_acceptance(chain, acc, np.argmax(logits, -1))
    assert int(acc.num_accepted[0]) == 7 and int(acc.num_accepted[1]) >= 3
    # AR: T = 1, next token = argmax at the root
    ar = tr.chain_tree(np.zeros((3, 0), np.int32), np.array([0, 1, 2]))
    lg = rng.normal(size=(3, 1, w)).astype(np.float32)
    acc = greedy_jit(ar, jnp.asarray(lg))
    np.testing.assert_array_equal(acc.num_accepted, 0)
    np.testing.assert_array_equal(acc.next_token, np.argmax(lg[:, 0], -1))
    np.testing.assert_array_equal(acc.emitted, np.argmax(lg[:, 0], -1)[:, None])


def test_accept_sample_cold_equals_greedy():
    rng = np.random.default_rng(2)
    w = 16
    lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 7, w)) * 3, jnp.float32), -1)
    tree = build_jit(lp, jnp.array([1, 2, 3]), 32)
    depths = np.asarray(tree.depths)
    deepest = [int(np.argmax(depths[s])) for s in range(3)]
    logits = forced_logits(rng, tree, w, deepest)
    logits[2] = rng.normal(size=logits[2].shape)
    g = greedy_jit(tree, jnp.asarray(logits))
    for temp in (0.0, 1e-6, jnp.array([0.0, 1e-6, 0.0])):
        for seed in range(3):
            s = sample_jit(tree, jnp.asarray(logits), temp, jax.random.key(seed))
            for f in ("num_accepted", "path", "next_token", "accepted_tokens", "emitted", "target_tokens"):
                np.testing.assert_array_equal(getattr(s, f), getattr(g, f))
    # per-stream temperature: stream 0 greedy, the others sampled
    s = sample_jit(tree, jnp.asarray(logits), jnp.array([0.0, 1.0, 1.0]), jax.random.key(0))
    np.testing.assert_array_equal(s.target_tokens[0], g.target_tokens[0])



def test_static_temperature_takes_one_path_with_the_same_tokens():
    """A Python temperature compiles only its own path (no random bits when greedy) and gives the tokens the
    traced temperature gives with the same key."""
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(2, 5, 50)) * 2, jnp.float32)
    key = jax.random.key(3)
    for temp in (0.0, 0.7):
        static = jax.jit(lambda x, k, t=temp: tr.sample_target_tokens(x, t, k))
        traced = jax.jit(tr.sample_target_tokens)
        np.testing.assert_array_equal(np.asarray(static(logits, key)),
                                      np.asarray(traced(logits, jnp.float32(temp), key)))
        jaxpr = str(jax.make_jaxpr(lambda x, k, t=temp: tr.sample_target_tokens(x, t, k))(logits, key))
        assert ("random_bits" in jaxpr) == (temp > 0), temp
        assert jaxpr.count("argmax[") == 1, temp  # the traced temperature's program has two (greedy and sample)


def test_non_finite_static_temperature_refused():
    """A Python NaN / inf temperature raises (NaN used to give token 0 at every node, inf uniform samples);
    <= 0 stays greedy."""
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(2, 3, 10)), jnp.float32)
    key = jax.random.key(0)
    tree = tr.chain_tree(jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32))
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=f"temperature must be finite.*{bad}"):
            tr.sample_target_tokens(logits, bad, key)
        with pytest.raises(ValueError, match="temperature must be finite"):
            tr.accept_sample(tree, logits, bad, key)
    for cold in (0, 0.0, -1.5):
        np.testing.assert_array_equal(tr.sample_target_tokens(logits, cold, key), jnp.argmax(logits, -1))

# --------------------------------------------------------------------------------------------------
# Lossless: chi-square of the emitted continuation vs direct target sampling
# --------------------------------------------------------------------------------------------------


W_TINY, DP_TINY, L_CONT, TEMP = 3, 3, 3, 0.8


def cond_logits(prefix):
    """The toy target: fixed logits for the next token given the whole context (root + path)."""
    rng = np.random.default_rng([12345, len(prefix), *prefix])
    return (1.5 * rng.normal(size=W_TINY)).astype(np.float32)


def cond_probs(prefix, temp=TEMP, top_k=0, top_p=1.0, min_p=0.0):
    return truncated_probs(cond_logits(prefix), temp, top_k, top_p, min_p)


def toy_tree(kind, roots, rng):
    """Draft tree correlated with the target (noisy target along the greedy path)."""
    lps = []
    for r in roots:
        prefix, rows = (r,), []
        for _ in range(DP_TINY):
            z = cond_logits(prefix) + rng.normal(size=W_TINY).astype(np.float32)
            rows.append(z - np.log(np.exp(z).sum()))
            prefix = prefix + (int(np.argmax(z)),)
        lps.append(rows)
    lp = jnp.asarray(np.array(lps, np.float32))
    if kind == "chain":
        return tr.chain_tree(jnp.argmax(lp, -1), jnp.asarray(roots))
    return build_jit(lp, jnp.asarray(roots, jnp.int32), 7)


def chi2_pvalue(counts, probs):
    n = counts.sum()
    exp = n * probs
    stat = float(((counts - exp) ** 2 / exp).sum())
    df = len(probs) - 1
    return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


@pytest.mark.parametrize("kind,top_k,top_p,min_p", [("ddtree", 0, 1.0, 0.0), ("chain", 0, 1.0, 0.0),
                                                     ("ddtree", 2, 1.0, 0.0), ("ddtree", 0, 0.9, 0.0),
                                                     ("ddtree", 0, 1.0, 0.05)])
def test_accept_sample_lossless_chi2(kind, top_k, top_p, min_p):
    """The walk's output law equals direct sampling from the target (truncated by top-k / top-p / min-p where
    set)."""
    rng = np.random.default_rng(11)
    roots = [0, 2]
    tree = toy_tree(kind, roots, rng)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    logits = np.zeros((2, tree.num_nodes, W_TINY), np.float32)
    for s, r in enumerate(roots):
        for t, path in enumerate(node_paths(tokens[s], parents[s])):
            logits[s, t] = cond_logits((r,) + path)
    n_samples = 120_000
    keys = jax.random.split(jax.random.key(2024), n_samples)
    run = jax.jit(jax.vmap(lambda k: tr.accept_sample(tree, jnp.asarray(logits), TEMP, k, top_k, top_p, min_p)))
    acc = run(keys)
    emitted, n_acc = np.asarray(acc.emitted), np.asarray(acc.num_accepted)  # [N, B, D+1], [N, B]
    assert n_acc.mean() > 0.5  # the tree really gets accepted, not just the bonus token
    cells = list(itertools.product(range(W_TINY), repeat=L_CONT))
    for s, r in enumerate(roots):
        # Continue each round's output to L_CONT tokens by sampling the target directly
        # (what the next rounds would do), then compare the joint law of the first L_CONT tokens.
        seq = np.full((n_samples, L_CONT), -1, np.int64)
        m = min(L_CONT, emitted.shape[2])
        seq[:, :m] = emitted[:, s, :m]
        for k in range(L_CONT):
            need = seq[:, k] < 0
            for pre in set(map(tuple, seq[need, :k])):
                rows = need & np.all(seq[:, :k] == np.array(pre, np.int64), axis=1)
                seq[rows, k] = rng.choice(W_TINY, size=rows.sum(), p=cond_probs((r,) + pre, TEMP, top_k, top_p, min_p))
        codes = seq @ (W_TINY ** np.arange(L_CONT - 1, -1, -1))
        counts = np.bincount(codes, minlength=W_TINY**L_CONT).astype(np.float64)

        def law(*settings):
            return np.array([np.prod([cond_probs((r,) + c[:k], *settings)[c[k]] for k in range(L_CONT)])
                             for c in cells])

        exact = law(TEMP, top_k, top_p, min_p)
        assert abs(exact.sum() - 1) < 1e-9
        support = exact > 0
        assert support.sum() > 1 and counts[~support].sum() == 0, "a truncated token was emitted"
        p = chi2_pvalue(counts[support], exact[support])
        assert p > 1e-4, (kind, s, p)
        # the test has power: the same samples reject a slightly different temperature, or the untruncated law
        wrong = law(1.0) if (top_k, top_p, min_p) == (0, 1, 0) else law(TEMP)
        assert chi2_pvalue(counts, wrong) < 1e-6


# --------------------------------------------------------------------------------------------------
# One jitted round; streams sharded over the 8 fake CPU devices
# --------------------------------------------------------------------------------------------------


def test_round_in_jit_while_loop_and_sharded(host_devices):
    """build -> accept in one jitted program (Tree carried through while_loop), and
    streams sharded over devices give the same result as one device."""
    rng = np.random.default_rng(9)
    b, w, budget = 8, 16, 32
    lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, 7, w)) * 3, jnp.float32), -1)
    roots = jnp.asarray(rng.integers(0, w, size=b), jnp.int32)
    logits = jnp.asarray(rng.normal(size=(b, budget + 1, w)), jnp.float32)

    @jax.jit
    def round_fn(lp, roots, logits, key):
        tree0 = tr.build_tree(lp, roots, budget)

        def body(carry):
            i, tree = carry
            return i + 1, tr.make_tree(tree.tokens, tree.parents, tree.max_depth, tree.logprob)

        _, tree = jax.lax.while_loop(lambda c: c[0] < 2, body, (0, tree0))
        acc = tr.accept_sample(tree, logits, jnp.where(jnp.arange(b) % 2 == 0, 0.0, 1.0), key)
        return tree, acc

    key = jax.random.key(0)
    tree, acc = round_fn(lp, roots, logits, key)
    check_invariants(tree, np.asarray(lp))
    ref_tree = build_jit(lp, roots, budget)
    for f in ("tokens", "parents", "depths", "logprob", "visibility"):
        np.testing.assert_array_equal(getattr(tree, f), getattr(ref_tree, f))
    g = greedy_jit(tree, logits)
    np.testing.assert_array_equal(acc.emitted[0::2], g.emitted[0::2])  # temperature-0 streams are greedy
    check_acceptance(tree, acc, np.asarray(acc.target_tokens))

    # sharded over the 8 host devices against the same round on one of them (not the GPU, if there is one)
    plain = round_fn(*(jax.device_put(a, host_devices[0]) for a in (lp, roots, logits)), key)
    mesh = jax.sharding.Mesh(np.array(host_devices), ("data",))
    spec = lambda *rest: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", *rest))
    sharded = round_fn(
        jax.device_put(lp, spec(None, None)),
        jax.device_put(roots, spec()),
        jax.device_put(logits, spec(None, None)),
        key,
    )
    for x, y in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(sharded)):
        np.testing.assert_array_equal(x, y)

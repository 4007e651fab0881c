"""Mosaic GPU MLA tree attention (``pallas_kernels.mla_attention_mgpu``).

CPU: the kernels' twin (``split_attention_ref``) against a float64 reference split by split, on inputs
built by ``tree_inputs``; the whole op (twin kernel, tree inputs, split merge) against the dense
reference and ``tree_attention_ref`` (ragged prefixes incl. 0 and a partial last block, NaN garbage
beyond the prefix, random trees, T = 1, chains, several splits); the kernel lowered for CUDA; argument
errors; the dispatcher's routing. GPU (``gpu`` marker): the kernel against the twin at K2.6
dims. JAX's Mosaic GPU interpreter cannot run this kernel (no register-operand wgmma), so there is no
interpret-mode kernel test.
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import mla_attention_mgpu as M
from pallas_kernels.split_combine import combine_splits, combine_splits_ref
from pallas_kernels.tree_attention import fold_rows, mla_attention, tree_attention_ref
from tests.test_tree_attention_kernel import as_jax, dense_reference, make_case

SCALE = 0.27


def split_reference(q_rows, cache, plen, tree_kv, tree_mask, H, scale, L, BK, NS, V=None):
    """float64, loops: stream b's keys are its NBP = ceil(plen / BK) cache blocks, then the tree keys padded to
    whole blocks (TB of them); split s takes blocks [s*per, min((s+1)*per, NBP + TB)), per = ceil((NBP + TB) /
    NS); row r < V (node r // H) sees the cache keys below plen and tree key u where tree_mask[b, r // H, u]
    (rows r >= T*H the cache keys alone). Returns o [NS, B, V, L], lse [NS, B, V] (-inf: sees nothing)."""
    q_rows, cache, tree_kv = (np.asarray(a, np.float64) for a in (q_rows, cache, tree_kv))
    B, R, _ = q_rows.shape
    V = V or R
    T = tree_mask.shape[1]
    TB = -(-T // BK)
    o, lse = np.zeros((NS, B, V, L)), np.full((NS, B, V), -np.inf)
    for b in range(B):
        nbp = -(-int(plen[b]) // BK)
        cached = np.zeros((nbp * BK, cache.shape[2]))
        cached[:int(plen[b])] = cache[b, :int(plen[b])]
        tree = np.zeros((TB * BK, cache.shape[2]))
        tree[:T] = tree_kv[b, :T]
        keys = np.concatenate([cached, tree])
        per = -(-(nbp + TB) // NS)
        for s in range(NS):
            lo, hi = min(s * per, nbp + TB) * BK, min(s * per + per, nbp + TB) * BK
            for r in range(V):
                vis = np.zeros(len(keys), bool)
                vis[:int(plen[b])] = True
                if r < T * H:
                    vis[nbp * BK:nbp * BK + T] = tree_mask[b, r // H]
                vis[:lo] = vis[hi:] = False
                if not vis.any():
                    continue
                sc = keys[vis] @ q_rows[b, r] * scale
                e = np.exp(sc - sc.max())
                o[s, b, r] = e @ keys[vis, :L] / e.sum()
                lse[s, b, r] = sc.max() + np.log(e.sum())
    return o, lse


@pytest.mark.parametrize("B,T,H,S,plens,kind,NS,V", [
    (3, 5, 8, 320, [0, 130, 320], "tree", 1, None),
    (3, 5, 8, 320, [0, 130, 320], "tree", 2, None),
    (3, 5, 8, 320, [0, 130, 320], "tree", 5, None),
    (3, 1, 8, 256, [0, 64, 200], "chain", 4, 8),     # plain decode: empty prefix, whole blocks, a partial one
    (2, 4, 8, 192, [191, 65], "tree", 5, 32),        # splits inside the tree block
    (1, 3, 8, 100, [100], "chain", 1, 24),           # the partial block reaches past the cache (S % 64 != 0)
])
def test_split_twin_on_tree_inputs_matches_reference_per_split(B, T, H, S, plens, kind, NS, V):
    """The kernels' twin on ``tree_inputs`` split by split, against the float64 loops; with V real rows also
    on the V rows alone (the narrow kernel's form)."""
    L, RD, BK, Np = 128, 64, 64, 64
    q, cache, plen, tree_kv, mask = make_case(3, B, T, H, L, RD, S, plens, kind)
    q = np.random.default_rng(4).standard_normal((B, Np, L + RD)).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    keys, bits = M.tree_inputs(bf(tree_kv), jnp.asarray(mask), H, Np, BK)
    assert keys.shape == (B, 64 * -(-T // 64), L + RD) and bits.shape == (B, keys.shape[1] // 32, Np)
    assert not np.asarray(bits)[:, :, T * H:].any()                 # padding rows see no tree key
    kw = dict(scale=SCALE, kv_lora_rank=L, block_k=BK, num_splits=NS, valid_rows=V)
    o, lse = jax.jit(functools.partial(M.split_attention_ref, **kw))(bf(q), bf(cache), jnp.asarray(plen), keys, bits)
    up = lambda a: np.asarray(bf(a), np.float64)  # noqa: E731
    r_o, r_l = split_reference(up(q), up(cache), plen, up(tree_kv), mask, H, SCALE, L, BK, NS, V)
    V = V or Np
    assert o.shape == (NS, B, V, L) and o.dtype == jnp.bfloat16 and lse.shape == (NS, B, V)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(r_l))
    fin = np.isfinite(r_l)
    np.testing.assert_allclose(np.asarray(lse)[fin], r_l[fin], atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(o, np.float32), r_o, atol=2e-2, rtol=2e-2)
    assert not np.asarray(o, np.float32)[~fin].any()  # empty rows of a split: zeros
    if V < Np:  # the V real rows alone: the same partials up to f32 summation order
        o_v, lse_v = jax.jit(functools.partial(M.split_attention_ref, **kw))(
            bf(q)[:, :V], bf(cache), jnp.asarray(plen), keys, bits[..., :V])
        np.testing.assert_allclose(np.asarray(o_v, np.float32), np.asarray(o, np.float32), rtol=8e-3, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse_v), np.asarray(lse), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B,T,H,S,plens,kind,NS", [
    (3, 6, 4, 200, [0, 37, 200], "tree", 2),     # empty, short (partial block only), whole blocks + partial
    (2, 1, 8, 256, [256, 129], "chain", 3),      # plain decode, T = 1
    (2, 9, 2, 152, [150, 64], "chain", 1),       # DFlash chain, exactly one whole block
    (1, 12, 16, 304, [300], "tree", 4),          # 192 rows: 3 tiles
    (2, 70, 1, 96, [96, 5], "tree", 6),          # 70 tree keys: 2 tree blocks, splits inside the tree
    (2, 9, 8, 200, [200, 70], "tree", 3),        # 72 rows: one tile and a tail, as the kernel takes them
])
def test_cascade_with_twin_prefix_matches_dense(B, T, H, S, plens, kind, NS):
    L, RD = 128, 64
    case = make_case(5, B, T, H, L, RD, S, plens, kind)
    args = as_jax(case, jnp.bfloat16)
    op = functools.partial(M.tree_attention_mgpu, scale=SCALE, kv_lora_rank=L, num_splits=NS, return_lse=True,
                           kernel=M.split_attention_ref)
    o, lse = jax.jit(functools.partial(op, combine=combine_splits_ref))(*args)
    up = [np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a) for a in args]
    r_o, r_l = dense_reference(*up, SCALE, L)
    assert o.shape == (B, T, H, L) and o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o, np.float32), r_o, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), r_l, atol=1e-3, rtol=1e-4)
    t_o = jax.jit(functools.partial(tree_attention_ref, scale=SCALE, kv_lora_rank=L))(*args)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(t_o, np.float32), atol=2e-2, rtol=2e-2)
    if NS > 1:  # the one-launch merge (interpreted): the same f32 values up to summation order, one bf16 rounding
        o2, lse2 = jax.jit(functools.partial(op, combine=functools.partial(combine_splits, interpret=True)))(*args)
        np.testing.assert_allclose(np.asarray(o2, np.float32), np.asarray(o, np.float32), atol=8e-3, rtol=8e-3)
        np.testing.assert_allclose(np.asarray(lse2), np.asarray(lse), rtol=1e-6, atol=1e-6)


def test_shared_memory_of_one_tile_and_a_tail_fits_where_two_tiles_leave_no_room():
    """In Mosaic GPU's 1 KB units: the two-tile kernel leaves under 1 KB of the H200's 227 KB, less than the
    tail's queries need (9 KB); without the query tile's rope columns and the probability tile it fits."""
    C = K26["C"]
    two_tiles, tail = M.smem_bytes(C, 64, 2), M.smem_bytes(C, 64, 2, tail=8)
    assert two_tiles <= M.SMEM_LIMIT < two_tiles + 2 * 8 * C
    assert tail <= M.SMEM_LIMIT and M.tail_rows_of(72) == M.TAIL_ROWS == 8
    assert [M.tail_rows_of(n) for n in (64, 71, 80, 136)] == [0, 0, 0, 0]


def test_errors():
    case = as_jax(make_case(1, 1, 2, 8, 128, 64, 128, [100], "chain"), jnp.bfloat16)
    kw = dict(scale=SCALE, kv_lora_rank=128)
    with pytest.raises(ValueError, match="bf16"):
        M.tree_attention_mgpu(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in case), **kw)
    with pytest.raises(ValueError, match="L % 128"):
        M.tree_attention_mgpu(*case, scale=SCALE, kv_lora_rank=64)
    with pytest.raises(NotImplementedError, match="interpret"):
        M.tree_attention_mgpu(*case, interpret=True, **kw)
    q_rows = jnp.zeros((1, 64, 192), jnp.bfloat16)
    tail = M.tree_inputs(case[3], case[4], 2, 64, 64)
    with pytest.raises(ValueError, match="block_k"):
        M.split_attention(q_rows, case[1], case[2], *tail, block_k=96, **kw)
    with pytest.raises(ValueError, match="block_k"):
        M.split_attention(q_rows, case[1], case[2], *tail, block_k=32, **kw)
    with pytest.raises(ValueError, match="shared memory"):
        M.split_attention(q_rows, case[1], case[2], *tail, block_k=256, stages=4, **kw)
    with pytest.raises(ValueError, match="whole 64-row tiles"):
        M.split_attention(q_rows[:, :40], case[1], case[2], *tail, **kw)
    q72, tail72 = jnp.zeros((1, 72, 192), jnp.bfloat16), M.tree_inputs(case[3], case[4], 2, 72, 64)
    with pytest.raises(ValueError, match="one tile and a tail"):
        M.split_attention(q72, case[1], case[2], *tail72, share_scores=False, **kw)
    with pytest.raises(ValueError, match="whole 64-row tiles"):
        M.split_attention(jnp.zeros((1, 80, 192), jnp.bfloat16), case[1], case[2],
                          *M.tree_inputs(case[3], case[4], 2, 80, 64), **kw)
    for f in (M.split_attention, M.split_attention_ref):
        with pytest.raises(ValueError, match="tree_kv"):
            f(q_rows, case[1], case[2], tail[0][:, :32], tail[1], **kw)
        with pytest.raises(ValueError, match="tree_bits"):
            f(q_rows, case[1], case[2], tail[0], tail[1][..., :32], **kw)
        with pytest.raises(ValueError, match="cache_kv"):
            f(q_rows, case[1][..., :64], case[2], *tail, **kw)
    with pytest.raises(ValueError, match="capacity S=100"):
        M.tree_attention_mgpu(case[0], case[1][:, :100], *case[2:], **kw)
    with pytest.raises(ValueError, match="bf16"):   # f32 tree latents are not silently cast
        M.tree_attention_mgpu(*case[:3], case[3].astype(jnp.float32), case[4], **kw)
    with pytest.raises(ValueError, match="num_splits=0"):
        M.tree_attention_mgpu(*case, num_splits=0, **kw)
    for bad in (dict(num_splits=3), dict(num_splits=2, share_scores=False), dict(num_splits=2, valid_rows=8)):
        with pytest.raises(ValueError, match="peer_merge"):
            M.split_attention(q_rows, case[1], case[2], *tail, peer_merge=True, **dict(kw, **bad))
    with pytest.raises(ValueError, match="peer_merge"):
        M.split_attention(q72, case[1], case[2], *tail72, num_splits=2, peer_merge=True, **kw)
    assert "L <= 512" in M.unsupported_reason((1, 1, 1, 1152), (1, 64, 1152), 1024, jnp.bfloat16)
    assert "shared memory" in M.unsupported_reason((1, 1, 1, 640), (1, 64, 640), 512, jnp.bfloat16)
    assert "S % 8" in M.unsupported_reason((1, 1, 1, 576), (1, 273, 576), 512, jnp.bfloat16)
    assert "S % 8" in M.unsupported_reason((1, 1, 1, 576), (1, 0, 576), 512, jnp.bfloat16)
    assert M.unsupported_reason((1, 1, 1, 576), (1, 64, 576), 512, jnp.bfloat16, jnp.bfloat16) is None


@pytest.mark.parametrize("bad,match", [
    (np.asarray([100, 7], np.int32), "\\[B\\]=1"), (np.asarray([100.0], np.float32), "integers"),
    (np.asarray([129], np.int32), "in \\[0, S=128\\]"), (np.asarray([-1], np.int32), "in \\[0, S=128\\]"),
])
def test_the_in_place_kernels_and_their_twin_refuse_a_bad_prefix_len(bad, match):
    """A prefix_len of the wrong shape or dtype, or a concrete one outside [0, S], is refused by name at every
    entry that reads the cache in place (the kernels would read zero rows past the cache as keys, or the plen ref
    out of bounds; the twin would clamp it)."""
    from pallas_kernels.mla_attention_narrow import split_attention_narrow

    case = as_jax(make_case(1, 1, 2, 8, 128, 64, 128, [100], "chain"), jnp.bfloat16)
    tail = M.tree_inputs(case[3], case[4], 2, 64, 64)
    for f in (M.split_attention, M.split_attention_ref, split_attention_narrow):
        with pytest.raises(ValueError, match=f"prefix_len must .*{match}"):
            f(jnp.zeros((1, 64, 192), jnp.bfloat16), case[1], jnp.asarray(bad), *tail, scale=SCALE,
              kv_lora_rank=128, valid_rows=16)


def test_a_tree_mask_without_its_diagonal_is_refused():
    """A node that may not see itself would have an empty row if its prefix is empty: the twin would give NaN, the
    Triton kernel 0 and the Mosaic kernel at T = 1 its constant mask words. So a concrete mask is checked."""
    case = list(as_jax(make_case(1, 2, 3, 8, 128, 64, 128, [100, 0], "tree")))
    case[4] = case[4].at[1, 2, 2].set(False)
    kw = dict(scale=SCALE, kv_lora_rank=128)
    for f in (tree_attention_ref, mla_attention, M.tree_attention_mgpu,
              functools.partial(mla_attention, interpret=True)):
        with pytest.raises(ValueError, match=r"diagonal must be True.*\[\[1, 2\]\]"):
            f(*case[:3], case[3], case[4], **kw)


def test_valid_rows_keep_only_the_real_rows_of_one_tile():
    """One 64-row tile with fewer real rows (T = 1, H = 8): the kernel's outputs hold those rows only, equal
    to the first rows of the full outputs; the rule and its errors; the kernel lowers for CUDA that way."""
    assert M.valid_rows_for(1, 8) == 8 and M.valid_rows_for(4, 8) == 32 and M.valid_rows_for(8, 8) is None
    assert M.valid_rows_for(1, 64) is None and M.valid_rows_for(3, 2) is None  # 6 rows: not a multiple of 8
    case = as_jax(make_case(2, 2, 1, 8, 128, 64, 256, [100, 256], "chain"), jnp.bfloat16)
    q_rows = fold_rows(case[0], M.ROWS)
    tail = M.tree_inputs(case[3], case[4], 8, M.ROWS, 64)
    kw = dict(scale=SCALE, kv_lora_rank=128, num_splits=3)
    full_o, full_l = M.split_attention_ref(q_rows, case[1], case[2], *tail, **kw)
    o, lse = M.split_attention_ref(q_rows, case[1], case[2], *tail, valid_rows=8, **kw)
    assert o.shape == (3, 2, 8, 128) and lse.shape == (3, 2, 8)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(full_o[:, :, :8], np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(full_l[:, :, :8]))
    for bad in (12, 64 + 8, 0):
        with pytest.raises(ValueError, match="valid_rows"):
            M.split_attention_ref(q_rows, case[1], case[2], *tail, valid_rows=bad, **kw)
    lowered = jax.jit(functools.partial(M.split_attention, valid_rows=8, **kw)).trace(
        q_rows, case[1], case[2], *tail).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text() and lowered.out_info[0].shape == (3, 2, 8, 128)


K26 = dict(C=576, L=512, scale=0.14468)


def k26_spec(B, T, H, S):
    C = K26["C"]
    return (jax.ShapeDtypeStruct((B, T, H, C), jnp.bfloat16), jax.ShapeDtypeStruct((B, S, C), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, T, T), jnp.bool_))


@pytest.mark.parametrize("T,H,NS,share,BK,stages,tail,rows", [
    (1, 64, 4, True, 64, 2, True, 64), (8, 8, 1, False, 64, 2, True, 64), (33, 64, 2, True, 64, 2, True, 2112),
    (9, 8, 1, True, 64, 2, True, 72), (9, 8, 4, True, 64, 2, False, 128), (9, 8, 4, False, 64, 2, True, 128)])
def test_kernel_lowers_for_cuda_on_cpu(T, H, NS, share, BK, stages, tail, rows):
    """Mosaic GPU lowering at K2.6 dims without a GPU: layouts, transforms, wgmma shapes, barriers,
    and shared memory within the H200's 227 KB; at T*H = 72 one tile and a tail (72 rows of partials), or
    two tiles (128) where the tail is off or the scores are not shared."""
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"],
                                  num_splits=NS, share_scores=share, block_k=BK, stages=stages, tail=tail,
                                  kernel=M.split_attention))
    text = f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and f"tensor<{NS}x2x{rows}x512xbf16>" in text


@pytest.mark.parametrize("T,default", [(9, True), (8, False)])
def test_first_block_alone_is_the_default_with_a_tail_only(T, default, monkeypatch):
    """The second key block's copy waits for the first by default where one tile and a tail run (T*H = 72),
    not with whole tiles; an explicit setting wins. Read off the copy pipeline while the kernel lowers for CUDA
    (comparing lowered modules is not stable: JAX 0.11.2 on the H200 serialized equal settings differently)."""
    seen = []

    def spy(*args, first_block_alone=False, **kw):
        seen.append(first_block_alone)
        return stream_key_blocks(*args, first_block_alone=first_block_alone, **kw)

    stream_key_blocks = M.stream_key_blocks
    monkeypatch.setattr(M, "stream_key_blocks", spy)
    for setting in (None, not default):
        kernel = functools.partial(M.split_attention, first_block_alone=setting)
        f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"],
                                      num_splits=2, kernel=kernel))
        f.trace(*k26_spec(2, T, 8, 1024)).lower(lowering_platforms=("cuda",))
    assert seen == [default, not default]


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against the twin at K2.6 dims (bf16 inputs; the twin on f32-upcast inputs).
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,kind,NS,share,tail", [
    (2, 1, 64, 4096, "chain", None, True, True), (3, 1, 8, 4096, "chain", 7, True, True),
    (2, 8, 8, 2048, "chain", None, True, True), (2, 64, 64, 2048, "tree", None, True, True),
    (1, 256, 8, 1024, "tree", 1, True, True), (2, 33, 64, 1000, "tree", 3, True, True),
    (2, 1, 64, 4096, "chain", None, False, True), (2, 33, 64, 1000, "tree", 3, False, True),
    (2, 200, 8, 64, "tree", 5, True, True),            # splits inside the tree (4 tree blocks, 1 cache block)
    (2, 4, 8, 2048, "tree", None, True, True),         # 32 real rows of one tile: only those written (valid_rows)
    (3, 9, 8, 1000, "tree", 4, True, True),            # DDTree budget 8 under TP-8: 72 rows, one tile and a tail
    (3, 9, 8, 1000, "tree", 4, True, False),     # ... and as two tiles
    (2, 9, 8, 4096, "chain", None, True, True),        # one tile and a tail, the default splits
    (2, 9, 8, 136, "tree", 1, True, True),             # one split: the kernel's output is the result
    (2, 9, 8, 64, "tree", 2, True, True),              # a split of tree blocks only (the tail's mask words)
])
def test_gpu_kernel_matches_twin_k26(B, T, H, S, kind, NS, share, tail):
    """The 64-row kernel, also where the default would take the narrow one (T*H <= 32); at T*H = 72 with a
    tail of 8 rows in the tile's program (``tail``) and as two tiles."""
    check_kernel_k26(B, T, H, S, kind, NS, share, tail, M.split_attention)


KERNEL_OPTIONS = {  # split_attention's options off their default, each under GPU parity and lowered on the CPU
    "pv_after_handoff": dict(pv_first=False),  # consumer 0's p·v after the hand-over (FlashMLA's order)
    "store_after_partner": dict(store_early=False),  # consumer 0 waits for consumer 1 before it stores its half
}


@pytest.mark.gpu
@pytest.mark.parametrize("option", sorted(KERNEL_OPTIONS))
@pytest.mark.parametrize("B,T,H,S,kind,NS,tail", [
    (2, 1, 64, 4096, "chain", None, True), (2, 64, 64, 2048, "tree", None, True), (2, 33, 64, 1000, "tree", 4, True),
    (3, 9, 8, 1000, "tree", 4, True), (2, 9, 8, 64, "tree", 2, True), (3, 9, 8, 1000, "tree", 4, False)])
def test_gpu_kernel_options_match_twin_k26(B, T, H, S, kind, NS, tail, option):
    """Each option of ``KERNEL_OPTIONS``, with whole tiles (empty streams, splits of tree blocks only) and with
    a tail."""
    check_kernel_k26(B, T, H, S, kind, NS, True, tail, functools.partial(M.split_attention, **KERNEL_OPTIONS[option]))


@pytest.mark.parametrize("option", sorted(KERNEL_OPTIONS))
@pytest.mark.parametrize("T,H", [(1, 64), (9, 8)])
def test_kernel_options_lower_for_cuda_on_cpu(T, H, option):
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"], num_splits=2,
                                  kernel=functools.partial(M.split_attention, **KERNEL_OPTIONS[option])))
    assert "mosaic_gpu" in f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,kind", [
    (2, 64, 64, 2048, "tree"), (2, 1, 64, 4096, "chain"), (3, 8, 8, 1000, "tree"), (2, 33, 64, 1000, "tree"),
    (2, 200, 8, 64, "tree"),      # the split inside the tree
])
def test_gpu_peer_merge_matches_twin_k26(B, T, H, S, kind):
    """Two splits merged in the kernel (``peer_merge``). Stream 0 has no prefix (``check_kernel_k26``), so where the
    tree is one block, split 0 sees no key."""
    check_kernel_k26(B, T, H, S, kind, 2, True, True, functools.partial(M.split_attention, peer_merge=True))


@pytest.mark.gpu
def test_gpu_peer_merge_counters_return_to_zero_between_calls():
    """The tiles' counters persist from call to call (``pl.get_global``): split 1 takes back what split 0 added,
    so five calls in a row, each on other prefixes and queries, all match the twin (a counter left above zero would
    let split 1 read split 0's output before it is written, or a stale one)."""
    L = K26["L"]
    f = jax.jit(lambda *a: M.tree_attention_mgpu(*a, scale=K26["scale"], kv_lora_rank=L, num_splits=2,
                                                 kernel=functools.partial(M.split_attention, peer_merge=True)))
    ref = jax.jit(lambda *a: tree_attention_ref(*a, scale=K26["scale"], kv_lora_rank=L))
    for seed in range(5):
        plens = [int(x) for x in np.random.default_rng(seed).integers(1, 2049, size=3)]
        args = as_jax(make_case(seed, 3, 16, 8, L, K26["C"] - L, 2048, plens, "tree"), jnp.bfloat16)
        o = np.asarray(f(*args), np.float32)
        r = np.asarray(ref(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]))
        assert np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2, seed


@pytest.mark.parametrize("T,H,rows", [(64, 64, 4096), (32, 8, 256)])
def test_peer_merge_lowers_for_cuda_on_cpu_to_merged_outputs(T, H, rows):
    """With ``peer_merge`` the kernel's outputs are the merged [1, B, V, L] (no merge launch follows)."""
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"], num_splits=2,
                                  kernel=functools.partial(M.split_attention, peer_merge=True)))
    text = f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()
    assert f"tensor<1x2x{rows}x512xbf16>" in text and "combine_splits" not in text


def test_twin_with_peer_merge_takes_the_kernels_shares_and_merges_them():
    """``split_attention_ref(peer_merge=True)`` gives the kernel's merged outputs, o [1, B, V, L] and lse [1, B, V],
    equal to its two splits merged apart (whichever shares they take); the op on it matches the dense reference,
    and the twin refuses a peer merge where the kernel does."""
    B, T, H, S, L = 3, 8, 8, 320, 128
    case = make_case(9, B, T, H, L, 64, S, [0, 130, 320], "tree")
    args = as_jax(case, jnp.bfloat16)
    q_rows = fold_rows(args[0], 64)
    keys, bits = M.tree_inputs(args[3], args[4], H, 64, 64)
    kw = dict(scale=SCALE, kv_lora_rank=L, num_splits=2)
    o, lse = M.split_attention_ref(q_rows, args[1], args[2], keys, bits, peer_merge=True, **kw)
    assert o.shape == (1, B, 64, L) and o.dtype == jnp.bfloat16 and lse.shape == (1, B, 64)
    parts = M.split_attention_ref(q_rows, args[1], args[2], keys, bits, **kw)
    merged, merged_lse = combine_splits_ref(*parts)
    np.testing.assert_allclose(np.asarray(o[0], np.float32), np.asarray(merged, np.float32), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse[0]), np.asarray(merged_lse), atol=1e-4, rtol=1e-4)
    ref_o, _ = dense_reference(*(np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a)
                                 for a in args), SCALE, L)
    op = M.tree_attention_mgpu(*args, scale=SCALE, kv_lora_rank=L, num_splits=2,
                               kernel=functools.partial(M.split_attention_ref, peer_merge=True))
    assert np.linalg.norm(np.asarray(op, np.float32) - ref_o) / np.linalg.norm(ref_o) < 1e-2
    with pytest.raises(ValueError, match="peer_merge"):
        M.split_attention_ref(q_rows, args[1], args[2], keys, bits, peer_merge=True, **dict(kw, num_splits=3))


def test_the_op_merges_two_splits_of_whole_tiles_in_the_kernel():
    """``tree_attention_mgpu`` chooses ``peer_merge`` where its kernel runs two splits of whole tiles with shared
    scores (T = 64, H = 64, one stream over 1K: 64 tiles x 2 splits), and the merge launch elsewhere; a kernel
    passed in is taken as it is."""
    assert M.splits_for(1, 64, 64, 1024) == 2 and M.splits_for(1, 8, 8, 1024) > 2
    assert M.uses_peer_merge(M.split_attention, 2, False, True, None)
    assert not M.uses_peer_merge(M.split_attention, 2, True, True, None)       # one tile and a tail
    assert not M.uses_peer_merge(M.split_attention, 2, False, False, None)     # scores not shared
    assert not M.uses_peer_merge(M.split_attention, 2, False, True, 32)        # a partial tile
    assert not M.uses_peer_merge(M.split_attention, 3, False, True, None)
    assert not M.uses_peer_merge(M.split_attention_ref, 2, False, True, None)

    def lowered(T, H, **kw):
        f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"], **kw))
        return f.trace(*k26_spec(1, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered(64, 64)
    assert "tensor<1x1x4096x512xbf16>" in text and "combine_splits" not in text
    assert "combine_splits" in lowered(8, 8)
    text = lowered(64, 64, kernel=M.split_attention)
    assert "tensor<2x1x4096x512xbf16>" in text and "combine_splits" in text


def check_kernel_k26(B, T, H, S, kind, NS, share, tail, kernel):
    """``kernel`` through ``tree_attention_mgpu`` on a random case at K2.6 dims against ``tree_attention_ref``
    on the f32-upcast inputs."""
    L = K26["L"]
    rng = np.random.default_rng(7)
    plens = [int(x) for x in rng.integers(0, S + 1, size=B)]
    plens[0] = 0 if B > 1 else S
    if S % 64 and B > 1:
        plens[-1] = S  # the partial block reaches past the cache: the TMA unit reads zeros there
    case = make_case(11, B, T, H, L, K26["C"] - L, S, plens, kind)
    args = as_jax(case, jnp.bfloat16)
    o, lse = jax.jit(lambda *a: M.tree_attention_mgpu(*a, scale=K26["scale"], kv_lora_rank=L, num_splits=NS,
                                                      share_scores=share, return_lse=True, tail=tail,
                                                      kernel=kernel))(*args)
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    r_o, r_l = jax.jit(lambda *a: tree_attention_ref(*a, scale=K26["scale"], kv_lora_rank=L,
                                                     return_lse=True))(*up)
    o, r_o = np.asarray(o, np.float32), np.asarray(r_o)
    assert np.all(np.isfinite(o))
    assert np.linalg.norm(o - r_o) / np.linalg.norm(r_o) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(r_l), atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("T,H,backend,expect", [(1, 64, "auto", "mosaic_gpu"), (1, 8, "auto", "mosaic_gpu"),
                                                (8, 8, "auto", "mosaic_gpu"), (8, 8, "triton", "triton"),
                                                (1, 8, "mgpu", "mosaic_gpu")])
def test_dispatcher_picks_the_kernel_for_cuda(T, H, backend, expect):
    f = jax.jit(functools.partial(mla_attention, scale=K26["scale"], kv_lora_rank=K26["L"], backend=backend))
    text = f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()
    # the Triton attention kernel is named "mla_tree_attention"; the split merge is a Triton launch either way
    attention = "mla_tree_attention" if expect == "triton" else "mosaic_gpu"
    assert attention in text and ("mla_tree_attention" if expect == "mosaic_gpu" else "mosaic_gpu") not in text
    zeros = [jnp.zeros(s.shape, s.dtype) for s in k26_spec(1, 1, 8, 64)]
    with pytest.raises(ValueError, match="backend"):
        mla_attention(*zeros, scale=1.0, kv_lora_rank=512, backend="cuda")
    with pytest.raises(NotImplementedError, match="interpret"):
        mla_attention(*zeros, scale=1.0, kv_lora_rank=512, backend="mgpu", interpret=True)
    with pytest.raises(ValueError, match="Mosaic GPU kernel cannot take dtype float32"):
        mla_attention(*(z.astype(jnp.float32) if z.dtype == jnp.bfloat16 else z for z in zeros), scale=1.0,
                      kv_lora_rank=512, backend="mgpu")
    with pytest.raises(ValueError, match="Triton kernel cannot take"):
        mla_attention(*zeros, scale=1.0, kv_lora_rank=512, backend="triton", block_rows=24)


@pytest.mark.parametrize("C,S", [(640, 256), (576, 273)])
def test_dispatcher_auto_falls_back_to_triton_where_the_mosaic_kernel_cannot_run(C, S):
    """C = 640 (512 + 128) needs more shared memory than an SM has, and a 273-slot cache breaks the TMA
    tiling rule: auto takes Triton, not a failing kernel."""
    B, T, H = 1, 8, 8
    spec = (jax.ShapeDtypeStruct((B, T, H, C), jnp.bfloat16), jax.ShapeDtypeStruct((B, S, C), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, T, T), jnp.bool_))
    f = jax.jit(functools.partial(mla_attention, scale=0.1, kv_lora_rank=512))
    text = f.trace(*spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "mosaic_gpu" not in text


# ---------------------------------------------------------------------------------------------
# The model's absorbed attention on the kernel: K2.6 latent dims (512 + 64), 8 heads, bf16.
# ---------------------------------------------------------------------------------------------

def latent_model(seed=0, abstract=False):
    from flax import nnx

    from ddtree_jax.config import tiny_config
    from ddtree_jax.model import KimiModel
    cfg = tiny_config(dtype="bfloat16", kv_lora_rank=512, qk_rope_head_dim=64, num_heads=8, num_layers=2)
    make = lambda: KimiModel(cfg, nnx.Rngs(seed))  # noqa: E731
    return nnx.eval_shape(make) if abstract else make()


def cached_verify_logits(model, prompt, block, runtime, capacity=None):
    """Prefill ``prompt`` [B, P] into a cache (``capacity`` slots, default P + T + 71), then verify ``block``
    [B, T] (causal) on top of it."""
    from ddtree_jax.cache import commit, init_cache
    from ddtree_jax.model import causal_mask
    b, p = prompt.shape
    t = block.shape[1]
    cache = init_cache(model.cfg, b, capacity or p + t + 71)   # 280 slots: the Mosaic kernel needs S % 8 == 0
    pos = jnp.broadcast_to(jnp.arange(p), (b, p))
    out = model(prompt, pos, cache, causal_mask(b, p), runtime=runtime)
    cache, _ = commit(cache, out.block_kv, jnp.broadcast_to(jnp.arange(p), (b, p)), jnp.full((b,), p, jnp.int32))
    pos = jnp.broadcast_to(p + jnp.arange(t), (b, t))
    return model(block, pos, cache, causal_mask(b, t), runtime=runtime).logits


def test_model_verify_lowers_to_the_kernel_for_cuda():
    from flax import nnx

    from ddtree_jax.cache import init_cache
    from ddtree_jax.model import Runtime, causal_mask
    model = latent_model(abstract=True)
    graphdef, state = nnx.split(model)

    def verify(state, tokens):
        cache = init_cache(model.cfg, 2, 256)
        m = nnx.merge(graphdef, state)
        b, t = tokens.shape
        return m(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), cache, causal_mask(b, t), runtime=Runtime()).logits

    staged = jax.jit(verify).trace(state, jax.ShapeDtypeStruct((2, 9), jnp.int32))   # 72 rows: the kernel
    assert "mosaic_gpu" in staged.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" not in staged.lower(lowering_platforms=("cpu",)).as_text()


def model_cached_verify_check(block_len=9, capacity=None):
    """Cached verify on the dispatcher's attention == the same on the twin == one full forward."""
    from ddtree_jax.cache import init_cache
    from ddtree_jax.model import Runtime, causal_mask
    model = latent_model()
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 256, (2, 200)), jnp.int32)        # 3 whole key blocks + 8 keys
    block = jnp.asarray(rng.integers(0, 256, (2, block_len)), jnp.int32)   # 9: 72 query rows
    kernel = cached_verify_logits(model, prompt, block, Runtime(), capacity)
    twin = cached_verify_logits(model, prompt, block, Runtime(attention_fn=tree_attention_ref), capacity)
    n = 200 + block_len
    both = jnp.concatenate([prompt, block], 1)
    full = model(both, jnp.broadcast_to(jnp.arange(n), (2, n)), init_cache(model.cfg, 2, n),
                 causal_mask(2, n), runtime=Runtime(attention_fn=tree_attention_ref)).logits[:, 200:]
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    assert bool(jnp.all(jnp.isfinite(kernel)))
    assert rel(kernel, twin) < 2e-2 and rel(kernel, full) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block_len,capacity", [(9, None), (1, 256), (4, 256)])
def test_gpu_model_cached_verify_matches_twin_and_full_forward(block_len, capacity):
    """72 rows (the 64-row kernel), and 8 and 32 rows over a 256-slot cache (the narrow kernel, whose
    prefix ends inside a block and whose tree latents the model pads)."""
    model_cached_verify_check(block_len, capacity)


def test_model_decode_lowers_to_the_narrow_kernel_for_cuda():
    """A decode step (T = 1, 8 heads) over a cache of whole 64-key blocks: the narrow kernel reads the padded
    latents in place (no tail gather), and the CPU lowering runs the twin."""
    from flax import nnx

    from ddtree_jax.cache import init_cache
    from ddtree_jax.model import Runtime, causal_mask
    model = latent_model(abstract=True)
    graphdef, state = nnx.split(model)

    def decode(state, tokens):
        cache = init_cache(model.cfg, 2, 256)
        m = nnx.merge(graphdef, state)
        return m(tokens, jnp.zeros((2, 1), jnp.int32), cache, causal_mask(2, 1), runtime=Runtime()).logits

    staged = jax.jit(decode).trace(state, jax.ShapeDtypeStruct((2, 1), jnp.int32))
    assert staged.lower(lowering_platforms=("cuda",)).as_text().count("narrow_body") >= 2  # one per layer
    assert "mosaic_gpu" not in staged.lower(lowering_platforms=("cpu",)).as_text()


# Lowering for CUDA inside shard_map over the 8 fake CPU devices: JAX 0.11's Pallas-Triton lowering asks the
# mesh's devices for their GPU (and fails on CPU devices, session 35 on the H200), so these lowering checks
# take the split merge in XLA (combine_splits_ref); what they check is the Mosaic GPU kernel's local shapes.
host_mesh_attention = functools.partial(mla_attention, backend="mgpu", combine=combine_splits_ref)


def test_sharded_latent_attention_equals_unsharded_and_lowers_to_local_kernels(host_devices):
    """8 fake CPU devices, data=2 x model=4: each device attends its 2 streams and 4 of the 16 heads
    (the twin here, the kernel on local [2, 16, 4, 576] queries when lowered for CUDA)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from ddtree_jax.model import Runtime, latent_attention
    from ddtree_jax.sharding import DEFAULT_RULES, make_mesh
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    B, T, H, S = 4, 16, 16, 200
    case = make_case(2, B, T, H, K26["L"], K26["C"] - K26["L"], S, [0, 64, 130, 200], "tree")
    args = as_jax(case, jnp.bfloat16)
    kw = dict(scale=K26["scale"], kv_lora_rank=K26["L"])
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    f = jax.jit(lambda *a: latent_attention(host_mesh_attention, runtime, *a, **kw))
    sharded_q = jax.device_put(args[0], NamedSharding(mesh, PartitionSpec("data", None, "model", None)))
    got = f(sharded_q, *args[1:])
    want = tree_attention_ref(*args, **kw)
    # the twin's chunking depends on the local shapes: equal up to bf16 rounding of the output
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=8e-3, rtol=8e-3)
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "tensor<2x16x4x576xbf16>" in text


def test_budget8_tree_under_8way_tensor_parallelism_lowers_to_one_tile_and_a_tail(host_devices):
    """K2.6's verify of a budget-8 tree (T = 9) with its 64 heads over model = 8 (8 fake CPU devices): each
    device's kernel takes its 9 x 8 = 72 query rows as one 64-row tile and a tail (72 rows of partials,
    not two tiles' 128)."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec

    from ddtree_jax.model import Runtime, latent_attention
    from ddtree_jax.sharding import DEFAULT_RULES, make_mesh
    mesh = make_mesh(data=1, model=8, devices=host_devices)
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    f = jax.jit(lambda *a: latent_attention(host_mesh_attention, runtime, *a, scale=K26["scale"],
                                            kv_lora_rank=K26["L"]))
    spec = list(k26_spec(2, 9, 64, 1024))
    spec[0] = jax.ShapeDtypeStruct(spec[0].shape, spec[0].dtype,
                                   sharding=NamedSharding(mesh, PartitionSpec(None, None, "model", None)))
    text = f.trace(*spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<2x9x8x576xbf16>" in text                      # the local queries: 8 of the 64 heads
    assert re.search(r"tensor<\d+x2x72x512xbf16>", text) and not re.search(r"tensor<\d+x2x128x512xbf16>", text)

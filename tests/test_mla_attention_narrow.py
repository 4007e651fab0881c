"""The swapped decode kernel (``pallas_kernels.mla_attention_narrow``). CPU: the op through its twin
(``mla_attention_mgpu.split_attention_ref``, whose split-by-split tests are in ``test_mla_attention_mgpu.py``)
against the dense reference, with tree latents as given and padded to a whole block; ``tree_inputs``;
padded latents in every entry; the kernel lowered for CUDA at K2.6 dims and the default routing; its
argument errors. GPU (``gpu`` marker): against the twin, split by split, and through
``tree_attention_mgpu(kernel=...)`` against ``tree_attention_ref`` (NaN garbage past every prefix)."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import mla_attention_mgpu as M
from pallas_kernels.mla_attention_narrow import NARROW_MAX_ROWS, narrow_smem_bytes, split_attention_narrow
from pallas_kernels.split_combine import combine_splits_ref
from pallas_kernels.tree_attention import tree_attention_ref
from tests.test_mla_attention_mgpu import K26, k26_spec
from tests.test_tree_attention_kernel import as_jax, dense_reference, make_case

SCALE = 0.27


@pytest.mark.parametrize("B,T,H,S,plens,kind,NS", [
    (2, 1, 8, 512, [512, 300], "chain", 6),
    (3, 2, 16, 256, [0, 100, 256], "tree", None),
    (2, 4, 4, 128, [127, 64], "star", 2),
    (1, 32, 1, 64, [63], "tree", 3),              # 32 one-head nodes
])
def test_op_with_twin_matches_dense(B, T, H, S, plens, kind, NS):
    L, RD = 128, 64
    case = make_case(7, B, T, H, L, RD, S, plens, kind)
    args = as_jax(case, jnp.bfloat16)
    op = functools.partial(M.tree_attention_mgpu, scale=SCALE, kv_lora_rank=L, num_splits=NS, return_lse=True,
                           kernel=M.split_attention_ref, combine=combine_splits_ref)
    o, lse = jax.jit(op)(*args)
    up = [np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a) for a in args]
    r_o, r_l = dense_reference(*up, SCALE, L)
    assert o.shape == (B, T, H, L) and o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o, np.float32), r_o, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), r_l, atol=1e-3, rtol=1e-4)
    # the same latents handed over padded to a whole block (as the model does): the same result, bit for bit
    padded = M.pad_tree_latents(args[3])
    o2, lse2 = jax.jit(op)(args[0], args[1], args[2], padded, args[4])
    np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


def test_tree_inputs():
    """Padding to whole blocks (or the latents as they are when already padded), and the mask words: at
    T = 1 the constant (rows < H see key 0) equals what the general packing gives for a [[True]] mask."""
    rng = np.random.default_rng(0)
    B, T, H, C = 2, 5, 4, 16
    tkv = jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)
    mask = jnp.asarray(np.tril(rng.random((B, T, T)) < 0.6) | np.eye(T, dtype=bool))
    keys, bits = M.tree_inputs(tkv, mask, H, 64, 64)
    assert keys.shape == (B, 64, C) and bits.shape == (B, 2, 64) and bits.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(keys[:, :T]), np.asarray(tkv))
    assert not np.asarray(keys[:, T:]).any()
    seen = np.asarray(M.unpack_bits(bits, 64))  # [B, 64 rows, 64 keys]
    for r in range(64):
        want = np.zeros((B, 64), bool)
        if r < T * H:
            want[:, :T] = np.asarray(mask)[:, r // H]
        np.testing.assert_array_equal(seen[:, r], want)
    assert M.tree_inputs(keys, mask, H, 64, 64)[0] is keys
    one = jnp.ones((B, 1, 1), bool)
    const = M.tree_inputs(tkv[:, :1], one, 8, 64, 64)[1]
    general = M.pack_bits(jnp.pad(jnp.broadcast_to(jnp.arange(64) < 8, (B, 1, 64)), ((0, 0), (0, 63), (0, 0))))
    np.testing.assert_array_equal(np.asarray(const), np.asarray(general))


def test_pad_tree_latents_rounds_up_to_whole_blocks_only():
    """[B, T, C] -> [B, TP, C], TP = T rounded up to whole blocks (T itself where it is whole, the latents as they
    are), the rows past T zero."""
    for T, block_k in [(1, 64), (63, 64), (64, 64), (65, 64), (128, 64), (5, 16), (32, 16)]:
        kv = jnp.asarray(np.random.default_rng(T).standard_normal((2, T, 8)) + 1.0, jnp.float32)
        out = M.pad_tree_latents(kv, block_k)
        assert out.shape == (2, -(-T // block_k) * block_k, 8), (T, block_k)
        np.testing.assert_array_equal(np.asarray(out[:, :T]), np.asarray(kv))
        assert not np.asarray(out[:, T:]).any()
        if T % block_k == 0:
            assert out is kv


def test_check_in_place_inputs_wants_tree_keys_in_whole_blocks():
    """tree_kv's TP must be a positive multiple of block_k (the kernels read whole blocks in place), checked
    directly: TP = 96 is whole 32-key mask words but not whole 64-key blocks."""
    B, R, C, S = 2, 64, 16, 128
    q, cache, plen = jnp.zeros((B, R, C)), jnp.zeros((B, S, C)), jnp.zeros((B,), jnp.int32)
    for TP, block_k in [(64, 64), (96, 32), (128, 64)]:
        bits = jnp.zeros((B, TP // M.WORD, R), jnp.int32)
        assert M.check_in_place_inputs(q, cache, plen, jnp.zeros((B, TP, C)), bits, block_k, "f") == (B, R, C, S, TP)
    for TP, block_k in [(96, 64), (32, 64), (0, 64)]:
        bits = jnp.zeros((B, TP // M.WORD, R), jnp.int32)
        with pytest.raises(ValueError, match="f: tree_kv .* TP a positive multiple of block_k"):
            M.check_in_place_inputs(q, cache, plen, jnp.zeros((B, TP, C)), bits, block_k, "f")


def test_padded_tree_latents_are_accepted_by_every_entry():
    """tree_kv [B, T', C] with T' > T: its padding rows are ignored by the twin and the Triton kernel
    (interpreted); a tree_kv shorter than T is an error."""
    from pallas_kernels.tree_attention import mla_attention
    L = 32
    case = make_case(9, 2, 3, 2, L, 16, 40, [40, 7], "tree")
    args = list(as_jax(case))
    padded = jnp.pad(args[3], ((0, 0), (0, 5), (0, 0)))
    kw = dict(scale=SCALE, kv_lora_rank=L)
    want = tree_attention_ref(*args, **kw)
    for f in (tree_attention_ref, functools.partial(mla_attention, interpret=True)):
        np.testing.assert_allclose(np.asarray(f(args[0], args[1], args[2], padded, args[4], **kw)), np.asarray(want),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tree_kv must be"):
        tree_attention_ref(args[0], args[1], args[2], args[3][:, :2], args[4], **kw)


@pytest.mark.parametrize("T,H,NS", [(1, 8, 4), (2, 8, 1), (4, 8, 3)])
def test_kernel_lowers_for_cuda_on_cpu(T, H, NS):
    """V = T*H = 8, 16, 32 rows: layouts (the reductions over keys, the transposed stores, the partial block's
    zeroing), transposed wgmma operands and shared memory within the H200's 227 KB."""
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"],
                                  num_splits=NS, kernel=split_attention_narrow))
    text = f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_default_kernel_is_narrow_up_to_32_rows_and_its_shared_memory_count():
    """``tree_attention_mgpu`` picks the narrow kernel for T*H <= 32 real rows (any cache capacity: a partial
    block past the cache reads zeros), and the 64-row one otherwise; ``narrow_smem_bytes`` lets three key blocks in
    flight at V = 8 and not at 16, and Mosaic GPU's own count (checked when lowering) agrees at V = 8."""
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"]))
    for T, H, S, narrow in [(1, 8, 1024, True), (4, 8, 1024, True), (1, 16, 1024, True), (8, 8, 1024, False),
                            (1, 64, 1024, False), (3, 2, 1024, False), (1, 8, 1000, True)]:
        text = f.trace(*k26_spec(2, T, H, S)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and ("narrow_body" in text) == narrow, (T, H, S)
        assert ("attention_body" in text) == (not narrow), (T, H, S)  # the 64-row kernel's own trace name
        assert (M.default_kernel_name(T, H, K26["C"], K26["L"]) == "narrow") == narrow, (T, H)
    name = functools.partial(M.default_kernel_name, C=K26["C"], L=K26["L"])
    assert (name(9, 8), name(8, 8), name(1, 64), name(3, 2)) == ("tail", "tiles", "tiles", "tiles")
    assert M.default_kernel_name(1, 8, 512, 512) == M.default_kernel_name(9, 8, 512, 512) == "tiles"  # no rope columns
    assert name(1, 8, block_k=32) == "tiles"
    assert narrow_smem_bytes(8, K26["C"], 64, 3) <= M.SMEM_LIMIT < narrow_smem_bytes(16, K26["C"], 64, 3)
    lowered = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"], stages=3))
    assert "narrow_body" in lowered.trace(*k26_spec(2, 1, 8, 1024)).lower(lowering_platforms=("cuda",)).as_text()


def test_partials_of_the_narrow_kernel_get_the_rows_unpadded(monkeypatch):
    """``tree_attention_mgpu(kernel=functools.partial(split_attention_narrow, ...))`` (e.g. with the profiler on)
    hands the kernel the V real query rows, as for the kernel itself: no padded 64-row copy of q."""
    def no_padding(*_):
        raise AssertionError("q padded to 64-row tiles for the narrow kernel")
    monkeypatch.setattr(M, "fold_rows", no_padding)
    kernel = functools.partial(split_attention_narrow, stages=2)
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"], num_splits=2,
                                  kernel=kernel))
    assert "narrow_body" in f.trace(*k26_spec(2, 4, 8, 1024)).lower(lowering_platforms=("cuda",)).as_text()


def test_errors():
    C, L = K26["C"], K26["L"]
    q = jnp.zeros((1, 64, C), jnp.bfloat16)
    cache = jnp.zeros((1, 256, C), jnp.bfloat16)
    plen = jnp.zeros((1,), jnp.int32)
    tree_kv, tree_bits = jnp.zeros((1, 64, C), jnp.bfloat16), jnp.zeros((1, 2, 64), jnp.int32)
    kw = dict(scale=0.1, kv_lora_rank=L)
    f = split_attention_narrow
    for bad in (None, 12, 40, 64):
        with pytest.raises(ValueError, match="valid_rows V a multiple of 8 up to 32"):
            f(q, cache, plen, tree_kv, tree_bits, valid_rows=bad, **kw)
    for rows in (128, 16):  # V rows or one 64-row tile
        with pytest.raises(ValueError, match="one 64-row tile of which the first V"):
            f(jnp.zeros((1, rows, C), jnp.bfloat16), cache, plen, tree_kv, jnp.zeros((1, 2, rows), jnp.int32),
              valid_rows=8, **kw)
    with pytest.raises(ValueError, match="block_k=128"):
        f(q, cache, plen, jnp.zeros((1, 128, C), jnp.bfloat16), jnp.zeros((1, 4, 64), jnp.int32),
          valid_rows=8, block_k=128, **kw)
    with pytest.raises(ValueError, match="tree_kv"):
        f(q, cache, plen, tree_kv[:, :32], tree_bits, valid_rows=8, **kw)
    with pytest.raises(ValueError, match="tree_bits"):
        f(q, cache, plen, tree_kv, tree_bits.astype(jnp.uint32), valid_rows=8, **kw)
    with pytest.raises(ValueError, match="shared memory"):
        split_attention_narrow(q, cache, plen, tree_kv, tree_bits, valid_rows=8, stages=4, **kw)
    with pytest.raises(ValueError, match="shared memory"):
        split_attention_narrow(q, cache, plen, tree_kv, tree_bits, valid_rows=16, stages=3, **kw)
    with pytest.raises(ValueError, match="L \\+ 64 <= C"):
        split_attention_narrow(q, cache, plen, tree_kv, tree_bits, valid_rows=8, scale=0.1, kv_lora_rank=C - 32)
    assert narrow_smem_bytes(NARROW_MAX_ROWS, C, 64, 2) <= M.SMEM_LIMIT


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,kind,NS", [
    (3, 1, 8, 4096, "chain", 7), (2, 1, 8, 8192, "chain", None), (2, 2, 8, 2048, "tree", 4),
    (2, 3, 8, 1000, "tree", None), (2, 4, 8, 2048, "tree", 3),
    (2, 4, 8, 64, "tree", 5),  # splits inside the tree block
    (4, 1, 16, 1024, "chain", 5),
])
def test_gpu_kernel_matches_reference_k26(B, T, H, S, kind, NS):
    L = K26["L"]
    rng = np.random.default_rng(5)
    plens = [int(x) for x in rng.integers(0, S + 1, size=B)]
    plens[0] = 0
    if B > 2:
        plens[1] = S // 2 // 64 * 64  # whole blocks only
    if S % 64:
        plens[-1] = S  # the partial block reaches past the cache: the TMA unit reads zeros there
    case = make_case(13, B, T, H, L, K26["C"] - L, S, plens, kind)
    args = as_jax(case, jnp.bfloat16)
    o, lse = jax.jit(lambda *a: M.tree_attention_mgpu(*a, scale=K26["scale"], kv_lora_rank=L, num_splits=NS,
                                                      return_lse=True, kernel=split_attention_narrow))(*args)
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    r_o, r_l = jax.jit(lambda *a: tree_attention_ref(*a, scale=K26["scale"], kv_lora_rank=L, return_lse=True))(*up)
    o, r_o = np.asarray(o, np.float32), np.asarray(r_o)
    assert np.all(np.isfinite(o))
    assert np.linalg.norm(o - r_o) / np.linalg.norm(r_o) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(r_l), atol=3e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,NS,plens", [(1, 6, [0, 600]), (4, 9, [0, 600]), (1, 5, [640, 64]), (2, 3, [1, 639])])
def test_gpu_splits_match_the_twin_split_by_split(T, NS, plens):
    """Each split's normalised partial and LSE, empty splits included (o = 0, lse = -inf), as the twin, with
    the tree latents padded as the model hands them over."""
    B, H, S, L = 2, 8, 640, K26["L"]
    case = make_case(17, B, T, H, L, K26["C"] - L, S, plens, "tree")
    q, cache, plen, tkv, mask = as_jax(case, jnp.bfloat16)
    qr = M.fold_rows(q, M.ROWS)
    keys, bits = M.tree_inputs(tkv, mask, H, qr.shape[1], 64)
    kw = dict(scale=K26["scale"], kv_lora_rank=L, num_splits=NS, valid_rows=T * H)
    o, lse = jax.jit(functools.partial(split_attention_narrow, **kw))(qr, cache, plen, keys, bits)
    r_o, r_l = jax.jit(functools.partial(M.split_attention_ref, **kw))(qr, cache, plen, keys, bits)
    o, r_o, lse, r_l = (np.asarray(a, np.float32) for a in (o, r_o, lse, r_l))
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_l))
    assert np.all(np.isfinite(o))
    finite = np.isfinite(r_l)
    np.testing.assert_allclose(lse[finite], r_l[finite], atol=3e-2, rtol=1e-2)
    assert np.linalg.norm(o - r_o) / max(np.linalg.norm(r_o), 1e-30) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_where_the_max_jumps_between_blocks(T):
    """Key blocks whose scores jump up and down by far more than the softmax's range (keys scaled per block by
    0.1-8, so the running max and the rescale of oᵀ change in some blocks and not in others): as
    ``tree_attention_ref``."""
    B, H, S, L = 2, 8, 1280, K26["L"]
    case = make_case(23, B, T, H, L, K26["C"] - L, S, [S, 1000], "tree")
    q, cache, plen, tkv, mask = as_jax(case, jnp.bfloat16)
    gains = np.resize(np.array([0.1, 1.0, 0.5, 4.0, 4.0, 0.2, 8.0, 1.0, 8.0, 0.1], np.float32), S // 64)
    cache = (cache.astype(jnp.float32) * jnp.asarray(np.repeat(gains, 64))[None, :, None]).astype(jnp.bfloat16)
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in (q, cache, plen, tkv, mask)]
    r_o, r_l = jax.jit(lambda *a: tree_attention_ref(*a, scale=K26["scale"], kv_lora_rank=L, return_lse=True))(*up)
    o, lse = jax.jit(lambda *a: M.tree_attention_mgpu(*a, scale=K26["scale"], kv_lora_rank=L, num_splits=3,
                                                      return_lse=True, kernel=split_attention_narrow))(
        q, cache, plen, tkv, mask)
    o, r_o = np.asarray(o, np.float32), np.asarray(r_o)
    assert np.all(np.isfinite(o))
    assert np.linalg.norm(o - r_o) / np.linalg.norm(r_o) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(r_l), atol=3e-2, rtol=1e-2)

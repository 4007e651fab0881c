"""The seesaw kernel (``pallas_kernels.mla_attention_seesaw``: whole 64-row tiles, both consumers scoring key blocks
in turn). CPU: lowered for CUDA at K2.6 dims through ``tree_attention_mgpu`` (one tile, several, a partial tile of
real rows, one split and several), its shared memory within the H200's, its argument errors. GPU (``gpu`` marker):
split by split against the twin (``split_attention_ref``; empty splits, splits of one to many blocks, odd and
even, a partial block owned by either consumer, tree blocks), and through ``tree_attention_mgpu`` against
``tree_attention_ref`` (NaN garbage past every prefix), also where the running max jumps between blocks."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import mla_attention_mgpu as M
from pallas_kernels.mla_attention_seesaw import seesaw_smem_bytes, split_attention_seesaw
from pallas_kernels.tree_attention import tree_attention_ref
from tests.test_mla_attention_mgpu import K26, k26_spec
from tests.test_tree_attention_kernel import as_jax, make_case


@pytest.mark.parametrize("T,H,NS,rows", [(1, 64, 4, 64), (8, 8, 1, 64), (33, 64, 2, 2112), (1, 32, 3, 32)])
def test_kernel_lowers_for_cuda_on_cpu(T, H, NS, rows):
    """Mosaic GPU lowering at K2.6 dims without a GPU (layouts, transforms, wgmma shapes, barriers, shared memory);
    ``rows`` partials per split: whole tiles, or the real rows of one tile."""
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"], num_splits=NS,
                                  kernel=split_attention_seesaw))
    text = f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and f"tensor<{NS}x2x{rows}x512xbf16>" in text


def test_shared_memory_fits_without_a_probability_tile():
    """p travels in the key blocks' rope columns: the program needs less than the 64-row kernel with its p tile."""
    C = K26["C"]
    assert seesaw_smem_bytes(C) <= M.SMEM_LIMIT
    assert seesaw_smem_bytes(C) < M.smem_bytes(C, 64, 2, share_scores=True)


def test_errors():
    C, L = K26["C"], K26["L"]
    q = jnp.zeros((1, 64, C), jnp.bfloat16)
    cache = jnp.zeros((1, 256, C), jnp.bfloat16)
    plen = jnp.zeros((1,), jnp.int32)
    tree_kv, tree_bits = jnp.zeros((1, 64, C), jnp.bfloat16), jnp.zeros((1, 2, 64), jnp.int32)
    kw = dict(scale=0.1, kv_lora_rank=L)
    f = split_attention_seesaw
    with pytest.raises(ValueError, match="whole 64-row query tiles"):
        f(jnp.zeros((1, 72, C), jnp.bfloat16), cache, plen, tree_kv, jnp.zeros((1, 2, 72), jnp.int32), **kw)
    with pytest.raises(ValueError, match="block_k=128"):
        f(q, cache, plen, jnp.zeros((1, 128, C), jnp.bfloat16), jnp.zeros((1, 4, 64), jnp.int32), block_k=128, **kw)
    with pytest.raises(ValueError, match="stages=3"):
        f(q, cache, plen, tree_kv, tree_bits, stages=3, **kw)
    with pytest.raises(ValueError, match="num_splits=0"):
        f(q, cache, plen, tree_kv, tree_bits, num_splits=0, **kw)
    with pytest.raises(ValueError, match="valid_rows=12"):
        f(q, cache, plen, tree_kv, tree_bits, valid_rows=12, **kw)
    with pytest.raises(ValueError, match="tree_bits"):
        f(q, cache, plen, tree_kv, tree_bits.astype(jnp.uint32), **kw)
    with pytest.raises(ValueError, match="L \\+ 64 <= C"):
        f(q, cache, plen, tree_kv, tree_bits, scale=0.1, kv_lora_rank=C)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T,H,NS,plens", [
    (1, 64, 6, [0, 600]),     # the tree block alone (5 empty splits); 11 blocks, 2 a split, the partial at step 1
    (1, 64, 5, [640, 65]),    # 11 blocks, 3 a split (odd: consumer 0 owns the last); the partial block alone
    (8, 8, 9, [0, 600]),      # 2 blocks a split, the partial one owned by consumer 1
    (8, 8, 2, [1, 639]),      # a one-key prefix; 11 blocks, 6 and 5 a split
    (70, 1, 6, [96, 5]),      # two tree blocks, splits inside the tree (their mask words in either slot)
    (4, 16, 1, [640, 300]),   # one split of 11 and 6 blocks
])
def test_gpu_splits_match_the_twin_split_by_split(T, H, NS, plens):
    """Each split's normalised partial and LSE, empty splits included (o = 0, lse = -inf), as the twin, with the
    tree latents padded as the model hands them over."""
    B, S, L = 2, 640, K26["L"]
    case = make_case(19, B, T, H, L, K26["C"] - L, S, plens, "tree")
    q, cache, plen, tkv, mask = as_jax(case, jnp.bfloat16)
    qr = M.fold_rows(q, M.ROWS)
    keys, bits = M.tree_inputs(tkv, mask, H, qr.shape[1], 64)
    kw = dict(scale=K26["scale"], kv_lora_rank=L, num_splits=NS)
    o, lse = jax.jit(functools.partial(split_attention_seesaw, **kw))(qr, cache, plen, keys, bits)
    r_o, r_l = jax.jit(functools.partial(M.split_attention_ref, **kw))(qr, cache, plen, keys, bits)
    o, r_o, lse, r_l = (np.asarray(a, np.float32) for a in (o, r_o, lse, r_l))
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_l))
    assert np.all(np.isfinite(o))
    finite = np.isfinite(r_l)
    np.testing.assert_allclose(lse[finite], r_l[finite], atol=3e-2, rtol=1e-2)
    assert not o[~finite].any()
    assert np.linalg.norm(o - r_o) / max(np.linalg.norm(r_o), 1e-30) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,kind,NS", [
    (2, 1, 64, 4096, "chain", None), (2, 8, 8, 2048, "chain", None), (2, 64, 64, 2048, "tree", None),
    (1, 256, 8, 1024, "tree", 1), (2, 33, 64, 1000, "tree", 3), (2, 1, 32, 4096, "chain", 4),  # 32 real rows
])
def test_gpu_op_matches_reference_k26(B, T, H, S, kind, NS):
    L = K26["L"]
    rng = np.random.default_rng(7)
    plens = [int(x) for x in rng.integers(0, S + 1, size=B)]
    plens[0] = 0 if B > 1 else S
    if S % 64 and B > 1:
        plens[-1] = S  # the partial block reaches past the cache: the TMA unit reads zeros there
    case = make_case(11, B, T, H, L, K26["C"] - L, S, plens, kind)
    args = as_jax(case, jnp.bfloat16)
    o, lse = jax.jit(lambda *a: M.tree_attention_mgpu(*a, scale=K26["scale"], kv_lora_rank=L, num_splits=NS,
                                                      return_lse=True, kernel=split_attention_seesaw))(*args)
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    r_o, r_l = jax.jit(lambda *a: tree_attention_ref(*a, scale=K26["scale"], kv_lora_rank=L, return_lse=True))(*up)
    o, r_o = np.asarray(o, np.float32), np.asarray(r_o)
    assert np.all(np.isfinite(o))
    assert np.linalg.norm(o - r_o) / np.linalg.norm(r_o) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(r_l), atol=3e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_where_the_max_jumps_between_blocks():
    """Key blocks whose scores jump up and down by far more than the softmax's range (keys scaled per block by
    0.1-8): the running max changes in some blocks and not in others, handed from consumer to consumer."""
    B, T, H, S, L = 2, 1, 64, 1280, K26["L"]
    case = make_case(23, B, T, H, L, K26["C"] - L, S, [S, 1000], "tree")
    q, cache, plen, tkv, mask = as_jax(case, jnp.bfloat16)
    gains = np.resize(np.array([0.1, 1.0, 0.5, 4.0, 4.0, 0.2, 8.0, 1.0, 8.0, 0.1, 0.3], np.float32), S // 64)
    cache = (cache.astype(jnp.float32) * jnp.asarray(np.repeat(gains, 64))[None, :, None]).astype(jnp.bfloat16)
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in (q, cache, plen, tkv, mask)]
    r_o, r_l = jax.jit(lambda *a: tree_attention_ref(*a, scale=K26["scale"], kv_lora_rank=L, return_lse=True))(*up)
    o, lse = jax.jit(lambda *a: M.tree_attention_mgpu(*a, scale=K26["scale"], kv_lora_rank=L, num_splits=3,
                                                      return_lse=True, kernel=split_attention_seesaw))(
        q, cache, plen, tkv, mask)
    o, r_o = np.asarray(o, np.float32), np.asarray(r_o)
    assert np.all(np.isfinite(o))
    assert np.linalg.norm(o - r_o) / np.linalg.norm(r_o) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(r_l), atol=3e-2, rtol=1e-2)

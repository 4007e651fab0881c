"""The swapped decode kernel (``pallas_kernels.mla_attention_narrow``): lowered for CUDA on the CPU at
K2.6 dims, its argument errors, and on a GPU (``gpu`` marker) against the twin, split by split, and
through ``tree_attention_mgpu(kernel=...)`` against ``tree_attention_ref``. Its twin is
``split_attention_ref``, whose own tests are in ``test_mla_attention_mgpu.py``."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import mla_attention_mgpu as M
from pallas_kernels.mla_attention_narrow import NARROW_MAX_ROWS, narrow_smem_bytes, split_attention_narrow
from pallas_kernels.tree_attention import tree_attention_ref
from tests.test_mla_attention_mgpu import K26, k26_spec
from tests.test_tree_attention_kernel import as_jax, make_case


@pytest.mark.parametrize("T,H,NS", [(1, 8, 4), (2, 8, 1), (4, 8, 3)])
def test_kernel_lowers_for_cuda_on_cpu(T, H, NS):
    """V = T*H = 8, 16, 32 rows: layouts (the reductions over keys, the transposed stores), transposed
    wgmma operands and shared memory within the H200's 227 KB."""
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"],
                                  num_splits=NS, kernel=split_attention_narrow))
    text = f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_default_kernel_is_narrow_up_to_32_rows_and_its_shared_memory_count():
    """``tree_attention_mgpu`` picks the narrow kernel for T*H <= 32 real rows of one tile and the 64-row one
    otherwise; ``narrow_smem_bytes`` lets three key blocks in flight at V = 8 and not at 16, and Mosaic GPU's
    own count (checked when lowering) agrees at V = 8."""
    f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"]))
    for T, H, narrow in [(1, 8, True), (4, 8, True), (1, 16, True), (8, 8, False), (1, 64, False), (3, 2, False)]:
        text = f.trace(*k26_spec(2, T, H, 1024)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and ("narrow_body" in text) == narrow, (T, H)
    assert narrow_smem_bytes(8, K26["C"], 64, 3) <= M.SMEM_LIMIT < narrow_smem_bytes(16, K26["C"], 64, 3)
    lowered = jax.jit(functools.partial(M.tree_attention_mgpu, scale=K26["scale"], kv_lora_rank=K26["L"], stages=3))
    assert "narrow_body" in lowered.trace(*k26_spec(2, 1, 8, 1024)).lower(lowering_platforms=("cuda",)).as_text()


def test_errors():
    C, L = K26["C"], K26["L"]
    q = jnp.zeros((1, 64, C), jnp.bfloat16)
    cache = jnp.zeros((1, 256, C), jnp.bfloat16)
    plen = jnp.zeros((1,), jnp.int32)
    tail_kv, tail_bits = jnp.zeros((1, 64, C), jnp.bfloat16), jnp.zeros((1, 2, 64), jnp.int32)
    kw = dict(scale=0.1, kv_lora_rank=L)
    for bad in (None, 12, 40, 64):
        with pytest.raises(ValueError, match="valid_rows a multiple of 8 up to 32"):
            split_attention_narrow(q, cache, plen, tail_kv, tail_bits, valid_rows=bad, **kw)
    with pytest.raises(ValueError, match="one 64-row tile"):
        split_attention_narrow(jnp.zeros((1, 128, C), jnp.bfloat16), cache, plen, tail_kv,
                               jnp.zeros((1, 2, 128), jnp.int32), valid_rows=8, **kw)
    with pytest.raises(ValueError, match="block_k=128"):
        split_attention_narrow(q, cache, plen, jnp.zeros((1, 128, C), jnp.bfloat16), jnp.zeros((1, 4, 64), jnp.int32),
                               valid_rows=8, block_k=128, **kw)
    with pytest.raises(ValueError, match="shared memory"):
        split_attention_narrow(q, cache, plen, tail_kv, tail_bits, valid_rows=8, stages=4, **kw)
    with pytest.raises(ValueError, match="shared memory"):
        split_attention_narrow(q, cache, plen, tail_kv, tail_bits, valid_rows=16, stages=3, **kw)
    with pytest.raises(ValueError, match="L \\+ 64 <= C"):
        split_attention_narrow(q, cache, plen, tail_kv, tail_bits, valid_rows=8, scale=0.1, kv_lora_rank=C - 32)
    with pytest.raises(ValueError, match="tail_kv"):
        split_attention_narrow(q, cache, plen, tail_kv[:, :32], tail_bits, valid_rows=8, **kw)
    assert narrow_smem_bytes(NARROW_MAX_ROWS, C, 64, 2) <= M.SMEM_LIMIT


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,kind,NS", [
    (3, 1, 8, 4096, "chain", 7), (2, 1, 8, 8192, "chain", None), (2, 2, 8, 2048, "tree", 4),
    (2, 3, 8, 1000, "tree", None), (2, 4, 8, 2048, "tree", 3),
    (2, 4, 8, 64, "tree", 5),  # splits inside the tail
])
def test_gpu_kernel_matches_reference_k26(B, T, H, S, kind, NS):
    L = K26["L"]
    rng = np.random.default_rng(5)
    plens = [int(x) for x in rng.integers(0, S + 1, size=B)]
    plens[0] = 0
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
@pytest.mark.parametrize("T,NS", [(1, 6), (4, 9)])
def test_gpu_splits_match_the_twin_split_by_split(T, NS):
    """Each split's normalised partial and LSE, empty splits included (o = 0, lse = -inf), as the twin."""
    B, H, S, L = 2, 8, 640, K26["L"]
    case = make_case(17, B, T, H, L, K26["C"] - L, S, [0, 600], "tree")
    q, cache, plen, tkv, mask = as_jax(case, jnp.bfloat16)
    qr = M.fold_rows(q, M.ROWS)
    tail_kv, tail_bits = M.tail_inputs(cache, plen, tkv, mask, H, qr.shape[1], 64)
    kw = dict(scale=K26["scale"], kv_lora_rank=L, num_splits=NS, valid_rows=T * H)
    o, lse = jax.jit(functools.partial(split_attention_narrow, **kw))(qr, cache, plen, tail_kv, tail_bits)
    r_o, r_l = jax.jit(functools.partial(M.split_attention_ref, **kw))(qr, cache, plen, tail_kv, tail_bits)
    o, r_o, lse, r_l = (np.asarray(a, np.float32) for a in (o, r_o, lse, r_l))
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_l))
    finite = np.isfinite(r_l)
    np.testing.assert_allclose(lse[finite], r_l[finite], atol=3e-2, rtol=1e-2)
    assert np.linalg.norm(o - r_o) / max(np.linalg.norm(r_o), 1e-30) < 1e-2

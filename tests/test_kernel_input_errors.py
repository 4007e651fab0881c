"""Input checks of the Pallas kernels and their twins (CPU): what one of a kernel/twin pair refuses, the other
refuses too (the same ValueError, naming the argument); edge inputs (no tokens, no streams, a row that sees
nothing) give the same results on both; weights only the twin can take run through the twin."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.moe import TiledInt4
from pallas_kernels import int4_moe_mgpu as K
from pallas_kernels import mla_attention_mgpu as M
from pallas_kernels.int4_moe import (Int4ExpertWeights, default_tile, int4_moe, int4_moe_ref, kernel_tiling_error,
                                     routed_experts)
from pallas_kernels.tree_attention import mla_attention, tree_attention, tree_attention_ref
from tests.test_int4_moe_kernel import dense_moe, make_ct, make_routing, rel
from tests.test_moe_tiled import random_stack

MOE_ENTRIES = {"twin": int4_moe_ref, "kernel": functools.partial(int4_moe, interpret=True),
               "dispatcher": routed_experts}


# --- INT4 routed experts (pallas_kernels/int4_moe.py) -------------------------------------------------------------
@pytest.mark.parametrize("e,d,f", [(4, 64, 96), (4, 96, 32)])
def test_twin_only_weights_run_through_the_twin(e, d, f):
    """D or F not a multiple of 64: the twin takes the weights (its default row blocks divide them), and so
    does the dispatcher, which sends them to the twin."""
    ct = make_ct(e, d, f, seed=3)
    weights = Int4ExpertWeights.from_compressed_tensors(*ct)
    assert kernel_tiling_error(weights) is not None
    ids, w = make_routing(5, 2, e, seed=3)
    x = np.random.default_rng(3).standard_normal((5, d)).astype(np.float32)
    want = dense_moe(x, ids, w, ct)
    for fn in (routed_experts, int4_moe_ref, jax.jit(routed_experts)):
        assert rel(fn(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), weights), want) < 1e-5
    y = routed_experts(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(w), weights)
    assert y.shape == (5, d) and y.dtype == jnp.bfloat16


def test_row_block_error_names_only_the_block_that_fails():
    ct = make_ct(4, 64, 96, seed=1)
    weights = Int4ExpertWeights.from_compressed_tensors(*ct)
    ids, w = make_routing(3, 2, 4, seed=1)
    args = (jnp.ones((3, 64), jnp.float32), jnp.asarray(ids), jnp.asarray(w), weights)
    for fn in MOE_ENTRIES.values():
        with pytest.raises(ValueError, match=r"^block_n1=64 must divide F=96$"):
            fn(*args, block_n1=64)
        with pytest.raises(ValueError, match=r"^block_n2=128 must divide D=64$"):
            fn(*args, block_n2=128)


@pytest.fixture(scope="module")
def moe_256():
    weights = Int4ExpertWeights.from_compressed_tensors(*make_ct(4, 256, 256, seed=1))
    ids, w = make_routing(3, 2, 4, seed=1)
    return weights, jnp.asarray(ids), jnp.asarray(w)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dispatcher_checks_tuning_on_the_twin_path(moe_256, dtype):
    """``routed_experts`` hands its tuning to the twin too: what the CUDA kernel refuses fails on the CPU as well,
    eagerly and under jit, and a misspelt keyword is a TypeError."""
    weights, ids, w = moe_256
    x = jnp.ones((3, 256), dtype)
    for fn in (routed_experts, jax.jit(routed_experts, static_argnames=("split1",))):
        with pytest.raises(ValueError, match="split1=7 must divide"):
            fn(x, ids, w, weights, split1=7)
    with pytest.raises(TypeError, match="splt1"):
        routed_experts(x, ids, w, weights, splt1=2)
    assert routed_experts(x, ids, w, weights, split1=1, block_n1=128).shape == (3, 256)


@pytest.mark.parametrize("bad,match", [
    (dict(probe="no_such_probe"), "unknown probe"), (dict(dequant="bogus"), "unknown dequant mode 'bogus'"),
    (dict(tile=0), "tile=0 must be a positive int"), (dict(tile=-4), "tile=-4 must be a positive int"),
    (dict(block_n1=0), "block_n1=0 must be a positive int"), (dict(block_n2=-64), "block_n2=-64 must be a positive"),
    (dict(split1=0), "split1=0 must be a positive int"), (dict(split2=-1), "split2=-1 must be a positive int"),
    (dict(tile=16.0), "tile=16.0 must be a positive int")])
def test_moe_entries_refuse_bad_tuning_alike(moe_256, bad, match):
    weights, ids, w = moe_256
    for name, fn in MOE_ENTRIES.items():
        with pytest.raises(ValueError, match=match):
            fn(jnp.ones((3, 256), jnp.float32), ids, w, weights, **bad)


def test_zero_tokens_give_an_empty_result_on_every_int4_moe_entry(moe_256):
    weights, _, _ = moe_256
    assert default_tile(0, 8, 4) == 16 and K.tiled_default_tile(0, 8, 4) == 8
    ids, w = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.zeros((0, 256), dtype)
        for fn in (*MOE_ENTRIES.values(), functools.partial(routed_experts, interpret=True), jax.jit(routed_experts)):
            y = fn(x, ids, w, weights)
            assert y.shape == (0, 256) and y.dtype == dtype


@pytest.mark.parametrize("tuning", [{}, dict(widths="ragged"), dict(widths="one", tile=8), dict(routing="per_pair"),
                                    dict(routing="per_pair", launch="one", down_blocks=2)])
def test_zero_tokens_give_an_empty_result_on_the_tiled_path(tuning):
    rng = np.random.default_rng(0)
    w13, w2 = random_stack(rng, 4, 512, 256), random_stack(rng, 4, 256, 256)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale, pair_gate_up=True)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    ids, w = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.zeros((0, 256), dtype)
        for fn in (K.routed_experts_tiled, K.routed_experts):
            y = fn(x, ids, w, t13, t2, **tuning)
            assert y.shape == (0, 256) and y.dtype == dtype


def test_tiled_path_refuses_zero_tile_and_split():
    rng = np.random.default_rng(0)
    t13, t2 = (TiledInt4.from_compressed_tensors(a.packed, a.scale)
               for a in (random_stack(rng, 4, 512, 256), random_stack(rng, 4, 256, 256)))
    ids, w = make_routing(3, 2, 4, seed=0)
    args = (jnp.ones((3, 256), jnp.float32), jnp.asarray(ids), jnp.asarray(w), t13, t2)
    with pytest.raises(ValueError, match="tile=0 must be a multiple of 8"):
        K.routed_experts_tiled(*args, tile=0)
    for split in (0, -2):
        with pytest.raises(ValueError, match=f"split={split} must be a positive int"):
            K.routed_experts_tiled(*args, split=split)


# --- MLA tree attention (pallas_kernels/tree_attention.py, mla_attention_mgpu.py) --------------------------------
L, RD, SCALE = 128, 64, 0.1


def attention_args(B=1, T=2, H=2, S=64, seed=0):
    rng = np.random.default_rng(seed)
    C = L + RD
    q = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((B, S, C)), jnp.bfloat16)
    tree_kv = jnp.asarray(rng.standard_normal((B, T, C)), jnp.bfloat16)
    mask = jnp.asarray(np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)))
    return q, cache, jnp.full((B,), min(5, S), jnp.int32), tree_kv, mask


KW = dict(scale=SCALE, kv_lora_rank=L)
TRITON_KERNEL = functools.partial(tree_attention, interpret=True)


def test_mla_attention_checks_triton_tuning_on_every_platform():
    """Tuning keywords pick (with "auto") or go to (with "triton") the Triton kernel: checked as it checks them,
    on the CPU too, rather than falling back to the twin or being dropped."""
    args = attention_args()
    with pytest.raises(ValueError, match="block_rows=24 must be a power of two"):
        mla_attention(*args, **KW, block_rows=24)
    with pytest.raises(ValueError, match="block_rows=24 must be a power of two"):
        jax.jit(lambda *a: mla_attention(*a, **KW, block_rows=24))(*args)
    with pytest.raises(ValueError, match="block_k=7 must be a power of two >= 16"):
        mla_attention(*args, **KW, backend="triton", block_k=7)
    with pytest.raises(TypeError, match="blok_k"):
        mla_attention(*args, **KW, blok_k=64)
    want = tree_attention_ref(*args, **KW)
    got = mla_attention(*args, **KW, block_rows=16, block_k=16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    three_heads = attention_args(H=3)  # no block_rows the Triton kernel takes: valid tuning leaves the twin
    got = mla_attention(*three_heads, **KW, num_splits=2)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(tree_attention_ref(*three_heads, **KW),
                                                                          np.float32))


@pytest.mark.parametrize("bad,error,match", [
    (dict(block_k=48), ValueError, "block_k=48 must be 64, 128 or 256"), (dict(stages=1), ValueError, "stages=1"),
    (dict(num_splits=0), ValueError, "num_splits=0 must be >= 1"), (dict(num_sms=0), ValueError, "num_sms=0"),
    (dict(num_splits=2.0), ValueError, "num_splits=2.0 must be an int"),
    (dict(blok_k=64), TypeError, "no tuning keyword 'blok_k'")])
def test_mla_attention_checks_mosaic_tuning_on_every_platform(bad, error, match):
    """backend="mgpu" hands its keywords to the Mosaic kernel, which the CPU never lowers: checked up front, as
    the Triton kernel's are, rather than running the twin on the CPU and failing only on a GPU."""
    args = attention_args()
    for fn in (mla_attention, jax.jit(lambda *a: mla_attention(*a, **KW, backend="mgpu", **bad))):
        with pytest.raises(error, match=match):
            fn(*args, **KW, backend="mgpu", **bad) if fn is mla_attention else fn(*args)
    good = dict(block_k=128, stages=3, num_splits=2, num_sms=132, share_scores=False, tail=False)
    got = mla_attention(*args, **KW, backend="mgpu", **good)  # the twin on the CPU
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(tree_attention_ref(*args, **KW), np.float32))


@pytest.mark.parametrize("bad,match", [
    (dict(num_splits=0), r"num_splits=0 must be >= 1"), (dict(num_splits=-1), r"num_splits=-1 must be >= 1"),
    (dict(block_k=7), "block_k=7 must be a power of two"), (dict(block_t=8), "block_t=8 must be a power of two"),
    (dict(num_warps=0), "num_warps=0 must be >= 1"), (dict(block_rows=16.5), "block_rows=16.5")])
def test_tree_attention_kernel_and_twin_refuse_bad_tuning_alike(bad, match):
    args = attention_args()
    for fn in (TRITON_KERNEL, tree_attention_ref, functools.partial(mla_attention, backend="triton")):
        with pytest.raises(ValueError, match=match):
            fn(*args, **KW, **bad)


def test_twin_refuses_a_chunk_below_one():
    for chunk in (0, -16):
        with pytest.raises(ValueError, match=f"chunk={chunk} must be >= 1"):
            tree_attention_ref(*attention_args(), **KW, chunk=chunk)


@pytest.mark.parametrize("bad,match", [
    (dict(num_splits=0), "num_splits=0 must be >= 1"), (dict(block_k=32), "block_k=32 must be 64, 128 or 256"),
    (dict(stages=1), "stages=1 must be >= 2"), (dict(num_splits=1.5), "num_splits=1.5 must be an int")])
def test_split_attention_twin_refuses_what_the_kernel_refuses(bad, match):
    q, cache, plen, tree_kv, mask = attention_args(H=2)
    block_k = bad.get("block_k", 64)
    rows = M.fold_rows(q, 64)
    keys, bits = M.tree_inputs(tree_kv, mask, 2, rows.shape[1], block_k)
    for fn in (M.split_attention, M.split_attention_ref):
        with pytest.raises(ValueError, match=match):
            fn(rows, cache, plen, keys, bits, **KW, **bad)


def test_twin_row_that_sees_nothing_matches_the_kernel():
    """Under jit a traced mask cannot be checked: a row with a False diagonal and no prefix sees no key. The twin
    gives out 0 and lse -inf there, as the Triton kernel does (no NaN)."""
    q, cache, _, tree_kv, _ = attention_args()
    plen = jnp.zeros((1,), jnp.int32)
    blind = jnp.asarray([[[False, False], [True, True]]])
    for fn in (tree_attention_ref, TRITON_KERNEL):
        out, lse = jax.jit(lambda m, fn=fn: fn(q, cache, plen, tree_kv, m, **KW, return_lse=True))(blind)
        assert not np.isnan(np.asarray(out, np.float32)).any(), fn
        np.testing.assert_array_equal(np.asarray(out[0, 0], np.float32), 0.0)
        assert np.isneginf(np.asarray(lse[0, 0])).all() and np.isfinite(np.asarray(lse[0, 1])).all()


@pytest.mark.parametrize("B,T,H", [(0, 2, 2), (1, 0, 2), (1, 2, 0)])
def test_nothing_to_attend_gives_empty_outputs_on_kernel_and_twin(B, T, H):
    q, cache, plen, tree_kv, mask = attention_args(B=max(B, 1), T=max(T, 1), H=max(H, 1))
    q, cache, plen = q[:B, :T, :H], cache[:B], plen[:B]
    tree_kv, mask = tree_kv[:B, :T], mask[:B, :T, :T]
    for fn in (tree_attention_ref, TRITON_KERNEL, mla_attention, functools.partial(mla_attention, block_rows=16)):
        out, lse = fn(q, cache, plen, tree_kv, mask, **KW, return_lse=True)
        assert out.shape == (B, T, H, L) and out.dtype == q.dtype and lse.shape == (B, T, H), fn


def test_prefix_len_that_is_not_an_array_is_refused_clearly():
    q, cache, _, tree_kv, mask = attention_args()
    for fn in (tree_attention_ref, TRITON_KERNEL, mla_attention):
        with pytest.raises(ValueError, match="prefix_len must be an integer array"):
            fn(q, cache, [5], tree_kv, mask, **KW)

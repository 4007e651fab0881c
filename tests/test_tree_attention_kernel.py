"""MLA tree-verify attention: twin vs a dense numpy reference, interpret-mode kernel vs both, CUDA
lowering on CPU, and GPU parity at K2.6 dims (``gpu`` marker; skipped without a GPU)."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention import (default_config, fold_rows, kernel_supports, mla_attention,
                                           tree_attention, tree_attention_ref)


def dense_reference(q, cache, plen, tkv, mask, scale, L):
    """float64 numpy: softmax over [valid prefix rows | visible tree nodes]; returns (out, lse)."""
    q, cache, tkv = (np.asarray(a, np.float64) for a in (q, cache, tkv))
    mask, plen = np.asarray(mask), np.asarray(plen)
    B, T, H, _ = q.shape
    out, lse = np.zeros((B, T, H, L)), np.zeros((B, T, H))
    for b in range(B):
        p = int(plen[b])
        keys = np.concatenate([cache[b, :p], tkv[b]], 0)
        vis = np.concatenate([np.ones((T, p), bool), mask[b]], 1)
        s = np.einsum("thc,kc->thk", q[b], keys) * scale
        s = np.where(vis[:, None, :], s, -np.inf)
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        tot = e.sum(-1, keepdims=True)
        out[b] = np.einsum("thk,kl->thl", e / tot, keys[:, :L])
        lse[b] = (m + np.log(tot))[..., 0]
    return out, lse


def tree_masks(rng, B, T, kind):
    """[B, T, T] bool ancestor-or-self masks: 'tree' (random parent arrays), 'chain', 'star'."""
    out = np.zeros((B, T, T), bool)
    for b in range(B):
        if kind == "chain":
            parent = [i - 1 for i in range(T)]
        elif kind == "star":
            parent = [-1] + [0] * (T - 1)
        else:
            parent = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
        for i in range(T):
            j = i
            while j >= 0:
                out[b, i, j] = True
                j = parent[j]
    return out


def make_case(seed, B, T, H, L, RD, S, plens, kind="tree", dtype=np.float32):
    rng = np.random.default_rng(seed)
    C = L + RD
    q = rng.standard_normal((B, T, H, C)).astype(np.float32)
    cache = rng.standard_normal((B, S, C)).astype(np.float32)
    plen = np.asarray(plens, np.int32)
    for b in range(B):
        cache[b, plen[b]:] = np.nan  # garbage beyond the prefix must never reach the result
    tkv = rng.standard_normal((B, T, C)).astype(np.float32)
    mask = tree_masks(rng, B, T, kind)
    return q, cache, plen, tkv, mask


def as_jax(case, dtype=jnp.float32):
    q, cache, plen, tkv, mask = case
    return (jnp.asarray(q, dtype), jnp.asarray(cache, dtype), jnp.asarray(plen),
            jnp.asarray(tkv, dtype), jnp.asarray(mask))


SCALE = 0.27


@pytest.mark.parametrize("B,T,H,S,plens,kind,chunk", [
    (3, 6, 4, 100, [0, 37, 100], "tree", 16),
    (2, 1, 4, 64, [0, 63], "chain", None),       # plain decode, T = 1
    (2, 9, 2, 50, [50, 7], "chain", 8),          # DFlash chain, chunk does not divide S
    (1, 12, 3, 33, [20], "star", 32),             # H not a power of two is fine for the twin
])
def test_twin_matches_dense(B, T, H, S, plens, kind, chunk):
    L, RD = 32, 16
    case = make_case(1, B, T, H, L, RD, S, plens, kind)
    ref_o, ref_l = dense_reference(*case, SCALE, L)
    o, lse = tree_attention_ref(*as_jax(case), scale=SCALE, kv_lora_rank=L, return_lse=True,
                                chunk=chunk)
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_l, atol=2e-5, rtol=2e-5)


def test_twin_bf16_close_to_dense():
    L, RD = 32, 16
    case = make_case(2, 2, 5, 4, L, RD, 80, [0, 71], "tree")
    args = as_jax(case, jnp.bfloat16)
    rounded = [np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a) for a in args]
    ref_o, _ = dense_reference(*rounded, SCALE, L)
    o = tree_attention_ref(*args, scale=SCALE, kv_lora_rank=L)
    assert o.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(o, np.float32) - ref_o) / np.linalg.norm(ref_o)
    assert err < 1e-2


# Interpret-mode kernel. Each case: (B, T, H, S, prefix lens, mask kind, tuning).
KERNEL_CASES = [
    (3, 6, 4, 100, [0, 37, 100], "tree", dict(block_rows=16, block_k=16)),        # S % block_k != 0
    (3, 6, 4, 96, [0, 37, 96], "tree", dict(block_rows=16, block_k=16, num_splits=3)),
    (2, 1, 8, 64, [0, 50], "chain", dict()),                                        # T = 1, H=8 < 16
    (2, 1, 32, 64, [64, 3], "chain", dict(block_rows=16, num_splits=2)),           # H > block_rows
    (2, 11, 2, 48, [17, 0], "chain", dict(block_rows=16, block_k=16, block_t=16)),  # causal chain
    (2, 20, 4, 64, [33, 64], "tree", dict(block_rows=32, block_k=32, block_t=16, num_splits=2)),
    (1, 3, 32, 32, [19], "tree", dict(block_rows=16, block_k=16)),                  # H > block_rows, T > 1
]


@pytest.mark.parametrize("B,T,H,S,plens,kind,tuning", KERNEL_CASES)
def test_kernel_interpret_matches_twin_and_dense(B, T, H, S, plens, kind, tuning):
    L, RD = 32, 16
    case = make_case(3, B, T, H, L, RD, S, plens, kind)
    args = as_jax(case)
    ref_o, ref_l = dense_reference(*case, SCALE, L)
    tw_o, tw_l = tree_attention_ref(*args, scale=SCALE, kv_lora_rank=L, return_lse=True)
    o, lse = tree_attention(*args, scale=SCALE, kv_lora_rank=L, return_lse=True, interpret=True,
                            **tuning)
    assert o.shape == (B, T, H, L) and lse.shape == (B, T, H)
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(np.asarray(o), np.asarray(tw_o), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(tw_l), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_l, atol=2e-5, rtol=2e-5)


def test_kernel_interpret_bf16():
    L, RD = 32, 16
    case = make_case(4, 2, 4, 4, L, RD, 64, [40, 5], "tree")
    args = as_jax(case, jnp.bfloat16)
    tw = tree_attention_ref(*args, scale=SCALE, kv_lora_rank=L)
    o = tree_attention(*args, scale=SCALE, kv_lora_rank=L, interpret=True, block_rows=16,
                       block_k=16, num_splits=2)
    assert o.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(o, np.float32) - np.asarray(tw, np.float32))
    assert err / np.linalg.norm(np.asarray(tw, np.float32)) < 1e-2


def test_dispatcher_uses_twin_on_cpu_and_interprets_on_request():
    L, RD = 32, 16
    case = make_case(5, 2, 3, 4, L, RD, 40, [9, 40], "tree")
    args = as_jax(case)
    ref_o, _ = dense_reference(*case, SCALE, L)
    dispatch = jax.jit(lambda *a: mla_attention(*a, scale=SCALE, kv_lora_rank=L))
    o = dispatch(*args)
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=2e-5)
    text = dispatch.lower(*args).as_text()
    if jax.default_backend() == "gpu":  # these f32 dims: the Triton kernel, close to the reference (above)
        assert "triton" in text
    else:
        assert "triton" not in text and "mosaic" not in text
        twin = jax.jit(lambda *a: tree_attention_ref(*a, scale=SCALE, kv_lora_rank=L))(*args)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(twin))  # the twin itself, not a kernel close to it
    o = mla_attention(*args, scale=SCALE, kv_lora_rank=L, interpret=True, block_rows=16)
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=2e-5)


def test_dispatcher_falls_back_to_twin_for_dims_the_kernel_rejects():
    L, RD = 24, 8  # not powers of two: the kernel refuses, the dispatcher must still work
    case = make_case(6, 1, 3, 3, L, RD, 20, [11], "star")
    assert not kernel_supports(case[0].shape, L)
    ref_o, _ = dense_reference(*case, SCALE, L)
    o = jax.jit(lambda *a: mla_attention(*a, scale=SCALE, kv_lora_rank=L))(*as_jax(case))
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad", [[-1, 4], [4, 17], [3.0, 4.0]])
def test_concrete_prefix_len_outside_the_cache_is_refused_and_a_traced_one_clamped(bad):
    """prefix_len outside [0, S] (or not integers) is a ValueError naming it where it is concrete, at every
    entry point; under jit (traced, nothing can raise) the twin reads it as clamped to [0, S]."""
    case = make_case(3, 2, 2, 2, 16, 8, 16, [4, 16], "chain")
    q, cache, _, tkv, mask = (jnp.asarray(a) for a in case[:5])
    kw = dict(scale=0.3, kv_lora_rank=16)
    for fn in (tree_attention_ref, mla_attention, functools.partial(tree_attention, interpret=True)):
        with pytest.raises(ValueError, match="prefix_len"):
            fn(q, cache, jnp.asarray(bad), tkv, mask, **kw)
    if not isinstance(bad[0], float):
        twin = jax.jit(lambda p: tree_attention_ref(q, cache, p, tkv, mask, **kw))
        traced = twin(jnp.asarray(bad, jnp.int32))
        clamped = twin(jnp.clip(jnp.asarray(bad, jnp.int32), 0, 16))
        np.testing.assert_array_equal(np.asarray(traced), np.asarray(clamped))


@pytest.mark.parametrize("T,H,num_splits", [(1, 64, 4), (8, 8, 1), (64, 64, 1)])
def test_kernel_lowers_for_cuda_on_cpu(T, H, num_splits, monkeypatch):
    """Triton lowering at K2.6 dims (no GPU needed), with MLIR verification of the Triton module:
    catches unsupported ops, non-pow2 tiles and ill-typed loops before any GPU time is spent."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    lower = reg.lowering.lower_jaxpr_to_triton_module

    def verified(*a, **k):
        res = lower(*a, **k)
        with res.module.context:
            res.module.operation.verify()
        return res

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", verified)
    B, S, L, C = 2, 1024, 512, 576
    spec = (jax.ShapeDtypeStruct((B, T, H, C), jnp.bfloat16), jax.ShapeDtypeStruct((B, S, C), jnp.bfloat16),
            jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, T, T), jnp.bool_))
    f = jax.jit(lambda *a: mla_attention(*a, scale=0.14468, kv_lora_rank=L, num_splits=num_splits))
    text = f.trace(*spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_explicit_block_rows_is_kept_where_the_default_would_not_fit():
    """H = 48 at T = 1: the default 64-row tile does not fit the heads, a given 16-row one does (the default is not
    checked in its place), and a block_rows that fits no rule is refused by name."""
    L, RD = 32, 16
    case = make_case(8, 1, 1, 48, L, RD, 40, [23], "chain")
    args = as_jax(case)
    with pytest.raises(ValueError, match="block_rows=64 must be a power of two"):
        tree_attention(*args, scale=SCALE, kv_lora_rank=L, interpret=True)
    o = tree_attention(*args, scale=SCALE, kv_lora_rank=L, interpret=True, block_rows=16, block_k=16)
    np.testing.assert_allclose(np.asarray(o), dense_reference(*case, SCALE, L)[0], atol=2e-5, rtol=2e-5)
    for bad in (0, 24, 32):
        with pytest.raises(ValueError, match=f"block_rows={bad} must be a power of two"):
            tree_attention(*args, scale=SCALE, kv_lora_rank=L, interpret=True, block_rows=bad)


def test_default_config_splits_only_when_few_programs():
    small = default_config(1, 1, 64, 65536, 576, 512)
    big = default_config(16, 256, 64, 8192, 576, 512)
    assert small["num_splits"] > 1 and big["num_splits"] == 1
    assert default_config(4, 1, 8, 4096, 576, 512)["block_rows"] == 16


def test_default_config_follows_its_documented_rules():
    """default_config's docstring and sweep notes as invariants: 64-row tiles unless T*H is smaller (16 at least);
    64-row tiles take 8 warps and (16-bit) 64-key blocks, smaller ones 4 warps and 32 keys; a power-of-two tail
    block in [16, 64]; splits only while programs stay under ~2 waves, each split at least 4 (64-row tiles) or 8
    key blocks, at most 64."""
    for (B, T, H, S), rows in [((1, 1, 64, 65536), 64), ((16, 1, 8, 8192), 16), ((1, 3, 8, 4096), 32),
                               ((4, 64, 64, 2048), 64), ((1, 1, 64, 1024), 64), ((2, 1, 8, 512), 16),
                               ((1, 20, 4, 8192), 64)]:
        for dtype in (jnp.bfloat16, jnp.float32):
            cfg = default_config(B, T, H, S, 576, 512, dtype)
            wide = cfg["block_rows"] == 64
            assert cfg["block_rows"] == rows
            assert cfg["num_warps"] == (8 if wide else 4)
            assert cfg["block_k"] == (64 if wide and dtype == jnp.bfloat16 else 32)
            bt = cfg["block_t"]
            assert bt & (bt - 1) == 0 and 16 <= bt <= 64 and (bt >= T or bt == 64)
            splits, programs = cfg["num_splits"], -(-T * H // rows) * B
            assert 1 <= splits <= 64 and (splits == 1 or (programs * (splits - 1) < 2 * 132))
            if splits > 1:
                assert (S // cfg["block_k"]) // splits >= (4 if wide else 8)


@pytest.mark.parametrize("T,H,L,RD,block_rows", [
    (2, 4, 32, 16, None), (1, 32, 32, 16, 16), (1, 48, 32, 16, None), (1, 48, 32, 16, 16), (4, 3, 32, 16, None),
    (2, 4, 24, 16, None), (2, 4, 32, 8, None), (2, 4, 8, 16, None), (11, 2, 16, 16, None)])
def test_kernel_supports_exactly_the_dims_the_kernel_takes(T, H, L, RD, block_rows):
    """The dispatcher's ``kernel_supports`` says yes exactly where ``tree_attention`` accepts the dims (else the
    dispatcher would send the kernel dims it refuses, or the twin dims it could take)."""
    B, S = 1, 32
    spec = (jax.ShapeDtypeStruct((B, T, H, L + RD), jnp.float32), jax.ShapeDtypeStruct((B, S, L + RD), jnp.float32),
            jnp.asarray([S], jnp.int32), jax.ShapeDtypeStruct((B, T, L + RD), jnp.float32),
            jnp.ones((B, T, T), bool))
    try:
        jax.eval_shape(lambda q, c, t: tree_attention(q, c, spec[2], t, spec[4], scale=SCALE, kv_lora_rank=L,
                                                      interpret=True, block_rows=block_rows), spec[0], spec[1],
                       spec[3])
        takes = True
    except ValueError:
        takes = False
    assert kernel_supports((B, T, H, L + RD), L, block_rows) == takes


def test_shapes_that_do_not_fit_are_refused_by_name():
    """q, cache_kv, tree_mask and kv_lora_rank that do not fit one another: a ValueError naming the argument at the
    twin and the kernel (else a broadcast would hide the mismatch, or the value slice would read past C)."""
    q, cache, plen, tkv, mask = as_jax(make_case(3, 2, 3, 2, 16, 16, 16, [4, 16], "chain"))
    cases = [((q[0], cache, plen, tkv, mask, 16), "q must be"),
             ((q, cache[..., :24], plen, tkv, mask, 16), "cache_kv must be"),
             ((q, cache[:1], plen, tkv, mask, 16), "cache_kv must be"),
             ((q, cache, plen, tkv, mask[:, :2, :2], 16), "tree_mask must be"),
             ((q, cache, plen, tkv, mask[:1], 16), "tree_mask must be"),
             ((q, cache, plen, tkv, mask.astype(jnp.float32), 16), r"tree_mask must be .* bool, got .* float32"),
             ((q, cache, plen, tkv, mask, 0), "kv_lora_rank=0"),
             ((q, cache, plen, tkv, mask, 33), "kv_lora_rank=33")]
    for fn in (tree_attention_ref, functools.partial(tree_attention, interpret=True)):
        for (*args, rank), match in cases:
            with pytest.raises(ValueError, match=match):
                fn(*args, scale=SCALE, kv_lora_rank=rank)
    for tuning in (dict(block_k=24), dict(block_t=8)):  # the kernel's key blocks: powers of two >= 16
        with pytest.raises(ValueError, match=r"block_[kt]=\d+ must be a power of two >= 16"):
            tree_attention(q, cache, plen, tkv, mask, scale=SCALE, kv_lora_rank=16, interpret=True, **tuning)


def test_fold_rows_puts_heads_in_rows_and_pads_to_the_next_whole_tile():
    q = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
    for multiple, rows in [(4, 12), (16, 16), (12, 12), (8, 16)]:
        folded = np.asarray(fold_rows(q, multiple))
        assert folded.shape == (2, rows, 5)
        np.testing.assert_array_equal(folded[:, :12], np.asarray(q).reshape(2, 12, 5))  # row = node * H + head
        assert not folded[:, 12:].any()


# ---------------------------------------------------------------------------------------------
# GPU parity at K2.6 dims (C = 576, L = 512, scale 0.14468), bf16, vs the twin on f32-upcast inputs.
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,kind", [
    (2, 1, 64, 4096, "chain"), (3, 1, 8, 4096, "chain"), (2, 8, 8, 2048, "chain"),
    (2, 64, 64, 2048, "tree"), (1, 256, 8, 1024, "tree"), (2, 33, 64, 1000, "tree"),
])
def test_gpu_parity_k26(B, T, H, S, kind):
    L, RD = 512, 64
    rng = np.random.default_rng(7)
    plens = [int(x) for x in rng.integers(0, S + 1, size=B)]
    plens[0] = 0 if B > 1 else S
    case = make_case(11, B, T, H, L, RD, S, plens, kind)
    args = as_jax(case, jnp.bfloat16)
    o, lse = jax.jit(lambda *a: mla_attention(*a, scale=0.14468, kv_lora_rank=L, return_lse=True))(*args)
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    r_o, r_l = jax.jit(lambda *a: tree_attention_ref(*a, scale=0.14468, kv_lora_rank=L,
                                                     return_lse=True))(*up)
    o, r_o = np.asarray(o, np.float32), np.asarray(r_o)
    assert np.all(np.isfinite(o))
    assert np.linalg.norm(o - r_o) / np.linalg.norm(r_o) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(r_l), atol=3e-2, rtol=1e-2)

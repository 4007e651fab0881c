"""Building blocks against plain references: parameter declaration (init, rank check), RMSNorm with its eps
and f32 statistics, and ``dot``'s cast of the weight to the activation dtype."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.layers import declare, dot, rms_norm


def test_declare_inits_and_refusals():
    ones = declare(None, (3, 4), ("embed", "ffn"), jnp.bfloat16, init="ones")
    assert ones.get_value().dtype == jnp.bfloat16 and (np.asarray(ones.get_value()) == 1).all()
    assert ones.get_metadata()["logical_axes"] == ("embed", "ffn")
    assert not np.asarray(declare(None, (5,), ("embed",), jnp.float32, init="zeros").get_value()).any()
    normal = np.asarray(declare(nnx.Rngs(0), (256, 128), ("embed", "ffn"), jnp.float32, std=0.05).get_value())
    assert abs(normal.mean()) < 0.002 and normal.std() == pytest.approx(0.05, rel=0.03)
    with pytest.raises(ValueError, match=r"shape \(3, 4\) and logical axes \('embed',\) differ in rank"):
        declare(None, (3, 4), ("embed",), jnp.float32, init="zeros")
    with pytest.raises(ValueError, match="unknown init 'uniform'"):
        declare(nnx.Rngs(0), (3,), ("embed",), jnp.float32, init="uniform")


def test_rms_norm_matches_the_formula_where_eps_matters():
    rng = np.random.default_rng(0)
    x = np.concatenate([1e-3 * rng.standard_normal((3, 16)), np.zeros((1, 16))]).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)
    eps = 1e-5
    x64 = x.astype(np.float64)
    want = weight * x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    got = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(weight), eps))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert (got[3] == 0).all()


def test_rms_norm_of_16_bit_input_normalises_in_float32_and_rounds_before_the_weight():
    """HF semantics: bf16 input normalised in f32 (the f32 result of the same values, rounded once to bf16), and
    the weight applied to that bf16 result."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(3 * rng.standard_normal((8, 256)), jnp.bfloat16)
    normed = rms_norm(x, jnp.ones(256, jnp.bfloat16), 1e-6)
    in_f32 = rms_norm(x.astype(jnp.float32), jnp.ones(256, jnp.float32), 1e-6)
    assert normed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(in_f32.astype(jnp.bfloat16), np.float32))
    weight = jnp.asarray(1 + 0.3 * rng.standard_normal(256), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rms_norm(x, weight, 1e-6), np.float32),
                                  np.asarray(weight * normed, np.float32))


def test_dot_casts_the_weight_to_the_activation_dtype():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    got = dot(x, w, "td,df->tf")
    want = jnp.einsum("td,df->tf", x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))

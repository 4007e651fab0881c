"""YaRN and plain RoPE tables against transformers for settings the tiny models never reach: the correction
range clamped at both ends or collapsed to one index, mscale != mscale_all_dim, mscale alone, an explicit
attention_factor, and positions that float16/bfloat16 cannot hold."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ddtree_jax.config import RopeConfig
from ddtree_jax.rope import rope_cos_sin, rope_inv_freq


def transformers_rope(rope: RopeConfig, dim: int) -> Qwen3RotaryEmbedding:
    params = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.kind == "yarn":
        params.update(factor=rope.factor, original_max_position_embeddings=rope.original_max_position,
                      beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)
        params.update({k: v for k, v in (("mscale", rope.mscale), ("mscale_all_dim", rope.mscale_all_dim),
                                         ("attention_factor", rope.attention_factor)) if v})
    max_pos = int(rope.original_max_position * rope.factor)
    return Qwen3RotaryEmbedding(Qwen3Config(hidden_size=4 * dim, num_attention_heads=4, head_dim=dim,
                                            max_position_embeddings=max_pos, rope_parameters=params))


ROPES = {
    "tiny-model": (RopeConfig(theta=50000.0, factor=64.0, original_max_position=32), 8),
    "k26": (RopeConfig(), 64),
    "both-ends-clamped": (RopeConfig(theta=10.0, factor=8.0, original_max_position=8192, beta_fast=2048.0), 16),
    "one-index-ramp": (RopeConfig(theta=10000.0, factor=4.0, original_max_position=2048, beta_fast=5.0,
                                  beta_slow=6.5), 32),
    "mscale-ratio": (RopeConfig(factor=40.0, mscale=0.707, mscale_all_dim=1.0), 64),
    "mscale-alone": (RopeConfig(factor=16.0, mscale=0.707, mscale_all_dim=0.0), 32),
    "explicit-attention-factor": (RopeConfig(factor=64.0, attention_factor=1.25), 64),
    "default": (RopeConfig(theta=10000.0, kind="default", factor=1.0), 32),
}


@pytest.mark.parametrize("name", ROPES)
def test_inverse_frequencies_and_amplitude_match_transformers(name):
    rope, dim = ROPES[name]
    hf = transformers_rope(rope, dim)
    inv_freq, amplitude = rope_inv_freq(rope, dim)
    # torch's float32 power is not correctly rounded (up to 0.53 ulp off on an AVX-512 CPU): one ulp apart at most
    np.testing.assert_array_max_ulp(inv_freq, hf.inv_freq.numpy(), maxulp=1)
    assert amplitude == pytest.approx(hf.attention_scaling, abs=1e-7)


@pytest.mark.parametrize("theta, dim", [(50000.0, 64), (10000.0, 64), (10000.0, 48), (1e6, 128), (10.0, 16)])
def test_plain_frequencies_are_correctly_rounded(theta, dim):
    """theta ** (2i / dim) in float32 (base and exponent as transformers rounds them) rounded once, against
    Python's double-precision pow: the same bits on every CPU (numpy's float32 power had been 0.9 ulp off on
    AVX-512, which put the table two ulps from transformers' there)."""
    base = float(np.float32(theta))
    expected = [np.float32(1.0) / np.float32(math.pow(base, float(np.float32(i) / np.float32(dim))))
                for i in range(0, dim, 2)]
    inv_freq, amplitude = rope_inv_freq(RopeConfig(theta=theta, kind="default", factor=1.0), dim)
    assert inv_freq.dtype == np.float32 and amplitude == 1.0
    np.testing.assert_array_equal(inv_freq, np.array(expected, np.float32))


def test_correction_range_cases_are_reached():
    """The settings above do reach the branches they are named after (else the comparison proves little); the
    one-index ramp needs beta_slow > beta_fast, which transformers handles the same way."""

    def correction_dim(rope, dim, rotations):
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    rope, dim = ROPES["both-ends-clamped"]
    assert correction_dim(rope, dim, rope.beta_fast) < 0 and correction_dim(rope, dim, rope.beta_slow) > dim - 1
    rope, dim = ROPES["one-index-ramp"]
    low, high = correction_dim(rope, dim, rope.beta_fast), correction_dim(rope, dim, rope.beta_slow)
    assert math.floor(low) == math.ceil(high)


def test_cos_sin_at_large_positions_are_exact_float32_angles():
    """Positions are converted to float32, not a 16-bit type: odd positions past 2**11 keep their value."""
    rope, dim = ROPES["k26"]
    positions = np.array([[0, 2049, 4097, 65537, 131071]])
    cos, sin = rope_cos_sin(jnp.asarray(positions, jnp.int32), rope, dim)
    inv_freq, amplitude = rope_inv_freq(rope, dim)
    angle = positions[..., None].astype(np.float32) * inv_freq  # float32 products, as the model computes them
    np.testing.assert_allclose(np.asarray(cos), amplitude * np.cos(angle.astype(np.float64)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin), amplitude * np.sin(angle.astype(np.float64)), atol=1e-5)

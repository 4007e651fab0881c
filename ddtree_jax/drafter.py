"""DFlash block-diffusion drafter (Qwen3-style layers with target-feature KV injection) in Flax NNX.

The drafter proposes, in one pass, a distribution for each of the Tb-1 positions after the bonus token.
Conditioning (notes ``dflash_ddtree.md`` §1): the target's layer outputs at ``target_layer_ids`` for the
committed context tokens (the last layer's after the target's final norm where ``last_tap_after_norm``, as the
reference reads transformers' hidden states: ``target_taps``) are concatenated on features, projected by
``fc`` and normed by ``hidden_norm``; every draft layer turns these context features into extra keys/values with its own
k/v projections (k_norm + RoPE on the keys; no input norm, no draft layer computation for context).
Queries come only from the block [bonus, MASK x (Tb-1)]; attention is non-causal inside the block and
sees every committed context row. Embedding and LM head are the target's (``KimiModel.embed_tokens``
and ``KimiModel.head``).

Context K/V are precomputed once (``append_context``) into a ``DraftCache`` that holds only committed
positions; the block's own K/V are never stored, so the per-round forward has fixed shapes.

Dimension letters: B streams, Tc context tokens, Tb block tokens, D hidden, H query heads, KVH kv heads,
hd head dim, F MLP width, S cache capacity, NLd draft layers, n taps, W vocab.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ddtree_jax.checks import as_int32
from ddtree_jax.config import (SILU_NAMES, ConfigError, RopeConfig, hf_original_max_position, hf_rope_section,
                               rope_problems, yarn_mscale)
from ddtree_jax.layers import RMSNorm, SwiGLU, declare, dot
from ddtree_jax.rope import apply_rope_half, rope_cos_sin
from ddtree_jax.safetensors_io import CheckpointError, checked_array, iter_tensors
from ddtree_jax.sharding import DEFAULT_RULES, ShardingRules, named_sharding

DRAFT_CACHE_AXES = ("layers", "batch", "seq", "heads", "head_dim")
DRAFT_LENGTH_AXES = ("batch",)
DEFAULT_BLOCK_SIZE = 16  # the reference's default when a config names no block size


# ----------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------

def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference rule for the tapped layers when a config gives none: ``n`` indices spread evenly
    over [1, L-3] (rounded half-to-even as Python's ``round``), or L//2 for one layer."""
    if num_draft_layers < 1 or num_target_layers < 1:
        raise ConfigError(f"cannot derive target_layer_ids from num_target_layers={num_target_layers}, "
                          f"num_draft_layers={num_draft_layers}")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = (num_target_layers - 3) - 1
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static description of a DFlash drafter (frozen, hashable: usable as a jit static argument)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    vocab_size: int
    dtype: str = "bfloat16"
    num_target_layers: int | None = None  # when known, taps are checked against it
    # a tap of the target's last layer is its output after the final norm, as the reference reads it
    # (transformers' hidden_states[-1]); False: before it, as drafters trained here before session 76 were
    last_tap_after_norm: bool = False

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} not divisible by num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (rotate-half RoPE)")
        if not self.rms_norm_eps > 0:
            problems.append(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if any(i < 0 for i in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} has negative entries")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} names a layer twice")
        if self.num_target_layers is not None and any(i >= self.num_target_layers for i in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} outside [0, num_target_layers="
                            f"{self.num_target_layers})")
        if self.block_size < 2:
            problems.append(f"block_size={self.block_size} must be >= 2 (bonus token + at least one draft)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id={self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        if self.rope.kind not in ("yarn", "default"):
            problems.append(f"rope kind {self.rope.kind!r} not in yarn/default")
        problems += rope_problems(self.rope)
        if self.dtype not in ("bfloat16", "float32", "float16"):
            problems.append(f"dtype {self.dtype!r} not in bfloat16/float32/float16")
        if problems:
            raise ConfigError("invalid DrafterConfig: " + "; ".join(problems))

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def softmax_scale(self) -> float:
        """head_dim^-0.5, as the reference attention (YaRN only scales the cos/sin amplitude)."""
        return self.head_dim ** -0.5

    def replace(self, **changes) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, dtype: str = "bfloat16",
                     legacy_yarn_amplitude: bool = False) -> "DrafterConfig":
        """Reads the config.json dict of an HF ``DFlashDraftModel`` (Qwen3 layout + ``dflash_config``).

        ``target_layer_ids`` / ``mask_token_id`` / ``block_size`` are read from ``dflash_config`` first,
        then from the top level (as the reference does); block_size defaults to 16 like the reference.
        Without target_layer_ids they are derived from ``num_target_layers`` (``build_target_layer_ids``).
        ``legacy_yarn_amplitude``: use the cos/sin amplitude 1 + 0.1 ln(factor) instead of the value
        transformers derives (mscale/mscale_all_dim = 1.0 for Kimi), unless the config sets
        ``attention_factor`` explicitly (notes §1.5).
        """
        archs = raw.get("architectures") or []
        if archs and "DFlashDraftModel" not in archs:
            raise ConfigError(f"unsupported drafter architectures {archs}; supported: ['DFlashDraftModel']")
        if raw.get("model_type", "qwen3") != "qwen3":
            raise ConfigError(f"unsupported drafter model_type {raw.get('model_type')!r} (only qwen3)")
        dflash = raw.get("dflash_config") or {}

        def value(name, default=None):
            return dflash.get(name, raw.get(name, default))

        def need(name):
            if raw.get(name) is None:
                raise ConfigError(f"drafter config.json lacks required field {name!r}")
            return raw[name]

        if raw.get("attention_bias", False):
            raise ConfigError("attention_bias=true is not supported")
        if raw.get("hidden_act", "silu") not in SILU_NAMES:
            raise ConfigError(f"unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
        if "sliding_attention" in (raw.get("layer_types") or []) or raw.get("use_sliding_window", False):
            raise ConfigError("sliding-window drafter layers are not supported")
        if value("is_causal") or value("causal"):
            raise ConfigError("causal drafter attention is not supported (DFlash blocks are non-causal)")
        for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
            if float(value(name, neutral)) != neutral:
                raise ConfigError(f"{name}={value(name)} is not supported (only {neutral})")
        if value("final_logit_softcapping") not in (None, 0, 0.0):
            raise ConfigError("final_logit_softcapping is not supported")

        num_layers = int(need("num_hidden_layers"))
        num_target_layers = raw.get("num_target_layers")
        num_target_layers = None if num_target_layers is None else int(num_target_layers)
        taps = value("target_layer_ids")
        if taps is None:
            if num_target_layers is None:
                raise ConfigError("drafter config has neither dflash_config.target_layer_ids nor "
                                  "num_target_layers to derive them from")
            taps = build_target_layer_ids(num_target_layers, num_layers)
        mask = value("mask_token_id")
        if mask is None:
            raise ConfigError("drafter config lacks dflash_config.mask_token_id")
        return cls(
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=int(need("num_attention_heads")),
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=int(raw.get("head_dim") or 128),  # Qwen3Config's default
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(raw, legacy_yarn_amplitude),
            target_layer_ids=tuple(int(i) for i in taps),
            block_size=int(value("block_size", DEFAULT_BLOCK_SIZE)),
            mask_token_id=int(mask),
            vocab_size=int(need("vocab_size")),
            dtype=dtype,
            num_target_layers=num_target_layers,
            last_tap_after_norm=True,  # the reference's hidden_states[layer_id + 1]: after the norm for the last
        )

    @classmethod
    def from_hf_dir(cls, path: str, *, dtype: str = "bfloat16", legacy_yarn_amplitude: bool = False):
        file = os.path.join(path, "config.json")
        if not os.path.exists(file):
            raise ConfigError(f"no config.json in {path!r}")
        with open(file) as f:
            return cls.from_hf_dict(json.load(f), dtype=dtype, legacy_yarn_amplitude=legacy_yarn_amplitude)


def _rope_from_hf(raw: dict[str, Any], legacy_yarn_amplitude: bool) -> RopeConfig:
    """RoPE as transformers reads a Qwen3 config (absent mscale fields are None, i.e. falsy)."""
    rope_raw = hf_rope_section(raw)
    theta = float(rope_raw.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = rope_raw.get("rope_type", rope_raw.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise ConfigError(f"unsupported drafter rope type {kind!r} (supported: yarn, default)")
    if kind == "default":
        return RopeConfig(theta=theta, kind="default", factor=1.0)
    if rope_raw.get("truncate", True) is not True:
        raise ConfigError("rope 'truncate: false' is not supported")
    max_pos = int(raw.get("max_position_embeddings", 32768))
    original = hf_original_max_position(raw, rope_raw, max_pos)
    if rope_raw.get("factor") is None:
        raise ConfigError("drafter yarn rope section lacks required field 'factor' (transformers refuses it too; "
                          "no default is assumed)")
    factor = float(rope_raw["factor"])
    attention_factor = rope_raw.get("attention_factor")
    if attention_factor is None and legacy_yarn_amplitude:
        attention_factor = yarn_mscale(factor)
    return RopeConfig(
        theta=theta, kind="yarn", factor=factor, original_max_position=original,
        beta_fast=float(rope_raw.get("beta_fast") or 32.0), beta_slow=float(rope_raw.get("beta_slow") or 1.0),
        mscale=float(rope_raw.get("mscale") or 0.0), mscale_all_dim=float(rope_raw.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def k26_drafter_config(dtype: str = "bfloat16", legacy_yarn_amplitude: bool = False) -> DrafterConfig:
    """Kimi-K2.5/K2.6-DFlash dimensions (notes §1.1). rms_norm_eps is Qwen3's default (the published
    config.json, when loaded, is authoritative)."""
    rope = RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position=4096, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                      attention_factor=yarn_mscale(64.0) if legacy_yarn_amplitude else None)
    return DrafterConfig(hidden_size=7168, intermediate_size=18432, num_layers=6, num_heads=64, num_kv_heads=8,
                         head_dim=128, rms_norm_eps=1e-6, rope=rope, target_layer_ids=(1, 12, 24, 35, 47, 58),
                         block_size=8, mask_token_id=163838, vocab_size=163840, dtype=dtype, num_target_layers=61,
                         last_tap_after_norm=True)  # an HF drafter's convention (its taps end at 58 of 61 anyway)


def tiny_drafter_config(target_cfg, *, block_size: int = 4, dtype: str | None = None, **overrides) -> DrafterConfig:
    """A 2-layer drafter for a tiny target (``ddtree_jax.config.tiny_config()``): same width, vocab and
    RoPE as the target, taps at the first and last target layers, mask id = vocab_size - 1."""
    base = dict(hidden_size=target_cfg.hidden_size, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=target_cfg.rope,
                target_layer_ids=tuple(sorted({0, target_cfg.num_layers - 1})), block_size=block_size,
                mask_token_id=target_cfg.vocab_size - 1, vocab_size=target_cfg.vocab_size,
                dtype=dtype or target_cfg.dtype, num_target_layers=target_cfg.num_layers)
    base.update(overrides)
    return DrafterConfig(**base)


def target_taps(cfg: DrafterConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target's ``tap_layers`` that give this drafter its context features, in ``target_layer_ids`` order: each
    id, and for the last layer with ``last_tap_after_norm`` the model's final-norm tap (index num_target_layers)."""
    last = num_target_layers - 1
    return tuple(num_target_layers if i == last and cfg.last_tap_after_norm else i for i in cfg.target_layer_ids)


def check_drafter_target(cfg: DrafterConfig, target_cfg) -> None:
    """Raises ConfigError if the drafter cannot run on this target (width, vocabulary, tapped layers, and the
    target depth it was built for when ``cfg.num_target_layers`` is set)."""
    problems = []
    if cfg.hidden_size != target_cfg.hidden_size:
        problems.append(f"drafter hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target_cfg.num_layers:
        problems.append(f"drafter built for num_target_layers={cfg.num_target_layers} != target num_layers "
                        f"{target_cfg.num_layers}")
    if any(i >= target_cfg.num_layers for i in cfg.target_layer_ids):
        problems.append(f"target_layer_ids {cfg.target_layer_ids} outside the target's {target_cfg.num_layers} layers")
    if problems:
        raise ConfigError("drafter does not fit the target: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------
# Draft context cache
# ----------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """Per draft layer K/V of the committed context rows (never of a block).

    k [NLd, B, S, KVH, hd]: keys after k_norm and RoPE at the row's absolute position;
    v [NLd, B, S, KVH, hd]; lengths [B] int32: valid rows per stream (rows >= lengths[b] are ignored).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_draft_cache(cfg: DrafterConfig, batch: int, capacity: int, dtype=None) -> DraftCache:
    """An empty cache: zeros [NLd, batch, capacity, KVH, hd] in ``dtype`` (default cfg.dtype)."""
    if batch < 1 or capacity < 1:
        raise ValueError(f"draft cache needs batch >= 1 and capacity >= 1, got batch={batch} capacity={capacity}")
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    return DraftCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def draft_cache_axes() -> DraftCache:
    """The logical axes of each cache leaf, as a DraftCache of tuples (for shardings)."""
    return DraftCache(k=DRAFT_CACHE_AXES, v=DRAFT_CACHE_AXES, lengths=DRAFT_LENGTH_AXES)


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------

def draft_attention_xla(q, cache_k, cache_v, lengths, block_k, block_v, *, scale):
    """Non-causal GQA of block queries over [valid cache rows | the whole block] (dense, XLA).

    q [B, Tb, H, hd]; cache_k, cache_v [B, S, KVH, hd] (rows >= lengths[b] ignored); lengths [B];
    block_k, block_v [B, Tb, KVH, hd]. Query head h reads kv head h // (H / KVH). Softmax in f32.
    Returns [B, Tb, H, hd] in q.dtype.
    """
    b, t, h, hd = q.shape
    s, kvh = cache_k.shape[1], cache_k.shape[2]
    f32 = jnp.float32
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    s_cache = jnp.einsum("btkgd,bskd->btkgs", qg, cache_k.astype(q.dtype), preferred_element_type=f32) * scale
    s_block = jnp.einsum("btkgd,bukd->btkgu", qg, block_k.astype(q.dtype), preferred_element_type=f32) * scale
    valid = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    s_cache = jnp.where(valid[:, None, None, None, :], s_cache, -jnp.inf)
    m = jnp.maximum(s_cache.max(-1, initial=-jnp.inf), s_block.max(-1))[..., None]
    p_cache, p_block = jnp.exp(s_cache - m), jnp.exp(s_block - m)
    denom = p_cache.sum(-1) + p_block.sum(-1)
    v_cache = jnp.where(valid[:, :, None, None], cache_v.astype(q.dtype), 0)
    out = jnp.einsum("btkgs,bskd->btkgd", p_cache.astype(q.dtype), v_cache, preferred_element_type=f32)
    out += jnp.einsum("btkgu,bukd->btkgd", p_block.astype(q.dtype), block_v.astype(q.dtype),
                      preferred_element_type=f32)
    return (out / denom[..., None]).reshape(b, t, h, hd).astype(q.dtype)


class DraftAttention(nnx.Module):
    """GQA with per-head q/k RMSNorm and rotate-half RoPE; weights q [D,H,hd], k/v [D,KVH,hd], o [H,hd,D]."""

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = declare(rngs, (d, h, hd), ("embed", "heads", "head_dim"), dtype)
        self.k = declare(rngs, (d, kvh, hd), ("embed", "heads", "head_dim"), dtype)
        self.v = declare(rngs, (d, kvh, hd), ("embed", "heads", "head_dim"), dtype)
        self.o = declare(rngs, (h, hd, d), ("heads", "head_dim", "embed"), dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, "head_dim")
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, "head_dim")
        self.cfg = cfg

    def key_value(self, x, cos, sin):
        """x [B, T, D] (normed block states or context features) -> k (normed, rotated), v [B, T, KVH, hd]."""
        k = apply_rope_half(self.k_norm(dot(x, self.k.get_value(), "btd,dkh->btkh")), cos, sin)
        return k, dot(x, self.v.get_value(), "btd,dkh->btkh")

    def __call__(self, x, cos, sin, cache_k, cache_v, lengths, attention_fn=None):
        """x [B, Tb, D] (input-normed); cache_k/v [B, S, KVH, hd] of this layer. Returns [B, Tb, D]."""
        q = apply_rope_half(self.q_norm(dot(x, self.q.get_value(), "btd,dhk->bthk")), cos, sin)
        k, v = self.key_value(x, cos, sin)
        attend = attention_fn or draft_attention_xla
        o = attend(q, cache_k, cache_v, lengths, k, v, scale=self.cfg.softmax_scale)
        return dot(o, self.o.get_value(), "bthk,hkd->btd")


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, "embed")
        self.attn = DraftAttention(cfg, rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, "embed")
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)

    def __call__(self, x, cos, sin, cache_k, cache_v, lengths, attention_fn=None):
        h = x + self.attn(self.input_norm(x), cos, sin, cache_k, cache_v, lengths, attention_fn)
        return h + self.mlp(self.post_norm(h))


class DFlashDrafter(nnx.Module):
    """fc [n*D, D] + hidden_norm (context fusion), NLd Qwen3-style layers, final norm. No embedding/head."""

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        d = cfg.hidden_size
        self.fc = declare(rngs, (cfg.num_taps * d, d), (None, "embed"), dtype)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, "embed")
        self.layers = nnx.List([DraftLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype, "embed")
        self.cfg = cfg

    def context_features(self, taps: jax.Array) -> jax.Array:
        """taps [n, B, Tc, D] (target layer outputs, in target_layer_ids order) -> hidden_norm(fc(concat))
        [B, Tc, D]; tap 0 occupies the first D input features of fc."""
        cfg = self.cfg
        n, b, t, d = taps.shape
        if n != cfg.num_taps or d != cfg.hidden_size:
            raise ValueError(f"taps of shape {taps.shape}: expected [{cfg.num_taps}, B, Tc, {cfg.hidden_size}]")
        x = jnp.moveaxis(taps.astype(jnp.dtype(cfg.dtype)), 0, 2).reshape(b, t, n * d)
        return self.hidden_norm(dot(x, self.fc.get_value(), "btf,fd->btd"))

    def context_kv(self, taps: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """taps [n, B, Tc, D], positions [B, Tc] -> k, v [NLd, B, Tc, KVH, hd] (k normed and rotated)."""
        ctx = self.context_features(taps)
        cos, sin = rope_cos_sin(positions, self.cfg.rope, self.cfg.head_dim)
        pairs = [layer.attn.key_value(ctx, cos, sin) for layer in self.layers]
        return jnp.stack([k for k, _ in pairs]), jnp.stack([v for _, v in pairs])

    def append_context(self, cache: DraftCache, taps: jax.Array, positions: jax.Array,
                       counts: jax.Array) -> tuple[DraftCache, jax.Array]:
        """Appends the first counts[b] context rows of each stream to the draft cache.

        taps [n, B, Tc, D]: target layer outputs (pre final norm) for the context tokens; positions [B, Tc]
        absolute; counts [B] int32 (rows counts[b].. are padding and ignored). Row i of stream b goes to
        slot lengths[b] + i. Returns (cache, overflow [B] bool). Writes never clamp: a stream with
        lengths + counts > capacity, or counts outside [0, Tc], is left untouched and flagged.
        """
        if taps.ndim != 4 or taps.shape[1] != cache.batch:
            raise ValueError(f"taps must be [n, B, Tc, D] with B = {cache.batch} (the draft cache's streams), got "
                             f"{taps.shape}")
        b, t = taps.shape[1:3]
        positions = as_int32("positions", positions, (b, t))
        counts = as_int32("counts", counts, (b,))
        k_new, v_new = self.context_kv(taps, positions)
        overflow = (counts < 0) | (counts > t) | (cache.lengths + counts > cache.capacity)
        i = jnp.arange(t)[None, :]
        write = (i < counts[:, None]) & ~overflow[:, None]  # [B, Tc]
        slots = jnp.where(write, cache.lengths[:, None] + i, cache.capacity)  # out of range -> dropped
        batch_idx = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        k = cache.k.at[:, batch_idx, slots].set(k_new.astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, batch_idx, slots].set(v_new.astype(cache.v.dtype), mode="drop")
        lengths = jnp.where(overflow, cache.lengths, cache.lengths + counts).astype(jnp.int32)
        return DraftCache(k=k, v=v, lengths=lengths), overflow

    def __call__(self, cache: DraftCache, block_embeds: jax.Array, block_positions: jax.Array, *,
                 attention_fn: Callable | None = None) -> jax.Array:
        """One draft pass over the block; the cache is read, never written.

        block_embeds [B, Tb, D]: target embeddings of [bonus, MASK x (Tb-1)]; block_positions [B, Tb]
        absolute (start .. start+Tb-1, with cache.lengths == start for reference semantics). Every block
        query sees the stream's cache rows < lengths[b] and the whole block (non-causal).
        Returns final-normed hidden states [B, Tb, D]; slot k (k >= 1) predicts the token at start+k via
        ``target.head``. ``attention_fn`` replaces ``draft_attention_xla`` (same signature).
        """
        cfg = self.cfg
        if block_embeds.ndim != 3 or block_embeds.shape[0] != cache.batch or block_embeds.shape[2] != cfg.hidden_size:
            raise ValueError(f"block_embeds must be [B, Tb, D] = [{cache.batch}, Tb, {cfg.hidden_size}], got "
                             f"{block_embeds.shape}")
        b, t = block_embeds.shape[:2]
        block_positions = as_int32("block_positions", block_positions, (b, t))
        x = block_embeds.astype(jnp.dtype(cfg.dtype))
        cos, sin = rope_cos_sin(block_positions, cfg.rope, cfg.head_dim)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], cache.lengths, attention_fn)
        return self.norm(x)


def block_tokens(cfg: DrafterConfig, bonus_tokens: jax.Array) -> jax.Array:
    """bonus_tokens [B] -> [B, Tb] int32 = [bonus, MASK x (Tb-1)]."""
    b = bonus_tokens.shape[0]
    masks = jnp.full((b, cfg.block_size - 1), cfg.mask_token_id, jnp.int32)
    return jnp.concatenate([bonus_tokens.astype(jnp.int32)[:, None], masks], axis=1)


def draft_logits(drafter: DFlashDrafter, target, cache: DraftCache, bonus_tokens: jax.Array, start: jax.Array, *,
                 attention_fn: Callable | None = None) -> jax.Array:
    """Per-position draft logits [B, Tb-1, W] f32; row k-1 is the distribution of the token at start+k.

    target: the KimiModel whose ``embed_tokens`` / ``head`` the drafter shares; cache: context rows for
    positions < start (lengths == start); bonus_tokens [B] (the token at ``start``); start [B] int32.
    """
    cfg = drafter.cfg
    check_drafter_target(cfg, target.cfg)
    bonus_tokens = as_int32("bonus_tokens", bonus_tokens, (cache.batch,))
    start = as_int32("start", start, (cache.batch,))
    tokens = block_tokens(cfg, bonus_tokens)
    positions = start[:, None] + jnp.arange(cfg.block_size, dtype=jnp.int32)[None, :]
    hidden = drafter(cache, target.embed_tokens(tokens), positions, attention_fn=attention_fn)
    return target.head(hidden[:, 1:])


# ----------------------------------------------------------------------------------------------------
# Loading the published HF layout
# ----------------------------------------------------------------------------------------------------

def hf_tensor_layout(cfg: DrafterConfig) -> dict[str, tuple[tuple, tuple[int, ...], Callable | None]]:
    """HF tensor name (without an optional ``model.`` prefix) -> (NNX path, HF shape, HF -> NNX transform)."""
    d, f, h, kvh, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layout: dict[str, tuple[tuple, tuple[int, ...], Callable | None]] = {
        "fc.weight": (("fc",), (d, cfg.num_taps * d), lambda w: w.T),
        "hidden_norm.weight": (("hidden_norm", "weight"), (d,), None),
        "norm.weight": (("norm", "weight"), (d,), None),
    }
    per_layer = {
        "self_attn.q_proj.weight": (("attn", "q"), (h * hd, d), lambda w: w.T.reshape(d, h, hd)),
        "self_attn.k_proj.weight": (("attn", "k"), (kvh * hd, d), lambda w: w.T.reshape(d, kvh, hd)),
        "self_attn.v_proj.weight": (("attn", "v"), (kvh * hd, d), lambda w: w.T.reshape(d, kvh, hd)),
        "self_attn.o_proj.weight": (("attn", "o"), (d, h * hd), lambda w: w.T.reshape(h, hd, d)),
        "self_attn.q_norm.weight": (("attn", "q_norm", "weight"), (hd,), None),
        "self_attn.k_norm.weight": (("attn", "k_norm", "weight"), (hd,), None),
        "input_layernorm.weight": (("input_norm", "weight"), (d,), None),
        "post_attention_layernorm.weight": (("post_norm", "weight"), (d,), None),
        "mlp.gate_proj.weight": (("mlp", "gate"), (f, d), lambda w: w.T),
        "mlp.up_proj.weight": (("mlp", "up"), (f, d), lambda w: w.T),
        "mlp.down_proj.weight": (("mlp", "down"), (d, f), lambda w: w.T),
    }
    for i in range(cfg.num_layers):
        for name, (sub, shape, transform) in per_layer.items():
            layout[f"layers.{i}.{name}"] = (("layers", i) + sub, shape, transform)
    return layout


def load_hf_drafter(path: str, *, dtype: str = "bfloat16", legacy_yarn_amplitude: bool = False,
                    mesh: Mesh | None = None, rules: ShardingRules | None = None) -> DFlashDrafter:
    """Reads an HF DFlash drafter directory (config.json + *.safetensors) into a DFlashDrafter.

    Tensor names as ``hf_tensor_layout`` (an optional ``model.`` prefix is accepted; rotary buffers are
    skipped). Raises ConfigError for an unsupported config and CheckpointError naming a missing,
    unexpected, duplicated or wrongly shaped tensor. With a mesh, each weight goes to its sharding.
    """
    cfg = DrafterConfig.from_hf_dir(path, dtype=dtype, legacy_yarn_amplitude=legacy_yarn_amplitude)
    rules = rules or DEFAULT_RULES
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(cfg, nnx.Rngs(0))))
    flat_abstract = {tuple(k): v for k, v in abstract.flat_state()}
    layout = hf_tensor_layout(cfg)
    placed: dict[tuple, Any] = {}
    seen: dict[str, str] = {}
    for name, file in iter_tensors(path):
        local = name[len("model."):] if name.startswith("model.") else name
        if local.endswith("rotary_emb.inv_freq"):
            continue
        if local not in layout:
            raise CheckpointError(f"unexpected tensor {name!r} in drafter checkpoint {path!r}")
        if local in seen:
            raise CheckpointError(f"tensor {name!r} duplicates {seen[local]!r}")
        seen[local] = name
        key, shape, transform = layout[local]
        if file.shape(name) != shape:
            raise CheckpointError(f"{name}: shape {file.shape(name)} != expected {shape}")
        variable = flat_abstract[key]
        value = file.get(name)
        array = checked_array(name, np.asarray(transform(value) if transform else value), variable.get_value())
        if mesh is not None:
            placed[key] = jax.device_put(array, named_sharding(mesh, rules, variable.get_metadata()["logical_axes"]))
        else:
            placed[key] = jnp.asarray(array)
    missing = [name for name in layout if name not in seen]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"drafter checkpoint {path!r} is missing tensors {missing[:5]}{more}")
    unmapped = [k for k in flat_abstract if k not in placed]
    if unmapped:  # a layout/model mismatch: a bug here, not in the checkpoint
        raise CheckpointError(f"drafter parameters without a checkpoint tensor: {unmapped[:5]}")
    state = nnx.State.from_flat_path({k: flat_abstract[k].replace(placed[k]) for k in flat_abstract})
    return nnx.merge(graphdef, state)


__all__ = ["DrafterConfig", "DraftCache", "DFlashDrafter", "init_draft_cache", "draft_logits", "load_hf_drafter",
           "k26_drafter_config", "tiny_drafter_config", "build_target_layer_ids", "check_drafter_target", "target_taps",
           "draft_attention_xla", "block_tokens", "hf_tensor_layout", "draft_cache_axes", "DRAFT_CACHE_AXES"]

"""Model configuration: one frozen, hashable value read from an HF ``config.json``.

Dimension letters used across the package (see README "Glossary"):
  B batch/streams, S sequence (cache capacity), T new tokens in a block (tree nodes incl. root),
  D model width, H query heads, N nope head dim, R rope head dim, V value head dim,
  L kv latent rank (512), Q q latent rank, E routed experts, K experts per token, F expert FFN width,
  W vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_WRAPPER_TYPES = ("kimi_k25",)
# transformers DeepseekV3Config defaults of fields that from_hf_dict requires (named in its error)
TRANSFORMERS_DEFAULTS = {"routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4}


class ConfigError(ValueError):
    """A config.json this package cannot represent."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies for the 64-dim rope part of MLA (YaRN or plain)."""

    theta: float = 50000.0
    kind: str = "yarn"  # "yarn" or "default"
    factor: float = 64.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    attention_factor: float | None = None  # cos/sin amplitude override; None = derived as HF does


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors ``pack-quantized`` INT4 settings of the routed experts."""

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a DeepSeek-V3-architecture (Kimi K2.x) text model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (first_k_dense_replace layers)
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    latent_norm_eps: float = 1e-6  # HF builds q_a/kv_a layernorms with eps 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    quant: QuantConfig | None = None
    # Name prefix of the text model's tensors in the HF checkpoint ("" or "language_model.").
    weight_prefix: str = ""
    # Multi-token-prediction layers stored after the num_layers decoder layers (HF checkpoints); not used.
    num_nextn_predict_layers: int = 0
    dtype: str = "bfloat16"  # activation / non-expert weight dtype
    # The router weight's dtype (HF: mlp.gate.weight). transformers keeps it in f32 whatever the model dtype;
    # a checkpoint that stores it in bf16 (K2.6) loses nothing in bf16, and with bf16 activations the router's
    # dot then sums the reference's exact products on the tensor cores (``moe.route``). The HF loader takes
    # it from the checkpoint (``hf_loader.hf_model_config``).
    router_dtype: str = "float32"

    def __post_init__(self):
        problems = []
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append("num_experts_per_tok > n_routed_experts")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            problems.append(f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        elif self.n_group > 1 and not self.n_routed_experts % self.n_group:
            per_group = self.n_routed_experts // self.n_group
            if per_group < 2:  # moe.route scores a group by the sum of its top-2 experts
                problems.append(f"n_routed_experts/n_group={per_group} experts per group; group routing needs >= 2")
            if self.topk_group * per_group < self.num_experts_per_tok:
                problems.append(f"topk_group={self.topk_group} groups of {per_group} experts hold fewer than "
                                f"num_experts_per_tok={self.num_experts_per_tok}")
        if self.qk_rope_head_dim % 2:
            problems.append("qk_rope_head_dim must be even")
        if self.quant is not None:  # the routed experts' in-dims, grouped
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % self.quant.group_size:
                    problems.append(f"{name}={getattr(self, name)} is not a multiple of the quantization "
                                    f"group_size {self.quant.group_size}")
        problems += rope_problems(self.rope)
        if self.num_nextn_predict_layers < 0:
            problems.append(f"num_nextn_predict_layers={self.num_nextn_predict_layers} must be >= 0")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            problems.append("first_k_dense_replace outside [0, num_layers]")
        for name in ("dtype", "router_dtype"):
            if getattr(self, name) not in ("bfloat16", "float32", "float16"):
                problems.append(f"{name} {getattr(self, name)!r} not in bfloat16/float32/float16")
        if problems:
            raise ConfigError("invalid ModelConfig: " + "; ".join(problems))

    # ----- derived sizes -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token per layer in absorbed MLA: L + R (576 for K2.6)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def softmax_scale(self) -> float:
        """192^-0.5 times the YaRN mscale squared (0.14468 for K2.6)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ----- HF config.json -----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, dtype: str = "bfloat16") -> "ModelConfig":
        """Builds a config from the dict of an HF ``config.json``.

        Accepts plain DeepseekV3 / kimi_k2 configs and the K2.5/K2.6 ``kimi_k25`` wrapper (text model
        under ``text_config``, tensors prefixed ``language_model.``). Anything else is refused.
        """
        model_type = raw.get("model_type")
        prefix = ""
        top = raw
        if model_type in SUPPORTED_WRAPPER_TYPES:
            if "text_config" not in raw:
                raise ConfigError(f"model_type {model_type!r} needs a 'text_config' section")
            raw = raw["text_config"]
            prefix = "language_model."
            model_type = raw.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_TEXT_MODEL_TYPES:
            known = SUPPORTED_TEXT_MODEL_TYPES + SUPPORTED_WRAPPER_TYPES
            raise ConfigError(f"unsupported architecture model_type={model_type!r}; supported: {known}")

        def need(key):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"config.json lacks required field {key!r}")
            return raw[key]

        def need_no_default(key):  # fields that change the math; a guessed default would go unnoticed
            if key not in raw or raw[key] is None:
                raise ConfigError(f"config.json lacks required field {key!r} (no default is assumed: transformers' "
                                  f"DeepseekV3Config default is {TRANSFORMERS_DEFAULTS[key]}, other tools differ)")
            return raw[key]

        rope_raw = hf_rope_section(raw)
        theta = float(rope_raw.get("rope_theta", raw.get("rope_theta", 10000.0)))
        kind = rope_raw.get("rope_type", rope_raw.get("type", "default"))
        if kind not in ("yarn", "default"):
            raise ConfigError(f"unsupported rope type {kind!r} (supported: yarn, default)")
        if kind == "yarn" and rope_raw.get("factor") is None:
            raise ConfigError("yarn rope section lacks required field 'factor' (no default is assumed: transformers "
                              "derives it from max_position_embeddings / original_max_position_embeddings)")
        rope = RopeConfig(
            theta=theta,
            kind=kind,
            factor=float(rope_raw.get("factor", 1.0)),
            original_max_position=hf_original_max_position(raw, rope_raw, raw.get("max_position_embeddings") or 4096),
            # as transformers reads them: a null or 0 beta is its default, a null mscale is absent (0: HF then
            # derives the amplitude from factor alone)
            beta_fast=float(rope_raw.get("beta_fast") or 32.0),
            beta_slow=float(rope_raw.get("beta_slow") or 1.0),
            mscale=float(rope_raw.get("mscale") or 0.0),
            mscale_all_dim=float(rope_raw.get("mscale_all_dim") or 0.0),
            attention_factor=None if rope_raw.get("attention_factor") is None else float(rope_raw["attention_factor"]),
        )
        if rope_raw.get("truncate", True) is not True:
            raise ConfigError("rope 'truncate: false' is not supported")

        eos = top.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        quant_raw = raw.get("quantization_config") or top.get("quantization_config")
        n_group = int(need_no_default("n_group"))
        topk_group = int(need_no_default("topk_group"))
        for key, value in (("n_group", n_group), ("topk_group", topk_group)):
            if value < 1:
                raise ConfigError(f"config.json {key}={value} must be >= 1")
        if raw.get("topk_method", "noaux_tc") not in ("noaux_tc",):
            raise ConfigError(f"unsupported topk_method {raw.get('topk_method')!r} (only noaux_tc)")
        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"unsupported scoring_func {raw.get('scoring_func')!r} (only sigmoid)")
        if raw.get("hidden_act", "silu") not in SILU_NAMES:
            raise ConfigError(f"unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
        if raw.get("attention_bias", False):
            raise ConfigError("attention_bias=true is not supported")
        if raw.get("tie_word_embeddings", False) or top.get("tie_word_embeddings", False):
            raise ConfigError("tied embeddings are not supported (K2 models have an untied lm_head)")
        if raw.get("rope_interleave", True) is not True:
            raise ConfigError("rope_interleave=false is not supported (DeepSeek/Kimi rotate interleaved pairs)")
        if raw.get("moe_layer_freq", 1) != 1:
            raise ConfigError("moe_layer_freq != 1 is not supported")

        from ddtree_jax.quant import parse_quantization_config  # local import: quant imports config

        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=int(need("num_attention_heads")),
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            n_routed_experts=int(need("n_routed_experts")),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_group=n_group,
            topk_group=topk_group,
            # transformers makes layer i dense where i < first_k_dense_replace: past the last layer, all are
            first_k_dense_replace=min(int(raw.get("first_k_dense_replace") or 0), int(need("num_hidden_layers"))),
            routed_scaling_factor=float(need_no_default("routed_scaling_factor")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            rms_norm_eps=float(need("rms_norm_eps")),
            rope=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
            bos_token_id=top.get("bos_token_id", raw.get("bos_token_id")),
            pad_token_id=top.get("pad_token_id", raw.get("pad_token_id")),
            quant=parse_quantization_config(quant_raw),
            weight_prefix=prefix,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            dtype=dtype,
        )

    @classmethod
    def from_hf_dir(cls, path: str, *, dtype: str = "bfloat16") -> "ModelConfig":
        file = os.path.join(path, "config.json")
        if not os.path.exists(file):
            raise ConfigError(f"no config.json in {path!r}")
        with open(file) as f:
            return cls.from_hf_dict(json.load(f), dtype=dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_problems(rope: RopeConfig) -> list[str]:
    """What makes a RoPE setting unusable (each read would give non-finite frequencies or a log of <= 0): theta,
    and for YaRN its factor, betas and original context, must be > 0."""
    names = ("theta",) + (("factor", "beta_fast", "beta_slow", "original_max_position") if rope.kind == "yarn" else ())
    return [f"{rope.kind} rope {name}={getattr(rope, name)} must be > 0" for name in names
            if not getattr(rope, name) > 0]


SILU_NAMES = ("silu", "swish")
"""The ``hidden_act`` names that transformers' ACT2FN maps to SiLU, the only activation the models here take."""


def hf_original_max_position(raw: dict[str, Any], rope_raw: dict[str, Any], default: int) -> int:
    """YaRN's pretraining length as transformers 5 reads an HF config: a top-level
    ``original_max_position_embeddings`` (as Phi-3 saves it) first, else the RoPE section's, else ``default``
    (max_position_embeddings). Both given and differing is refused: earlier transformers and other tools read the
    section's, so either choice would silently change the frequencies for someone."""
    top, section = raw.get("original_max_position_embeddings"), rope_raw.get("original_max_position_embeddings")
    if top is not None and section is not None and top != section:
        raise ConfigError(f"config.json has original_max_position_embeddings {top} at the top level and {section} "
                          "in its RoPE section; keep one (transformers 5 reads the top-level one)")
    value = top if top is not None else section if section is not None else default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigError(f"original_max_position_embeddings must be an integer, got {value!r}")
    return int(value)


def hf_rope_section(raw: dict[str, Any]) -> dict[str, Any]:
    """An HF config's RoPE section: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (earlier files).
    A config with both, differing, is refused: transformers 5 reads ``rope_scaling`` and drops the other,
    other tools read ``rope_parameters``, so either choice would silently change the frequencies for someone."""
    parameters, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    if parameters and scaling and parameters != scaling:
        raise ConfigError(f"config.json has both rope_parameters {parameters} and rope_scaling {scaling}, and they "
                          "differ; keep one (transformers 5 reads rope_scaling, other tools rope_parameters)")
    return parameters or scaling or {}


def k26_config(dtype: str = "bfloat16", quantized: bool = True) -> ModelConfig:
    """Full Kimi K2.6 text-model dimensions (values as in its config.json; the router in bf16, as its
    checkpoint stores ``mlp.gate.weight``)."""
    return ModelConfig(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_layers=61,
        num_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=262144,
        eos_token_ids=(163586,),
        bos_token_id=163584,
        pad_token_id=163839,
        quant=QuantConfig() if quantized else None,
        weight_prefix="language_model.",
        dtype=dtype,
        router_dtype="bfloat16",
    )


def tiny_config(dtype: str = "float32", **overrides) -> ModelConfig:
    """Tiny dims with the K2.6 structure, for tests on CPU."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_layers=3,
        num_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position=32,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=2048,
        eos_token_ids=(1,),
        dtype=dtype,
    )
    base.update(overrides)
    return ModelConfig(**base)

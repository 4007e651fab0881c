"""Load an HF checkpoint directory (config.json + *.safetensors) into a ``KimiModel``.

Public entry point: ``load_hf_model(path, dtype=..., mesh=..., rules=...)``. Reads shard by shard,
one memory-mapped tensor at a time; each finished parameter goes straight to its device sharding.
Accepts the plain DeepseekV3 layout (``model.*``, ``lm_head.weight``), the K2.5/K2.6 wrapper
(``language_model.`` prefix, vision tensors skipped), per-expert or fused expert tensors, and the
compressed-tensors INT4 expert layout (``weight_packed`` / ``weight_scale`` / ``weight_shape``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ddtree_jax.config import ModelConfig
from ddtree_jax.model import KimiModel
from ddtree_jax.quant import QuantArray
from ddtree_jax.safetensors_io import CheckpointError, checked_array, iter_tensors
from ddtree_jax.sharding import DEFAULT_RULES, ShardingRules, named_sharding


def _attn_rules(cfg: ModelConfig):
    h, n, r, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return {
        "self_attn.q_a_proj.weight": (("attn", "q_a"), lambda w: w.T),
        "self_attn.q_a_layernorm.weight": (("attn", "q_a_norm", "weight"), None),
        "self_attn.q_b_proj.weight": (("attn", "q_b"), lambda w: w.T.reshape(w.shape[1], h, n + r)),
        "self_attn.q_proj.weight": (("attn", "q_b"), lambda w: w.T.reshape(w.shape[1], h, n + r)),
        "self_attn.kv_a_proj_with_mqa.weight": (("attn", "kv_a"), lambda w: w.T),
        "self_attn.kv_a_layernorm.weight": (("attn", "kv_a_norm", "weight"), None),
        "self_attn.kv_b_proj.weight": (("attn", "kv_b"), lambda w: w.T.reshape(w.shape[1], h, n + v)),
        "self_attn.o_proj.weight": (("attn", "o"), lambda w: w.T.reshape(h, v, w.shape[0])),
        "input_layernorm.weight": (("input_norm", "weight"), None),
        "post_attention_layernorm.weight": (("post_norm", "weight"), None),
        "mlp.gate_proj.weight": (("mlp", "gate"), lambda w: w.T),
        "mlp.up_proj.weight": (("mlp", "up"), lambda w: w.T),
        "mlp.down_proj.weight": (("mlp", "down"), lambda w: w.T),
        "mlp.shared_experts.gate_proj.weight": (("mlp", "shared", "gate"), lambda w: w.T),
        "mlp.shared_experts.up_proj.weight": (("mlp", "shared", "up"), lambda w: w.T),
        "mlp.shared_experts.down_proj.weight": (("mlp", "shared", "down"), lambda w: w.T),
        "mlp.gate.weight": (("mlp", "router"), None),
        "mlp.gate.e_score_correction_bias": (("mlp", "router_bias"), None),
    }


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                     r"(weight|weight_packed|weight_scale|weight_shape)$")
_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$)")


class _ExpertStack:
    """Assembles one layer's per-expert tensors into stacked [E, ...] arrays, checking completeness."""

    def __init__(self, cfg: ModelConfig, layer: int):
        self.cfg, self.layer = cfg, layer
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.shapes = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
        self.parts: dict[tuple[str, str], np.ndarray] = {}
        self.seen: set[tuple[int, str, str]] = set()
        self.num_experts = e

    def _buffer(self, name: str, proj: str, kind: str, value: np.ndarray) -> np.ndarray:
        """The layer's [E, ...] stack for ``value``, in the dtype of the first expert that arrived; a value of
        another dtype must be exactly representable in it (nothing is rounded before the final cast)."""
        key = ("w13" if proj != "down_proj" else "w2", kind)
        if key not in self.parts:
            e, d, f = self.num_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
            full = (e, 2 * f, value.shape[-1]) if key[0] == "w13" else (e, d, value.shape[-1])
            self.parts[key] = np.zeros(full, value.dtype)
        buffer = self.parts[key]
        if value.dtype != buffer.dtype and not np.array_equal(value.astype(buffer.dtype).astype(value.dtype), value,
                                                              equal_nan=True):
            raise CheckpointError(f"{name}: stored as {value.dtype}, not exactly representable in {buffer.dtype}, "
                                  f"the dtype of this layer's experts that came first (store one dtype per layer)")
        return buffer

    def add(self, name: str, expert: int, proj: str, kind: str, value: np.ndarray) -> None:
        if expert >= self.num_experts:
            raise CheckpointError(f"{name}: expert index {expert} >= n_routed_experts={self.num_experts}")
        out_dim, in_dim = self.shapes[proj]
        if (expert, proj, kind) in self.seen:
            raise CheckpointError(f"{name}: duplicate tensor")
        if kind != "weight" and self.cfg.quant is None:
            raise CheckpointError(f"{name}: quantized expert tensor but config.json has no quantization_config")
        if kind == "weight_shape":
            if not np.issubdtype(value.dtype, np.integer):
                raise CheckpointError(f"{name}: dtype {value.dtype} is not an integer type (int32/int64 expected)")
            if [int(x) for x in np.asarray(value).reshape(-1)] != [out_dim, in_dim]:
                raise CheckpointError(f"{name}: weight_shape {np.asarray(value).tolist()} != expected "
                                      f"{[out_dim, in_dim]}")
            self.seen.add((expert, proj, kind))
            return
        if kind == "weight":
            if self.cfg.quant is not None:
                raise CheckpointError(f"{name}: float expert weight but quantization_config declares INT4 experts")
            if not jnp.issubdtype(value.dtype, jnp.floating):
                raise CheckpointError(f"{name}: dtype {value.dtype} is not a float type")
            expected = (out_dim, in_dim)
        else:
            group = self.cfg.quant.group_size
            expected = (out_dim, in_dim // 8) if kind == "weight_packed" else (out_dim, in_dim // group)
            if kind == "weight_packed" and value.dtype != np.int32:
                raise CheckpointError(f"{name}: dtype {value.dtype} != int32")
            if kind == "weight_scale" and not jnp.issubdtype(value.dtype, jnp.floating):
                raise CheckpointError(f"{name}: dtype {value.dtype} is not a float type")
        if tuple(value.shape) != expected:
            raise CheckpointError(f"{name}: shape {tuple(value.shape)} != expected {expected}")
        buffer = self._buffer(name, proj, kind, value)
        rows = slice(out_dim, 2 * out_dim) if proj == "up_proj" else slice(0, out_dim)
        buffer[expert, rows] = value
        self.seen.add((expert, proj, kind))

    def add_fused(self, name: str, which: str, value: np.ndarray) -> None:
        e, d, f = self.num_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        expected = (e, 2 * f, d) if which == "gate_up_proj" else (e, d, f)
        if tuple(value.shape) != expected:
            raise CheckpointError(f"{name}: shape {tuple(value.shape)} != expected {expected}")
        if self.cfg.quant is not None:
            raise CheckpointError(f"{name}: fused float experts but quantization_config declares INT4 experts")
        covered = [(ex, proj, "weight") for ex in range(e)
                   for proj in (("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",))]
        if any(c in self.seen for c in covered):
            raise CheckpointError(f"{name}: duplicate tensor (this layer's {which} experts already arrived, fused or "
                                  f"per expert)")
        self.parts[("w13" if which == "gate_up_proj" else "w2", "weight")] = np.array(value)
        self.seen.update(covered)

    def _required(self):
        kinds = ("weight_packed", "weight_scale", "weight_shape") if self.cfg.quant is not None else ("weight",)
        return [(ex, proj, kind) for ex in range(self.num_experts) for proj in ("gate_proj", "up_proj", "down_proj")
                for kind in kinds]

    def complete(self) -> bool:
        """True once every expert tensor of the layer has arrived."""
        return all(r in self.seen for r in self._required())

    def finish(self, prefix: str) -> dict[str, Any]:
        quantized = self.cfg.quant is not None
        missing = [f"{prefix}mlp.experts.{ex}.{proj}.{kind}" for ex, proj, kind in self._required()
                   if (ex, proj, kind) not in self.seen]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(f"checkpoint is missing tensors: {missing[:3]}{more}")
        if quantized:
            return {name: QuantArray(self.parts[(name, "weight_packed")], self.parts[(name, "weight_scale")])
                    for name in ("w13", "w2")}
        return {name: self.parts[(name, "weight")] for name in ("w13", "w2")}


class ShapeOnlyRngs:
    """Stand-in for ``nnx.Rngs`` when only shapes matter (under ``nnx.eval_shape``): ``params()`` returns
    one fixed key. nnx.Rngs would bump a traced counter per parameter, and each bump costs a walk over
    the whole trace (quadratic: ~1 min for full K2.6); the values are never computed here anyway."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and abstract (ShapeDtypeStruct) state of the model; nothing is allocated."""
    abstract = nnx.eval_shape(lambda: KimiModel(cfg, ShapeOnlyRngs()))
    return nnx.split(abstract)


def flat_params(state: nnx.State) -> dict[tuple, nnx.Variable]:
    """{path tuple: Variable} of a (possibly abstract) model state, in declaration order."""
    return {tuple(k): v for k, v in state.flat_state()}


def _check_file_complete(file) -> None:
    """Raises CheckpointError naming the first tensor that lies past the end of a (truncated) shard."""
    for name in file.keys():
        end = file.data_start + file.header[name]["data_offsets"][1]
        if end > file.size:
            raise CheckpointError(f"{file.path}: truncated file: tensor {name!r} ends at byte {end} but the file "
                                  f"has {file.size}")


def iter_hf_params(path: str, cfg: ModelConfig, flat_abstract: dict[tuple, nnx.Variable],
                   progress: Callable[[str], None] | None = None) -> Iterator[tuple[tuple, Any]]:
    """Streams the parameters of an HF checkpoint directory as host numpy values, one finished
    parameter at a time: yields (state path, value) with value an ndarray in the target dtype or a
    QuantArray of ndarrays (packed int32 [E, O, I/8], scale [E, O, I/G]).

    Host memory stays near one tensor for ordinary weights and one layer's expert stack for the routed
    experts (a layer's experts are yielded as soon as all of them have arrived). Every tensor is checked
    (name, shape, dtype) against ``flat_abstract``; after the last tensor, a parameter that never
    arrived raises ``CheckpointError`` naming it.
    """
    attn_rules = _attn_rules(cfg)
    stacks: dict[int, _ExpertStack] = {}
    finished_layers: set[int] = set()
    done: set[tuple] = set()
    text_prefix = cfg.weight_prefix

    def prepare(key: tuple, value, tensor_name: str):
        if key not in flat_abstract:
            raise CheckpointError(f"{tensor_name}: maps to {key}, which this model does not have")
        target = flat_abstract[key].get_value()
        if isinstance(value, QuantArray) != isinstance(target, QuantArray):
            raise CheckpointError(f"{tensor_name}: quantized/float layout does not match the config")
        if key in done:
            raise CheckpointError(f"{tensor_name}: duplicate tensor (maps to {key} again)")
        done.add(key)
        checked = jax.tree.map(lambda leaf, ab: checked_array(tensor_name, leaf, ab), value, target)
        if isinstance(value, QuantArray) and checked.scale.dtype != value.scale.dtype and not np.array_equal(
                checked.scale.astype(value.scale.dtype), value.scale, equal_nan=True):
            raise CheckpointError(f"{tensor_name}: weight_scale stored as {value.scale.dtype}, not exactly "
                                  f"representable in the model's scale dtype {checked.scale.dtype} (every dequantised "
                                  f"expert weight would change); INT4 experts here keep bfloat16 scales, as K2.x "
                                  f"ships them: a checkpoint quantized from a float16 or float32 model is not "
                                  f"supported")
        if key[-1] == "router" and checked.dtype != np.float32 and not np.array_equal(
                checked.astype(value.dtype), value):
            raise CheckpointError(f"{tensor_name}: stored as {value.dtype}, not exactly representable in the "
                                  f"config's router_dtype={cfg.router_dtype} (routing would change); use "
                                  f"router_dtype='float32' (hf_model_config reads it from the checkpoint)")
        return key, checked

    checked_files: set[str] = set()
    for name, file in iter_tensors(path):
        if file.path not in checked_files:  # a truncated shard fails before any of it is used
            checked_files.add(file.path)
            _check_file_complete(file)
        if not name.startswith(text_prefix):
            continue  # e.g. the K2.5/K2.6 vision tower and projector
        local = name[len(text_prefix):]
        if _IGNORED.search(local):
            continue
        if progress:
            progress(name)
        if local == "lm_head.weight":
            yield prepare(("lm_head",), file.get(name).T, name)
            continue
        if not local.startswith("model."):
            raise CheckpointError(f"unexpected tensor {name!r}")
        local = local[len("model."):]
        if local == "embed_tokens.weight":
            yield prepare(("embed",), file.get(name), name)
            continue
        if local == "norm.weight":
            yield prepare(("norm", "weight"), file.get(name), name)
            continue
        match = _LAYER.match(local)
        if not match:
            raise CheckpointError(f"unexpected tensor {name!r}")
        layer, rest = int(match.group(1)), match.group(2)
        if layer >= cfg.num_layers:
            if layer < cfg.num_layers + cfg.num_nextn_predict_layers:
                continue  # a multi-token-prediction layer: not used
            raise CheckpointError(f"{name}: layer {layer} is past num_hidden_layers={cfg.num_layers} and its "
                                  f"{cfg.num_nextn_predict_layers} multi-token-prediction layer(s)")
        if cfg.n_shared_experts == 0 and rest.startswith("mlp.shared_experts."):
            if file.get(name).size:  # transformers saves a model without shared experts with empty ones
                raise CheckpointError(f"{name}: a shared-expert tensor that is not empty, but n_shared_experts is 0")
            continue
        if rest in attn_rules:
            sub, transform = attn_rules[rest]
            value = file.get(name)
            if transform:
                try:
                    value = transform(value)
                except ValueError as e:  # a reshape to the config's heads: the shape check below comes too late
                    raise CheckpointError(f"{name}: shape {tuple(value.shape)} does not fit the config's "
                                          f"{cfg.num_heads} heads ({e})") from None
            yield prepare(("layers", layer) + sub, value, name)
            continue
        expert = _EXPERT.match(rest)
        fused = _FUSED.match(rest)
        if expert or fused:
            if layer < cfg.first_k_dense_replace:
                raise CheckpointError(f"{name}: layer {layer} is dense (first_k_dense_replace="
                                      f"{cfg.first_k_dense_replace}) but has expert tensors")
            if layer in finished_layers:
                raise CheckpointError(f"{name}: duplicate tensor (layer {layer} experts already complete)")
            stack = stacks.setdefault(layer, _ExpertStack(cfg, layer))
            if expert:
                stack.add(name, int(expert.group(1)), expert.group(2), expert.group(3), file.get(name))
            else:
                stack.add_fused(name, fused.group(1), file.get(name))
            if stack.complete():
                finished_layers.add(layer)
                for which, value in stacks.pop(layer).finish(f"{text_prefix}model.layers.{layer}.").items():
                    yield prepare(("layers", layer, "mlp", which), value, f"{text_prefix}model.layers.{layer}.mlp."
                                  f"experts ({which})")
            continue
        if rest.endswith((".weight_packed", ".weight_scale", ".weight_shape")):
            raise CheckpointError(f"{name}: quantized tensor for a module this engine keeps in float (only the "
                                  "routed experts may be INT4; see quantization_config.ignore)")
        raise CheckpointError(f"unexpected tensor {name!r}")

    for layer in range(cfg.first_k_dense_replace, cfg.num_layers):
        if layer in finished_layers:
            continue
        if layer not in stacks:
            raise CheckpointError(f"checkpoint has no routed-expert tensors for layer {layer}")
        stacks.pop(layer).finish(f"{text_prefix}model.layers.{layer}.")  # raises, naming the missing tensors

    missing = [k for k in flat_abstract if k not in done]
    if missing:
        names = [_hf_name(k, attn_rules, text_prefix) for k in missing[:5]]
        raise CheckpointError(f"checkpoint is missing {len(missing)} parameters, e.g. {names}")


def _hf_name(key: tuple, attn_rules: dict, text_prefix: str) -> str:
    """The checkpoint tensor a state path reads (``iter_hf_params``' mapping backwards; alternatives joined by
    ' or '), else the path itself."""
    fixed = {("lm_head",): "lm_head.weight", ("embed",): "model.embed_tokens.weight",
             ("norm", "weight"): "model.norm.weight"}
    if key in fixed:
        return text_prefix + fixed[key]
    if len(key) > 2 and key[0] == "layers":
        hf = [name for name, (path, _) in attn_rules.items() if path == tuple(key[2:])]
        if hf:
            return " or ".join(f"{text_prefix}model.layers.{key[1]}.{name}" for name in hf)
    return ".".join(str(p) for p in key)


def hf_model_config(path: str, *, dtype: str = "bfloat16") -> ModelConfig:
    """``ModelConfig.from_hf_dir`` with ``router_dtype`` from the checkpoint: bf16 (f16) where every layer's
    ``mlp.gate.weight`` is stored in bf16 (f16), as K2.6's is; f32 otherwise, as transformers keeps it."""
    cfg = ModelConfig.from_hf_dir(path, dtype=dtype)
    stored = {file.dtype(name) for name, file in iter_tensors(path) if name.endswith("mlp.gate.weight")}
    router_dtype = {"BF16": "bfloat16", "F16": "float16"}.get(stored.pop()) if len(stored) == 1 else None
    return cfg.replace(router_dtype=router_dtype or "float32")


def load_hf_model(path: str, *, dtype: str = "bfloat16", mesh: Mesh | None = None,
                  rules: ShardingRules | None = None, progress: Callable[[str], None] | None = None) -> KimiModel:
    """Reads an HF checkpoint directory into a KimiModel (sharded when a mesh is given).

    Raises ``ConfigError`` for an unsupported config and ``CheckpointError`` (naming the tensor) for a
    missing, unexpected, wrongly shaped/typed, duplicated or truncated tensor.
    """
    cfg = hf_model_config(path, dtype=dtype)
    graphdef, abstract = abstract_model(cfg)
    flat_abstract = flat_params(abstract)
    placed: dict[tuple, Any] = {}
    for key, value in iter_hf_params(path, cfg, flat_abstract, progress):
        variable = flat_abstract[key]
        if mesh is not None:
            sharding = named_sharding(mesh, rules or DEFAULT_RULES, variable.get_metadata()["logical_axes"])
            placed[key] = jax.tree.map(lambda a: jax.device_put(a, sharding), value)
        else:
            placed[key] = jax.tree.map(jnp.asarray, value)
    state = nnx.State.from_flat_path({k: flat_abstract[k].replace(placed[k]) for k in flat_abstract})
    return nnx.merge(graphdef, state)

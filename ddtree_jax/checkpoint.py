"""Our own checkpoints: the model's param tree (INT4 ``QuantArray`` experts included) in Orbax, plus the
``ModelConfig`` as JSON, so that a checkpoint directory is self-describing.

Layout of a checkpoint directory ``path``::

    path/ddtree_checkpoint.json     the commit record: format, ModelConfig, user metadata, data dir, parts
    path/data-<hex>/<part>/         one Orbax (StandardCheckpointer) checkpoint per part: "layer_000" ...
                                    "layer_NNN" (one decoder layer each), "embed", "norm", "lm_head"

A QuantArray leaf is stored as its two arrays, ``.../w13/packed`` (int32 [E, O, I/8]) and
``.../w13/scale`` ([E, O, I/G]); every other parameter as one array, under its NNX state path.

Atomicity: a save writes all parts into a fresh ``data-<hex>`` directory that nothing references, then
replaces ``ddtree_checkpoint.json`` with one ``os.replace`` (the commit point), then deletes older data
directories. A save that fails or is killed before the commit leaves the previous checkpoint intact and
restorable; its orphan data directory is removed by the next successful save.

Per-part files also bound host memory for conversion: ``convert_hf_checkpoint`` streams an HF directory
(``hf_loader.iter_hf_params``) and writes each layer as soon as all of its tensors have arrived.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from ddtree_jax.config import ModelConfig, QuantConfig, RopeConfig
from ddtree_jax.hf_loader import abstract_model, flat_params, hf_model_config, iter_hf_params
from ddtree_jax.model import KimiModel
from ddtree_jax.quant import QuantArray
from ddtree_jax.safetensors_io import CheckpointError
from ddtree_jax.sharding import DEFAULT_RULES, ShardingRules, named_sharding
from pallas_kernels.int4_moe import PlanarInt4
from pallas_kernels.int4_tiles import TiledInt4

FORMAT = "ddtree-jax-checkpoint/1"
INDEX_FILE = "ddtree_checkpoint.json"
_DATA_DIR = re.compile(r"^data-[0-9a-f]{32}$")


# ----------------------------------------------------------------------------------------------
# ModelConfig <-> JSON
# ----------------------------------------------------------------------------------------------
def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A JSON-ready dict of every ModelConfig field (nested rope / quant as dicts)."""
    out = dataclasses.asdict(cfg)
    out["eos_token_ids"] = list(cfg.eos_token_ids)
    return out


def _refuse_unknown_fields(cls, raw: dict, what: str) -> None:
    """CheckpointError naming the fields of a stored config dict that dataclass ``cls`` does not have."""
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise CheckpointError(f"stored {what} config has unknown fields {unknown}")


def _nested_config(cls, raw, what: str):
    """``cls(**raw)`` for a stored nested config (rope, quant); CheckpointError naming what is wrong with it."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"stored {what} config must be a JSON object, got {raw!r}")
    _refuse_unknown_fields(cls, raw, what)
    return cls(**raw)


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Inverse of ``config_to_dict``."""
    raw = dict(raw)
    raw["rope"] = _nested_config(RopeConfig, raw.get("rope"), "RoPE")
    raw["quant"] = None if raw.get("quant") is None else _nested_config(QuantConfig, raw["quant"], "quant")
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
    _refuse_unknown_fields(ModelConfig, raw, "model")
    return ModelConfig(**raw)


# ----------------------------------------------------------------------------------------------
# Param tree <-> parts of nested str-keyed dicts
# ----------------------------------------------------------------------------------------------
def part_name(path: tuple) -> str:
    """The part a parameter is stored in: ``layer_007`` for ("layers", 7, ...), else its top-level name
    (``embed``, ``norm``, ``lm_head``: written as soon as they arrive, never held through a conversion)."""
    if path and path[0] == "layers":
        return f"layer_{int(path[1]):03d}"
    return str(path[0])


def _leaf_items(path: tuple, value) -> list[tuple[tuple[str, ...], Any]]:
    """(string path, array) pairs of one parameter value (a QuantArray gives two)."""
    base = tuple(str(p) for p in path)
    if isinstance(value, (PlanarInt4, TiledInt4)):
        raise CheckpointError(f"{'.'.join(base)}: experts are in the kernel layout; checkpoints store the "
                              "compressed-tensors layout: call ddtree_jax.moe.unprepare_for_kernels(model) first")
    if isinstance(value, QuantArray):
        return [(base + ("packed",), value.packed), (base + ("scale",), value.scale)]
    return [(base, value)]


def _nest(items) -> dict:
    tree: dict = {}
    for path, leaf in items:
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = leaf
    return tree


def _lookup(tree: dict, path: tuple[str, ...]):
    for p in path:
        tree = tree[p]
    return tree


def _tree_bytes(values) -> int:
    return int(sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(values)))


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------
def _write_json_atomic(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json_index(path: str, name: str, fmt: str, what: str, fields: dict[str, type]) -> dict[str, Any]:
    """The JSON record ``path/name`` of format ``fmt`` holding ``fields`` (name -> JSON type); CheckpointError
    naming the file where it is absent, not JSON, of another format or lacks a field."""
    file = os.path.join(path, name)
    if not os.path.exists(file):
        raise CheckpointError(f"{path}: not a ddtree-jax {what} (no {name})")
    with open(file) as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file}: not JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != fmt:
        found = index.get("format") if isinstance(index, dict) else index
        raise CheckpointError(f"{path}: unknown {what} format {found!r} (expected {fmt!r})")
    for field, kind in fields.items():
        if not isinstance(index.get(field), kind):
            raise CheckpointError(f"{file}: field {field!r} must be a JSON {kind.__name__}, got "
                                  f"{index.get(field)!r}")
    return index


def read_index(path: str) -> dict[str, Any]:
    """The commit record of a checkpoint directory (format, model_config, metadata, data, parts), its data
    directory's name and parts checked."""
    index = _read_json_index(path, INDEX_FILE, FORMAT, "checkpoint",
                             {"model_config": dict, "data": str, "parts": dict})
    if not _DATA_DIR.match(index["data"]):
        raise CheckpointError(f"{path}: {INDEX_FILE} names data dir {index['data']!r}, expected "
                              "'data-<32 hex digits>'")
    for part, names in index["parts"].items():
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise CheckpointError(f"{path}: {INDEX_FILE} part {part!r} must list parameter names, got {names!r}")
    return index


class CheckpointWriter:
    """Writes one checkpoint part by part; nothing is visible until ``commit()``.

    Use as a context manager: leaving the block with an exception deletes the uncommitted data and
    leaves any previous checkpoint at ``path`` untouched.
    """

    def __init__(self, path: str, cfg: ModelConfig, metadata: dict[str, Any] | None = None):
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(f"{path}: exists and is not a directory")
        os.makedirs(path, exist_ok=True)
        self.path, self.cfg, self.metadata = path, cfg, dict(metadata or {})
        json.dumps(self.metadata)  # fail early on metadata that JSON cannot store
        self.data = f"data-{uuid.uuid4().hex}"
        self.parts: dict[str, list[str]] = {}
        self.bytes = 0
        self._checkpointer = ocp.StandardCheckpointer()
        self._committed = False

    def write_part(self, name: str, params: dict[tuple, Any]) -> None:
        """Saves one part: params {state path: array or QuantArray} (host numpy or jax arrays)."""
        if name in self.parts:
            raise ValueError(f"part {name!r} written twice")
        items = [item for path, value in params.items() for item in _leaf_items(path, value)]
        target = os.path.abspath(os.path.join(self.path, self.data, name))
        self._checkpointer.save(target, _nest(items))
        self._checkpointer.wait_until_finished()  # bounded memory: the part is on disk before the next one
        self.parts[name] = [".".join(str(p) for p in path) for path in params]
        self.bytes += _tree_bytes(list(params.values()))

    def commit(self) -> None:
        """Makes the written parts the checkpoint at ``path`` (atomic), then removes older data dirs."""
        self._checkpointer.close()
        index = {"format": FORMAT, "model_config": config_to_dict(self.cfg), "metadata": self.metadata,
                 "data": self.data, "parts": self.parts, "param_bytes": self.bytes}
        _write_json_atomic(os.path.join(self.path, INDEX_FILE), index)
        self._committed = True
        for entry in os.listdir(self.path):
            if _DATA_DIR.match(entry) and entry != self.data:
                shutil.rmtree(os.path.join(self.path, entry), ignore_errors=True)

    def abort(self) -> None:
        self._checkpointer.close()
        shutil.rmtree(os.path.join(self.path, self.data), ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._committed:
            self.abort()


STORAGE_DTYPES = ("bfloat16", "float16", "float32")


def _check_storage_dtype(storage_dtype) -> None:
    if storage_dtype is not None and str(jnp.dtype(storage_dtype)) not in STORAGE_DTYPES:
        raise CheckpointError(f"storage_dtype {storage_dtype!r} must be one of {STORAGE_DTYPES} (None: as held)")


def _refuse_float16_overflow(what: str, name: str, value, source_dtype) -> None:
    """CheckpointError where a cast to float16 (the one float cast here that can overflow) made a value inf."""
    if jnp.dtype(value.dtype) == jnp.float16 and jnp.dtype(source_dtype) != jnp.float16 and not bool(
            jnp.isfinite(value).all()):
        raise CheckpointError(f"{what}: parameter {name} overflows float16 (|x| > 65504) when cast from "
                              f"{jnp.dtype(source_dtype).name}; use bfloat16 or float32")


ROUTING_PARAMS = ("router", "router_bias")
"""Stored in their declared dtypes whatever ``storage_dtype``: rounding the router's weight or correction bias
changes which experts tokens pick (72 of 4096 tokens at 64 experts top-8, for a bias rounded to bfloat16), as the
HF loader refuses too."""


def _stored(name: str, value, storage_dtype):
    """``value`` as written: float arrays cast to ``storage_dtype`` (None: unchanged; CheckpointError where float16
    cannot hold a value); INT4 QuantArrays, integer arrays and the ROUTING_PARAMS always unchanged."""
    if (storage_dtype is None or not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.floating)
            or name.rsplit(".", 1)[-1] in ROUTING_PARAMS):
        return value
    stored = value.astype(storage_dtype)
    _refuse_float16_overflow("saving", name, stored, value.dtype)
    return stored


def save_model(model_or_state: KimiModel | nnx.State, path: str, metadata: dict[str, Any] | None = None, *,
               cfg: ModelConfig | None = None, storage_dtype: str | None = None) -> None:
    """Saves a KimiModel (or its ``nnx.State`` plus ``cfg``) to ``path`` atomically.

    Arrays may be sharded over a mesh; every shard is written. ``metadata`` (JSON-serializable) is
    stored in the commit record next to the ModelConfig. ``storage_dtype`` (e.g. "bfloat16", as real
    checkpoints ship) rounds the float parameters but the routing ones (ROUTING_PARAMS) on disk;
    ``restore_model`` casts them back to the config's dtype, so the restored model is the rounded one.
    """
    if isinstance(model_or_state, nnx.Module):
        cfg = cfg or model_or_state.cfg
        state = nnx.state(model_or_state)
    else:
        state = model_or_state
        if cfg is None:
            raise ValueError("save_model of a bare nnx.State needs cfg=")
    _check_storage_dtype(storage_dtype)
    _check_state_fits(state, cfg)
    grouped: dict[str, dict[tuple, Any]] = {}
    for key, variable in flat_params(state).items():
        grouped.setdefault(part_name(key), {})[key] = _stored(".".join(map(str, key)), variable.get_value(),
                                                               storage_dtype)
    if storage_dtype is not None:
        metadata = dict(metadata or {}, storage_dtype=str(jnp.dtype(storage_dtype)))
    with CheckpointWriter(path, cfg, metadata) as writer:
        for name, params in grouped.items():
            _save_part(writer, name, params)
        writer.commit()


def _check_state_fits(state: nnx.State, cfg: ModelConfig) -> None:
    """CheckpointError unless ``state`` holds exactly the parameters ``cfg`` declares, in their shapes: a checkpoint
    whose config does not describe its arrays could never be restored."""
    _, abstract = abstract_model(cfg)
    want, have = flat_params(abstract), flat_params(state)
    name = lambda key: ".".join(map(str, key))  # noqa: E731
    extra, missing = sorted(map(name, set(have) - set(want))), sorted(map(name, set(want) - set(have)))
    if extra or missing:
        raise CheckpointError(f"the state does not match the config: {len(missing)} parameters missing (e.g. "
                              f"{missing[:3]}), {len(extra)} not in the config (e.g. {extra[:3]})")
    for key, variable in want.items():
        shapes = [tuple(leaf.shape) for _, leaf in _leaf_items(key, variable.get_value())]
        held = [tuple(leaf.shape) for _, leaf in _leaf_items(key, have[key].get_value())]  # refuses kernel layouts
        if shapes != held:
            raise CheckpointError(f"parameter {name(key)} has shape(s) {held}, the config declares {shapes}")


def _save_part(writer: CheckpointWriter, name: str, params: dict[tuple, Any]) -> None:
    """One part of ``save_model`` (a seam for tests that interrupt a save)."""
    writer.write_part(name, params)


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
def checkpoint_config(path: str) -> ModelConfig:
    """The ModelConfig stored in a checkpoint directory."""
    return config_from_dict(read_index(path)["model_config"])


def restore_model(path: str, cfg: ModelConfig | None = None, mesh: Mesh | None = None,
                  rules: ShardingRules | None = None) -> KimiModel:
    """Restores a checkpoint into a KimiModel built from abstract shapes (nothing is allocated twice).

    cfg: None = the stored config; otherwise it must agree with the stored one on every field but ``dtype``
    (float parameters are cast on restore): a field that does not change a shape (RoPE, routing, norms, EOS
    ids) still changes what the weights compute, so it is refused too, naming each difference.
    mesh / rules: each array is read directly into its NamedSharding from the logical axes
    (default rules ``DEFAULT_RULES``); without a mesh everything goes to the first device.
    """
    index = read_index(path)
    stored = config_from_dict(index["model_config"])
    if cfg is None:
        cfg = stored
    else:
        diff = [f.name for f in dataclasses.fields(ModelConfig)
                if f.name != "dtype" and getattr(cfg, f.name) != getattr(stored, f.name)]
        if diff:
            raise CheckpointError(f"{path}: config differs from the stored one in " + ", ".join(
                f"{f} ({getattr(cfg, f)!r} != stored {getattr(stored, f)!r})" for f in diff))
    rules = rules or DEFAULT_RULES
    graphdef, abstract = abstract_model(cfg)
    flat_abstract = flat_params(abstract)
    by_part: dict[str, list[tuple]] = {}
    for key in flat_abstract:
        by_part.setdefault(part_name(key), []).append(key)
    stored_params = {p for names in index["parts"].values() for p in names}
    missing = [".".join(str(p) for p in k) for k in flat_abstract if ".".join(str(p) for p in k) not in stored_params]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
    extra = sorted(stored_params - {".".join(str(p) for p in k) for k in flat_abstract})
    if extra:  # its record's config describes fewer parameters than it holds: restoring would drop them
        raise CheckpointError(f"{path}: checkpoint holds {len(extra)} parameters its config does not declare, "
                              f"e.g. {extra[:5]}")
    placed: dict[tuple, Any] = {}
    checkpointer = ocp.StandardCheckpointer()
    try:
        for name, keys in by_part.items():
            if name not in index["parts"]:
                raise CheckpointError(f"{path}: checkpoint has no part {name!r}")

            def spec(key, leaf):
                if mesh is None:
                    sharding = SingleDeviceSharding(jax.devices()[0])
                else:
                    sharding = named_sharding(mesh, rules, flat_abstract[key].get_metadata()["logical_axes"])
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

            target_items = [item for key in keys
                            for item in _leaf_items(key, jax.tree.map(lambda leaf, k=key: spec(k, leaf),
                                                                      flat_abstract[key].get_value()))]
            part_dir = os.path.abspath(os.path.join(path, index["data"], name))
            if not os.path.isdir(part_dir):
                raise CheckpointError(f"{path}: part directory {part_dir} is missing")
            restored = checkpointer.restore(part_dir, _nest(target_items))
            for key in keys:
                value = flat_abstract[key].get_value()
                base = tuple(str(p) for p in key)
                if isinstance(value, QuantArray):
                    placed[key] = QuantArray(_lookup(restored, base + ("packed",)),
                                             _lookup(restored, base + ("scale",)))
                else:
                    placed[key] = _lookup(restored, base)
    finally:
        checkpointer.close()
    for key, value in placed.items():
        for leaf in jax.tree.leaves(value):
            _refuse_float16_overflow(path, ".".join(map(str, key)), leaf, stored.dtype)
    state = nnx.State.from_flat_path({k: flat_abstract[k].replace(placed[k]) for k in flat_abstract})
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------
# Streaming conversion of an HF directory
# ----------------------------------------------------------------------------------------------
def convert_hf_checkpoint(hf_dir: str, out_dir: str, *, dtype: str = "bfloat16",
                          metadata: dict[str, Any] | None = None,
                          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Converts an HF checkpoint directory into our checkpoint at ``out_dir`` with bounded host memory.

    Tensors are read memory-mapped one at a time; finished parameters are buffered per part and each
    part (one decoder layer, or the globals) is written and freed as soon as all of its parameters
    have arrived, so host memory stays near the largest in-flight layer(s), not the whole model.
    ``progress(tensor_name)`` is called per tensor. Returns stats: parameter bytes written, the
    largest number of bytes buffered at once, and the number of parts.
    """
    cfg = hf_model_config(hf_dir, dtype=dtype)
    if os.path.isdir(out_dir) and os.path.samefile(hf_dir, out_dir):
        raise CheckpointError(f"{out_dir} is the HF checkpoint's own directory: convert into one of its own")
    _check_no_foreign_tokenizer_files(hf_dir, out_dir)  # before hours of conversion, not after
    _, abstract = abstract_model(cfg)
    flat_abstract = flat_params(abstract)
    expected: dict[str, set[tuple]] = {}
    for key in flat_abstract:
        expected.setdefault(part_name(key), set()).add(key)
    buffers: dict[str, dict[tuple, Any]] = {}
    buffered = peak_buffered = 0
    meta = {"source": os.path.abspath(hf_dir), **(metadata or {})}
    with CheckpointWriter(out_dir, cfg, meta) as writer:
        for key, value in iter_hf_params(hf_dir, cfg, flat_abstract, progress):
            name = part_name(key)
            buffers.setdefault(name, {})[key] = value
            buffered += _tree_bytes(value)
            peak_buffered = max(peak_buffered, buffered)
            if set(buffers[name]) == expected[name]:
                params = buffers.pop(name)
                writer.write_part(name, {k: params[k] for k in flat_abstract if k in params})
                buffered -= _tree_bytes(list(params.values()))
                del params
        if buffers:  # iter_hf_params raises on missing tensors; this guards the bookkeeping
            raise CheckpointError(f"incomplete parts after conversion: {sorted(buffers)}")
        writer.commit()
    copied = copy_tokenizer_files(hf_dir, out_dir)
    return {"param_bytes": writer.bytes, "peak_buffered_bytes": peak_buffered, "parts": len(writer.parts),
            "tokenizer_files": copied}


def _check_no_foreign_tokenizer_files(src_dir: str, dst_dir: str) -> None:
    """Raises CheckpointError if ``dst_dir`` holds tokenizer files that ``src_dir`` lacks: ``load_tokenizer``
    could prefer one of them over the source's own (e.g. an old ``tokenizer.json`` beside a new
    ``tiktoken.model``). They are the user's files, so they are named, not deleted."""
    from ddtree_jax.tokenizer import TOKENIZER_DIR_FILES

    foreign = [name for name in TOKENIZER_DIR_FILES
               if os.path.isfile(os.path.join(dst_dir, name)) and not os.path.isfile(os.path.join(src_dir, name))]
    if foreign:
        raise CheckpointError(f"{dst_dir}: holds tokenizer files {foreign} that {src_dir} lacks; the converted "
                              f"checkpoint would load them as its tokenizer. Remove them or use another out_dir")


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copies the tokenizer files of a model directory (``tokenizer.TOKENIZER_DIR_FILES``) that exist, so that
    the converted checkpoint decodes text as the source does; returns their names. Raises CheckpointError
    (copying nothing) if ``dst_dir`` holds tokenizer files that ``src_dir`` lacks."""
    from ddtree_jax.tokenizer import TOKENIZER_DIR_FILES

    _check_no_foreign_tokenizer_files(src_dir, dst_dir)
    copied = [name for name in TOKENIZER_DIR_FILES if os.path.isfile(os.path.join(src_dir, name))]
    for name in copied:
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return copied


# ----------------------------------------------------------------------------------------------------
# DFlash drafter checkpoints: ``drafter_config.json`` (the commit record) + ``params-<hex>/`` (one Orbax
# StandardCheckpointer item, named in the record's "params"). Drafters saved before that field existed keep
# their params in ``params/``; a record without "params" means that directory.
# ----------------------------------------------------------------------------------------------------
DRAFTER_INDEX_FILE = "drafter_config.json"
_DRAFTER_PARAMS_DIR = re.compile(r"^params(-[0-9a-f]{32})?$")
DRAFTER_FORMAT = "ddtree-jax-drafter/1"


def drafter_config_to_dict(cfg) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["target_layer_ids"] = list(cfg.target_layer_ids)
    return out


def drafter_config_from_dict(raw: dict[str, Any]):
    from ddtree_jax.drafter import DrafterConfig

    raw = dict(raw)
    _refuse_unknown_fields(DrafterConfig, raw, "drafter")
    raw["rope"] = _nested_config(RopeConfig, raw.get("rope"), "drafter RoPE")
    raw["target_layer_ids"] = tuple(raw["target_layer_ids"])
    return DrafterConfig(**raw)


def is_drafter_checkpoint(path: str) -> bool:
    return os.path.exists(os.path.join(path, DRAFTER_INDEX_FILE))


def save_drafter(drafter, path: str, metadata: dict[str, Any] | None = None, *,
                 storage_dtype: str | None = None) -> None:
    """Saves a drafter atomically, as ``save_model`` does: writes the params (float ones rounded to
    ``storage_dtype`` if given; ``restore_drafter`` casts back to the config dtype) into a fresh
    ``params-<hex>/``, commits by atomically replacing ``drafter_config.json``, then deletes older params
    dirs. A save that fails or is killed before the commit leaves the previous drafter restorable."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: exists and is not a directory")
    _check_storage_dtype(storage_dtype)
    names = {".".join(str(p) for p in k): v.get_value() for k, v in nnx.state(drafter).flat_state()}
    flat = {name: np.asarray(_stored(name, value, storage_dtype)) for name, value in names.items()}
    os.makedirs(path, exist_ok=True)
    if storage_dtype is not None:
        metadata = dict(metadata or {}, storage_dtype=str(jnp.dtype(storage_dtype)))
    index = {"format": DRAFTER_FORMAT, "config": drafter_config_to_dict(drafter.cfg), "metadata": metadata or {},
             "params": f"params-{uuid.uuid4().hex}"}
    json.dumps(index)  # fail early on metadata that JSON cannot store
    params_dir = os.path.abspath(os.path.join(path, index["params"]))
    try:
        _save_drafter_params(params_dir, flat)
        _write_json_atomic(os.path.join(path, DRAFTER_INDEX_FILE), index)
    except BaseException:
        shutil.rmtree(params_dir, ignore_errors=True)
        raise
    for entry in os.listdir(path):
        if _DRAFTER_PARAMS_DIR.match(entry) and entry != index["params"]:
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def _save_drafter_params(params_dir: str, flat: dict[str, np.ndarray]) -> None:
    """The Orbax write of ``save_drafter`` (a seam for tests that interrupt a save)."""
    ckpt = ocp.StandardCheckpointer()
    try:
        ckpt.save(params_dir, flat)
        ckpt.wait_until_finished()
    finally:
        ckpt.close()


def restore_drafter(path: str, dtype: str | None = None, mesh: Mesh | None = None,
                    rules: ShardingRules | None = None):
    """Restores a drafter saved by ``save_drafter`` (optionally cast to ``dtype``, sharded on ``mesh``)."""
    from ddtree_jax.drafter import DFlashDrafter
    from ddtree_jax.hf_loader import ShapeOnlyRngs

    index = _read_json_index(path, DRAFTER_INDEX_FILE, DRAFTER_FORMAT, "drafter checkpoint", {"config": dict})
    params_name = index.get("params", "params")  # absent: the layout before atomic saves
    if not isinstance(params_name, str) or not _DRAFTER_PARAMS_DIR.match(params_name):
        raise CheckpointError(f"{path}: {DRAFTER_INDEX_FILE} names params dir {params_name!r}, expected "
                              f"'params' or 'params-<32 hex digits>'")
    params_dir = os.path.abspath(os.path.join(path, params_name))
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{path}: params directory {params_dir} is missing")
    cfg = drafter_config_from_dict(index["config"])
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(cfg, ShapeOnlyRngs())))
    flat_abstract = {tuple(k): v for k, v in abstract.flat_state()}
    names = {k: ".".join(str(p) for p in k) for k in flat_abstract}
    # restore in the stored dtype (whatever it was), cast afterwards
    ckpt = ocp.StandardCheckpointer()
    meta = ckpt.metadata(params_dir)
    stored = getattr(meta, "item_metadata", meta)
    stored = getattr(stored, "tree", stored)
    missing = [n for n in names.values() if n not in stored]
    if missing:
        ckpt.close()
        raise CheckpointError(f"{path}: drafter checkpoint lacks {missing[:3]}")
    like = {n: jax.ShapeDtypeStruct(tuple(stored[n].shape), stored[n].dtype) for n in names.values()}
    restored = ckpt.restore(params_dir, like)
    ckpt.close()
    placed = {}
    for key, variable in flat_abstract.items():
        want = variable.get_value()
        value = np.asarray(restored[names[key]])
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: {names[key]} has shape {value.shape}, config needs {want.shape}")
        with np.errstate(over="ignore"):  # float16's overflow, refused below
            value = value.astype(want.dtype)
        _refuse_float16_overflow(path, names[key], value, restored[names[key]].dtype)
        if mesh is not None:
            value = jax.device_put(value, named_sharding(mesh, rules or DEFAULT_RULES,
                                                         variable.get_metadata()["logical_axes"]))
        placed[key] = variable.replace(jax.numpy.asarray(value))
    return nnx.merge(graphdef, nnx.State.from_flat_path(placed))

"""Logical axes -> mesh axes: the one table that decides where every array lives.

Code names dimensions by logical axis ("experts", "heads", "batch", ...). Only this module knows mesh
axis names. The default 8-GPU layout is one ``model`` axis of size 8 that serves both as the
expert-parallel axis (routed experts split 384/8 = 48 per GPU) and as the tensor-parallel axis of
attention heads, dense FFN width and vocabulary; a ``data`` axis splits streams.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")

# Logical axis names used in parameter / cache declarations.
LOGICAL_AXES = (
    "batch",  # streams
    "seq",  # cache slots / sequence
    "embed",  # model width D
    "vocab",  # W
    "heads",  # attention heads H
    "q_lora",  # Q
    "kv_lora",  # L (+R): the latent width
    "head_dim",  # N / R / V
    "ffn",  # dense / shared-expert FFN width
    "experts",  # E
    "router",  # E of the router's weights and bias: replicated by DEFAULT_RULES (see there)
    "expert_ffn",  # F inside one routed expert
    "layers",
)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Maps each logical axis to a mesh axis (or None = replicated)."""

    rules: tuple[tuple[str, str | None], ...]

    def __post_init__(self):
        names = [name for name, _ in self.rules]
        unknown = set(names) - set(LOGICAL_AXES)
        if unknown:
            raise ValueError(f"unknown logical axes {sorted(unknown)}; known: {LOGICAL_AXES}")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:  # only the first would ever be read
            raise ValueError(f"logical axes {repeated} are given more than one rule")
        for _, mesh_axis in self.rules:
            if mesh_axis is not None and mesh_axis not in MESH_AXES:
                raise ValueError(f"unknown mesh axis {mesh_axis!r}; known: {MESH_AXES}")

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        for name, mesh_axis in self.rules:
            if name == logical:
                return mesh_axis
        if logical not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {logical!r}")
        return None

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for an array whose dims carry ``logical_axes``; a mesh axis is used once."""
        physical = [self.mesh_axis(a) for a in logical_axes]
        seen = set()
        for i, axis in enumerate(physical):
            if axis is None:
                continue
            if axis in seen:
                raise ValueError(f"mesh axis {axis!r} used twice by logical axes {tuple(logical_axes)}")
            seen.add(axis)
        return PartitionSpec(*physical)


# "router" stays replicated: every device routes every token (expert parallelism needs each token's
# top-k everywhere). Sharding the router's E over "model" made XLA pick the top-k across devices, four
# collectives per MoE layer (two all-to-alls, an all-gather and an all-reduce in the HLO on 2 fake CPU
# devices, session 10) to save 11 MB of f32 reads a layer; on two H200s those NCCL kernels took 42 us per
# device per layer at one token.
DEFAULT_RULES = ShardingRules(
    rules=(
        ("batch", "data"),
        ("experts", "model"),
        ("heads", "model"),
        ("ffn", "model"),
        ("vocab", "model"),
    )
)


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh; ``model`` defaults to all devices not used by ``data``."""
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("data", data), ("model", model)):
        if size is not None and not (isinstance(size, (int, np.integer)) and size >= 1):
            raise ValueError(f"mesh axis {name} must be an int >= 1, got {size!r}")
    if model is None:
        if len(devices) % data:
            raise ValueError(f"{len(devices)} devices do not split into data={data}")
        model = len(devices) // data
    if data * model > len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices, have {len(devices)}")
    grid = np.array(devices[: data * model]).reshape(data, model)
    return Mesh(grid, MESH_AXES)


def named_sharding(mesh: Mesh, rules: ShardingRules, logical_axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, rules.spec(logical_axes))


def param_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules):
    """NamedSharding for every leaf of an ``nnx.State``, from each Param's ``logical_axes``."""
    def one(variable):
        axes = variable.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"parameter without logical_axes metadata: {variable}")
        return variable.replace(jax.tree.map(lambda leaf: named_sharding(mesh, rules, axes), variable.get_value()))
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(x, sharding):
    """``x`` on ``sharding``: an array is put there (``jax.device_put``); an abstract one (``jax.ShapeDtypeStruct``,
    for lowering ahead of time without the arrays) gets the sharding attached."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, sharding)


def shard_state(state: nnx.State, mesh: Mesh | None, rules: ShardingRules | None) -> nnx.State:
    """Places a state on the mesh by its logical axes (no-op without a mesh); an abstract state (ShapeDtypeStruct
    leaves, e.g. ``nnx.eval_shape``'s) gets its shardings attached (``place``)."""
    if mesh is None:
        return state
    return jax.tree.map(place, state, param_shardings(state, mesh, rules or DEFAULT_RULES))

"""Bytes per device from abstract shapes only: weights, latent cache and drafter, for a mesh.

Nothing is allocated: parameter shapes come from ``nnx.eval_shape`` of the modules, and the bytes a
device holds come from each array's logical axes mapped through the sharding rules onto a mesh *shape*
(no devices needed), exactly as ``ddtree_jax.sharding`` would place them. A dimension split n ways
holds ceil(dim / n) per device (the largest shard).

Cache sizes are per token of one stream: the target's latent cache is NL x C values (C = L + R = 576
for K2.6) and the drafter's K/V cache is NLd x 2 x KVH x hd values, both in the activation dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.cache import CACHE_AXES
from ddtree_jax.config import ModelConfig
from ddtree_jax.quant import QuantArray
from ddtree_jax.sharding import DEFAULT_RULES, MESH_AXES, ShardingRules
from pallas_kernels.int4_moe import PlanarInt4
from pallas_kernels.int4_tiles import TiledInt4

CATEGORIES = ("experts_int4", "expert_scales", "attention", "mlp", "router", "embed_head", "norms")


def parse_mesh(text: str) -> dict[str, int]:
    """"DxM" (e.g. "1x8") -> {"data": D, "model": M}."""
    try:
        sizes = [int(x) for x in text.lower().split("x")]
    except ValueError:
        sizes = []
    if len(sizes) != len(MESH_AXES) or min(sizes) < 1:
        raise ValueError(f"mesh {text!r} must look like 'DATAxMODEL', e.g. '1x8'")
    return dict(zip(MESH_AXES, sizes))


def shard_shape(shape: Sequence[int], logical_axes: Sequence[str | None], mesh_shape: dict[str, int],
                rules: ShardingRules, *, exact: bool = False) -> tuple[int, ...]:
    """The shape of the largest shard of an array [shape] with ``logical_axes`` on a mesh of ``mesh_shape``; with
    ``exact`` a ValueError where a mesh axis does not divide its dimension (no uneven shards)."""
    spec = tuple(rules.spec(logical_axes)) + (None,) * len(shape)
    local = []
    for d, axis in zip(shape, spec):
        n = 1 if axis is None else mesh_shape[axis]
        if exact and d % n:
            raise ValueError(f"mesh axis {axis!r} of size {n} does not divide dimension {d} of shape {tuple(shape)} "
                             f"(logical axes {tuple(logical_axes)})")
        local.append(math.ceil(d / n))
    return tuple(local)


def bytes_per_device(shape: Sequence[int], dtype, logical_axes: Sequence[str | None], mesh_shape: dict[str, int],
                     rules: ShardingRules, *, exact: bool = False) -> int:
    """Bytes of the largest shard of an array [shape] with ``logical_axes`` on a mesh of ``mesh_shape`` (``exact``:
    as ``shard_shape``)."""
    return array_bytes(shard_shape(shape, logical_axes, mesh_shape, rules, exact=exact), dtype)


def array_bytes(shape: Sequence[int], dtype) -> int:
    """Bytes of a dense array, sub-byte dtypes (int4: two values per byte) included."""
    return int(np.prod(shape, dtype=np.int64)) * jax.dtypes.itemsize_bits(dtype) // 8


def _category(path: tuple, value) -> str:
    names = [str(p) for p in path]
    if names[-1] in ("embed", "lm_head"):
        return "embed_head"
    if names[-1] == "weight":  # RMSNorm weights (input_norm, post_norm, q_a_norm, final norm, ...)
        return "norms"
    if "attn" in names:
        return "attention"
    if names[-1] in ("router", "router_bias"):
        return "router"
    return "mlp"


def param_bytes(state: nnx.State, mesh_shape: dict[str, int], rules: ShardingRules) -> dict[str, dict[str, int]]:
    """{category: {"total": bytes, "per_device": bytes}} of an abstract (or real) ``nnx.State``.

    INT4 QuantArray (or kernel-layout PlanarInt4) leaves count as "experts_int4" (packed words) and "expert_scales";
    the rest is split by module kind (attention, mlp = dense and shared-expert FFNs and float routed experts,
    router, embed_head, norms).
    """
    out = {c: {"total": 0, "per_device": 0} for c in CATEGORIES}
    for path, variable in state.flat_state():
        axes = variable.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"parameter {path} has no logical_axes")
        value = variable.get_value()
        if isinstance(value, (QuantArray, PlanarInt4, TiledInt4)):
            parts = [("experts_int4", value.packed), ("expert_scales", value.scale)]
        else:
            parts = [(_category(tuple(path), value), value)]
        for cat, leaf in parts:
            out[cat]["total"] += array_bytes(leaf.shape, leaf.dtype)
            out[cat]["per_device"] += bytes_per_device(leaf.shape, leaf.dtype, axes, mesh_shape, rules, exact=True)
    return out


def target_cache_arrays(cfg: ModelConfig, dtype=None) -> tuple:
    """The target's latent cache for one token of one stream: ((copies, shape [NL, B=1, S=1, C], dtype, logical
    axes),), the form ``MemoryPlan.target_cache`` holds."""
    return ((1, (cfg.num_layers, 1, 1, cfg.latent_dim), jnp.dtype(dtype or cfg.dtype).name, CACHE_AXES),)


def cache_arrays_bytes(arrays: tuple, mesh_shape: dict[str, int], rules: ShardingRules, *, streams: int = 1,
                       capacity: int = 1, exact: bool = True) -> dict[str, int]:
    """{total, per_device} bytes of cache ``arrays`` ((copies, one-token shape, dtype, logical axes) each) grown to
    ``streams`` streams of ``capacity`` tokens; per_device is the largest shard, as ``rules`` place "batch" and
    "seq" (``exact``: a ValueError where a mesh axis does not divide a dimension, as JAX refuses to place it; off
    for a rate per token of one stream)."""
    out = {"total": 0, "per_device": 0}
    for copies, one_token, dtype, axes in arrays:
        shape = [streams if a == "batch" else capacity if a == "seq" else d for d, a in zip(one_token, axes)]
        out["total"] += copies * array_bytes(shape, dtype)
        out["per_device"] += copies * bytes_per_device(shape, dtype, axes, mesh_shape, rules, exact=exact)
    return out


def drafter_plan(drafter_cfg, mesh_shape: dict[str, int], rules: ShardingRules) -> dict[str, Any]:
    """Drafter weights (from ``DFlashDrafter`` abstractly) and its K/V cache arrays for one token of one stream."""
    from ddtree_jax.drafter import DRAFT_CACHE_AXES, DFlashDrafter
    from ddtree_jax.hf_loader import ShapeOnlyRngs

    abstract = nnx.eval_shape(lambda: DFlashDrafter(drafter_cfg, ShapeOnlyRngs()))
    one = (drafter_cfg.num_layers, 1, 1, drafter_cfg.num_kv_heads, drafter_cfg.head_dim)  # k or v of one token
    return {"weights": param_bytes(nnx.state(abstract), mesh_shape, rules),
            "cache_arrays": ((2, one, jnp.dtype(drafter_cfg.dtype).name, DRAFT_CACHE_AXES),)}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes for one mesh: ``weights`` / ``drafter_weights`` {category: {total, per_device}}; the caches as
    arrays for one token of one stream (``target_cache`` / ``drafter_cache``: (copies, shape, dtype, logical
    axes) each, "batch" and "seq" dims of size 1), placed by ``rules``."""

    mesh_shape: dict
    weights: dict
    target_cache: tuple
    drafter_weights: dict | None = None
    drafter_cache: tuple = ()
    rules: ShardingRules = DEFAULT_RULES

    @property
    def cache_per_token(self) -> dict[str, int]:
        """The target's cache for one token of one stream: {total, per_device}."""
        return cache_arrays_bytes(self.target_cache, self.mesh_shape, self.rules, exact=False)

    @property
    def drafter_cache_per_token(self) -> dict[str, int] | None:
        """The drafter's K/V cache for one token of one stream, or None without a drafter."""
        return (cache_arrays_bytes(self.drafter_cache, self.mesh_shape, self.rules, exact=False)
                if self.drafter_cache else None)

    def weight_bytes(self, key: str = "per_device") -> int:
        total = sum(v[key] for v in self.weights.values())
        if self.drafter_weights:
            total += sum(v[key] for v in self.drafter_weights.values())
        return total

    def cache_bytes(self, capacity: int, streams: int, key: str = "per_device") -> int:
        """Target + drafter caches of ``streams`` streams of ``capacity`` tokens: in all ("total") or on the
        device holding the largest shard ("per_device"), split as ``rules`` place "batch" and "seq"."""
        return cache_arrays_bytes(self.target_cache + self.drafter_cache, self.mesh_shape, self.rules,
                                  streams=streams, capacity=capacity)[key]


def plan_memory(cfg: ModelConfig, mesh_shape: dict[str, int], rules: ShardingRules = DEFAULT_RULES,
                drafter_cfg=None) -> MemoryPlan:
    """The MemoryPlan of a target config (and optionally a drafter) on a mesh shape; allocates nothing."""
    from ddtree_jax.hf_loader import abstract_model

    _, abstract = abstract_model(cfg)
    plan = MemoryPlan(mesh_shape=dict(mesh_shape), weights=param_bytes(abstract, mesh_shape, rules),
                      target_cache=target_cache_arrays(cfg), rules=rules)
    if drafter_cfg is not None:
        d = drafter_plan(drafter_cfg, mesh_shape, rules)
        plan = dataclasses.replace(plan, drafter_weights=d["weights"], drafter_cache=d["cache_arrays"])
    return plan


def held_bytes_per_device(tree) -> dict:
    """{device: bytes of the shards of ``tree``'s arrays it holds}, sub-byte dtypes counted as ``array_bytes``
    does: what ``plan_memory``'s per-device figures predict."""
    held = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + array_bytes(shard.data.shape, leaf.dtype)
    return held


def state_bytes(state: nnx.State) -> int:
    """Actual bytes of a state's arrays (all leaves, QuantArray parts included)."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(state)))

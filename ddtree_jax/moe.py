"""Mixture of experts: the noaux_tc router and the routed-expert computation behind one function.

Shapes: M tokens, D model width, E routed experts, K experts per token, F expert FFN width,
G number of router groups.

Routed expert weights keep the PyTorch [out, in] orientation of the checkpoint, stacked over experts:
  w13 [E, 2F, D] (gate rows first, then up), w2 [E, D, F]
either as float arrays or as ``QuantArray`` (compressed-tensors INT4, ``ddtree_jax.quant``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from ddtree_jax.config import ModelConfig
from ddtree_jax.layers import SwiGLU, declare
from ddtree_jax.quant import QuantArray, expert_slice, quantize_array
from ddtree_jax.sharding import ShardingRules


def route(x: jax.Array, router_weight: jax.Array, bias: jax.Array, cfg: ModelConfig):
    """Exactly the HF DeepseekV3 noaux_tc gate.

    x [M, D]; router_weight [E, D] f32; bias [E] f32 (used for selection only).
    Returns expert_ids [M, K] int32 and expert_weights [M, K] f32 (normalised, times the scaling factor).
    """
    logits = jnp.einsum("md,ed->me", x.astype(jnp.float32), router_weight.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        m = choice.shape[0]
        grouped = choice.reshape(m, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [M, G]
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(m)[:, None], top_groups].set(True)
        expert_mask = jnp.repeat(group_mask, cfg.n_routed_experts // cfg.n_group, axis=1)
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    _, expert_ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return expert_ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def routed_experts_xla(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, w13, w2,
                       *, expert_offset: int | jax.Array = 0) -> jax.Array:
    """Routed-expert sum in plain XLA, touching only the active experts.

    x [M, D]; expert_ids [M, K] (global ids); expert_weights [M, K] f32; w13 [El, 2F, D], w2 [El, D, F]
    hold experts ``expert_offset .. expert_offset + El`` (El = E on one device, E/n under expert
    parallelism). Loops (lax.scan) over at most min(El, M*K) active expert slots; each slot reads
    its expert's weights once (INT4 experts are dequantised one expert at a time) and applies it to
    the tokens routed there. Returns y [M, D] in f32.
    """
    m, k = expert_ids.shape
    num_local = w13.shape[0]
    local_ids = expert_ids - expert_offset
    is_local = (local_ids >= 0) & (local_ids < num_local)
    local_ids = jnp.where(is_local, local_ids, -1)
    slots = min(num_local, m * k)
    active = jnp.unique(local_ids.reshape(-1), size=slots + 1, fill_value=-1)
    active = jnp.sort(active)[-slots:]  # drop one -1 (present when any id is non-local) or pad
    # combine[m, a] = routing weight of token m for the expert in slot a (0 when not routed there)
    hit = (local_ids[:, :, None] == active[None, None, :]) & (active[None, None, :] >= 0)
    combine = jnp.einsum("mka,mk->ma", hit.astype(jnp.float32), expert_weights.astype(jnp.float32))
    f = w2.shape[-1]

    def one_expert(y, slot):
        e, weight_col = slot

        def compute(y):
            w13_e = expert_slice(w13, e, x.dtype)  # [2F, D]
            w2_e = expert_slice(w2, e, x.dtype)  # [D, F]
            h = jnp.einsum("md,fd->mf", x, w13_e, preferred_element_type=jnp.float32)
            act = (jax.nn.silu(h[:, :f]) * h[:, f:]).astype(x.dtype)
            out = jnp.einsum("mf,df->md", act, w2_e, preferred_element_type=jnp.float32)
            return y + out * weight_col[:, None]

        return jax.lax.cond(e >= 0, compute, lambda y: y, y), None

    y0 = jnp.zeros(x.shape, jnp.float32)
    y, _ = jax.lax.scan(one_expert, y0, (active, combine.T))
    return y


class MoE(nnx.Module):
    """Router + routed experts + shared expert(s)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = declare(rngs, (e, d), ("experts", "embed"), jnp.float32)
        self.router_bias = declare(None, (e,), ("experts",), jnp.float32, init="zeros")
        self.w13 = declare(rngs, (e, 2 * f, d), ("experts", "expert_ffn", "embed"), dtype)
        self.w2 = declare(rngs, (e, d, f), ("experts", "embed", "expert_ffn"), dtype)
        if cfg.quant is not None:  # INT4 experts: the same declaration, quantized
            self.w13 = nnx.Param(quantize_array(self.w13.get_value(), cfg.quant.group_size), logical_axes=self.w13.logical_axes)
            self.w2 = nnx.Param(quantize_array(self.w2.get_value(), cfg.quant.group_size), logical_axes=self.w2.logical_axes)
        self.shared = SwiGLU(d, cfg.shared_intermediate_size, dtype, rngs) if cfg.n_shared_experts else None
        self.cfg = cfg

    def __call__(self, x: jax.Array, *, mesh: Mesh | None = None, rules: ShardingRules | None = None,
                 routed_fn: Callable | None = None) -> jax.Array:
        """x [..., D] -> [..., D]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = route(flat, self.router.get_value(), self.router_bias.get_value(), self.cfg)
        y = routed_experts(flat, ids, weights, self.w13.get_value(), self.w2.get_value(), mesh=mesh, rules=rules,
                           routed_fn=routed_fn).astype(x.dtype)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.reshape(shape)


def routed_experts(x, expert_ids, expert_weights, w13, w2, *, mesh: Mesh | None = None,
                   rules: ShardingRules | None = None, routed_fn: Callable | None = None) -> jax.Array:
    """The one entry point for routed-expert compute. Returns y [M, D] f32.

    Without a mesh (or with the experts axis unsharded) it runs ``routed_fn`` (default: the XLA
    path) on all experts. With experts sharded over a mesh axis it runs expert-parallel under
    shard_map: tokens and routing are replicated, each device computes its own experts' share,
    and one psum over the expert axis (M x D f32 per device) adds the shares.
    """
    routed_fn = routed_fn or routed_experts_xla
    axis = None if mesh is None or rules is None else rules.mesh_axis("experts")
    if axis is None or mesh.shape[axis] == 1:
        return routed_fn(x, expert_ids, expert_weights, w13, w2)
    n = mesh.shape[axis]
    num_experts = w13.shape[0]
    if num_experts % n:
        raise ValueError(f"{num_experts} experts do not split over mesh axis {axis!r} of size {n}")
    local = num_experts // n
    expert_spec = jax.tree.map(lambda _: PartitionSpec(axis), w13)
    expert_spec2 = jax.tree.map(lambda _: PartitionSpec(axis), w2)

    def shard_body(x, ids, weights, w13_local, w2_local):
        offset = jax.lax.axis_index(axis) * local
        y = routed_fn(x, ids, weights, w13_local, w2_local, expert_offset=offset)
        return jax.lax.psum(y, axis)

    return jax.shard_map(
        shard_body, mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(), expert_spec, expert_spec2),
        out_specs=PartitionSpec(), check_vma=False,
    )(x, expert_ids, expert_weights, w13, w2)


__all__ = ["MoE", "route", "routed_experts", "routed_experts_xla", "QuantArray"]

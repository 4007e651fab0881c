"""Mixture of experts: the noaux_tc router and the routed-expert computation behind one function.

Shapes: M tokens, D model width, E routed experts, K experts per token, F expert FFN width,
G number of router groups.

Routed expert weights keep the PyTorch [out, in] orientation of the checkpoint, stacked over experts:
  w13 [E, 2F, D] (gate rows first, then up), w2 [E, D, F]
either as float arrays, as ``QuantArray`` (compressed-tensors INT4, ``ddtree_jax.quant``), or, after the
one-time ``prepare_for_kernels(model)``, in a GPU kernel's layout: ``TiledInt4`` (default, the Mosaic GPU
kernel, ``pallas_kernels.int4_moe_mgpu``) or ``PlanarInt4`` (the Pallas-Triton kernel,
``pallas_kernels.int4_moe``). The routed-expert compute follows the leaf type unless a Runtime names one:
float / QuantArray -> ``routed_experts_xla``; TiledInt4 -> ``routed_experts_tiled``; PlanarInt4 ->
``routed_experts_int4`` (each: the kernel when lowered for CUDA with bf16 activations, its pure-JAX twin
elsewhere).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from ddtree_jax.config import ModelConfig
from ddtree_jax.layers import SwiGLU, declare, swiglu
from ddtree_jax.quant import QuantArray, expert_slice, quantize_array
from ddtree_jax.sharding import ShardingRules
from ddtree_jax.topk import top_k
from pallas_kernels import int4_moe as int4_kernel
from pallas_kernels import int4_moe_mgpu as tiled_kernel
from pallas_kernels.int4_moe import Int4ExpertWeights, PlanarInt4, kernel_tiling_error
from pallas_kernels.int4_tiles import FRAG_ROWS, TiledInt4

W13_AXES = ("experts", "expert_ffn", "embed")  # w13 [E, 2F, D] (QuantArray: packed [E, 2F, D/8], scale [E, 2F, D/G])
W2_AXES = ("experts", "embed", "expert_ffn")  # w2 [E, D, F]
# Kernel-layout stacks (PlanarInt4: packed [E, O, I/8], scale [E, I/G, O]; TiledInt4: packed [E, O/R, ., .],
# scale [E, O/R, I/G, R]) share only the leading expert axis.
KERNEL_AXES = ("experts", None, None)
KERNEL_LAYOUTS = {"tiles": TiledInt4, "planar": PlanarInt4}


def route(x: jax.Array, router_weight: jax.Array, bias: jax.Array, cfg: ModelConfig, top_k_method: str = "auto"):
    """Exactly the HF DeepseekV3 noaux_tc gate.

    x [M, D]; router_weight [E, D] (``cfg.router_dtype``); bias [E] f32 (used for selection only). top_k_method:
    one of ``ddtree_jax.topk.METHODS`` (the same experts either way; "auto" compares up to 16 tokens).
    Returns expert_ids [M, K] int32 and expert_weights [M, K] f32 (normalised, times the scaling factor).

    The reference takes the logits in f32 from upcast operands. With x and the weight both bf16 or both
    f16, every product is exact in f32 (8 or 11 significant bits each, 24 in f32), so a 16-bit dot that
    accumulates in f32 sums the same products, in another order; on the GPU it runs on the tensor cores
    (9.6 against 22.3 µs at K2.6's router and 33 tokens on the H200, where the f32 dot is an FFMA GEMM).
    """
    if x.dtype == router_weight.dtype and x.dtype in (jnp.bfloat16, jnp.float16):
        logits = jnp.einsum("md,ed->me", x, router_weight, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("md,ed->me", x.astype(jnp.float32), router_weight.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        m = choice.shape[0]
        grouped = choice.reshape(m * cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = top_k(grouped, 2, top_k_method)[0].sum(-1).reshape(m, cfg.n_group)  # [M, G]
        _, top_groups = top_k(group_scores, cfg.topk_group, top_k_method)
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(m)[:, None], top_groups].set(True)
        expert_mask = jnp.repeat(group_mask, cfg.n_routed_experts // cfg.n_group, axis=1)
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    _, expert_ids = top_k(choice, cfg.num_experts_per_tok, top_k_method)
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return expert_ids, weights * cfg.routed_scaling_factor


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


def routed_experts_int4(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, w13: PlanarInt4,
                        w2: PlanarInt4, *, expert_offset: int | jax.Array = 0, interpret: bool = False,
                        **tuning) -> jax.Array:
    """Routed-expert sum on kernel-layout INT4 weights (``prepare_for_kernels``); same contract as
    ``routed_experts_xla``.

    x [M, D]; expert_ids [M, K] (global ids); expert_weights f32 [M, K]; w13 / w2 PlanarInt4 stacks of
    experts ``expert_offset .. expert_offset + El`` (pairs routed elsewhere contribute nothing).
    Returns y [M, D] f32. Lowered for CUDA with bf16 activations: the Pallas kernel; on any other
    platform, for f32 activations, or for weights the kernel cannot tile: its pure-JAX twin
    (``pallas_kernels.int4_moe.routed_experts``). ``interpret=True`` runs the kernel through the
    Pallas interpreter on every platform (tests); ``tuning`` goes to ``int4_moe``.
    """
    if not (isinstance(w13, PlanarInt4) and isinstance(w2, PlanarInt4)):
        raise TypeError(f"routed_experts_int4 takes kernel-layout experts (PlanarInt4), got {type(w13).__name__}"
                        f" / {type(w2).__name__}: run ddtree_jax.moe.prepare_for_kernels(model) after loading")
    return int4_kernel.routed_experts(x, expert_ids, expert_weights, Int4ExpertWeights.from_leaves(w13, w2),
                                      expert_offset=expert_offset, out_dtype=jnp.float32, interpret=interpret,
                                      **tuning)


def routed_experts_tiled(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, w13: TiledInt4,
                         w2: TiledInt4, *, expert_offset: int | jax.Array = 0, **tuning) -> jax.Array:
    """Routed-expert sum on tiled INT4 stacks (``prepare_for_kernels(layout="tiles")``); same contract as
    ``routed_experts_xla``. Lowered for CUDA with bf16 activations: the Mosaic GPU kernel (Hopper);
    otherwise its pure-JAX twin (``pallas_kernels.int4_moe_mgpu.routed_experts``)."""
    if not (isinstance(w13, TiledInt4) and isinstance(w2, TiledInt4)):
        raise TypeError(f"routed_experts_tiled takes TiledInt4 stacks, got {type(w13).__name__} / "
                        f"{type(w2).__name__}: run ddtree_jax.moe.prepare_for_kernels(model) after loading")
    return tiled_kernel.routed_experts(x, expert_ids, expert_weights, w13, w2, expert_offset=expert_offset,
                                       out_dtype=jnp.float32, **tuning)


def default_routed_fn(w13, expert_shards: int = 1) -> Callable:
    """The routed-expert compute for a w13 leaf: ``routed_experts_tiled`` for TiledInt4 stacks (told that
    ``expert_shards`` devices share the experts, for its split-K, when more than one),
    ``routed_experts_int4`` for PlanarInt4 stacks, else ``routed_experts_xla``."""
    if isinstance(w13, TiledInt4):
        return routed_experts_tiled if expert_shards == 1 else functools.partial(routed_experts_tiled,
                                                                                 expert_shards=expert_shards)
    return routed_experts_int4 if isinstance(w13, PlanarInt4) else routed_experts_xla


class MoE(nnx.Module):
    """Router + routed experts + shared expert(s)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = declare(rngs, (e, d), ("router", "embed"), jnp.dtype(cfg.router_dtype))
        self.router_bias = declare(None, (e,), ("router",), jnp.float32, init="zeros")
        self.w13 = declare(rngs, (e, 2 * f, d), W13_AXES, dtype)
        self.w2 = declare(rngs, (e, d, f), W2_AXES, dtype)
        if cfg.quant is not None:  # INT4 experts: the same declaration, quantized
            self.w13 = nnx.Param(quantize_array(self.w13.get_value(), cfg.quant.group_size),
                                 logical_axes=self.w13.logical_axes)
            self.w2 = nnx.Param(quantize_array(self.w2.get_value(), cfg.quant.group_size),
                                logical_axes=self.w2.logical_axes)
        self.shared = SwiGLU(d, cfg.shared_intermediate_size, dtype, rngs) if cfg.n_shared_experts else None
        self.cfg = cfg

    def __call__(self, x: jax.Array, *, mesh: Mesh | None = None, rules: ShardingRules | None = None,
                 routed_fn: Callable | None = None) -> jax.Array:
        """x [..., D] -> [..., D]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = route(flat, self.router.get_value(), self.router_bias.get_value(), self.cfg)
        shared = None if self.shared is None else (self.shared.gate.get_value(), self.shared.up.get_value(),
                                                   self.shared.down.get_value())
        # split like the experts, the shared expert's share rides their psum (GSPMD would all-reduce it apart)
        with_experts = shared is not None and shares_experts_axis(shared, mesh, rules)
        y = routed_experts(flat, ids, weights, self.w13.get_value(), self.w2.get_value(), mesh=mesh, rules=rules,
                           routed_fn=routed_fn, shared=shared if with_experts else None).astype(x.dtype)
        if shared is not None and not with_experts:
            y = y + self.shared(flat)
        return y.reshape(shape)


def shares_experts_axis(shared, mesh: Mesh | None, rules: ShardingRules | None) -> bool:
    """Whether the shared expert's FFN width is split over the mesh axis of the routed experts, evenly (the
    default rules: both over "model"), so that ``routed_experts`` can add its share before the one psum."""
    axis = None if mesh is None or rules is None else rules.mesh_axis("experts")
    if axis is None or mesh.shape[axis] == 1 or rules.mesh_axis("ffn") != axis:
        return False
    return shared[0].shape[1] % mesh.shape[axis] == 0


def routed_experts(x, expert_ids, expert_weights, w13, w2, *, mesh: Mesh | None = None,
                   rules: ShardingRules | None = None, routed_fn: Callable | None = None, shared=None) -> jax.Array:
    """The one entry point for routed-expert compute. Returns y [M, D] f32.

    Without a mesh (or with the experts axis unsharded) it runs ``routed_fn`` (default: chosen by the
    weights' type, ``default_routed_fn``) on all experts. With experts sharded over a mesh axis it runs
    expert-parallel under shard_map: tokens and routing are replicated, each device computes its own
    experts' share, and one psum over the expert axis (M x D f32 per device) adds the shares.
    ``shared``: the shared expert's (gate [D, F], up [D, F], down [F, D]), added to y; under the mesh its F
    must split over the experts' axis (``shares_experts_axis``), and each device adds its slice's f32 share
    before the psum.
    """
    axis = None if mesh is None or rules is None else rules.mesh_axis("experts")
    if axis is None or mesh.shape[axis] == 1:
        y = (routed_fn or default_routed_fn(w13))(x, expert_ids, expert_weights, w13, w2)
        return y if shared is None else y + swiglu(x, *shared, out_dtype=jnp.float32)
    if shared is not None and not shares_experts_axis(shared, mesh, rules):
        raise ValueError(f"the shared expert's FFN width ({shared[0].shape[1]}) must split over the experts' mesh "
                         f"axis {axis!r} (rules put 'ffn' on {rules.mesh_axis('ffn')!r}) to share its psum")
    n = mesh.shape[axis]
    routed_fn = routed_fn or default_routed_fn(w13, expert_shards=n)
    num_experts = w13.shape[0]
    if num_experts % n:
        raise ValueError(f"{num_experts} experts do not split over mesh axis {axis!r} of size {n}")
    local = num_experts // n
    expert_spec = jax.tree.map(lambda _: PartitionSpec(axis), w13)
    expert_spec2 = jax.tree.map(lambda _: PartitionSpec(axis), w2)

    def shard_body(x, ids, weights, w13_local, w2_local, *shared_local):
        offset = jax.lax.axis_index(axis) * local
        y = routed_fn(x, ids, weights, w13_local, w2_local, expert_offset=offset)
        if shared_local:
            y = y + swiglu(x, *shared_local, out_dtype=jnp.float32)
        return jax.lax.psum(y, axis)

    shared_specs = () if shared is None else (PartitionSpec(None, axis), PartitionSpec(None, axis),
                                              PartitionSpec(axis, None))
    return jax.shard_map(
        shard_body, mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(), expert_spec, expert_spec2) + shared_specs,
        out_specs=PartitionSpec(), check_vma=False,
    )(x, expert_ids, expert_weights, w13, w2, *(shared or ()))


def _moe_layers(model: nnx.Module):
    for path, module in nnx.iter_modules(model):
        if isinstance(module, MoE):
            yield ".".join(str(p) for p in path), module


def _to_layout(layout: str, w13: QuantArray, w2: QuantArray, fuse_silu: bool | None = False):
    """(w13, w2) in a kernel layout and why the GPU kernel cannot run them (None if it can); raises
    ValueError where the layout cannot hold them at all. fuse_silu None: pair gate/up rows where they can be."""
    if layout == "tiles":
        if fuse_silu is None:
            fuse_silu = w13.shape[1] % (2 * FRAG_ROWS) == 0
        return (TiledInt4.from_compressed_tensors(w13.packed, w13.scale, pair_gate_up=fuse_silu),
                TiledInt4.from_compressed_tensors(w2.packed, w2.scale), None)
    weights = Int4ExpertWeights.from_leaves(
        PlanarInt4.from_compressed_tensors(w13.packed, w13.scale, gate_up=True),
        PlanarInt4.from_compressed_tensors(w2.packed, w2.scale, gate_up=False))
    return (*weights.leaves(), kernel_tiling_error(weights))


def prepare_for_kernels(model: nnx.Module, *, layout: str = "tiles", allow_twin_only: bool = False,
                        fuse_silu: bool | None = None) -> nnx.Module:
    """One-time load-time repack, in place: every MoE layer's INT4 ``w13`` / ``w2`` (QuantArray,
    compressed-tensors) take a GPU kernel's layout; returns ``model``.

        model = prepare_for_kernels(load_hf_model(path))   # or restore_model(...); then Engine(model, ...)

    layout "tiles" (default): ``TiledInt4`` stacks for the Mosaic GPU kernel (``pallas_kernels.int4_moe_mgpu``,
    Hopper: H100/H200); "planar": ``PlanarInt4`` stacks for the Pallas-Triton kernel
    (``pallas_kernels.int4_moe``, any CUDA GPU, slower). From then on the routed experts run the kernel
    when lowered for CUDA (bf16 activations) and the kernel's pure-JAX twin elsewhere: the same
    dequantised weights as the XLA path, equal to f32 rounding (the twin's tiled dots sum in another
    order); ``Runtime(routed_fn=routed_experts_xla)`` on a prepared model reproduces the unprepared
    model bit for bit. The repacked Params carry logical axes ``KERNEL_AXES`` (experts leading), so
    ``shard_state`` / expert parallelism split them as before. Each layer's compressed-tensors arrays
    are dropped as soon as its kernel copy exists (freed unless referenced elsewhere): peak memory is
    the model plus one layer's experts. Build Engines after this call (an Engine keeps the state it was
    given). Layers already in a kernel layout are left as they are. Bit-exact inverse:
    ``unprepare_for_kernels`` (also needed before ``save_model``).

    ``fuse_silu`` ("tiles" only): w13 stored with gate and up rows paired in 64-row blocks, so that the
    gate+up kernel applies SiLU·up in its epilogue wherever it runs without split-K (needs 2F % 256 == 0;
    True raises where a layer's stack does not allow it). Default (None): wherever 2F % 256 == 0, e.g. every
    K2.6 layer (on the H200 1-2 % faster per MoE layer at M >= 9, experiments/results/bench_moe_h200_fuse.json).

    Raises ValueError naming the layer for float (unquantized) experts and for stacks the layout cannot
    hold ("tiles": group 32, bf16 scales, O % 64 == 0, I % 256 == 0); for "planar", also for shapes the
    Triton kernel cannot tile unless ``allow_twin_only`` (those layers then run the twin everywhere).
    """
    if layout not in KERNEL_LAYOUTS:
        raise ValueError(f"unknown kernel layout {layout!r}; expected one of {sorted(KERNEL_LAYOUTS)}")
    if fuse_silu is True and layout != "tiles":
        raise ValueError(f"fuse_silu is a property of the 'tiles' layout, not {layout!r}")
    want = KERNEL_LAYOUTS[layout]
    for name, moe in _moe_layers(model):
        w13, w2 = moe.w13.get_value(), moe.w2.get_value()
        if isinstance(w13, want) and isinstance(w2, want):
            continue
        if isinstance(w13, tuple(KERNEL_LAYOUTS.values())) or isinstance(w2, tuple(KERNEL_LAYOUTS.values())):
            raise ValueError(f"{name}: experts are already in another kernel layout ({type(w13).__name__} / "
                             f"{type(w2).__name__}); call unprepare_for_kernels(model) first to change to {layout!r}")
        for attr, value in (("w13", w13), ("w2", w2)):
            if not isinstance(value, QuantArray):
                raise ValueError(f"{name}: routed experts' {attr} is {type(value).__name__} "
                                 f"({getattr(value, 'dtype', '?')}), not INT4; the INT4 kernels need "
                                 "compressed-tensors experts (a config with quant)")
        try:
            new13, new2, problem = _to_layout(layout, w13, w2, fuse_silu)
        except ValueError as e:
            raise ValueError(f"{name}: experts w13 {w13.shape} / w2 {w2.shape} cannot take the {layout!r} "
                             f"kernel layout: {e}") from e
        if problem and not allow_twin_only:
            raise ValueError(f"{name}: {problem}. Pass allow_twin_only=True to run these experts through the "
                             "kernel's pure-JAX twin on every platform")
        del w13, w2
        moe.w13 = nnx.Param(new13, logical_axes=KERNEL_AXES)
        moe.w2 = nnx.Param(new2, logical_axes=KERNEL_AXES)
    return model


def unprepare_for_kernels(model: nnx.Module) -> nnx.Module:
    """Inverse of ``prepare_for_kernels``, in place and bit-exact: kernel-layout experts back to
    compressed-tensors QuantArrays with their declared logical axes; returns ``model``."""
    for _, moe in _moe_layers(model):
        for attr, axes in (("w13", W13_AXES), ("w2", W2_AXES)):
            value = getattr(moe, attr).get_value()
            if isinstance(value, tuple(KERNEL_LAYOUTS.values())):
                setattr(moe, attr, nnx.Param(QuantArray(*value.to_compressed_tensors()), logical_axes=axes))
    return model


__all__ = ["MoE", "route", "routed_experts", "routed_experts_xla", "routed_experts_int4", "routed_experts_tiled",
           "default_routed_fn", "prepare_for_kernels", "unprepare_for_kernels", "QuantArray", "PlanarInt4",
           "TiledInt4"]

"""Kimi K2.6 text model (DeepSeek-V3 architecture) in Flax NNX.

One forward serves three uses: prefill of padded prompts, one-token decode, and a *tree block*
(T new tokens with arbitrary positions and an arbitrary T x T visibility mask) on top of the
committed latent cache. The forward never writes the cache; it returns the block's latents and the
caller commits the rows it keeps (``ddtree_jax.cache.commit``).

Dimension letters: B streams, T block tokens, S cache capacity, D model, H heads, N nope head dim,
R rope head dim, V value head dim, L kv latent, C = L + R, Q q latent, W vocab, NL layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from ddtree_jax.cache import LatentCache
from ddtree_jax.checks import check_int
from ddtree_jax.config import ModelConfig
from ddtree_jax.layers import RMSNorm, SwiGLU, declare, dot, rms_norm
from ddtree_jax.moe import MoE
from ddtree_jax.rope import apply_rope_interleaved, rope_cos_sin
from ddtree_jax.sharding import DEFAULT_RULES, ShardingRules
from pallas_kernels.mla_kernel_inputs import pad_tree_latents
from pallas_kernels.tree_attention import mla_attention


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Static execution choices of a forward (hashable; part of the jit key)."""

    mesh: Mesh | None = None
    rules: ShardingRules | None = None
    attention: str = "absorbed"  # "absorbed" (latent cache, production) or "naive" (per-head K/V)
    attention_fn: Callable | None = None  # overrides the latent attention (default: mla_attention)
    routed_fn: Callable | None = None  # overrides the routed-expert compute (e.g. the Pallas kernel)
    # JAX matmul precision inside the forward; None leaves the caller's setting. "float32" because NVIDIA
    # GPUs otherwise run f32 matmuls as TF32, whose rounding differs between a one-token step and a tree
    # batch and can flip near-tie greedy tokens (greedy DDTree != AR; seen on an H200). Applied to f32
    # models only (bf16 operands have nothing to round further); no effect on CPU.
    matmul_precision: str | None = "float32"

    def __post_init__(self):
        if self.attention not in ("absorbed", "naive"):
            raise ValueError(f"attention must be 'absorbed' or 'naive', got {self.attention!r}")
        if self.mesh is not None and self.rules is None:
            # the rules every placement on a mesh falls back to; without them the latent attention and the
            # experts would run as one global program rather than per device (correct, but not sharded as placed)
            object.__setattr__(self, "rules", DEFAULT_RULES)


def latent_attention(attend: Callable, runtime: Runtime, q, cache_kv, prefix_len, tree_kv, tree_mask, **kw):
    """``attend`` (the latent attention, e.g. ``mla_attention``) once per device under shard_map when the
    runtime's mesh shards streams ("batch") or heads: each device attends its own streams and heads over
    its streams' latent cache (shared by all heads), so a Pallas kernel sees plain local arrays rather
    than GSPMD gathering its operands around a custom call. An axis whose size does not divide B or H is
    left replicated (same result, less parallel). q [B, T, H, C] -> [B, T, H, L]."""
    mesh, rules = runtime.mesh, runtime.rules
    if mesh is None or rules is None:
        return attend(q, cache_kv, prefix_len, tree_kv, tree_mask, **kw)

    def usable(logical, size):
        axis = rules.mesh_axis(logical)
        return axis if axis is not None and mesh.shape[axis] > 1 and size % mesh.shape[axis] == 0 else None

    b_ax, h_ax = usable("batch", q.shape[0]), usable("heads", q.shape[2])
    if b_ax is None and h_ax is None:
        return attend(q, cache_kv, prefix_len, tree_kv, tree_mask, **kw)
    rows, per_stream = PartitionSpec(b_ax, None, h_ax, None), PartitionSpec(b_ax)
    return jax.shard_map(lambda *a: attend(*a, **kw), mesh=mesh,
                         in_specs=(rows, per_stream, per_stream, per_stream, per_stream),
                         out_specs=rows, check_vma=False)(q, cache_kv, prefix_len, tree_kv, tree_mask)


class MLA(nnx.Module):
    """Multi-head latent attention with q_lora / kv_lora, naive and absorbed forms."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        d, h = cfg.hidden_size, cfg.num_heads
        n, r, v, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_a, self.q_a_norm = None, None
            self.q_b = declare(rngs, (d, h, n + r), ("embed", "heads", "head_dim"), dtype)
        else:
            self.q_a = declare(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), dtype)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dtype, "q_lora")
            self.q_b = declare(rngs, (cfg.q_lora_rank, h, n + r), ("q_lora", "heads", "head_dim"), dtype)
        self.kv_a = declare(rngs, (d, lat + r), ("embed", "kv_lora"), dtype)
        self.kv_a_norm = RMSNorm(lat, cfg.latent_norm_eps, dtype, "kv_lora")
        self.kv_b = declare(rngs, (lat, h, n + v), ("kv_lora", "heads", "head_dim"), dtype)
        self.o = declare(rngs, (h, v, d), ("heads", "head_dim", "embed"), dtype)
        self.cfg = cfg

    def project(self, x, cos, sin):
        """x [B, T, D] -> q_nope [B,T,H,N], q_pe [B,T,H,R] (rotated), latents [B,T,C] (normed + rotated)."""
        cfg = self.cfg
        if self.q_a is None:
            q = dot(x, self.q_b.get_value(), "btd,dhk->bthk")
        else:
            q = dot(self.q_a_norm(dot(x, self.q_a.get_value(), "btd,dq->btq")), self.q_b.get_value(), "btq,qhk->bthk")
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_pe = apply_rope_interleaved(q_pe, cos, sin)
        kv = dot(x, self.kv_a.get_value(), "btd,dc->btc")
        latent = self.kv_a_norm(kv[..., : cfg.kv_lora_rank])
        k_pe = apply_rope_interleaved(kv[..., cfg.kv_lora_rank:], cos, sin)
        return q_nope, q_pe, jnp.concatenate([latent, k_pe], axis=-1)

    def __call__(self, x, cos, sin, cache_kv, prefix_len, tree_mask, runtime: Runtime):
        """x [B,T,D]; cache_kv [B,S,C] of this layer. Returns (out [B,T,D], block latents [B,T,C])."""
        cfg = self.cfg
        q_nope, q_pe, block_kv = self.project(x, cos, sin)
        w_uk = self.kv_b.get_value()[..., : cfg.qk_nope_head_dim]  # [L, H, N]
        w_uv = self.kv_b.get_value()[..., cfg.qk_nope_head_dim:]  # [L, H, V]
        if runtime.attention == "absorbed":
            q_latent = dot(q_nope, w_uk, "bthn,lhn->bthl")
            q_abs = jnp.concatenate([q_latent, q_pe], axis=-1)  # [B,T,H,C]
            attend = runtime.attention_fn or mla_attention  # Pallas kernel on GPU, JAX twin elsewhere
            # the block's latents padded to whole 64-key blocks here, where XLA fuses the padding into the
            # fusion that finishes them, so that the GPU kernels read them in place (no copy of their own)
            o_latent = latent_attention(attend, runtime, q_abs, cache_kv, prefix_len, pad_tree_latents(block_kv),
                                        tree_mask, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank)
            o = dot(o_latent, w_uv, "bthl,lhv->bthv")
        else:  # "naive" (Runtime checks the name)
            o = self._naive_attention(q_nope, q_pe, cache_kv, prefix_len, block_kv, tree_mask, w_uk, w_uv)
        return dot(o, self.o.get_value(), "bthv,hvd->btd"), block_kv

    def _naive_attention(self, q_nope, q_pe, cache_kv, prefix_len, block_kv, tree_mask, w_uk, w_uv):
        """Per-head keys/values expanded from the latents, as the HF reference computes them. Cache rows at or past
        a stream's prefix_len may hold anything (NaN included): zeroed, as a weight of 0 times NaN is NaN."""
        cfg = self.cfg
        s = cache_kv.shape[1]
        cache_kv = jnp.where((jnp.arange(s)[None, :] < prefix_len[:, None])[..., None], cache_kv, 0)
        kv_all = jnp.concatenate([cache_kv, block_kv.astype(cache_kv.dtype)], axis=1)  # [B, S+T, C]
        latent, k_pe = kv_all[..., : cfg.kv_lora_rank], kv_all[..., cfg.kv_lora_rank:]
        k_nope = dot(latent, w_uk, "bsl,lhn->bshn")
        values = dot(latent, w_uv, "bsl,lhv->bshv")
        scores = (dot(q_nope, k_nope, "bthn,bshn->bths").astype(jnp.float32)
                  + jnp.einsum("bthr,bsr->bths", q_pe, k_pe, preferred_element_type=jnp.float32))
        scores = scores * cfg.softmax_scale
        visible_prefix = jnp.arange(s)[None, None, :] < prefix_len[:, None, None]  # [B,1,S]
        visible_prefix = jnp.broadcast_to(visible_prefix, tree_mask.shape[:2] + (s,))
        visible = jnp.concatenate([visible_prefix, tree_mask], axis=-1)  # [B,T,S+T]
        scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(q_nope.dtype)
        return dot(probs, values, "bths,bshv->bthv")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, "embed")
        self.attn = MLA(cfg, rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, "embed")
        if layer_idx < cfg.first_k_dense_replace:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        else:
            self.mlp = MoE(cfg, rngs)

    def __call__(self, x, cos, sin, cache_kv, prefix_len, tree_mask, runtime: Runtime):
        attn_out, block_kv = self.attn(self.input_norm(x), cos, sin, cache_kv, prefix_len, tree_mask, runtime)
        h = x + attn_out
        normed = self.post_norm(h)
        if isinstance(self.mlp, MoE):
            mlp_out = self.mlp(normed, mesh=runtime.mesh, rules=runtime.rules, routed_fn=runtime.routed_fn)
        else:
            mlp_out = self.mlp(normed)
        return h + mlp_out, block_kv


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime"))
def apply_layer(graphdef, state, x, cos, sin, cache_kv, prefix_len, tree_mask, runtime: Runtime):
    """``DecoderLayer.__call__`` as a function of the layer's state, jitted: inside a model's jitted forward the
    layers of one structure (dense, MoE) share one traced and lowered body, which every layer calls with its own
    weights, so a forward of NL layers lowers in the time of two (XLA inlines the calls before it optimises)."""
    return nnx.merge(graphdef, state)(x, cos, sin, cache_kv, prefix_len, tree_mask, runtime)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array  # [B, T, W] f32 ([B, R, W] at the forward's logit_rows)
    block_kv: jax.Array  # [NL, B, T, C]: latents of the block tokens, to commit
    taps: jax.Array | None  # [n_taps, B, T, D]: outputs of the requested layers (pre final norm; FINAL_NORM_TAP after)


class KimiModel(nnx.Module):
    """Embedding, NL decoder layers, final norm, untied lm_head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.embed = declare(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, "embed")
        self.lm_head = declare(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)
        self.cfg = cfg

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: LatentCache, tree_mask: jax.Array,
                 *, tap_layers: Sequence[int] = (), runtime: Runtime = Runtime(),
                 logit_rows: jax.Array | None = None) -> ForwardOutput:
        """A block of T tokens per stream on top of each stream's committed cache.

        tokens, positions [B, T] int32; cache: committed latents (lengths = visible prefix);
        tree_mask [B, T, T] bool (causal for prefill/chains, ancestor-or-self for trees).
        tap_layers: 0-based layer indices whose outputs are returned in ``taps``, before the final norm; the index
        ``num_layers`` (``final_norm_tap``) returns the last layer's output after it, as transformers'
        ``hidden_states[-1]``.
        logit_rows [B, R] int32 in [0, T): the logits only at these rows of each stream ([B, R, W]; a prefill needs
        its last row alone), or None: at every row ([B, T, W]).
        Token ids must lie in [0, W): callers validate on the host (``check_tokens``).
        """
        if runtime.matmul_precision is None or jnp.dtype(self.cfg.dtype) != jnp.float32:
            return self._forward(tokens, positions, cache, tree_mask, tap_layers, runtime, logit_rows)
        with jax.default_matmul_precision(runtime.matmul_precision):
            return self._forward(tokens, positions, cache, tree_mask, tap_layers, runtime, logit_rows)

    def _forward(self, tokens, positions, cache, tree_mask, tap_layers, runtime, logit_rows) -> ForwardOutput:
        cfg = self.cfg
        check_block(cfg, tokens, positions, cache, tree_mask)
        if logit_rows is not None:
            check_int("logit_rows", logit_rows)
            if np.ndim(logit_rows) != 2 or np.shape(logit_rows)[0] != np.shape(tokens)[0]:
                raise ValueError(f"logit_rows must be [B, R] with B = {np.shape(tokens)[0]}, got "
                                 f"{np.shape(logit_rows)}")
        for layer in tap_layers:
            if not 0 <= layer <= cfg.num_layers:
                raise ValueError(f"tap layer {layer} outside [0, {cfg.num_layers}] ({cfg.num_layers}: the last "
                                 "layer's output after the final norm)")
        if len(set(tap_layers)) != len(tap_layers):
            raise ValueError(f"tap_layers {tuple(tap_layers)} names a layer twice")
        x = jnp.take(self.embed.get_value(), tokens, axis=0)
        cos, sin = rope_cos_sin(positions, cfg.rope, cfg.qk_rope_head_dim)
        block_kv, taps = [], []
        for i, layer in enumerate(self.layers):
            x, kv = apply_layer(*nnx.split(layer), x, cos, sin, cache.kv[i], cache.lengths, tree_mask, runtime)
            block_kv.append(kv)
            if i in tap_layers:
                taps.append(x)
        if cfg.num_layers in tap_layers:
            taps.append(self.norm(x))
        if taps:
            taps = jnp.stack([taps[sorted(tap_layers).index(i)] for i in tap_layers])
        else:
            taps = None
        if logit_rows is not None:
            x = jnp.take_along_axis(x, logit_rows[:, :, None], axis=1)  # [B, R, D]
        logits = jnp.einsum("btd,dw->btw", self.norm(x), self.lm_head.get_value().astype(x.dtype),
                            preferred_element_type=jnp.float32)
        return ForwardOutput(logits=logits, block_kv=jnp.stack(block_kv), taps=taps)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed.get_value(), tokens, axis=0)

    def head(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden [..., D] -> logits [..., W] f32 (shared with the drafter)."""
        return jnp.einsum("...d,dw->...w", hidden, self.lm_head.get_value().astype(hidden.dtype),
                          preferred_element_type=jnp.float32)


def check_tokens(tokens, vocab_size: int) -> None:
    """Host-side validation of token ids (jit cannot raise; jnp.take would silently wrap ids in
    [-vocab_size, 0) and give NaN rows for other out-of-range ids)."""
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got min {arr.min()} max {arr.max()}")


def check_block(cfg: ModelConfig, tokens, positions, cache: LatentCache, tree_mask) -> None:
    """Shapes and dtypes of a forward's block (static, so also under jit): tokens and positions [B, T] integers,
    tree_mask [B, T, T] bool, cache kv [NL, B, S, C] and lengths [B]; a ValueError naming the argument otherwise.
    A float position would rotate by a fraction of a step and a float mask would read any nonzero as visible."""
    if np.ndim(tokens) != 2:
        raise ValueError(f"tokens must be [B, T], got shape {np.shape(tokens)}")
    b, t = np.shape(tokens)
    check_int("tokens", tokens)
    check_int("positions", positions, (b, t))
    mask_dtype = tree_mask.dtype if hasattr(tree_mask, "dtype") else np.asarray(tree_mask).dtype
    if np.shape(tree_mask) != (b, t, t) or mask_dtype != np.bool_:
        raise ValueError(f"tree_mask must be [B, T, T]={(b, t, t)} bool, got {np.shape(tree_mask)} {mask_dtype}")
    want_kv = (cfg.num_layers, b, cache.capacity, cfg.latent_dim)
    if cache.kv.shape != want_kv or cache.lengths.shape != (b,):
        raise ValueError(f"cache must hold kv [NL, B, S, C]={want_kv} and lengths [B]=({b},) for this block, got "
                         f"kv {cache.kv.shape} and lengths {cache.lengths.shape}")


def causal_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


__all__ = ["KimiModel", "Runtime", "ForwardOutput", "check_block", "check_tokens", "causal_mask", "latent_attention",
           "rms_norm"]

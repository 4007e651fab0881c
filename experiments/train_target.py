"""Trains a small Kimi-K2-architecture target (MLA + noaux_tc MoE) on the pinned stdlib corpus, then
quantizes its routed experts to INT4 and reports held-out perplexity before and after.

    python experiments/train_target.py --steps 300 --batch 8 --seq 256 --out checkpoints/target
    # the shipped target (one H200, 3 minutes of training; tokens.npz from `data.py tokens`):
    python experiments/train_target.py --tokens tokens.npz --batch 64 --seq 512 --lr 2e-3 --minutes 6 \
        --max-epochs 10 --warmup 100 --eval-every 100 --eval-rows 256 --matmul-precision tensorfloat32 --out DIR
      (held-out NLL bottomed at ~6.7 epochs: use --max-epochs 6)

Outputs in ``--out``: the INT4 model (``ddtree_jax.checkpoint.save_model``: ddtree_checkpoint.json +
data-*/), ``tokenizer.json`` (copied), ``manifest.json`` (exact command, commit, data hash, metrics),
``loss_curve.json`` (+ ``loss_curve.png`` when matplotlib is installed). The resumable training state
(float params + AdamW state + step) lives in ``--state-dir`` (default ``<out>.train_state``; not for the repo).

Training specifics (CPU-friendly, differentiable):
  * attention: ``Runtime(attention="naive")`` (plain masked softmax; the absorbed twin scans the prefix
    in a data-dependent while loop, which reverse-mode AD cannot go through);
  * routed experts (``--experts``): ``dense`` = ``routed_experts_dense`` below, every expert on every
    token, combined with the routing weights (zero for experts not chosen); ``xla`` = the inference
    path ``moe.routed_experts_xla`` (scan over active experts), also differentiable and with the same
    gradients, ~10% faster per step on CPU at E=8 top-2 (dense costs E/K x the routed FLOPs, so prefer
    ``xla`` for larger E). Either way gradients reach the router through the selected experts'
    weights (as DeepSeek-V3), never through the top-k choice.
  * the noaux_tc selection bias is updated without gradients (DeepSeek-V3's load balancing):
    bias_e += rate * sign(mean load - load_e) per MoE layer per step (``--bias-rate``, 0 disables).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax.cache import init_cache  # noqa: E402
from ddtree_jax.config import ConfigError, ModelConfig, QuantConfig, RopeConfig  # noqa: E402
from ddtree_jax.model import KimiModel, Runtime, causal_mask  # noqa: E402
from ddtree_jax.moe import MoE, route  # noqa: E402
from ddtree_jax.quant import QuantArray, quantize_array  # noqa: E402
from experiments import data as data_lib  # noqa: E402
from experiments.bench_util import add_matmul_precision_arg  # noqa: E402

DEFAULT_STEPS = 300
MIN_CLOCK_WARMUP = 13  # StepClock skips 3 warmup steps and times at least 10 more
INFERENCE_EVAL_ROWS = 16  # the shipped inference path's NLL is measured on the first 16 held-out rows
EVAL_ROWS_MIN = INFERENCE_EVAL_ROWS
PROBE_ROWS = 32  # --eval-every's held-out NLL probe


# ----------------------------------------------------------------------------------------------------
# Model config and the training-only forward pieces
# ----------------------------------------------------------------------------------------------------
def small_target_config(vocab_size: int, dtype: str = "float32", **overrides) -> ModelConfig:
    """A ~30M-parameter (~13M active per token) K2.6-shaped config: 4 layers (first dense), width 512,
    MLA with q/kv LoRA (kv latent 128 + rope 32), 16 routed experts top-2 + 1 shared, K2.6's YaRN RoPE;
    EOS = token 0 (<|endoftext|>). ``overrides`` replace any field (``--config``)."""
    base = dict(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, num_layers=4,
        num_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position=4096, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=262144, eos_token_ids=(0,), dtype=dtype,
    )
    base.update(overrides)
    return ModelConfig(**base)


def routed_experts_dense(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, w13, w2, *,
                         expert_offset: int | jax.Array = 0) -> jax.Array:
    """Training path of the routed experts (same signature as ``moe.routed_experts_xla``).

    x [M, D]; expert_ids [M, K]; expert_weights [M, K] f32; w13 [E, 2F, D], w2 [E, D, F] (float or
    QuantArray, dequantised whole). Runs all E experts on all M tokens and combines with
    combine[m, e] = sum_k weights[m, k] * (ids[m, k] == e): differentiable in x, the weights and the
    experts. Cost E/K times the routed FLOPs. Returns y [M, D] f32.
    """
    if isinstance(w13, QuantArray):
        w13 = w13.dequantize(x.dtype)
    if isinstance(w2, QuantArray):
        w2 = w2.dequantize(x.dtype)
    e, f = w13.shape[0], w2.shape[-1]
    onehot = jax.nn.one_hot(expert_ids - expert_offset, e, dtype=jnp.float32)  # [M, K, E]; non-local -> 0
    combine = jnp.einsum("mke,mk->me", onehot, expert_weights.astype(jnp.float32))
    h = jnp.einsum("md,efd->emf", x, w13.astype(x.dtype), preferred_element_type=jnp.float32)
    act = (jax.nn.silu(h[..., :f]) * h[..., f:]).astype(x.dtype)
    out = jnp.einsum("emf,edf->emd", act, w2.astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("emd,me->md", out, combine)


# matmul_precision=None: the trainers' --matmul-precision applies (e.g. TF32 for training on a GPU)
TRAIN_RUNTIME = Runtime(attention="naive", routed_fn=routed_experts_dense, matmul_precision=None)


def lm_forward(model: KimiModel, tokens: jax.Array, runtime: Runtime = TRAIN_RUNTIME, tap_layers=()):
    """Plain causal forward of rows tokens [B, T] at positions 0..T-1 (a 1-slot empty cache)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = init_cache(model.cfg, b, 1)
    return model(tokens, positions, cache, causal_mask(b, t), tap_layers=tap_layers, runtime=runtime)


def token_nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """logits [B, T, W] f32, labels [B, T] -> per-token negative log-likelihood [B, T] f32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def expert_load(model: KimiModel, tokens: jax.Array, runtime: Runtime = TRAIN_RUNTIME) -> jax.Array:
    """Fraction of routed slots per expert in each MoE layer for rows tokens [B, T] -> [num_moe, E]
    (one more forward, layer by layer, reading the router's choice)."""
    from ddtree_jax.rope import rope_cos_sin

    cfg = model.cfg
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_cos_sin(positions, cfg.rope, cfg.qk_rope_head_dim)
    cache, mask = init_cache(cfg, b, 1), causal_mask(b, t)
    x = model.embed_tokens(tokens)
    loads = []
    for i, layer in enumerate(model.layers):
        attn, _ = layer.attn(layer.input_norm(x), cos, sin, cache.kv[i], cache.lengths, mask, runtime)
        h = x + attn
        normed = layer.post_norm(h)
        if isinstance(layer.mlp, MoE):
            ids, _ = route(normed.reshape(-1, cfg.hidden_size), layer.mlp.router.value,
                           layer.mlp.router_bias.value, cfg)
            loads.append(jax.nn.one_hot(ids, cfg.n_routed_experts).sum((0, 1)) / ids.size)
            x = h + layer.mlp(normed, routed_fn=runtime.routed_fn)
        else:
            x = h + layer.mlp(normed)
    return jnp.stack(loads)


# ----------------------------------------------------------------------------------------------------
# Optimizer and one step
# ----------------------------------------------------------------------------------------------------
def make_optimizer(weight_decay: float = 0.1, clip: float = 1.0):
    """AdamW (b2 0.95) with unit learning rate, global-norm clipping, weight decay only on matrices
    (ndim >= 2). The step functions multiply its updates by the step's learning rate, which the host
    reads from ``lr_schedule``: identical to optax.adamw(schedule) (decoupled decay is scaled by the
    rate too), but the schedule's length can be fixed after training has started (``--minutes``)."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))


def lr_schedule(steps: int, lr: float, warmup: int):
    """Linear warmup over ``warmup`` steps (0: none, step 0 at ``lr``), then cosine decay to lr/10 at ``steps``.
    The warmup part does not depend on ``steps``."""
    if warmup == 0:
        return optax.cosine_decay_schedule(lr, max(steps, 1), alpha=0.1)
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)


def scaled_update(tx, grads, opt_state, params, lr):
    """One optimizer update with learning rate ``lr`` (a traced scalar); returns (params, opt_state)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: (lr * u).astype(u.dtype), updates)
    return optax.apply_updates(params, updates), opt_state


def _is_router_bias(path) -> bool:
    return any(getattr(k, "key", None) == "router_bias" for k in path)


def float32_master(params):
    """(float32 copies of ``params``' float leaves, each leaf's own dtype). Training updates the copies and runs
    the model on them cast back (``as_dtypes``): a bfloat16 param near 1.0 drops any update below half its ulp,
    2^-9, so at the learning rates used here (3e-4..3e-3 a step) RMSNorm weights would stop training."""
    dtypes = jax.tree.map(lambda x: x.dtype, params)
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params), dtypes


def as_dtypes(params, dtypes):
    """``params`` cast to ``dtypes`` (a tree of dtypes like it, from ``float32_master``); None: as they are."""
    return params if dtypes is None else jax.tree.map(lambda x, d: x.astype(d), params, dtypes)


def make_train_step(graphdef, tx, runtime: Runtime = TRAIN_RUNTIME, dtypes=None):
    """Returns jitted step(params, opt_state, rows [B, T+1], lr) -> (params, opt_state, loss).

    params: the model's ``nnx.Param`` state, or its float32 master copy with the model's ``dtypes``
    (``float32_master``). router_bias gets no gradient update (see ``make_bias_update``)."""

    def loss_fn(params, rows):
        model = nnx.merge(graphdef, as_dtypes(params, dtypes))
        out = lm_forward(model, rows[:, :-1], runtime)
        return token_nll(out.logits, rows[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, rows, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, rows)
        grads = jax.tree_util.tree_map_with_path(lambda p, g: jnp.zeros_like(g) if _is_router_bias(p) else g, grads)
        params, opt_state = scaled_update(tx, grads, opt_state, params, lr)
        return params, opt_state, loss

    return step


class StepClock:
    """Fixes a run's length from its measured speed: ``--minutes`` of training = the steps timed so far
    plus as many more as fit at the mean step time of steps ``skip..`` (the first ``skip`` include
    compilation). ``total(step)`` is None until ``measure`` steps have been timed."""

    def __init__(self, minutes: float, measure: int, skip: int = 3):
        self.budget_s, self.measure, self.skip = 60.0 * minutes, measure, skip
        self.t_start = time.perf_counter()
        self.t_skip = None
        self.steps = None

    def tick(self, steps_done: int) -> int | None:
        now = time.perf_counter()
        if steps_done == self.skip:
            self.t_skip = now
        if self.steps is None and self.t_skip is not None and steps_done == self.skip + self.measure:
            per_step = (now - self.t_skip) / self.measure
            self.steps = steps_done + max(int((self.budget_s - (now - self.t_start)) / per_step), 0)
            print(f"clock: {per_step * 1e3:.1f} ms/step -> {self.steps} steps in {self.budget_s / 60:.1f} min")
        return self.steps


def training_loop(run_step, *, start: int, total_steps: int | None, minutes: float | None, lr: float, warmup: int,
                  max_minutes: float | None, save_every: int, save, desc: str, curve: list[dict] | None = None,
                  max_steps: int | None = None):
    """The loop both trainers share.

    ``run_step(step, lr) -> dict`` of floats (with "loss") does one update. ``total_steps`` None means
    "fix it from ``minutes``" (``StepClock``, during warmup, whose learning rates do not depend on the
    length; ``minutes`` is what is left of the budget, and a resumed run, ``start`` > 0, must still have
    13 warmup steps to time). ``save(step, total_steps, curve)`` runs every ``save_every`` steps and at the
    end (also when ``max_minutes`` stops the run early, then with ``total_steps`` None if the length was not
    fixed yet). ``max_steps`` caps a length fixed from ``minutes`` (e.g. a number of epochs); it is refused
    with a fixed ``total_steps``. Returns (curve, steps_done, total_steps, seconds); total_steps is None
    when ``max_minutes`` stopped the run before its length was fixed.
    """
    from tqdm import tqdm

    if max_steps is not None and total_steps is not None:
        raise ValueError(f"max_steps {max_steps} caps a length fixed from minutes; total_steps {total_steps} is "
                         "already fixed")
    if total_steps is None and warmup < MIN_CLOCK_WARMUP:
        raise ValueError(f"--minutes times warmup steps 3..12; use --warmup >= {MIN_CLOCK_WARMUP}")
    if total_steps is None and warmup - start < MIN_CLOCK_WARMUP:
        raise ValueError(f"the saved state is at step {start}, before --minutes fixed the run's length, and only "
                         f"{max(warmup - start, 0)} of the {warmup} warmup steps are left to time it "
                         f"(>= {MIN_CLOCK_WARMUP} needed): start again with a fresh --state-dir")
    clock = StepClock(minutes, measure=min(warmup - start - 3, 30)) if total_steps is None else None
    warm = lr_schedule(warmup + 1, lr, warmup)
    schedule = lr_schedule(total_steps, lr, warmup) if total_steps else None
    curve = list(curve or [])
    t0 = time.perf_counter()
    bar = tqdm(initial=start, total=total_steps, desc=desc, mininterval=5)
    step = start
    while total_steps is None or step < total_steps:
        rate = float((schedule or warm)(step))
        record = run_step(step, rate)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"loss {record['loss']} at step {step}")
        curve.append({"step": step, **record, "lr": rate, "time_s": time.perf_counter() - t0})
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}")
        step += 1
        if clock is not None and total_steps is None and clock.tick(step - start) is not None:
            total_steps = clock.steps + start
            if max_steps is not None:
                total_steps = min(total_steps, max(max_steps, step))
            schedule = lr_schedule(total_steps, lr, warmup)
            bar.total = total_steps
        done = step == total_steps or bool(max_minutes and time.perf_counter() - t0 > 60 * max_minutes)
        if done or (total_steps is not None and step % save_every == 0):
            save(step, total_steps, curve)
        if done:
            break
    bar.close()
    return curve, step, total_steps, time.perf_counter() - t0


def make_bias_update(graphdef, rate: float, runtime: Runtime = TRAIN_RUNTIME, dtypes=None):
    """Returns jitted update(params, rows [B, T+1]) -> (params, loads [num_moe, E]): DeepSeek-V3's
    gradient-free balancing, bias_e += rate * sign(mean load - load_e), per MoE layer (loads of the model in
    ``dtypes``, as ``make_train_step``)."""

    @jax.jit
    def update(params, rows):
        loads = expert_load(nnx.merge(graphdef, as_dtypes(params, dtypes)), rows[:, :-1], runtime)
        model = nnx.merge(graphdef, params)
        moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        for j, mlp in enumerate(moe):
            mlp.router_bias.value = mlp.router_bias.value + rate * jnp.sign(loads[j].mean() - loads[j])
        return nnx.state(model), loads

    return update


def make_nll_eval(graphdef, rows: np.ndarray, batch: int = 8, runtime: Runtime = TRAIN_RUNTIME, dtypes=None):
    """Returns evaluate(state) -> mean per-token NLL (nats) over all rows [N, T+1] (inputs rows[:, :-1],
    labels rows[:, 1:]) of the model ``nnx.merge(graphdef, state)`` (``state`` cast to ``dtypes``, as
    ``make_train_step``), in chunks of ``batch`` rows (a last, shorter chunk holds the remainder); compiled once
    per chunk shape, reusable."""

    @jax.jit
    def nll(state, chunk):
        m = nnx.merge(graphdef, as_dtypes(state, dtypes))
        return token_nll(lm_forward(m, chunk[:, :-1], runtime).logits, chunk[:, 1:]).sum()

    chunks = [jnp.asarray(rows[i:i + batch]) for i in range(0, len(rows), batch)]
    if not chunks:
        raise ValueError("no rows to evaluate")

    def evaluate(state) -> float:
        total = sum(float(nll(state, c)) for c in chunks)
        return total / sum(c.shape[0] * (c.shape[1] - 1) for c in chunks)

    return evaluate


def eval_nll(model: KimiModel, rows: np.ndarray, batch: int = 8, runtime: Runtime = TRAIN_RUNTIME) -> float:
    """Mean per-token NLL (nats) of ``model`` over rows [N, T+1]."""
    graphdef, state = nnx.split(model)
    return make_nll_eval(graphdef, rows, batch, runtime)(state)


# ----------------------------------------------------------------------------------------------------
# INT4 export
# ----------------------------------------------------------------------------------------------------
def quantize_experts(model: KimiModel, group_size: int = 32) -> KimiModel:
    """A copy of ``model`` whose routed experts are INT4 ``QuantArray`` (config gets ``quant``)."""
    cfg = model.cfg.replace(quant=QuantConfig(group_size=group_size))
    qmodel = nnx.eval_shape(lambda: KimiModel(cfg, nnx.Rngs(0)))
    graphdef, abstract = nnx.split(qmodel)
    src = {tuple(k): v for k, v in nnx.state(model).flat_state()}
    flat = {}
    for k, var in abstract.flat_state():
        k = tuple(k)
        value = src[k].get_value()
        if isinstance(var.get_value(), QuantArray):
            value = quantize_array(value, group_size)
        flat[k] = var.replace(value)
    return nnx.merge(graphdef, nnx.State.from_flat_path(flat))


# ----------------------------------------------------------------------------------------------------
# Resumable training state (a thin Orbax wrapper; swap for ddtree_jax.checkpoint when it grows one)
# ----------------------------------------------------------------------------------------------------
def save_train_state(path: str, tree: Any, step: int, meta: dict | None = None) -> None:
    """Saves any pytree of arrays (params, optimizer state, ...) at ``path/step_<n>``; older steps are
    removed after the new one is complete (Orbax writes to a temporary directory and renames).
    ``meta`` (JSON): what a resume must agree with (schedule, data, config), and the run history."""
    leaves = jax.tree.leaves(tree)
    payload = {f"{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
    os.makedirs(path, exist_ok=True)
    target = os.path.abspath(os.path.join(path, f"step_{step:07d}"))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(target, payload, force=True)
    ckpt.wait_until_finished()
    ckpt.close()
    with open(os.path.join(path, "latest.json.tmp"), "w") as f:
        json.dump({"step": step, "dir": os.path.basename(target), "num_leaves": len(leaves),
                   "treedef": str(jax.tree.structure(tree)), "meta": meta or {}}, f)
    os.replace(os.path.join(path, "latest.json.tmp"), os.path.join(path, "latest.json"))
    for entry in os.listdir(path):
        if entry.startswith("step_") and entry != os.path.basename(target):
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def read_train_meta(path: str) -> dict | None:
    index = os.path.join(path, "latest.json")
    if not os.path.exists(index):
        return None
    with open(index) as f:
        return json.load(f)


def restore_train_state(path: str, like: Any, expect: dict | None = None) -> tuple[Any, int] | None:
    """The latest state saved by ``save_train_state`` with the structure of ``like``; None if absent.
    Raises ValueError if the stored structure differs (a different config or optimizer) or if any key
    of ``expect`` differs from the stored ``meta["resume_key"]``."""
    meta = read_train_meta(path)
    if meta is None:
        return None
    stored_key = meta.get("meta", {}).get("resume_key")
    if expect is not None and stored_key != expect:
        raise ValueError(f"{path}: stored training state was made with {stored_key}, this run has {expect}; "
                         "use a fresh --state-dir (or the same arguments) to resume")
    leaves, treedef = jax.tree.flatten(like)
    if meta["num_leaves"] != len(leaves) or meta["treedef"] != str(treedef):
        raise ValueError(f"{path}: stored training state has a different structure; use a fresh --state-dir")
    abstract = {f"{i:05d}": jax.ShapeDtypeStruct(np.shape(x), x.dtype) for i, x in enumerate(leaves)}
    ckpt = ocp.StandardCheckpointer()
    restored = ckpt.restore(os.path.abspath(os.path.join(path, meta["dir"])), abstract)
    ckpt.close()
    return jax.tree.unflatten(treedef, [jnp.asarray(restored[f"{i:05d}"]) for i in range(len(leaves))]), meta["step"]


def save_run(state_dir: str, state: Any, step: int, total_steps: int | None, curve: list[dict], resume_key: dict,
             history: list[dict]) -> None:
    """``save_train_state`` with what a resume of either trainer needs: the key it must agree with, the run's
    length (None while --minutes has not fixed it), the segments so far (``history``: start_step, end_step,
    seconds each) and the loss curve (``curve.json``)."""
    save_train_state(state_dir, state, step, {"resume_key": resume_key, "total_steps": total_steps,
                                              "history": history})
    with open(os.path.join(state_dir, "curve.json"), "w") as f:
        json.dump(curve, f)


def restore_run(state_dir: str, like: Any, resume_key: dict, total_steps: int | None):
    """What ``save_run`` left in ``state_dir``: (state, start step, total_steps, the curve before start, the
    earlier segments); (like, 0, total_steps, [], []) when it holds none. Raises as ``restore_train_state``."""
    restored = restore_train_state(state_dir, like, resume_key)
    if restored is None:
        return like, 0, total_steps, [], []
    state, start = restored
    meta = read_train_meta(state_dir)["meta"]
    total_steps = meta.get("total_steps", total_steps)
    curve, curve_file = [], os.path.join(state_dir, "curve.json")
    if os.path.exists(curve_file):
        with open(curve_file) as f:
            curve = [c for c in json.load(f) if c["step"] < start]
    print(f"resumed from {state_dir} at step {start} of {total_steps}")
    return state, start, total_steps, curve, meta.get("history", [])


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------
def load_tokenizer_json(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def prepare_rows(tokenizer, seq: int, *, tokenizer_path: str, tokens_path: str | None = None,
                 allow_mismatch: bool = False):
    """Packed training rows [N, seq+1] and held-out rows, plus data info (hashes)."""
    train, held, info = data_lib.corpus_streams(tokenizer, tokenizer_path=tokenizer_path, tokens_path=tokens_path,
                                                allow_mismatch=allow_mismatch)
    train_rows, held_rows = data_lib.pack(train, seq), data_lib.pack(held, seq)
    return train_rows, held_rows, dict(info, train_rows=len(train_rows), heldout_rows=len(held_rows))


def probe_rows(held_rows: np.ndarray, eval_rows: int, count: int = PROBE_ROWS) -> np.ndarray:
    """``count`` held-out rows for the --eval-every probe, spread evenly over the rows past the final evaluation's
    first ``eval_rows`` (rows are packed file after file, so the probe spans many files, not the last few)."""
    spare = len(held_rows) - eval_rows
    if spare < count:
        raise ValueError(f"--eval-every probes {count} held-out rows past the --eval-rows {eval_rows}, but only "
                         f"{max(spare, 0)} of the {len(held_rows)} held-out rows are left")
    return held_rows[eval_rows + np.linspace(0, spare - 1, count).round().astype(int)]


def batch_rows(rows: np.ndarray, step: int, batch: int, seed: int) -> np.ndarray:
    """Rows of ``step``: epochs are seeded permutations, so a resumed run sees the same batches."""
    per_epoch = len(rows) // batch
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng(seed + epoch).permutation(len(rows))
    return rows[order[i * batch:(i + 1) * batch]]


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------
def write_curve(out: str, curve: list[dict], title: str, key: str = "loss") -> None:
    with open(os.path.join(out, "loss_curve.json"), "w") as f:
        json.dump(curve, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c["step"] for c in curve], [c[key] for c in curve], lw=1, label=f"train {key}")
    held = [c for c in curve if "heldout_nll" in c]
    if held:
        ax.plot([c["step"] for c in held], [c["heldout_nll"] for c in held], "o-", ms=3, label="held-out NLL")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel(f"train {key} (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curve.png"), dpi=100)
    plt.close(fig)


def add_training_args(p, *, storage_help: str) -> None:
    """The arguments both trainers share: run length, precision, storage, resume, data source, provenance."""
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS})")
    length.add_argument("--minutes", type=float, default=None,
                        help="train for about this long: the step count is fixed from the speed measured "
                             "during warmup (recorded in the manifest)")
    add_matmul_precision_arg(p, "default", "jax default matmul precision for f32 training (tensorfloat32 on "
                                           "Hopper GPUs)")
    p.add_argument("--storage-dtype", choices=["float32", "bfloat16"], default="bfloat16", help=storage_help)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop (and save) after this wall time; rerun the same command to resume")
    p.add_argument("--allow-mismatch", action="store_true")
    p.add_argument("--tokens", default=None, help="corpus as tokenized by `data.py tokens` (instead of the stdlib)")
    p.add_argument("--commit", default=None,
                   help="commit to record in the manifest (default: git HEAD here; copies on other machines may lie)")


def planned_steps(args) -> int | None:
    """--steps (default DEFAULT_STEPS), or None when --minutes fixes the length during warmup."""
    return None if args.minutes is not None else (args.steps if args.steps is not None else DEFAULT_STEPS)


def check_training_args(args) -> None:
    """Checks the flags ``add_training_args`` adds and the ones both trainers have (--batch, --lr, --warmup,
    --seed, --config) before any data or model work; ValueError naming the flag otherwise."""
    for flag, value, least in (("--steps", args.steps, 1), ("--save-every", args.save_every, 1),
                               ("--batch", args.batch, 1), ("--warmup", args.warmup, 0), ("--seed", args.seed, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    for flag, value in (("--minutes", args.minutes), ("--max-minutes", args.max_minutes), ("--lr", args.lr)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be finite and > 0, got {value}")
    if args.minutes is not None and args.warmup < MIN_CLOCK_WARMUP:
        raise ValueError(f"--minutes times warmup steps 3..12 to fix the run's length; use --warmup >= "
                         f"{MIN_CLOCK_WARMUP}, got {args.warmup}")
    try:
        overrides = json.loads(args.config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config must be a JSON object: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--config must be a JSON object, got {args.config!r}")


def check_target_args(args) -> None:
    """``check_training_args`` plus the target's own flags."""
    check_training_args(args)
    if args.max_epochs is not None:
        if args.minutes is None:
            raise ValueError("--max-epochs caps a length fixed from --minutes; with --steps (or its default) "
                             "the length is already fixed: give --steps for the number of steps wanted")
        if not (math.isfinite(args.max_epochs) and args.max_epochs > 0):
            raise ValueError(f"--max-epochs must be finite and > 0, got {args.max_epochs}")
    for flag, value, least in (("--eval-every", args.eval_every, 0), ("--seq", args.seq, 1),
                               ("--bias-every", args.bias_every, 1), ("--eval-rows", args.eval_rows, EVAL_ROWS_MIN)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if not (math.isfinite(args.bias_rate) and args.bias_rate >= 0):
        raise ValueError(f"--bias-rate must be finite and >= 0 (0 disables), got {args.bias_rate}")
    overrides = json.loads(args.config)
    flags = sorted(set(overrides) & {"vocab_size", "dtype"})
    if flags:
        raise ValueError(f"--config cannot set {flags}: the vocabulary is the tokenizer's, the dtype --dtype's")
    try:  # the config as train builds it (a placeholder vocabulary): a bad field is a usage error, not a traceback
        small_target_config(256, args.dtype, **overrides)
    except (TypeError, ConfigError) as e:
        raise ValueError(f"--config: {e}") from None


def minutes_left(minutes: float | None, history: list[dict]) -> float | None:
    """What is left of a --minutes budget after the earlier segments of a resumed run (``history``)."""
    return None if minutes is None else minutes - sum(h["seconds"] for h in history) / 60


def stopped_early(steps_done: int, total_steps: int | None, state_dir: str) -> bool:
    """True (with a message) when --max-minutes stopped the run: before its planned end, or before --minutes
    fixed its length (``total_steps`` None)."""
    if total_steps is None:
        print(f"stopped at step {steps_done} (--max-minutes), before --minutes fixed the run's length during "
              f"warmup; state in {state_dir}; rerun the same command to resume")
        return True
    if steps_done < total_steps:
        print(f"stopped at step {steps_done} of {total_steps} (--max-minutes); state in {state_dir}; "
              "rerun the same command to resume")
        return True
    return False


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(p, storage_help="dtype of the float params on disk (restored as --dtype); INT4 experts "
                                      "are unaffected")
    p.add_argument("--max-epochs", type=float, default=None, help="with --minutes: at most this many epochs")
    p.add_argument("--eval-every", type=int, default=0,
                   help=f"held-out NLL on {PROBE_ROWS} rows spread past --eval-rows, every N steps (0: never)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--experts", choices=["dense", "xla"], default="dense", help="routed-expert training path")
    p.add_argument("--bias-rate", type=float, default=1e-2)
    p.add_argument("--bias-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", default=os.path.join(ROOT, "checkpoints", "target"))
    p.add_argument("--state-dir", default=None, help="resumable training state (default <out>.train_state)")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "checkpoints", "tokenizer", "tokenizer.json"))
    p.add_argument("--eval-rows", type=int, default=64,
                   help=f"held-out rows for perplexity (>= {EVAL_ROWS_MIN}: the inference path's NLL takes the first "
                        f"{INFERENCE_EVAL_ROWS})")
    p.add_argument("--config", default="{}", help="JSON overrides of the model config, e.g. '{\"num_layers\": 2}'")
    args = p.parse_args(argv)
    try:
        check_target_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def target_resume_key(args, info: dict) -> dict:
    """What a resumed target run must agree with: the schedule (--max-epochs included: it fixes a --minutes run's
    length), the model flags, the corpus (``data_hash``) and the tokenizer that cut it (``info`` of
    ``prepare_rows``)."""
    key = {k: getattr(args, k) for k in ("steps", "minutes", "max_epochs", "batch", "seq", "lr", "warmup",
                                         "bias_rate", "bias_every", "seed", "dtype", "config")}
    return dict(key, data_hash=info["data_hash"], tokenizer_sha256=info["tokenizer_sha256"])


def main(argv=None):
    args = parse_args(argv)
    with jax.default_matmul_precision(args.matmul_precision):
        return train(args, argv)


def train(args, argv=None):
    state_dir = args.state_dir or args.out.rstrip("/") + ".train_state"
    tokenizer = load_tokenizer_json(args.tokenizer)
    train_rows, held_rows, info = prepare_rows(tokenizer, args.seq, tokenizer_path=args.tokenizer,
                                               tokens_path=args.tokens, allow_mismatch=args.allow_mismatch)
    if len(train_rows) < args.batch:
        raise ValueError(f"--batch {args.batch} is more than the {len(train_rows)} training rows of "
                         f"{args.seq + 1} tokens (--seq {args.seq})")
    if len(held_rows) < args.eval_rows:
        raise ValueError(f"--eval-rows {args.eval_rows} is more than the {len(held_rows)} held-out rows of "
                         f"{args.seq + 1} tokens")
    probe = probe_rows(held_rows, args.eval_rows) if args.eval_every else None
    cfg = small_target_config(tokenizer.get_vocab_size(), args.dtype, **json.loads(args.config))
    model = KimiModel(cfg, nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)  # every variable is an nnx.Param
    n_params = sum(x.size for x in jax.tree.leaves(params))
    params, dtypes = float32_master(params)
    tx = make_optimizer()
    opt_state = tx.init(params)
    resume_key = target_resume_key(args, info)
    runtime = TRAIN_RUNTIME if args.experts == "dense" else Runtime(attention="naive", matmul_precision=None)
    (params, opt_state), start, total_steps, curve, history = restore_run(
        state_dir, (params, opt_state), resume_key, planned_steps(args))
    print(f"target: {n_params / 1e6:.2f}M params, {info['train_rows']} train rows x {args.seq + 1}, "
          f"{info['heldout_rows']} held-out rows; data hash {info['data_hash'][:12]}")
    step_fn = make_train_step(graphdef, tx, runtime, dtypes)
    bias_fn = make_bias_update(graphdef, args.bias_rate, runtime, dtypes) if args.bias_rate > 0 else None
    live = {"params": params, "opt_state": opt_state, "max_load": float("nan")}
    heldout_eval = make_nll_eval(graphdef, probe, dtypes=dtypes) if args.eval_every else None
    per_epoch = len(train_rows) // args.batch

    def run_step(step, lr):
        rows = jnp.asarray(batch_rows(train_rows, step, args.batch, args.seed))
        live["params"], live["opt_state"], loss = step_fn(live["params"], live["opt_state"], rows, jnp.float32(lr))
        if bias_fn is not None and step % args.bias_every == 0:
            live["params"], loads = bias_fn(live["params"], rows)
            live["max_load"] = float(loads.max()) * cfg.n_routed_experts  # 1.0 = perfectly balanced
        record = {"loss": float(loss), "max_load_x_mean": live["max_load"],
                  "tokens": (step + 1) * args.batch * args.seq}
        if args.eval_every and (step + 1) % args.eval_every == 0:
            record["heldout_nll"] = heldout_eval(live["params"])
        return record

    def save(step, total, curve_now):
        run = {"start_step": start, "end_step": step, "seconds": time.perf_counter() - t_begin}
        save_run(state_dir, (live["params"], live["opt_state"]), step, total, curve_now, resume_key, history + [run])

    t_begin = time.perf_counter()
    curve, steps_done, total_steps, train_s = training_loop(
        run_step, start=start, total_steps=total_steps, minutes=minutes_left(args.minutes, history), lr=args.lr,
        warmup=args.warmup, max_minutes=args.max_minutes, save_every=args.save_every, save=save, desc="target",
        curve=curve, max_steps=None if args.max_epochs is None or total_steps is not None
        else int(args.max_epochs * per_epoch))  # a resumed --minutes run's stored length is already capped
    params = live["params"]
    if stopped_early(steps_done, total_steps, state_dir):
        return None
    model = nnx.merge(graphdef, as_dtypes(params, dtypes))

    qmodel = quantize_experts(model)
    from ddtree_jax.checkpoint import restore_model, save_model

    os.makedirs(args.out, exist_ok=True)
    save_model(qmodel, args.out, metadata={"trained_by": "experiments/train_target.py"},
               storage_dtype=None if args.storage_dtype == args.dtype else args.storage_dtype)
    shutil.copy(args.tokenizer, os.path.join(args.out, "tokenizer.json"))
    shipped = restore_model(args.out)  # INT4 experts, float params as stored
    eval_rows = held_rows[: args.eval_rows]
    nll_float = eval_nll(model, eval_rows)
    nll_int4 = eval_nll(shipped, eval_rows)
    nll_int4_infer = eval_nll(shipped, eval_rows[:INFERENCE_EVAL_ROWS], runtime=Runtime())  # shipped inference path
    history = history + [{"start_step": start, "end_step": steps_done, "seconds": train_s}]
    metrics = {"steps": steps_done, "batch": args.batch, "seq": args.seq,
               "train_seconds": sum(h["seconds"] for h in history), "runs": history,
               "tokens_seen": steps_done * args.batch * args.seq,
               "final_train_loss": float(np.mean([c["loss"] for c in curve[-20:]])),
               "heldout_rows": len(eval_rows), "heldout_tokens": int(eval_rows[:, 1:].size),
               "heldout_nll_float": nll_float, "heldout_ppl_float": math.exp(nll_float),
               "heldout_nll_int4": nll_int4, "heldout_ppl_int4": math.exp(nll_int4),
               "heldout_nll_int4_inference_path_16rows": nll_int4_infer,
               "params": int(n_params), "storage_dtype": args.storage_dtype}
    print(json.dumps(metrics, indent=1))

    manifest = {"command": "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
                                                + (argv if argv is not None else sys.argv[1:])),
                "commit": args.commit or data_lib.git_commit(), "args": vars(args), "data": info,
                "tokenizer": os.path.relpath(args.tokenizer, ROOT), "metrics": metrics,
                "model_config": json.loads(json.dumps(dataclasses.asdict(qmodel.cfg)))}
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    write_curve(args.out, curve, f"target {n_params / 1e6:.1f}M, batch {args.batch}x{args.seq}")
    print(f"wrote {args.out}")
    return metrics


if __name__ == "__main__":
    main()

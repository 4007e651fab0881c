"""Trains a DFlash drafter for a trained target (``experiments/train_target.py``) with the DFlash recipe
(notes ``dflash_ddtree.md`` §2):

  * data: target-generated greedy continuations (engine, AR mode, batched) of prompts cut from the
    training split; the loss sees only continuation tokens;
  * frozen shared embedding / lm_head (the target's); context = tapped target features of the sequence;
  * random anchors per sequence, re-sampled every step; all blocks of a sequence in one forward:
    KV = [S context rows | N blocks x Bs], Q = N blocks x Bs; a block sees context strictly before its
    anchor plus its own block in both directions (``training_mask``);
  * block = [token at anchor, MASK x (Bs-1)]; slot k predicts the token at anchor + k;
    position-decayed CE, w_k = exp(-(k-1)/gamma), loss = sum w CE / sum w.

    python experiments/train_drafter.py --target checkpoints/target --out checkpoints/drafter --steps 300
    # the shipped drafter (one H200, ~6 minutes in all; tokens.npz from `data.py tokens`):
    python experiments/train_drafter.py --target checkpoints/target --out DIR --tokens tokens.npz --minutes 4 \
        --warmup 50 --batch 64 --lr 2e-3 --num-seqs 16384 --eval-seqs 256 --gen-streams 512 \
        --matmul-precision tensorfloat32

Outputs in ``--out``: ``drafter_config.json`` + ``params-<hex>/`` (``ddtree_jax.checkpoint.save_drafter``, float
params stored as ``--storage-dtype``), ``manifest.json`` (command, commit, data hash, metrics incl.
per-position accuracy on held-out text, measured on the drafter as restored), ``loss_curve.json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax.checkpoint import drafter_config_to_dict, restore_drafter, save_drafter  # noqa: E402
from ddtree_jax.drafter import DFlashDrafter, DrafterConfig, check_drafter_target, target_taps  # noqa: E402
from ddtree_jax.engine import Engine, EngineConfig  # noqa: E402
from ddtree_jax.layers import dot  # noqa: E402
from ddtree_jax.model import KimiModel  # noqa: E402
from ddtree_jax.rope import apply_rope_half, rope_cos_sin  # noqa: E402
from experiments import data as data_lib  # noqa: E402
from experiments.train_target import (TRAIN_RUNTIME, add_training_args, as_dtypes,  # noqa: E402
                                      check_training_args, float32_master, lm_forward, load_tokenizer_json,
                                      make_optimizer, minutes_left, planned_steps, restore_run, save_run,
                                      scaled_update, stopped_early, training_loop, write_curve)

EVAL_BATCH = 16  # sequences per evaluation forward (``evaluate``)


def small_drafter_config(target_cfg, mask_token_id: int, *, block_size: int = 8, taps=None,
                         dtype: str | None = None, **overrides) -> DrafterConfig:
    """A 2-layer DFlash drafter for ``small_target_config``: target width/vocab/RoPE, GQA 4/2 x 64,
    taps at layer 1 and the last layer, block 8 (as Kimi-K2.5-DFlash)."""
    taps = taps or tuple(sorted({min(1, target_cfg.num_layers - 1), target_cfg.num_layers - 1}))
    base = dict(hidden_size=target_cfg.hidden_size, intermediate_size=2 * target_cfg.hidden_size, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope=target_cfg.rope,
                target_layer_ids=taps, block_size=block_size, mask_token_id=mask_token_id,
                vocab_size=target_cfg.vocab_size, dtype=dtype or target_cfg.dtype,
                num_target_layers=target_cfg.num_layers)
    base.update(overrides)
    return DrafterConfig(**base)


# ----------------------------------------------------------------------------------------------------
# The training forward
# ----------------------------------------------------------------------------------------------------
def training_mask(anchors: jax.Array, seq_len: int, block_size: int) -> jax.Array:
    """Visibility of the training forward. anchors [B, N] -> bool [B, N*Bs, S + N*Bs].

    Query row n*Bs + k (block n, slot k) sees context column j < S iff j < anchors[b, n] (strictly
    before the anchor: the anchor's own target features do not exist at inference), and block column
    S + m*Bs + l iff m == n (its own block, both directions)."""
    b, n = anchors.shape
    q_anchor = jnp.repeat(anchors, block_size, axis=1)  # [B, N*Bs]
    ctx = jnp.arange(seq_len)[None, None, :] < q_anchor[:, :, None]  # [B, N*Bs, S]
    block_id = jnp.arange(n * block_size) // block_size
    own = block_id[:, None] == block_id[None, :]  # [N*Bs, N*Bs]
    return jnp.concatenate([ctx, jnp.broadcast_to(own, (b,) + own.shape)], axis=-1)


def masked_gqa(q, k, v, mask, scale):
    """q [B, Tq, H, hd], k/v [B, Tk, KVH, hd], mask [B, Tq, Tk] bool -> [B, Tq, H, hd] (f32 softmax)."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    s = jnp.einsum("btkgd,bskd->btkgs", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, :, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("btkgs,bskd->btkgd", p, v.astype(q.dtype), preferred_element_type=jnp.float32
                      ).reshape(b, t, h, hd).astype(q.dtype)


def drafter_train_hidden(drafter: DFlashDrafter, taps: jax.Array, block_embeds: jax.Array,
                         anchors: jax.Array) -> jax.Array:
    """All blocks of each sequence in one pass.

    taps [n, B, S, D]: target layer outputs at positions 0..S-1; block_embeds [B, N*Bs, D]: target
    embeddings of each block [token at anchor, MASK x (Bs-1)]; anchors [B, N] (block n occupies
    positions anchors[b, n] + 0..Bs-1). Returns final-normed hidden states [B, N*Bs, D]; equal, block by
    block, to ``DFlashDrafter.__call__`` with a cache holding the context rows < anchor.
    """
    cfg = drafter.cfg
    bs = cfg.block_size
    _, b, s, _ = taps.shape
    ctx = drafter.context_features(taps)  # [B, S, D]
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    blk_pos = (anchors[:, :, None] + jnp.arange(bs, dtype=jnp.int32)).reshape(b, -1)
    cos_c, sin_c = rope_cos_sin(ctx_pos, cfg.rope, cfg.head_dim)
    cos_b, sin_b = rope_cos_sin(blk_pos, cfg.rope, cfg.head_dim)
    mask = training_mask(anchors, s, bs)
    x = block_embeds.astype(jnp.dtype(cfg.dtype))
    for layer in drafter.layers:
        attn = layer.attn
        h = layer.input_norm(x)
        q = apply_rope_half(attn.q_norm(dot(h, attn.q.value, "btd,dhk->bthk")), cos_b, sin_b)
        kc, vc = attn.key_value(ctx, cos_c, sin_c)
        kb, vb = attn.key_value(h, cos_b, sin_b)
        o = masked_gqa(q, jnp.concatenate([kc, kb], 1), jnp.concatenate([vc, vb], 1), mask, cfg.softmax_scale)
        x = x + dot(o, attn.o.value, "bthk,hkd->btd")
        x = x + layer.mlp(layer.post_norm(x))
    return drafter.norm(x)


def decay_weights(block_size: int, gamma: float) -> np.ndarray:
    """[Bs] loss weights: 0 for slot 0 (the known anchor token), exp(-(k-1)/gamma) for k >= 1."""
    k = np.arange(block_size)
    return np.where(k == 0, 0.0, np.exp(-(k - 1) / gamma)).astype(np.float32)


def sample_anchors(rng: np.random.Generator, batch: int, num_anchors: int, lo: int, hi: int) -> np.ndarray:
    """[B, N] anchors drawn uniformly without replacement from [lo, hi] per sequence, sorted."""
    if hi - lo + 1 < num_anchors:
        raise ValueError(f"only {hi - lo + 1} anchor positions in [{lo}, {hi}] for {num_anchors} anchors")
    return np.sort(np.stack([rng.choice(np.arange(lo, hi + 1), num_anchors, replace=False) for _ in range(batch)]),
                   axis=1).astype(np.int32)


def step_batch(seed: int, step: int, num_seqs: int, batch: int, num_anchors: int, lo: int, hi: int):
    """Step ``step``'s draw: (``batch`` distinct sequence indices, their anchors [B, N] in [lo, hi]), a function
    of (seed, step) alone, so that a resumed run trains on the batches an uninterrupted one would."""
    rng = np.random.default_rng([seed, 1000, step])
    idx = rng.choice(num_seqs, batch, replace=False)
    return idx, sample_anchors(rng, batch, num_anchors, lo, hi)


def block_inputs(seqs: jax.Array, anchors: jax.Array, block_size: int, mask_token_id: int):
    """seqs [B, S], anchors [B, N] -> (block tokens [B, N*Bs], labels [B, N, Bs]) where labels[b, n, k]
    = seqs[b, anchors[b, n] + k] and the block is [seqs[anchor], MASK, ...]."""
    b, n = anchors.shape
    idx = anchors[:, :, None] + jnp.arange(block_size)[None, None, :]  # [B, N, Bs]
    labels = jnp.take_along_axis(seqs, idx.reshape(b, -1), axis=1).reshape(b, n, block_size)
    tokens = jnp.where(jnp.arange(block_size)[None, None, :] == 0, labels, mask_token_id).reshape(b, -1)
    return tokens.astype(jnp.int32), labels


def drafter_loss(drafter, target, taps, seqs, anchors, weights):
    """Position-decayed CE and per-slot accuracy. Returns (loss, (correct [B, N, Bs] bool))."""
    cfg = drafter.cfg
    tokens, labels = block_inputs(seqs, anchors, cfg.block_size, cfg.mask_token_id)
    embeds = jax.lax.stop_gradient(target.embed_tokens(tokens))
    hidden = drafter_train_hidden(drafter, taps, embeds, anchors)
    logits = target.head(hidden).reshape(labels.shape + (-1,))  # [B, N, Bs, W]
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    w = jnp.broadcast_to(weights, ce.shape)
    loss = (ce * w).sum() / w.sum()
    return loss, jnp.argmax(logits, -1) == labels


def make_train_step(drafter_def, target_def, tx, weights, dtypes=None):
    """Returns jitted step(params, opt_state, target_state, taps, seqs, anchors, lr)
    -> (params, opt_state, loss, per-slot accuracy [Bs]). params: the drafter's state, or its float32 master
    copy with the drafter's ``dtypes`` (``train_target.float32_master``)."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, target_state, taps, seqs, anchors, lr):
        target = nnx.merge(target_def, target_state)

        def loss_fn(p):
            return drafter_loss(nnx.merge(drafter_def, as_dtypes(p, dtypes)), target, taps, seqs, anchors, weights)

        (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params, opt_state = scaled_update(tx, grads, opt_state, params, lr)
        return params, opt_state, loss, correct.mean((0, 1))

    return step


# ----------------------------------------------------------------------------------------------------
# Data: target continuations and features
# ----------------------------------------------------------------------------------------------------
def generate_continuations(target: KimiModel, prompts: np.ndarray, new_tokens: int, streams: int = 32,
                           progress=None) -> np.ndarray:
    """Greedy target continuations (engine, AR mode). prompts [N, P] -> sequences [N, P + new_tokens]."""
    n, p = prompts.shape
    engine = Engine(target, None, EngineConfig(mode="ar", max_new_tokens=new_tokens, capacity=p + new_tokens + 2,
                                               rounds_per_dispatch=new_tokens + 1))
    out = []
    for i in range(0, n, streams):
        chunk = prompts[i:i + streams]
        pad = streams - len(chunk)
        batch = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)]) if pad else chunk
        result = engine.generate(batch.tolist(), 0.0)
        gen = np.asarray([t[:new_tokens] for t in result["tokens"]], np.int32)
        out.append(np.concatenate([batch, gen], 1)[: len(chunk)])
        if progress:
            progress(len(chunk))
    return np.concatenate(out)


def compute_taps(target: KimiModel, seqs: np.ndarray, tap_layers, batch: int = 16) -> np.ndarray:
    """Target layer outputs at ``tap_layers`` for every position: seqs [N, S] -> float32 [n, N, S, D]."""
    graphdef, state = nnx.split(target)

    @jax.jit
    def run(state, chunk):
        return lm_forward(nnx.merge(graphdef, state), chunk, TRAIN_RUNTIME, tap_layers=tuple(tap_layers)).taps

    parts = [np.asarray(run(state, jnp.asarray(seqs[i:i + batch])), np.float32) for i in range(0, len(seqs), batch)]
    return np.concatenate(parts, axis=1)


def cut_prompts(rows: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """``count`` windows of ``length`` tokens from packed rows [N, T] (seeded)."""
    rng = np.random.default_rng(seed)
    r = rng.integers(0, len(rows), count)
    s = rng.integers(0, rows.shape[1] - length + 1, count)
    return np.stack([rows[i, j:j + length] for i, j in zip(r, s)]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------
# Drafter checkpoint (thin; to move into ddtree_jax.checkpoint)
# ----------------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------
def evaluate(drafter, target, taps, seqs, lo, weights, seed=0, num_anchors=16, batch=EVAL_BATCH) -> dict:
    """Per-slot accuracy (slots 1..Bs-1) and the mean accepted chain length 1 + #leading correct slots
    on sequences seqs [N, S] with features taps [n, N, S, D] (anchors in [lo, S - Bs])."""
    cfg = drafter.cfg
    d_def, d_state = nnx.split(drafter)
    t_def, t_state = nnx.split(target)
    w = jnp.asarray(weights)

    @jax.jit
    def run(d_state, t_state, taps, seqs, anchors):
        return drafter_loss(nnx.merge(d_def, d_state), nnx.merge(t_def, t_state), taps, seqs, anchors, w)

    rng = np.random.default_rng(seed)
    losses, corrects = [], []
    s = seqs.shape[1]
    for i in range(0, len(seqs) - batch + 1, batch):
        anchors = sample_anchors(rng, batch, num_anchors, lo, s - cfg.block_size)
        loss, correct = run(d_state, t_state, jnp.asarray(taps[:, i:i + batch]), jnp.asarray(seqs[i:i + batch]),
                            jnp.asarray(anchors))
        losses.append(float(loss))
        corrects.append(np.asarray(correct)[..., 1:].reshape(-1, cfg.block_size - 1))
    c = np.concatenate(corrects)
    chain = 1 + np.cumprod(c, axis=1).sum(1)
    return {"loss": float(np.mean(losses)), "accuracy_per_slot": c.mean(0).round(4).tolist(),
            "chain_tau": float(chain.mean()), "blocks": int(len(c))}


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(ROOT, "checkpoints", "target"))
    p.add_argument("--out", default=os.path.join(ROOT, "checkpoints", "drafter"))
    p.add_argument("--state-dir", default=None)
    add_training_args(p, storage_help="dtype of the params on disk (restored in the target's dtype)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--num-seqs", type=int, default=512, help="training sequences (target continuations)")
    p.add_argument("--eval-seqs", type=int, default=64, help=f"held-out sequences (a multiple of {EVAL_BATCH})")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gen-streams", type=int, default=32, help="streams per batch when generating continuations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="{}", help="JSON overrides of the drafter config")
    args = p.parse_args(argv)
    try:
        check_drafter_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def check_drafter_args(args) -> None:
    """``check_training_args`` plus the drafter's own flags; ValueError naming the flag otherwise."""
    check_training_args(args)
    for flag, value, least in (("--block-size", args.block_size, 2), ("--num-anchors", args.num_anchors, 1),
                               ("--num-seqs", args.num_seqs, args.batch), ("--eval-seqs", args.eval_seqs, EVAL_BATCH),
                               ("--prompt-len", args.prompt_len, 1), ("--gen-streams", args.gen_streams, 1),
                               ("--new-tokens", args.new_tokens, args.num_anchors + args.block_size - 1)):
        if value < least:
            why = {"--block-size": " (slot 0 is the known anchor token: one slot at least to predict)",
                   "--num-seqs": " (--batch: each batch draws distinct sequences)",
                   "--eval-seqs": f" (evaluate's batch of {EVAL_BATCH})",
                   "--new-tokens": " (--num-anchors + --block-size - 1: distinct anchors in the continuation, "
                                   "each with a whole block after it)"}.get(flag, "")
            raise ValueError(f"{flag} must be >= {least}{why}, got {value}")
    if args.eval_seqs % EVAL_BATCH:
        raise ValueError(f"--eval-seqs must be a multiple of {EVAL_BATCH} (evaluate's batch), got {args.eval_seqs}")
    if not (math.isfinite(args.gamma) and args.gamma > 0):
        raise ValueError(f"--gamma must be finite and > 0, got {args.gamma}")
    overrides = set(json.loads(args.config))
    flags = sorted(overrides & {"block_size", "mask_token_id", "vocab_size", "dtype", "target_layer_ids"})
    if flags:
        raise ValueError(f"--config cannot set {flags}: --block-size, the tokenizer's mask token and vocabulary, "
                         "the target's dtype and taps set them")
    unknown = sorted(overrides - {f.name for f in dataclasses.fields(DrafterConfig)})
    if unknown:
        raise ValueError(f"--config names no DrafterConfig field: {unknown}")


def drafter_resume_key(args, info: dict) -> dict:
    """What a resumed drafter run must agree with: the schedule and sampling flags, the target (its commit
    record's contents), the corpus (``data_hash``) and the tokenizer that cut it (``info`` of ``corpus_streams``)."""
    key = {k: getattr(args, k) for k in ("steps", "minutes", "batch", "lr", "warmup", "block_size", "gamma",
                                         "num_anchors", "num_seqs", "prompt_len", "new_tokens", "seed", "config")}
    return dict(key, target_record_sha256=target_record_sha256(args.target), data_hash=info["data_hash"],
                tokenizer_sha256=info["tokenizer_sha256"])


def target_record_sha256(target_dir: str) -> str:
    """SHA-256 of the target's commit record (ddtree_checkpoint.json: its config and the name of its data
    directory, which every save makes new), so a resume is keyed on the target's contents, not a file time."""
    with open(os.path.join(target_dir, "ddtree_checkpoint.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main(argv=None):
    args = parse_args(argv)
    with jax.default_matmul_precision(args.matmul_precision):
        return train(args, argv)


def train(args, argv=None):
    from tqdm import tqdm

    from ddtree_jax.checkpoint import restore_model

    state_dir = args.state_dir or args.out.rstrip("/") + ".train_state"
    target = restore_model(args.target)
    tokenizer = load_tokenizer_json(os.path.join(args.target, "tokenizer.json"))
    mask_id = tokenizer.token_to_id(data_lib.MASK_TOKEN)
    dcfg = small_drafter_config(target.cfg, mask_id, block_size=args.block_size, **json.loads(args.config))
    check_drafter_target(dcfg, target.cfg)

    t0 = time.perf_counter()
    train, held, info = data_lib.corpus_streams(tokenizer, tokenizer_path=os.path.join(args.target, "tokenizer.json"),
                                                tokens_path=args.tokens, allow_mismatch=args.allow_mismatch)
    width = args.prompt_len + args.new_tokens
    train_rows, held_rows = data_lib.pack(train, width), data_lib.pack(held, width)
    bar = tqdm(total=args.num_seqs + args.eval_seqs, desc="target continuations", mininterval=5)
    seqs = generate_continuations(target, cut_prompts(train_rows, args.num_seqs, args.prompt_len, args.seed),
                                  args.new_tokens, streams=args.gen_streams, progress=bar.update)
    eval_seqs = generate_continuations(target, cut_prompts(held_rows, args.eval_seqs, args.prompt_len, args.seed + 1),
                                       args.new_tokens, streams=args.gen_streams, progress=bar.update)
    bar.close()
    taps = compute_taps(target, seqs, target_taps(dcfg, target.cfg.num_layers))
    eval_taps = compute_taps(target, eval_seqs, target_taps(dcfg, target.cfg.num_layers))
    data_s = time.perf_counter() - t0
    print(f"data: {len(seqs)} train / {len(eval_seqs)} held-out sequences of {width} tokens "
          f"({args.new_tokens} generated), taps {taps.shape}, {data_s:.0f}s")

    drafter = DFlashDrafter(dcfg, nnx.Rngs(args.seed))
    d_def, params = nnx.split(drafter)
    t_def, t_state = nnx.split(target)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    params, dtypes = float32_master(params)
    weights = jnp.asarray(decay_weights(dcfg.block_size, args.gamma))
    before = evaluate(drafter, target, eval_taps, eval_seqs, args.prompt_len, weights, num_anchors=args.num_anchors)
    tx = make_optimizer(weight_decay=0.01)
    opt_state = tx.init(params)
    resume_key = drafter_resume_key(args, info)
    (params, opt_state), start, total_steps, curve, history = restore_run(
        state_dir, (params, opt_state), resume_key, planned_steps(args))
    step_fn = make_train_step(d_def, t_def, tx, weights, dtypes)
    live = {"params": params, "opt_state": opt_state}

    def run_step(step, lr):
        idx, anchors = step_batch(args.seed, step, len(seqs), args.batch, args.num_anchors, args.prompt_len,
                                  width - dcfg.block_size)
        live["params"], live["opt_state"], loss, acc = step_fn(
            live["params"], live["opt_state"], t_state, jnp.asarray(taps[:, idx]), jnp.asarray(seqs[idx]),
            jnp.asarray(anchors), jnp.float32(lr))
        return {"loss": float(loss), "acc_slot1": float(acc[1]), "acc_last": float(acc[-1])}

    def save(step, total, curve_now):
        run = {"start_step": start, "end_step": step, "seconds": time.perf_counter() - t_begin}
        save_run(state_dir, (live["params"], live["opt_state"]), step, total, curve_now, resume_key, history + [run])

    t_begin = time.perf_counter()
    curve, steps_done, total_steps, train_s = training_loop(
        run_step, start=start, total_steps=total_steps, minutes=minutes_left(args.minutes, history), lr=args.lr,
        warmup=args.warmup, max_minutes=args.max_minutes, save_every=args.save_every, save=save, desc="drafter",
        curve=curve)
    params = live["params"]
    if stopped_early(steps_done, total_steps, state_dir):
        return None
    history = history + [{"start_step": start, "end_step": steps_done, "seconds": train_s}]
    save_drafter(nnx.merge(d_def, as_dtypes(params, dtypes)), args.out,
                 metadata={"trained_by": "experiments/train_drafter.py"},
                 storage_dtype=None if args.storage_dtype == dcfg.dtype else args.storage_dtype)
    drafter = restore_drafter(args.out, dtype=dcfg.dtype)  # evaluate the drafter as shipped
    after = evaluate(drafter, target, eval_taps, eval_seqs, args.prompt_len, weights, num_anchors=args.num_anchors)
    metrics = {"steps": steps_done, "batch": args.batch, "train_seconds": sum(h["seconds"] for h in history),
               "runs": history, "data_seconds": data_s,
               "params": int(n_params), "final_train_loss": float(np.mean([c["loss"] for c in curve[-20:]])),
               "heldout_before": before, "heldout_after": after, "storage_dtype": args.storage_dtype}
    print(json.dumps(metrics, indent=1))
    with open(os.path.join(args.target, "manifest.json")) as f:
        target_manifest = json.load(f)
    manifest = {"command": "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
                                                + (argv if argv is not None else sys.argv[1:])),
                "commit": args.commit or data_lib.git_commit(), "args": vars(args), "data": info,
                "target": os.path.relpath(os.path.abspath(args.target), ROOT),
                "target_commit": target_manifest.get("commit"), "metrics": metrics,
                "drafter_config": drafter_config_to_dict(dcfg)}
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.copy(os.path.join(args.target, "tokenizer.json"), os.path.join(args.out, "tokenizer.json"))
    write_curve(args.out, curve, f"DFlash drafter {n_params / 1e6:.1f}M, block {dcfg.block_size}, gamma {args.gamma}")
    print(f"wrote {args.out}")
    return metrics


if __name__ == "__main__":
    main()

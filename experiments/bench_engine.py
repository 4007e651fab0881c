"""Engine benchmark: tokens/s of AR, DFlash and DDTree, one round split into its phases, the
no-host-sync check, per-layer step cost vs tokens per step (for full-size projections), and the INT4
kernel path vs the XLA path of the routed experts (section ``kernel``).

    PYTHONPATH=. python experiments/bench_engine.py --size full --layers 4 --out DIR   # H200
    PYTHONPATH=. python experiments/bench_engine.py --size tiny                        # CPU smoke run
    PYTHONPATH=. python experiments/bench_engine.py --size full --layers 4 --sections kernel --out DIR

Section ``kernel``: the same random target twice in one run, as built (compressed-tensors experts, XLA
routed path) and after ``prepare_for_kernels`` (Mosaic GPU INT4 kernel on CUDA, its twin elsewhere); for
M in --kernel-ms: one full MoE decoder layer (MLA over a 1K prefix + MoE) at M tokens per step, and
the target's verify forward over B streams x T block tokens (M = B*T, random trees on a
--prompt-len prefix). Prints ms of both paths, the speedup and the relative difference of the outputs.

Section ``prefill``: one stream's prompt of P tokens (--prefill-lens) prefilled in blocks of each size of
--prefill-chunks (0: one block; ``decode.prefill``): ms, tokens/s and XLA's scratch bytes of the program.

    PYTHONPATH=. python experiments/bench_engine.py --size full --layers 4 --prepare-kernels --sections prefill \
        --prefill-lens 512,8192 --prefill-chunks 0,512,2048,4096 --out DIR

Weights are random and generated on the device (INT4 experts as random nibbles + scales), so the
acceptance length here means nothing (a random drafter); the timings do.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax import decode as decode_lib  # noqa: E402
from ddtree_jax.cache import commit, init_cache  # noqa: E402
from ddtree_jax.config import QuantConfig, k26_config, tiny_config  # noqa: E402
from ddtree_jax.drafter import DFlashDrafter, k26_drafter_config, tiny_drafter_config  # noqa: E402
from ddtree_jax.engine import MODES, Engine, EngineConfig, RUNNING, _run_rounds, place_caches  # noqa: E402
from ddtree_jax.model import KimiModel, Runtime, causal_mask  # noqa: E402
from ddtree_jax.moe import prepare_for_kernels  # noqa: E402
from ddtree_jax.rope import rope_cos_sin  # noqa: E402
from ddtree_jax.hf_loader import ShapeOnlyRngs  # noqa: E402
from ddtree_jax.memory_plan import array_bytes  # noqa: E402
from ddtree_jax.quant import QuantArray  # noqa: E402
from ddtree_jax.sharding import DEFAULT_RULES, named_sharding  # noqa: E402
from ddtree_jax.tree import accept_tokens, build_tree, sample_target_tokens  # noqa: E402
from experiments.bench_util import (measure_copy_bandwidth, measure_torch_copy_bandwidth, print_table,  # noqa: E402
                                    kernel_totals, launches_by_name, time_fn, trace_kernel_events, write_result)


@functools.lru_cache(maxsize=None)
def _maker(kind: str, shape: tuple, dtype, sharding):
    """A jitted maker of one kind of random array (compiled once per kind, shape, dtype and placement)."""
    def make(key):
        if kind == "bits":  # INT4 words: random nibbles
            return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)
        if kind == "scale":
            return jax.random.uniform(key, shape, jnp.float32, 0.001, 0.003).astype(dtype)
        if kind in ("ones", "zeros"):
            return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.jit(make, out_shardings=sharding)


def random_state(abstract_state, seed: int, mesh=None, rules=None):
    """Random weights made on the device, leaf by leaf (norm weights = 1, INT4 = random nibbles). With a
    ``mesh`` each array is made in its shards, placed by its logical axes (``rules``, default
    ``DEFAULT_RULES``): no sharded array exists whole on one device (full K2.6 fits only spread out)."""
    flat = list(abstract_state.flat_state())
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = {}
    for (path, variable), key in zip(flat, keys):
        value = variable.value
        sharding = None
        if mesh is not None:
            sharding = named_sharding(mesh, rules or DEFAULT_RULES, variable.get_metadata()["logical_axes"])
        name = path[-1] if isinstance(path[-1], str) else ""
        if isinstance(value, QuantArray):
            if value.packed.dtype != jnp.int32:
                raise ValueError(f"{path}: random INT4 words are int32, the stack holds {value.packed.dtype}")
            k1, k2 = jax.random.split(key)
            new = QuantArray(_maker("bits", value.packed.shape, jnp.dtype(jnp.int32), sharding)(k1),
                             _maker("scale", value.scale.shape, jnp.dtype(value.scale.dtype), sharding)(k2))
        else:
            kind = "ones" if name == "weight" else "zeros" if path[-2:] == ("router_bias",) else "normal"
            new = _maker(kind, tuple(value.shape), jnp.dtype(value.dtype), sharding)(key)
        out[tuple(path)] = variable.replace(new)
    return nnx.State.from_flat_path(out)


def expert_share(cfg, m: int) -> float:
    """Expected share of the routed experts that M tokens' top-k touches under uniform routing."""
    return 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** m


def weight_share(path, cfg, m: int) -> float:
    """Share of one weight (``path``: its nnx state path) that a step of M tokens reads: the routed experts
    (``w13``, ``w2``) by ``expert_share``, the token embedding table by the M rows it gathers, everything else
    (attention, norms, shared expert, router and its bias, lm head) in full."""
    if path[-1] in ("w13", "w2"):
        return expert_share(cfg, m)
    if path[-1] == "embed":
        return min(m, cfg.vocab_size) / cfg.vocab_size
    return 1.0


def step_weight_bytes(state, cfg, m: int) -> float:
    """Bytes of ``state``'s weights that a step of M tokens reads (each scaled by ``weight_share``)."""
    return sum(weight_share(path, cfg, m) * bytes_of(variable.get_value()) for path, variable in state.flat_state())


def build_models(args):
    if args.size == "full":
        cfg = k26_config(dtype="bfloat16").replace(num_layers=args.layers)
        taps = tuple(range(1, args.layers))[:6] or (0,)
        dcfg = dataclasses.replace(k26_drafter_config(dtype="bfloat16"), target_layer_ids=taps,
                                   num_target_layers=args.layers)
    else:
        cfg = tiny_config(dtype="float32", quant=QuantConfig(group_size=32), vocab_size=512, num_layers=args.layers,
                          hidden_size=256, moe_intermediate_size=256)  # the smallest D, F the INT4 kernels tile
        dcfg = tiny_drafter_config(cfg, block_size=8)
    target_def, target_abs = nnx.split(nnx.eval_shape(lambda: KimiModel(cfg, ShapeOnlyRngs())))
    drafter_def, drafter_abs = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(dcfg, ShapeOnlyRngs())))
    target = nnx.merge(target_def, random_state(target_abs, 0))
    drafter = nnx.merge(drafter_def, random_state(drafter_abs, 1))
    return target, drafter


def bytes_of(tree) -> int:
    """Bytes of every array in ``tree`` (int4 counted as half a byte, unlike ``nbytes``)."""
    return sum(array_bytes(x.shape, x.dtype) for x in jax.tree.leaves(tree))


def bench_engine(target, drafter, args, deadline, rows):
    rng = np.random.default_rng(0)
    vocab = target.cfg.vocab_size
    for mode, budget, streams in args.runs:
        if time.time() > deadline:
            print(f"skipping {mode} streams={streams}: time budget")
            continue
        ecfg = EngineConfig(mode=mode, budget=budget, max_new_tokens=args.new_tokens,
                            capacity=args.prompt_len + args.new_tokens + 64, rounds_per_dispatch=args.new_tokens)
        engine = Engine(target, drafter if mode != "ar" else None, ecfg)
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(streams)]
        t0 = time.perf_counter()
        engine.generate(prompts)  # compile
        compile_s = time.perf_counter() - t0
        res = engine.generate(prompts, seed=1)
        rounds = max(res["rounds"])
        rows.append({"bench": "engine", "mode": mode, "budget": budget if mode == "ddtree" else None,
                     "streams": streams, "tokens": res["new_tokens"], "rounds": rounds,
                     "tau": res["tau_mean"], "decode_s": res["decode_s"],
                     "tok_per_s": res["tokens_per_s"],
                     "ms_per_round": 1e3 * res["decode_s"] / max(rounds, 1),
                     "compile_s": compile_s, **rounds_breakdown(engine, prompts)})
        print({k: v[:8] if k == "kernels" else v for k, v in rows[-1].items()}, flush=True)


def bench_prefill(target, args, deadline, rows, bandwidth):
    """One stream's prompt of P tokens prefilled in blocks of C tokens (``decode.prefill``, C = 0: one block):
    ms (median), tokens/s, the program's scratch memory (XLA's ``temp_size_in_bytes``: what a prefill holds at
    once beside weights and cache) and the floor of reading every weight once (bytes / the copy bandwidth)."""
    graphdef, state = nnx.split(target)
    cfg = target.cfg
    floor_ms = 1e3 * bytes_of(state) / bandwidth  # a prompt of >= 384 tokens touches every expert
    rng = np.random.default_rng(0)
    for length in args.prefill_lens:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, length)), jnp.int32)
        lengths = jnp.array([length], jnp.int32)
        for chunk in args.prefill_chunks:
            if time.time() > deadline:
                print(f"skipping prefill P={length} C={chunk}: time budget")
                continue
            row = {"bench": "prefill", "P": length, "chunk": chunk or "one block",
                   "blocks": decode_lib.prefill_block_shape(length, chunk or None)[1]}
            try:
                compiled = decode_lib._prefill.lower(graphdef, state, init_cache(cfg, 1, length), tokens, lengths,
                                                     runtime=Runtime(), tap_layers=(), chunk=chunk or None).compile()
                memory = compiled.memory_analysis()
                timing = time_fn(lambda: decode_lib.prefill(graphdef, state, init_cache(cfg, 1, length), tokens,
                                                            lengths, chunk=chunk or None), repeats=args.repeats)
                row.update(ms=1e3 * timing["median_s"], tok_per_s=length / timing["median_s"], floor_ms=floor_ms,
                           temp_MB=None if memory is None else memory.temp_size_in_bytes / 1e6)
            except Exception as e:  # e.g. out of memory at one block: the row says so, the others still run
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(row, flush=True)


def check_lengths(text: str, flag: str, least: int) -> list[int]:
    """A comma list of integers >= ``least`` (``flag`` names it in the ValueError)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated integers") from None
    if any(v < least for v in values):
        raise ValueError(f"{flag} {text!r}: each must be at least {least}")
    return values


def parse_runs(text: str, budget: int) -> list[tuple[str, int, int]]:
    """'MODE:STREAMS,...' -> [(mode, budget, streams)] (budget 1 but for ddtree); ValueError naming the bad one."""
    runs = []
    for item in text.split(","):
        mode, _, streams = item.partition(":")
        if mode not in MODES or not streams.isdigit() or int(streams) < 1:
            raise ValueError(f"--runs item {item!r} must be MODE:STREAMS with MODE one of {MODES}, STREAMS >= 1")
        runs.append((mode, budget if mode == "ddtree" else 1, int(streams)))
    return runs


def bench_round_split(target, drafter, args, rows):
    """One DDTree round split into draft / build / verify / accept(+commit), each jitted alone."""
    ecfg = EngineConfig(mode="ddtree", budget=args.budget, max_new_tokens=8,
                        capacity=args.prompt_len + 128, rounds_per_dispatch=1)
    engine = Engine(target, drafter, ecfg)
    rng = np.random.default_rng(1)
    state = engine.prefill([rng.integers(0, target.cfg.vocab_size, args.prompt_len).tolist()])
    tdef, tstate, ddef, dstate = engine.target_def, engine.target_state, engine.drafter_def, engine.drafter_state
    taps, depth = engine.taps, engine.depth

    @jax.jit
    def draft(tstate, dstate, state):
        t, d = nnx.merge(tdef, tstate), nnx.merge(ddef, dstate)
        dc, _ = d.append_context(state.draft_cache, state.ctx_taps, state.ctx_start[:, None] + jnp.arange(depth + 1),
                                 state.ctx_counts)
        block = jnp.concatenate([state.bonus[:, None], jnp.full((1, d.cfg.block_size - 1), d.cfg.mask_token_id)], 1)
        hidden = d(dc, t.embed_tokens(block), state.cache.lengths[:, None] + jnp.arange(d.cfg.block_size))
        return jax.nn.log_softmax(t.head(hidden[:, 1:]), -1)

    build = jax.jit(lambda lp, root: build_tree(lp, root, args.budget))

    @jax.jit
    def verify(tstate, tree, cache):
        t = nnx.merge(tdef, tstate)
        out = t(tree.tokens, tree.positions(cache.lengths), cache, tree.visibility, tap_layers=taps)
        return out.logits, out.block_kv, out.taps

    @jax.jit
    def accept(tree, logits, block_kv, cache, key):
        acc = accept_tokens(tree, sample_target_tokens(logits, 0.0, key))
        cache, _ = commit(cache, block_kv, jnp.maximum(acc.path, 0), acc.num_accepted + 1)
        return acc.num_accepted, cache.lengths

    logprobs = draft(tstate, dstate, state)
    tree = build(logprobs, state.bonus)
    logits, block_kv, _ = verify(tstate, tree, state.cache)
    phases = {
        "draft": time_fn(draft, tstate, dstate, state, repeats=args.repeats),
        "build": time_fn(build, logprobs, state.bonus, repeats=args.repeats),
        "verify": time_fn(verify, tstate, tree, state.cache, repeats=args.repeats),
        "accept+commit": time_fn(accept, tree, logits, block_kv, state.cache, jax.random.key(0), repeats=args.repeats),
    }
    calls = {"draft": (draft, (tstate, dstate, state)), "build": (build, (logprobs, state.bonus)),
             "verify": (verify, (tstate, tree, state.cache)),
             "accept+commit": (accept, (tree, logits, block_kv, state.cache, jax.random.key(0)))}
    for name, t in phases.items():
        fn, fn_args = calls[name]
        rows.append({"bench": "round_split", "phase": name, "budget": args.budget, "ms": 1e3 * t["median_s"],
                     **device_breakdown(fn, fn_args)})
        print({k: v[:8] if k == "kernels" else v for k, v in rows[-1].items()}, flush=True)
        if args.hlo and args.out:
            with open(os.path.join(args.out, f"hlo_{name.replace('+', '_')}.txt"), "w") as f:
                f.write(fn.lower(*fn_args).compile().as_text())
    return engine, state


def rounds_breakdown(engine: Engine, prompts) -> dict:
    """The device's side of ``engine.run`` from one prefilled state (the programs ``generate`` compiled):
    per round, span and busy time (ms) and every kernel ([name, launches, µs], summed over the rounds).
    The state is copied for each call (the rounds donate it); those copies are in the trace, ~µs."""
    prefilled = engine.prefill(prompts, seed=1)
    rounds = int(np.asarray(engine.run(jax.tree.map(jnp.copy, prefilled)).rounds).max())
    found = device_breakdown(lambda st: engine.run(jax.tree.map(jnp.copy, st)), (prefilled,))
    if "device_error" in found:
        return found
    return {"rounds_traced": rounds, "device_ms_per_round": found["device_span_ms"] / max(rounds, 1),
            "device_busy_ms_per_round": found["device_busy_ms"] / max(rounds, 1),
            "launches_per_round": found["launches"] / max(rounds, 1), "kernels": found["kernels"]}


def device_breakdown(fn, args) -> dict:
    """One traced call of ``fn(*args)``: its device span and busy time (ms; the wall-clock ``ms`` beside
    them also holds the dispatch) and its kernels by summed time ([name, launches, µs], longest first)."""
    events = trace_kernel_events(fn, args)
    if not events:
        return {"device_error": "the profiler trace holds no kernel events"}
    span = max(s + d for _, s, d, _ in events) - events[0][1]
    kernels = [[n, int(k), round(sec * 1e6, 2)] for n, k, sec in kernel_totals(launches_by_name(events))]
    return {"device_span_ms": span / 1e6, "device_busy_ms": sum(e[2] for e in events) / 1e6,
            "launches": len(events), "kernels": kernels}


def bench_no_host_sync(engine, args, rows):
    """Rounds inside one dispatch run under a transfer guard that forbids implicit host transfers,
    and N rounds in one dispatch cost about N rounds (no per-round host round-trip)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, engine.cfg.vocab_size, args.prompt_len).tolist()]
    n = 16
    ecfg = dataclasses.replace(engine.ecfg, rounds_per_dispatch=n, max_new_tokens=10 * n)
    engine16 = Engine.__new__(Engine)
    engine16.__dict__.update(engine.__dict__, ecfg=ecfg)
    state = engine16.prefill(prompts)
    no_floor = jnp.int32(0)  # on the device before the transfer guard below
    run = lambda st: _run_rounds(engine16.target_def, engine16.target_state, engine16.drafter_def,  # noqa: E731
                                 engine16.drafter_state, st, no_floor, ecfg=ecfg, runtime=engine16.runtime,
                                 taps=engine16.taps, depth=engine16.depth)
    state = run(state)  # compile
    jax.block_until_ready(state.bonus)
    with jax.transfer_guard("disallow"):
        t0 = time.perf_counter()
        state = run(state)
        jax.block_until_ready(state.bonus)
        elapsed = time.perf_counter() - t0
    rounds = int(np.asarray(state.rounds)[0])
    rows.append({"bench": "no_host_sync", "rounds_in_dispatch": n, "dispatch_ms": 1e3 * elapsed,
                 "ms_per_round": 1e3 * elapsed / n, "transfer_guard": "disallow (passed)",
                 "still_running": bool(np.asarray(state.status)[0] == RUNNING), "rounds_total": rounds})
    print(rows[-1], flush=True)


def bench_layer_cost(target, args, deadline, rows, bandwidth):
    """One MoE decoder layer at M tokens per step (B=1 stream, T=M block, 1K-token prefix)."""
    cfg = target.cfg
    layer = target.layers[cfg.first_k_dense_replace]
    ldef, lstate = nnx.split(layer)
    prefix = 1024
    for m in (1, 9, 33, 65, 264, 528):
        if time.time() > deadline:
            break
        x = 0.1 * jax.random.normal(jax.random.key(m), (1, m, cfg.hidden_size), jnp.dtype(cfg.dtype))
        kv = jnp.zeros((1, prefix + m, cfg.latent_dim), jnp.dtype(cfg.dtype))
        cos, sin = rope_cos_sin(prefix + jnp.arange(m)[None], cfg.rope, cfg.qk_rope_head_dim)

        @jax.jit
        def step(lstate, x, kv):
            lay = nnx.merge(ldef, lstate)
            return lay(x, cos, sin, kv, jnp.array([prefix]), causal_mask(1, m), Runtime())[0]

        t = time_fn(step, lstate, x, kv, repeats=args.repeats)["median_s"]
        moved = step_weight_bytes(lstate, cfg, m)
        rows.append({"bench": "layer", "M": m, "ms": 1e3 * t, "bytes_floor_MB": moved / 1e6,
                     "floor_ms": 1e3 * moved / bandwidth, "pct_of_bw": 100 * moved / bandwidth / t,
                     "projected_61_layers_ms": 61 * 1e3 * t})
        print(rows[-1], flush=True)


def verify_shape(m: int) -> tuple[int, int]:
    """(streams B, block tokens T) of a verify step with M = B*T tokens: one stream up to 65 tokens
    (a DDTree-64 tree), else streams of 66-token trees."""
    if m <= 65:
        return 1, m
    if m % 66:
        raise ValueError(f"M={m}: above 65 tokens the verify step uses streams of 66-token trees")
    return m // 66, 66


def random_verify_inputs(rng, cfg, b: int, t: int, prefix: int, runtime: Runtime = Runtime()):
    """A verify step's inputs: ``b`` random trees (``random_trees``) of ``t`` random tokens over ``prefix`` committed
    rows of an empty latent cache, placed on the runtime's mesh (``place_caches``): tokens [B, T], positions [B, T],
    cache, visibility [B, T, T]."""
    depth, vis = random_trees(rng, b, t)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    cache = dataclasses.replace(init_cache(cfg, b, prefix + t), lengths=jnp.full((b,), prefix, jnp.int32))
    cache, _ = place_caches(cache, None, runtime)
    return tokens, jnp.asarray(prefix + depth, jnp.int32), cache, jnp.asarray(vis)


def random_trees(rng, b: int, t: int):
    """[B, T] parents-first random trees: depths [B, T] and ancestor-or-self visibility [B, T, T]."""
    depth = np.zeros((b, t), np.int32)
    vis = np.zeros((b, t, t), bool)
    for i in range(b):
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, t)]
        for j in range(t):
            depth[i, j] = depth[i, parents[j]] + 1 if j else 0
            k = j
            while k >= 0:
                vis[i, j, k] = True
                k = parents[k]
    return depth, vis


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_kernel_path(target, args, deadline, rows, bandwidth):
    """INT4 kernel path vs XLA path on the same weights: one MoE layer per M, then the verify forward."""
    t0 = time.time()
    prepared = prepare_for_kernels(nnx.clone(target))  # shares every non-expert array with ``target``
    jax.block_until_ready(jax.tree.leaves(nnx.state(prepared)))
    print(f"prepare_for_kernels: {time.time() - t0:.1f}s ({jax.default_backend()}: "
          f"{'INT4 kernel' if jax.default_backend() == 'gpu' else 'pure-JAX twin'} on the prepared side)", flush=True)
    cfg = target.cfg
    idx = cfg.first_k_dense_replace
    dt = jnp.dtype(cfg.dtype)
    ms = [int(v) for v in args.kernel_ms.split(",")]
    layers = {"xla": nnx.split(target.layers[idx]), "kernel": nnx.split(prepared.layers[idx])}
    layer_state, target_state = nnx.state(target.layers[idx]), nnx.state(target)
    prefix = 1024
    for m in ms:  # one MoE decoder layer
        if time.time() > deadline:
            print(f"kernel_layer: skipping M={m} and up (time budget)")
            break
        x = 0.1 * jax.random.normal(jax.random.key(m), (1, m, cfg.hidden_size), dt)
        kv = jnp.zeros((1, prefix + m, cfg.latent_dim), dt)
        cos, sin = rope_cos_sin(prefix + jnp.arange(m)[None], cfg.rope, cfg.qk_rope_head_dim)
        row = {"bench": "kernel_layer", "M": m}
        outs = {}
        for path, (ldef, lstate) in layers.items():
            step = jax.jit(lambda st, x, kv, ldef=ldef: nnx.merge(ldef, st)(
                x, cos, sin, kv, jnp.array([prefix]), causal_mask(1, m), Runtime())[0])
            try:
                t1 = time.perf_counter()
                outs[path] = jax.block_until_ready(step(lstate, x, kv))
                row[f"{path}_compile_s"] = time.perf_counter() - t1
                row[f"{path}_ms"] = 1e3 * time_fn(step, lstate, x, kv, repeats=args.repeats)["median_s"]
                if path == "kernel" and m == ms[0]:
                    text = step.lower(lstate, x, kv).as_text()  # Mosaic GPU ("tiles") or Triton ("planar")
                    row["kernel_in_program"] = "mosaic_gpu" in text or "int4_moe_gate_up" in text
            except Exception as e:  # keep the other path's numbers
                row[f"{path}_error"] = f"{type(e).__name__}: {e}"[:300]
        floor_s = step_weight_bytes(layer_state, cfg, m) / bandwidth
        row["floor_ms"] = 1e3 * floor_s
        if "xla_ms" in row and "kernel_ms" in row:
            row["speedup"] = row["xla_ms"] / row["kernel_ms"]
            row["kernel_pct_of_bw"] = 100 * 1e3 * floor_s / row["kernel_ms"]
            row["rel_diff"] = rel_diff(outs["kernel"].astype(jnp.float32), outs["xla"].astype(jnp.float32))
        rows.append(row)
        print(row, flush=True)

    rng = np.random.default_rng(3)
    graphs = {"xla": nnx.split(target), "kernel": nnx.split(prepared)}
    p = args.prompt_len
    for m in ms:  # the verify forward of the whole target
        if time.time() > deadline:
            print(f"kernel_verify: skipping M={m} and up (time budget)")
            break
        b, t = verify_shape(m)
        tokens, positions, cache, vis = random_verify_inputs(rng, cfg, b, t, p)
        row = {"bench": "kernel_verify", "M": m, "streams": b, "tree_tokens": t, "prefix": p}
        # floor: the weights M tokens read (``step_weight_bytes``) and the streams' latent caches of the prefix
        floor_s = (step_weight_bytes(target_state, cfg, m)
                   + b * p * cfg.num_layers * cfg.latent_dim * dt.itemsize) / bandwidth
        row["floor_ms"] = 1e3 * floor_s
        outs = {}
        for path, (gdef, gstate) in graphs.items():
            fwd = jax.jit(lambda st, tok, pos, c, v, gdef=gdef: nnx.merge(gdef, st)(tok, pos, c, v).logits)
            try:
                t1 = time.perf_counter()
                outs[path] = jax.block_until_ready(fwd(gstate, tokens, positions, cache, vis))
                row[f"{path}_compile_s"] = time.perf_counter() - t1
                row[f"{path}_ms"] = 1e3 * time_fn(fwd, gstate, tokens, positions, cache, vis,
                                                  repeats=args.repeats)["median_s"]
            except Exception as e:
                row[f"{path}_error"] = f"{type(e).__name__}: {e}"[:300]
        if "xla_ms" in row and "kernel_ms" in row:
            row["speedup"] = row["xla_ms"] / row["kernel_ms"]
            row["kernel_pct_of_bw"] = 100 * 1e3 * floor_s / row["kernel_ms"]
            row["rel_diff"] = rel_diff(outs["kernel"], outs["xla"])
            agree = np.asarray(outs["kernel"]).argmax(-1) == np.asarray(outs["xla"]).argmax(-1)
            row["argmax_agree"] = float(np.mean(agree))
        rows.append(row)
        print(row, flush=True)


SECTIONS = ("layer", "round_split", "no_host_sync", "engine", "kernel", "prefill")


def check_sections(text: str) -> list[str]:
    """--sections -> its names; ValueError for an unknown or repeated name, or no_host_sync without
    round_split before it (it reuses that section's engine)."""
    names = text.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"--sections: unknown {unknown}; known: {', '.join(SECTIONS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--sections {text!r} names a section twice")
    engine_made = names.index("round_split") if "round_split" in names else len(names)
    if "no_host_sync" in names and names.index("no_host_sync") < engine_made:
        raise ValueError("--sections: no_host_sync reuses round_split's engine; put round_split before it")
    return names


def check_kernel_ms(text: str) -> list[int]:
    """--kernel-ms -> its M values; ValueError for one that is not a positive integer or not a verify
    step's size (``verify_shape``: up to 65, else a multiple of 66)."""
    try:
        ms = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--kernel-ms {text!r} must be comma-separated integers") from None
    for m in ms:
        if m < 1:
            raise ValueError(f"--kernel-ms: M={m} must be at least 1")
        verify_shape(m)
    return ms


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=["full", "tiny"], default="tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-budget-s", type=float, default=400)
    p.add_argument("--sections", default="layer,round_split,no_host_sync,engine,kernel",
                   help=f"comma list of {', '.join(SECTIONS)}, run in the order given (no_host_sync reuses the "
                        "engine of round_split: after it)")
    p.add_argument("--runs", default="ar:1,dflash:1,ddtree:1,ddtree:4,ar:4",
                   help="section engine: MODE:STREAMS,... (ddtree at --budget)")
    p.add_argument("--kernel-ms", default="1,9,33,65,264,528", help="tokens per step M of section kernel")
    p.add_argument("--prefill-lens", default="1024,4096", help="section prefill: prompt lengths P")
    p.add_argument("--prefill-chunks", default="0,512,2048", help="section prefill: block sizes (0: one block)")
    p.add_argument("--prepare-kernels", action="store_true",
                   help="run every section on the target after prepare_for_kernels (the INT4 kernel's layout), "
                        "as a user on a GPU would; not with section kernel, which compares both paths itself")
    p.add_argument("--hlo", action="store_true", help="section round_split: write each phase's optimized HLO to --out")
    p.add_argument("--commit", default=None, help="commit hash to record (the device copy has no git)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        args.runs = parse_runs(args.runs, args.budget)
        check_sections(args.sections)
        check_kernel_ms(args.kernel_ms)
        args.prefill_lens = check_lengths(args.prefill_lens, "--prefill-lens", 1)
        args.prefill_chunks = check_lengths(args.prefill_chunks, "--prefill-chunks", 0)
    except ValueError as e:
        p.error(str(e))
    for flag, value, least in (("--repeats", args.repeats, 1), ("--budget", args.budget, 1),
                               ("--layers", args.layers, 2)):  # 2 layers: the first dense, one MoE
        if value < least:
            p.error(f"{flag} {value}: must be at least {least}")
    if not args.time_budget_s > 0:
        p.error(f"--time-budget-s {args.time_budget_s}: must be > 0")
    if args.hlo and (not args.out or "round_split" not in args.sections.split(",")):
        p.error("--hlo writes the round split's phases into --out: give --out and section round_split")
    if args.prepare_kernels and "kernel" in args.sections.split(","):
        p.error("--prepare-kernels prepares the target for every section; section kernel compares the XLA and "
                "kernel paths itself: leave it out of --sections")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    start = time.time()
    deadline = start + args.time_budget_s
    rows = []
    bandwidth = measure_torch_copy_bandwidth() or measure_copy_bandwidth(1 << 28 if args.size == "tiny" else 1 << 30)
    target, drafter = build_models(args)
    if args.prepare_kernels:
        target = prepare_for_kernels(target)
    print(f"built: target {bytes_of(nnx.state(target)) / 1e9:.2f} GB,"
          f" drafter {bytes_of(nnx.state(drafter)) / 1e9:.2f} GB,"
          f" copy bandwidth {bandwidth / 1e12:.2f} TB/s, {time.time() - start:.0f}s", flush=True)
    engines = {}
    sections = {
        "layer": lambda: bench_layer_cost(target, args, deadline, rows, bandwidth),
        "round_split": lambda: engines.update(ddtree=bench_round_split(target, drafter, args, rows)[0]),
        "no_host_sync": lambda: bench_no_host_sync(engines["ddtree"], args, rows),
        "engine": lambda: bench_engine(target, drafter, args, deadline, rows),
        "kernel": lambda: bench_kernel_path(target, args, deadline, rows, bandwidth),
        "prefill": lambda: bench_prefill(target, args, deadline, rows, bandwidth),
    }
    for name in args.sections.split(","):
        if time.time() > deadline:
            print(f"skipping {name}: time budget")
            continue
        try:
            sections[name]()
        except Exception as e:  # keep what was measured; report the failure
            rows.append({"bench": name, "error": f"{type(e).__name__}: {e}"[:500]})
            print(rows[-1], flush=True)
    payload = {"config": vars(args), "copy_bandwidth_Bps": bandwidth, "rows": rows,
               "target_bytes": bytes_of(nnx.state(target)), "drafter_bytes": bytes_of(nnx.state(drafter))}
    if args.commit:
        payload["code_commit"] = args.commit  # write_result records it as the commit (the device has no git)
    path = write_result(f"bench_engine_{args.size}", payload, args.out)
    for bench in ("layer", "round_split", "engine", "no_host_sync", "kernel_layer", "kernel_verify", "prefill"):
        sel = [r for r in rows if r.get("bench") == bench]
        if sel:
            print(f"\n== {bench}")
            print_table(sel, list(dict.fromkeys(k for r in sel for k in r if k not in ("bench", "kernels"))))
    print(f"\nwrote {path}; total {time.time() - start:.0f}s")
    failed = [r["bench"] for r in rows if "error" in r]
    if failed:
        sys.exit(f"sections failed: {', '.join(failed)} (their error rows are in {path})")


if __name__ == "__main__":
    main()

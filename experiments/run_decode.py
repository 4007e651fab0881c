"""Decode prompts with the target alone (AR), DFlash chains, or DDTree, and report acceptance and speed.

    python experiments/run_decode.py        # shipped trained pair, held-out prompts, AR / DFlash / DDTree
    python experiments/run_decode.py --target DIR --drafter DIR --mode ddtree --budget 64 --compare
    python experiments/run_decode.py --target random --drafter random --prompt-ids "1 2 3" --json out.json

Defaults: the trained K2-architecture target and DFlash drafter shipped in ``checkpoints/`` (see their
``manifest.json``), eight prompts cut from held-out standard-library files (``experiments/data.py``).
``--target``: an HF checkpoint directory (config.json + safetensors), a ddtree-jax Orbax checkpoint
(``experiments/convert_checkpoint.py``), or ``random`` (a tiny random K2-architecture model with INT4
experts). ``--drafter``: an HF DFlash drafter directory or ``random``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time
from typing import Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax.checkpoint import (INDEX_FILE, checkpoint_config, is_drafter_checkpoint,  # noqa: E402
                                   restore_drafter, restore_model)
from ddtree_jax.config import QuantConfig, tiny_config  # noqa: E402
from ddtree_jax.drafter import DFlashDrafter, load_hf_drafter, tiny_drafter_config  # noqa: E402
from ddtree_jax.engine import EOS, Engine, EngineConfig, inspect_round  # noqa: E402
from ddtree_jax.hf_loader import load_hf_model  # noqa: E402
from ddtree_jax.model import KimiModel  # noqa: E402
from ddtree_jax.tokenizer import load_tokenizer  # noqa: E402
from experiments import bench_util  # noqa: E402

CHECKPOINTS = os.path.join(ROOT, "checkpoints")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(CHECKPOINTS, "target"),
                   help="HF dir, ddtree-jax Orbax checkpoint, or 'random' (tiny random INT4 model)")
    p.add_argument("--drafter", default=os.path.join(CHECKPOINTS, "drafter"),
                   help="HF DFlash drafter dir, ddtree-jax drafter checkpoint, or 'random'")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    src.add_argument("--prompt-ids", action="append", help="space-separated token ids (repeatable)")
    src.add_argument("--prompts-file", help="file with one prompt per line")
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts when no prompt is given")
    p.add_argument("--mode", choices=["ar", "dflash", "ddtree", "all"], default="all")
    p.add_argument("--budget", type=int, default=64, help="DDTree node budget")
    p.add_argument("--streams", type=int, default=None, help="streams decoded together (default: #prompts)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--capacity", type=int, default=512, help="cache slots per stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    bench_util.add_matmul_precision_arg(p, "float32")
    p.add_argument("--compare", action="store_true", help="also run AR and report the speedup")
    p.add_argument("--json", help="write generated ids and metrics here")
    return p.parse_args(argv)


def load_models(args):
    if args.target == "random":
        cfg = tiny_config(dtype=args.dtype, quant=QuantConfig(group_size=32), vocab_size=512, num_layers=4)
        target = KimiModel(cfg, nnx.Rngs(args.seed))
    elif os.path.exists(os.path.join(args.target, INDEX_FILE)):  # our Orbax checkpoint
        target = restore_model(args.target, checkpoint_config(args.target).replace(dtype=args.dtype))
    else:  # an HF directory
        target = load_hf_model(args.target, dtype=args.dtype)
    drafter = None
    if args.mode != "ar":
        if args.drafter == "random":
            drafter = DFlashDrafter(tiny_drafter_config(target.cfg), nnx.Rngs(args.seed + 1))
        elif is_drafter_checkpoint(args.drafter):
            drafter = restore_drafter(args.drafter, dtype=args.dtype)
        else:
            drafter = load_hf_drafter(args.drafter, dtype=args.dtype)
    return target, drafter


def load_pair(args):
    """(target, drafter or None, tokenizer, eos_ids) for ``args`` as ``main`` uses them."""
    target, drafter = load_models(args)
    tokenizer = load_tokenizer(None if args.target == "random" else args.target, target.cfg.vocab_size)
    eos_ids = tuple(target.cfg.eos_token_ids) if args.target != "random" else ()
    return target, drafter, tokenizer, eos_ids


def read_prompts(args, tokenizer):
    if args.prompt_ids:
        return [[int(t) for t in s.split()] for s in args.prompt_ids]
    if args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        return [tokenizer.encode(t) for t in texts]
    if args.prompt:
        return [tokenizer.encode(t) for t in args.prompt]
    from experiments import data as data_lib  # held-out standard-library files (never trained on)

    held, _ = data_lib.load_texts("heldout", allow_mismatch=True)  # a differing stdlib is reported, not fatal
    return [q["ids"] for q in data_lib.eval_prompts(tokenizer, held, n=args.num_prompts, min_tokens=64,
                                                     max_tokens=128, seed=args.seed)]


def draw_tree(tree_tokens, parents, accepted_path, tokenizer, max_children=3, max_depth=4):
    """A small text picture of one verified tree: accepted nodes marked '*', at most ``max_children``
    children per node (accepted first) and ``max_depth`` levels; hidden nodes are counted."""
    children = {i: [] for i in range(len(parents))}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    accepted = set(int(n) for n in accepted_path if n >= 0)
    lines = [f"*{tokenizer.decode([int(tree_tokens[0])])!r}  (root = bonus token)"]

    def subtree_size(node):
        return 1 + sum(subtree_size(k) for k in children[node])

    def visit(node, prefix, depth):
        kids = sorted(children[node], key=lambda k: (k not in accepted, k))
        shown = kids[:max_children] if depth < max_depth else []
        hidden = sum(subtree_size(k) for k in kids[len(shown):])
        for i, kid in enumerate(shown):
            last = i == len(shown) - 1 and not hidden
            mark = "*" if kid in accepted else " "
            lines.append(f"{prefix}{'└─' if last else '├─'}{mark}{tokenizer.decode([int(tree_tokens[kid])])!r}")
            visit(kid, prefix + ("   " if last else "│  "), depth + 1)
        if hidden:
            lines.append(f"{prefix}└─ … {hidden} more nodes")

    visit(0, "", 1)
    return "\n".join(lines)


def split_batches(prompts, streams):
    """Consecutive batches of ``streams`` prompts (the last one may be smaller)."""
    return [prompts[i:i + streams] for i in range(0, len(prompts), streams)]


def merge_results(results):
    """Joins ``Engine.generate`` results of consecutive batches: (tokens, status, metrics).

    tau: tokens emitted per stream-round incl. the bonus (the prefill token excluded), as the engine
    counts it; tokens_per_round_batch: all new tokens / rounds run (a batch runs as many rounds as its
    longest stream); tokens_per_s: new tokens / decode time (prefill excluded); tau_hist[k]: stream-rounds
    that emitted k tokens.
    """
    tokens = [t for r in results for t in r["tokens"]]
    status = [s for r in results for s in r["status"]]
    rounds = sum(sum(r["rounds"]) for r in results)
    emitted = sum(r["new_tokens"] - len(r["tokens"]) for r in results)  # minus the prefill token per stream
    decode_s = sum(r["decode_s"] for r in results)
    new_tokens = sum(r["new_tokens"] for r in results)
    metrics = {
        "tau": emitted / max(rounds, 1), "rounds": rounds,
        "tokens_per_round_batch": new_tokens / max(sum(max(r["rounds"]) for r in results), 1),
        "tokens_per_s": new_tokens / decode_s if decode_s else float("nan"),
        "new_tokens": new_tokens, "decode_s": decode_s, "prefill_s": sum(r["prefill_s"] for r in results),
        "tau_hist": np.sum([r["tau_hist"] for r in results], axis=0).tolist(),
    }
    return tokens, status, metrics


def warm_up(engine: Engine, batches, temperature: float) -> float:
    """Compiles every program a pass over ``batches`` uses (prefill per padded shape, the round loop per
    batch size) without decoding: after each prefill the round loop is entered with every stream already
    stopped (so also at a smaller last batch's size). Returns seconds."""
    t0 = time.perf_counter()
    for batch in batches:
        state = engine.prefill(batch, temperature)
        state = dataclasses.replace(state, status=state.status * 0 + EOS)  # derived, so placed like the real one
        jax.block_until_ready(engine.run(state, temperature).out_tokens)
    return time.perf_counter() - t0


def warm_up_all(jobs: Sequence[tuple[Engine, list, float]], workers: int) -> tuple[list[float], dict]:
    """``warm_up`` of every (engine, batches, temperature) in a pool of ``workers`` threads.

    Returns each job's seconds (in threads: its own wall, stretched by the jobs alongside) and the wall of
    all with the XLA compiles and their summed seconds (above the wall where compiles overlapped)."""
    precision = jax.config.jax_default_matmul_precision  # thread-local and in the jit cache key: pass it on

    def warm(engine, batches, temperature):
        with jax.default_matmul_precision(precision):
            return warm_up(engine, batches, temperature)

    t0 = time.perf_counter()
    with bench_util.counting_compiles() as compiles, concurrent.futures.ThreadPoolExecutor(workers) as pool:
        seconds = [f.result() for f in [pool.submit(warm, *job) for job in jobs]]
    return seconds, {"compile_wall_s": time.perf_counter() - t0, "xla_compiles": len(compiles),
                     "xla_compile_s_sum": sum(compiles)}


def run_mode(target, drafter, mode, args, prompts, tokenizer, eos_ids):
    ecfg = EngineConfig(mode=mode, budget=args.budget, max_new_tokens=args.max_new_tokens, capacity=args.capacity,
                        eos_ids=eos_ids)
    engine = Engine(target, drafter if mode != "ar" else None, ecfg)
    streams = args.streams or len(prompts)
    batches = split_batches(prompts, streams)
    compile_s = warm_up(engine, batches, args.temperature)
    results = [engine.generate(batch, args.temperature, args.seed + i) for i, batch in enumerate(batches)]
    tokens, status, metrics = merge_results(results)
    metrics = {"mode": mode, "budget": args.budget if mode == "ddtree" else None, "streams": streams, **metrics,
               "compile_s": compile_s}
    picture = None
    if mode == "ddtree":
        tree, acc = inspect_round(engine, prompts[:1], args.temperature, args.seed)
        picture = draw_tree(tree["tokens"], tree["parents"], acc["path"], tokenizer)
    return {"metrics": metrics, "tokens": tokens, "status": status, "tree_picture": picture}


def main(argv=None):
    args = parse_args(argv)
    with jax.default_matmul_precision(args.matmul_precision):
        return _main(args)


def _main(args):
    target, drafter, tokenizer, eos_ids = load_pair(args)
    prompts = read_prompts(args, tokenizer)
    modes = ["ar", "dflash", "ddtree"] if args.mode == "all" else (
        ["ar", args.mode] if args.compare and args.mode != "ar" else [args.mode])
    print(f"target: {args.target}  layers={target.cfg.num_layers} hidden={target.cfg.hidden_size} "
          f"experts={target.cfg.n_routed_experts} int4={target.cfg.quant is not None}  drafter: {args.drafter}  "
          f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    report = {"args": vars(args), "runs": {}}
    for mode in modes:
        report["runs"][mode] = run_mode(target, drafter, mode, args, prompts, tokenizer, eos_ids)
    print()
    print(f"{'mode':>8} {'tau':>6} {'tok/round':>10} {'tok/s':>9} {'rounds':>7} {'compile s':>10}")
    for mode, run in report["runs"].items():
        m = run["metrics"]
        print(f"{mode:>8} {m['tau']:6.2f} {m['tokens_per_round_batch']:10.2f} {m['tokens_per_s']:9.1f} "
              f"{m['rounds']:7d} {m['compile_s']:10.1f}")
    if "ar" in report["runs"]:
        base = report["runs"]["ar"]["metrics"]["tokens_per_s"]
        for mode in modes[1:]:
            run = report["runs"][mode]
            run["speedup_vs_ar"] = run["metrics"]["tokens_per_s"] / base
            run["identical_to_ar"] = run["tokens"] == report["runs"]["ar"]["tokens"]
            print(f"{mode} vs ar: speedup {run['speedup_vs_ar']:.2f}x, outputs identical to AR: "
                  f"{run['identical_to_ar']}" + ("" if args.temperature == 0 else " (sampling: not expected)"))
    last = report["runs"][modes[-1]]
    print("\nfirst stream:", repr(tokenizer.decode(last["tokens"][0])))
    if last["tree_picture"]:
        print("\none verified tree (stream 0, first round; * = accepted path):")
        print(last["tree_picture"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()

"""AR vs DFlash vs DDTree with the trained target (``train_target.py``) and drafter (``train_drafter.py``)
on held-out prompts, through ``run_decode.run_mode``. ``run_decode.py`` itself loads HF directories only;
this script loads our Orbax checkpoints (``ddtree_jax.checkpoint.restore_model`` and
``train_drafter.restore_drafter``) until run_decode learns to.

    python experiments/decode_trained.py --prompts 8 --max-new-tokens 64 --budget 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from ddtree_jax.checkpoint import restore_model  # noqa: E402
from ddtree_jax.tokenizer import load_tokenizer  # noqa: E402
from experiments import data as data_lib  # noqa: E402
from experiments.run_decode import run_mode  # noqa: E402
from experiments.train_drafter import restore_drafter  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(ROOT, "checkpoints", "target"))
    p.add_argument("--drafter", default=os.path.join(ROOT, "checkpoints", "drafter"))
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    p.add_argument("--min-prompt-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=None)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--modes", default="ar,dflash,ddtree")
    p.add_argument("--allow-mismatch", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    target = restore_model(args.target, cfg=None)
    if target.cfg.dtype != args.dtype:
        target = restore_model(args.target, cfg=target.cfg.replace(dtype=args.dtype))
    drafter = restore_drafter(args.drafter, dtype=args.dtype)
    tokenizer = load_tokenizer(args.target, target.cfg.vocab_size)
    held, _ = data_lib.load_texts("heldout", allow_mismatch=args.allow_mismatch)
    prompts = [q["ids"] for q in data_lib.eval_prompts(tokenizer, held, n=args.prompts,
                                                        min_tokens=args.min_prompt_tokens,
                                                        max_tokens=args.max_prompt_tokens, seed=args.seed)]
    eos = tuple(target.cfg.eos_token_ids)
    print(f"target {target.cfg.num_layers}L d{target.cfg.hidden_size} E{target.cfg.n_routed_experts} "
          f"int4={target.cfg.quant is not None}; drafter {drafter.cfg.num_layers}L block {drafter.cfg.block_size}; "
          f"{len(prompts)} held-out prompts; {jax.devices()[0].device_kind}")
    report = {"args": vars(args), "runs": {}}
    t0 = time.perf_counter()
    for mode in args.modes.split(","):
        report["runs"][mode] = run_mode(target, drafter, mode, args, prompts, tokenizer, eos)
    print(f"\n{'mode':>8} {'tau':>6} {'tok/round':>10} {'tok/s':>9} {'rounds':>7} {'compile s':>10}")
    for mode, run in report["runs"].items():
        m = run["metrics"]
        print(f"{mode:>8} {m['tau']:6.2f} {m['tokens_per_round_batch']:10.2f} {m['tokens_per_s']:9.1f} "
              f"{m['rounds']:7d} {m['compile_and_first_run_s']:10.1f}")
    if "ar" in report["runs"]:
        for mode in report["runs"]:
            same = report["runs"][mode]["tokens"] == report["runs"]["ar"]["tokens"]
            report["runs"][mode]["identical_to_ar"] = same
            print(f"{mode}: outputs identical to AR: {same}")
    print("\nfirst stream (last mode):", repr(tokenizer.decode(report["runs"][mode]["tokens"][0])))
    report["wall_s"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

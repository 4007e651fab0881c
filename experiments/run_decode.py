"""Decode prompts with the target alone (AR), DFlash chains, or DDTree, and report acceptance and speed.

    python experiments/run_decode.py        # shipped trained pair, held-out prompts, AR / DFlash / DDTree
    python experiments/run_decode.py --target DIR --drafter DIR --mode ddtree --budget 64 --compare
    python experiments/run_decode.py --target random --drafter random --prompt-ids "1 2 3" --json out.json

Defaults: the trained K2-architecture target and DFlash drafter shipped in ``checkpoints/`` (see their
``manifest.json``), eight prompts cut from held-out standard-library files (``experiments/data.py``; with the
shipped tokenizer and ``--seed 0`` the first 16 of that cut come from ``experiments/heldout_prompts.json``, so they
are the pinned prompts whatever this machine's Python).
``--target``: an HF checkpoint directory (config.json + safetensors), a ddtree-jax Orbax checkpoint
(``experiments/convert_checkpoint.py``), or ``random`` (a tiny random K2-architecture model with INT4
experts). ``--drafter``: an HF DFlash drafter directory, a ddtree-jax drafter checkpoint (the shipped default) or
``random``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import platform
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
from ddtree_jax.engine import (EOS, LOGPROBS_MODES, SEED_LIMIT, Engine, EngineConfig, check_temperature,  # noqa: E402
                               inspect_round, required_capacity, tree_depth)
from ddtree_jax.hf_loader import load_hf_model  # noqa: E402
from ddtree_jax import serving  # noqa: E402
from ddtree_jax.model import KimiModel  # noqa: E402
from ddtree_jax.processors import (check_additive_penalty, check_logit_bias, check_min_new_tokens,  # noqa: E402
                                   check_repetition_penalty)
from ddtree_jax.sampling import check_min_p, check_top_k, check_top_p  # noqa: E402
from ddtree_jax.stop_strings import check_stop_strings  # noqa: E402
from ddtree_jax.tokenizer import TOKENIZER_FILES, load_tokenizer, tokenizer_file  # noqa: E402
from ddtree_jax.tree import check_budget  # noqa: E402
from experiments import bench_util  # noqa: E402

CHECKPOINTS = os.path.join(ROOT, "checkpoints")


MODE_CHOICES = ("ar", "dflash", "ddtree", "all")
DEFAULT_BUDGET = 64
DEFAULT_NUM_PROMPTS = 8
PROMPTS_FILE_HELP = ("JSON Lines file of prompt texts: each line one JSON string, read exactly as JSON decodes it "
                     "(e.g. \"def f(x):\\n    return x\\n\" is two lines of code); blank lines are skipped, "
                     "\\r\\n line ends are fine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(CHECKPOINTS, "target"),
                   help="HF dir, ddtree-jax Orbax checkpoint, or 'random' (tiny random INT4 model)")
    p.add_argument("--drafter", default=None,
                   help="HF DFlash drafter dir, ddtree-jax drafter checkpoint, or 'random' (default: the shipped "
                        "drafter; not for --mode ar)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    src.add_argument("--prompt-ids", action="append", help="space-separated token ids (repeatable)")
    src.add_argument("--prompts-file", help=PROMPTS_FILE_HELP)
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"held-out prompts when no prompt is given (default {DEFAULT_NUM_PROMPTS}; up to 16 of them "
                        "ship in experiments/heldout_prompts.json, more are cut from this machine's stdlib)")
    p.add_argument("--mode", choices=MODE_CHOICES, default="all")
    p.add_argument("--budget", type=int, default=None,
                   help=f"DDTree node budget (default {DEFAULT_BUDGET}; only for --mode ddtree or all)")
    p.add_argument("--streams", type=int, default=None, help="streams decoded together (default: #prompts)")
    p.add_argument("--continuous", action="store_true",
                   help="continuous batching: the prompts in --streams slots, each slot taking the next prompt as "
                        "soon as its stream stops (default: consecutive batches of --streams prompts)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    add_truncation_args(p, "with --temperature > 0")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--capacity", type=int, default=512,
                   help="cache slots per stream: must hold the longest prompt, --max-new-tokens and the mode's "
                        "draft tree (checked before decoding)")
    p.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
                   help="a prompt's prefill runs in blocks of this many tokens, bounding its memory by the block, "
                        "not the prompt (0: the whole prompt in one block; default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help=f"prompt i samples with seed + i, whatever --streams (all in [0, {SEED_LIMIT})); it also "
                        "cuts the held-out prompts (0: the shipped ones, experiments/heldout_prompts.json; another "
                        "seed cuts others from this machine's stdlib) and seeds --target/--drafter random")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="transformers' repetition penalty over the prompt and output tokens, greedy too (1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit per time it is in the output, greedy too; in [-2, 2] (0: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from the logit of a token in the output, greedy too; in [-2, 2] (0: off)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID:AMOUNT",
                   help="added to token ID's logit before sampling, greedy too; in [-100, 100] (repeatable; "
                        "e.g. 13:-100 bans 13)")
    p.add_argument("--allowed-ids", default=None, metavar="IDS",
                   help="space-separated token ids: only these may be generated, greedy too (default: all)")
    p.add_argument("--bad-ids", action="append", default=[], metavar="IDS",
                   help="space-separated token ids (repeatable): the last is never generated right after the others "
                        "(one id: never), greedy too")
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="no EOS, no --stop-ids sequence and no --stop string ends a stream within its first N "
                        "tokens (0: off)")
    p.add_argument("--stop-ids", action="append", default=[],
                   help="space-separated token ids (repeatable): a stream stops once it has generated them in a row "
                        "(kept in its output, like the EOS)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a stream stops once its generated text holds TEXT (repeatable; the token that completes it "
                        "is kept; in bash, $'\\n\\n' is two newlines)")
    p.add_argument("--logprobs", nargs="?", const="raw", choices=LOGPROBS_MODES, default=None,
                   help="also keep each generated token's log-probability: under the target ('raw', the default) or "
                        "under what it was taken from ('processed': logit processing, temperature, filters); report "
                        "each mode's mean per token and perplexity (in --json: per token)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    bench_util.add_matmul_precision_arg(p, "float32")
    p.add_argument("--compare", action="store_true",
                   help="with --mode dflash or ddtree: also run AR and report the speedup (--mode all always does)")
    p.add_argument("--json", help="write generated ids and metrics here")
    p.add_argument("--commit", default=None, help="with --json: the code commit to record (a checkout copied "
                                                  "elsewhere may report a stale git HEAD; default: git's)")
    return p


def add_truncation_args(p: argparse.ArgumentParser, when: str) -> None:
    """--top-k, --top-p and --min-p: the filters of what is sampled (``EngineConfig``); ``when`` leads each help."""
    p.add_argument("--top-k", type=int, default=0, help=f"{when}: sample from the top_k likeliest tokens only (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help=f"{when}: then from the fewest likeliest tokens whose "
                                                         "probability reaches top_p (1: all)")
    p.add_argument("--min-p", type=float, default=0.0, help=f"{when}: then from the tokens at least min_p times as "
                                                         "likely as the likeliest (0: all)")


def parse_args(argv=None):
    """Parsed and checked flags (``check_args``); a bad flag exits with argparse's usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def modes_of(args) -> list[str]:
    """The modes run, in order (AR first whenever it is compared against)."""
    if args.mode == "all":
        return ["ar", "dflash", "ddtree"]
    return ["ar", args.mode] if args.compare else [args.mode]


def check_args(args) -> None:
    """Checks every flag before any model is built and fills in the mode-dependent defaults (``--budget``,
    ``--drafter``, ``--num-prompts``); ValueError naming the flag otherwise. Also reads ``--prompts-file``."""
    modes = modes_of(args)
    check_mode_flags(args, modes)
    for flag, values in (("--stop-ids", args.stop_ids), ("--bad-ids", args.bad_ids)):
        for i, text in enumerate(values):
            parse_ids(text, i, flag)
    parse_logit_bias(args.logit_bias)
    if args.allowed_ids is not None:
        parse_ids(args.allowed_ids, 0, "--allowed-ids")
    try:
        check_stop_strings(args.stop)
    except ValueError as e:
        raise ValueError(f"--stop: {e}") from None
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--capacity", args.capacity),
                        ("--streams", args.streams), ("--num-prompts", args.num_prompts)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 1, or 0 for the whole prompt in one block, "
                         f"got {args.prefill_chunk}")
    for flag, check, value in (("--temperature", check_temperature, args.temperature),
                               ("--top-k", check_top_k, args.top_k), ("--top-p", check_top_p, args.top_p),
                               ("--min-p", check_min_p, args.min_p),
                               ("--repetition-penalty", check_repetition_penalty, args.repetition_penalty),
                               ("--frequency-penalty", lambda v: check_additive_penalty("frequency_penalty", v),
                                args.frequency_penalty),
                               ("--presence-penalty", lambda v: check_additive_penalty("presence_penalty", v),
                                args.presence_penalty),
                               ("--min-new-tokens", check_min_new_tokens, args.min_new_tokens)):
        try:
            check(value)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    if args.min_new_tokens > args.max_new_tokens:
        raise ValueError(f"--min-new-tokens {args.min_new_tokens} passes --max-new-tokens {args.max_new_tokens}")
    if args.temperature == 0 and (args.top_k != 0 or args.top_p != 1 or args.min_p != 0):
        raise ValueError("--top-k, --top-p and --min-p filter what is sampled; greedy decoding (--temperature 0) "
                         "samples nothing: give --temperature > 0")
    for flag, path in (("--target", args.target), ("--drafter", args.drafter)):
        if path not in (None, "random") and not os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is neither a directory nor 'random'")
    if args.target != "random" and tokenizer_file(args.target) is None:
        raise ValueError(f"--target {args.target!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): copy the "
                         "model's tokenizer file there")
    if args.json is not None:
        if not args.json.strip():
            raise ValueError("--json must name a file, got an empty string")
        if os.path.isdir(args.json):
            raise ValueError(f"--json {args.json!r} is a directory: name the report's file")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise ValueError(f"--json {args.json!r}: its directory does not exist")
    if args.commit is not None:
        if not args.json:
            raise ValueError("--commit is recorded in the --json report; give --json too")
        if not args.commit.strip():
            raise ValueError("--commit must name a commit, got an empty string")
    n = count_prompts(args)
    if args.streams is not None and args.streams > n:
        raise ValueError(f"--streams {args.streams} is more than the {n} prompts given")
    if args.continuous and (args.streams is None or args.streams == n):
        raise ValueError(f"--continuous refills --streams slots from the prompts waiting: give --streams fewer than "
                         f"the {n} prompts")
    if not 0 <= args.seed < SEED_LIMIT - (n - 1):
        reason = f" (its {n} prompts sample with --seed + 0..{n - 1})" if n > 1 else ""
        raise ValueError(f"--seed must be in [0, {SEED_LIMIT - (n - 1)}){reason}, got {args.seed}")


def check_mode_flags(args, modes: Sequence[str]) -> None:
    """Flags that only some modes or prompt sources use: refused where unused, defaulted where used."""
    if args.compare and args.mode == "ar":
        raise ValueError("--compare runs AR next to a speculative mode; --mode ar is AR alone")
    if "ddtree" in modes:
        try:
            args.budget = check_budget(DEFAULT_BUDGET if args.budget is None else args.budget)
        except ValueError as e:
            raise ValueError(f"--budget: {e}") from None
    elif args.budget is not None:
        raise ValueError(f"--budget is the DDTree node budget; --mode {args.mode} does not build trees "
                         "(use --mode ddtree or all)")
    if modes == ["ar"]:
        if args.drafter is not None:
            raise ValueError("--mode ar decodes with the target alone; --drafter is not used")
    elif args.drafter is None:
        args.drafter = os.path.join(CHECKPOINTS, "drafter")
    given = args.prompt or args.prompt_ids or args.prompts_file
    if given and args.num_prompts is not None:
        raise ValueError("--num-prompts picks held-out prompts; it does not apply to --prompt, --prompt-ids or "
                         "--prompts-file")
    if not given and args.num_prompts is None:
        args.num_prompts = DEFAULT_NUM_PROMPTS


def count_prompts(args) -> int:
    """How many prompts the flags give; checks ``--prompt`` / ``--prompt-ids`` / ``--prompts-file`` contents."""
    if args.prompt_ids:
        return len([parse_ids(s, i) for i, s in enumerate(args.prompt_ids)])
    if args.prompts_file:
        return len(read_prompts_file(args.prompts_file))
    if args.prompt:
        empty = [i for i, text in enumerate(args.prompt) if not text]
        if empty:
            raise ValueError(f"--prompt #{empty[0] + 1} is empty")
        return len(args.prompt)
    return args.num_prompts


def load_models(args):
    if args.target == "random":
        cfg = tiny_config(dtype=args.dtype, quant=QuantConfig(group_size=32), vocab_size=512, num_layers=4)
        target = KimiModel(cfg, nnx.Rngs(args.seed))
    elif os.path.exists(os.path.join(args.target, INDEX_FILE)):  # our Orbax checkpoint
        target = restore_model(args.target, checkpoint_config(args.target).replace(dtype=args.dtype))
    else:  # an HF directory
        target = load_hf_model(args.target, dtype=args.dtype)
    drafter = None
    if args.drafter is not None:  # check_args leaves it None for AR alone
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


def parse_ids(text: str, index: int, flag: str = "--prompt-ids") -> list[int]:
    """One value of ``flag`` (``--prompt-ids``, ``--stop-ids``): space-separated token ids >= 0; ValueError
    otherwise."""
    problem = f"{flag} #{index + 1} must be space-separated token ids >= 0, got {text!r}"
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        raise ValueError(problem) from None
    if not ids or min(ids) < 0:
        raise ValueError(problem)
    return ids


def parse_logit_bias(values: Sequence[str], vocab_size: int | None = None) -> dict[int, float]:
    """The ``--logit-bias`` values ("ID:AMOUNT", e.g. "13:-100") as {id: amount} (``processors.check_logit_bias``,
    ids below ``vocab_size`` where given); ValueError naming the flag otherwise."""
    pairs = []
    for i, text in enumerate(values):
        token, sep, amount = text.partition(":")
        try:
            pairs.append((int(token), float(amount)))
        except ValueError:
            raise ValueError(f"--logit-bias #{i + 1} must be ID:AMOUNT (e.g. 13:-100), got {text!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias #{i + 1} must be ID:AMOUNT (e.g. 13:-100), got {text!r}")
    try:
        return dict(check_logit_bias(pairs, vocab_size))
    except ValueError as e:
        raise ValueError(f"--logit-bias: {e}") from None


def read_prompts_file(path: str) -> list[str]:
    """The prompt texts of a JSON Lines file (``PROMPTS_FILE_HELP``), exactly as written; ValueError naming
    the line for anything else."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            lines = f.read().split("\n")  # JSON strings hold no raw newline, so this split is exact
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts-file {path!r}: {e}") from None
    texts = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not a JSON string ({e.msg}); {PROMPTS_FILE_HELP}") from None
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{lineno}: expected a non-empty JSON string, got {line.strip()[:60]}")
        texts.append(text)
    if not texts:
        raise ValueError(f"--prompts-file {path!r} holds no prompts")
    return texts


def read_prompts(args, tokenizer) -> tuple[list[list[int]], str]:
    """(token ids of each prompt, where they came from): the prompt flags' own, or ``--num-prompts`` held-out
    prompts (``--seed`` picks them): the shipped pinned cut (``data.shipped_prompts``) where it holds them, else cut
    from this machine's held-out standard-library files (a stdlib other than the pinned one is warned about)."""
    if args.prompt_ids:
        return [parse_ids(s, i) for i, s in enumerate(args.prompt_ids)], "--prompt-ids"
    if args.prompts_file:
        texts = read_prompts_file(args.prompts_file)
        return [tokenizer.encode(t) for t in texts], f"--prompts-file {args.prompts_file}"
    if args.prompt:
        return [tokenizer.encode(t) for t in args.prompt], "--prompt"
    from experiments import data as data_lib  # held-out standard-library files (never trained on)

    cut = dict(seed=args.seed, **data_lib.PROMPT_TOKENS)
    fingerprint = None if args.target == "random" else data_lib.tokenizer_file_fingerprint(args.target)
    shipped = data_lib.shipped_prompts(fingerprint, args.num_prompts, **cut)
    if shipped is not None:  # the pinned cut, whatever this machine's stdlib
        return [tokenizer.encode(text) for text in shipped], os.path.relpath(data_lib.PROMPTS_PATH, ROOT)
    prompts = data_lib.cut_heldout_prompts(tokenizer, args.num_prompts, allow_mismatch=True, **cut)
    return [q["ids"] for q in prompts], f"held-out files of this machine's Python {platform.python_version()} stdlib"


def engine_config(mode: str, args, eos_ids=()) -> EngineConfig:
    budget = {"budget": args.budget} if mode == "ddtree" else {}
    return EngineConfig(mode=mode, max_new_tokens=args.max_new_tokens, capacity=args.capacity, eos_ids=eos_ids,
                        prefill_chunk=args.prefill_chunk or None,
                        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, logprobs=args.logprobs is not None,
                        logprobs_mode=args.logprobs or "raw",
                        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                        presence_penalty=args.presence_penalty, logit_bias=parse_logit_bias(args.logit_bias),
                        min_new_tokens=args.min_new_tokens, stop_strings=tuple(args.stop),
                        allowed_token_ids=() if args.allowed_ids is None else parse_ids(args.allowed_ids, 0,
                                                                                        "--allowed-ids"),
                        stop_sequences=tuple(tuple(parse_ids(s, i, "--stop-ids")) for i, s in enumerate(args.stop_ids)),
                        bad_words=tuple(tuple(parse_ids(s, i, "--bad-ids")) for i, s in enumerate(args.bad_ids)),
                        **budget)


def check_fits(args, modes: Sequence[str], prompts, target, drafter, eos_ids=()) -> None:
    """Before anything is compiled: ``--top-k`` and the token ids of ``--prompt-ids``, ``--stop-ids``, ``--bad-ids``,
    ``--allowed-ids`` and ``--logit-bias`` against the vocabulary,
    ``--min-new-tokens`` against the stops it holds back (``eos_ids``, ``--stop-ids``), the DDTree budget against the
    drafter's depth and the vocabulary, and ``--capacity`` against every mode's need (``required_capacity``);
    ValueError naming what is needed."""
    block_size = drafter.cfg.block_size if drafter is not None else 1
    try:
        check_top_k(args.top_k, target.cfg.vocab_size)
    except ValueError as e:
        raise ValueError(f"--top-k: {e} (the target's vocabulary)") from None
    allowed = [] if args.allowed_ids is None else [args.allowed_ids]
    for flag, values in (("--prompt-ids", args.prompt_ids or []), ("--stop-ids", args.stop_ids),
                         ("--bad-ids", args.bad_ids), ("--allowed-ids", allowed)):
        for i, text in enumerate(values):
            outside = [t for t in parse_ids(text, i, flag) if t >= target.cfg.vocab_size]
            if outside:
                raise ValueError(f"{flag} #{i + 1} holds {outside}, outside the target's vocabulary "
                                 f"[0, {target.cfg.vocab_size})")
    parse_logit_bias(args.logit_bias, target.cfg.vocab_size)
    if args.min_new_tokens and not (eos_ids or args.stop_ids or args.stop):
        raise ValueError(f"--min-new-tokens {args.min_new_tokens} holds back EOS ids and stop sequences, and this "
                         "target has no EOS id: give --stop-ids or --stop")
    if "ddtree" in modes:
        check_budget(args.budget, block_size - 1, target.cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    need = {mode: required_capacity(longest, args.max_new_tokens,
                                    tree_depth(engine_config(mode, args, eos_ids), block_size)) for mode in modes}
    worst = max(modes, key=need.get)
    if args.capacity < need[worst]:
        raise ValueError(f"--capacity {args.capacity} is too small: the longest prompt ({longest} tokens), "
                         f"--max-new-tokens {args.max_new_tokens} and the draft tree of --mode {worst} need "
                         f"--capacity {need[worst]} or more")


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


def batch_seeds(seed: int, batches) -> list[list[int]]:
    """Each batch's per-stream seeds: prompt i of all the batches samples with seed + i (its own key, so what it
    samples does not depend on how the prompts are split into batches)."""
    starts = np.cumsum([0] + [len(batch) for batch in batches])
    return [list(range(seed + start, seed + start + len(batch))) for start, batch in zip(starts, batches)]


def merge_results(results):
    """Joins ``Engine.generate`` results of consecutive batches: (tokens, status, metrics).

    tau: tokens emitted per stream-round incl. the bonus (the prefill token excluded), as the engine
    counts it; tokens_per_round_batch: all new tokens / rounds run (a batch runs as many rounds as its
    longest stream); tokens_per_s: tokens emitted by the rounds / decode time (the prefill, its time and its
    one token per stream excluded; speedup_vs_ar compares these); round_tokens: those tokens; tau_hist[k]:
    stream-rounds that emitted k tokens; where the results hold log-probabilities, mean_logprob: their mean over
    every generated token, and perplexity: exp(-mean_logprob).
    """
    tokens = [t for r in results for t in r["tokens"]]
    status = [s for r in results for s in r["status"]]
    rounds = sum(sum(r["rounds"]) for r in results)
    emitted = sum(r["round_tokens"] for r in results)  # the prefill's token per stream excluded
    decode_s = sum(r["decode_s"] for r in results)
    new_tokens = sum(r["new_tokens"] for r in results)
    metrics = {
        "tau": emitted / max(rounds, 1), "rounds": rounds,
        "tokens_per_round_batch": new_tokens / max(sum(r["batch_rounds"] for r in results), 1),
        "tokens_per_s": emitted / decode_s if decode_s else float("nan"),
        "new_tokens": new_tokens, "round_tokens": emitted, "decode_s": decode_s,
        "prefill_s": sum(r["prefill_s"] for r in results),
        "tau_hist": np.sum([r["tau_hist"] for r in results], axis=0).tolist(),
    }
    if all(r.get("logprobs") is not None for r in results):
        mean = float(np.mean([lp for r in results for stream in r["logprobs"] for lp in stream]))
        metrics.update(mean_logprob=mean, perplexity=float(np.exp(-mean)))
    return tokens, status, metrics


def warm_up(engine: Engine, batches, temperature: float) -> float:
    """Compiles every program a pass over ``batches`` uses (prefill per padded shape, the round loop per
    batch size) without decoding: after each prefill the round loop is entered with every stream already
    stopped (so also at a smaller last batch's size). Returns seconds."""
    t0 = time.perf_counter()
    for batch in batches:
        state = engine.prefill(batch, temperature)
        state = dataclasses.replace(state, status=state.status * 0 + EOS)  # derived, so placed like the real one
        jax.block_until_ready(engine.run(state).out_tokens)
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


def build_engine(target, drafter, mode, args, tokenizer, eos_ids) -> Engine:
    """The engine of one mode (the drafter unused in AR)."""
    return Engine(target, drafter if mode != "ar" else None, engine_config(mode, args, eos_ids), tokenizer=tokenizer)


def run_mode(engine: Engine, mode, args, prompts, tokenizer):
    streams = args.streams if args.streams is not None else len(prompts)
    if args.continuous:
        seeds = list(range(args.seed, args.seed + len(prompts)))  # prompt i's own (batch_seeds')
        t0 = time.perf_counter()
        serving.warm_up(engine, engine.check_requests(prompts, args.temperature, seeds), streams)
        compile_s = time.perf_counter() - t0
        results = [engine.generate(prompts, args.temperature, seeds, slots=streams)]
    else:
        batches = split_batches(prompts, streams)
        compile_s = warm_up(engine, batches, args.temperature)
        results = [engine.generate(batch, args.temperature, batch_seed)
                   for batch, batch_seed in zip(batches, batch_seeds(args.seed, batches))]
    tokens, status, metrics = merge_results(results)
    metrics = {"mode": mode, "budget": args.budget if mode == "ddtree" else None, "streams": streams,
               "continuous": args.continuous, **metrics, "compile_s": compile_s}
    picture = None
    if mode == "ddtree":
        tree, acc = inspect_round(engine, prompts[:1], args.temperature, [args.seed])  # prompt 0's first round
        picture = draw_tree(tree["tokens"], tree["parents"], acc["path"], tokenizer)
    run = {"metrics": metrics, "tokens": tokens, "status": status, "tree_picture": picture}
    if args.logprobs:
        run["logprobs"] = [lp for r in results for lp in r["logprobs"]]
    return run


def main(argv=None):
    """Runs the command line ``argv``. A flag refused on its own, or against the loaded models (``check_fits``),
    exits with argparse's usage error (status 2) before anything is compiled."""
    args = parse_args(argv)
    with jax.default_matmul_precision(args.matmul_precision):
        return _main(args)


def _main(args):
    target, drafter, tokenizer, eos_ids = load_pair(args)
    modes = modes_of(args)
    try:  # every check that reads the models, the prompts or the engines, before anything is compiled
        prompts, prompt_source = read_prompts(args, tokenizer)
        check_fits(args, modes, prompts, target, drafter, eos_ids)
        engines = {mode: build_engine(target, drafter, mode, args, tokenizer, eos_ids) for mode in modes}
        for engine in engines.values():
            engine.check_requests(prompts, args.temperature, args.seed)
    except ValueError as e:
        build_parser().error(str(e))
    print(f"target: {args.target}  layers={target.cfg.num_layers} hidden={target.cfg.hidden_size} "
          f"experts={target.cfg.n_routed_experts} int4={target.cfg.quant is not None}  drafter: {args.drafter}  "
          f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    print(f"prompts: {len(prompts)} from {prompt_source}")
    # where it ran and what it read (held-out prompts past the shipped ones come from this interpreter's standard
    # library, so another Python version decodes other prompts there: data.verify warns)
    environment = {**bench_util.hardware(), "commit": args.commit or bench_util.git_commit(),
                   "python": platform.python_version()}
    report = {"args": vars(args), "environment": environment,
              "prompt_source": prompt_source, "prompts": [[int(t) for t in p] for p in prompts], "runs": {}}
    for mode in modes:
        report["runs"][mode] = run_mode(engines[mode], mode, args, prompts, tokenizer)
    print()
    scores = f" {'logprob/tok':>12} {'perplexity':>11}" if args.logprobs else ""
    print(f"{'mode':>8} {'tau':>6} {'tok/round':>10} {'tok/s':>9} {'rounds':>7} {'compile s':>10}" + scores)
    for mode, run in report["runs"].items():
        m = run["metrics"]
        scores = f" {m['mean_logprob']:12.4f} {m['perplexity']:11.3f}" if args.logprobs else ""
        print(f"{mode:>8} {m['tau']:6.2f} {m['tokens_per_round_batch']:10.2f} {m['tokens_per_s']:9.1f} "
              f"{m['rounds']:7d} {m['compile_s']:10.1f}" + scores)
    if "ar" in report["runs"]:
        base = report["runs"]["ar"]["metrics"]["tokens_per_s"]
        for mode in modes[1:]:
            run = report["runs"][mode]
            run["speedup_vs_ar"] = run["metrics"]["tokens_per_s"] / base
            run["identical_to_ar"] = run["tokens"] == report["runs"]["ar"]["tokens"]
            print(f"{mode} vs ar: speedup {run['speedup_vs_ar']:.2f}x, outputs identical to AR: "
                  f"{run['identical_to_ar']}" + ("" if args.temperature == 0 else " (sampling: not expected)"))
    for line in stop_report(report["runs"], args.capacity):
        print(line)
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


NORMAL_STOPS = ("eos", "stop_token", "stop_sequence", "stop_string", "max_new_tokens")


def stop_report(runs: dict, capacity: int) -> list[str]:
    """Lines on streams that did not stop by EOS or the token limit: each such mode's status counts and a
    warning for streams cut short by a full cache (and for AR comparisons they spoil). Empty if none."""
    cut = {mode: run["status"].count("cache_full") for mode, run in runs.items()}
    lines = []
    for mode, run in runs.items():
        counts = collections.Counter(run["status"])
        if set(counts) - set(NORMAL_STOPS):
            lines.append(f"{mode} stream status: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        if cut[mode]:
            lines.append(f"WARNING: {cut[mode]} of {len(run['status'])} {mode} streams stopped early because the "
                         f"cache was full (--capacity {capacity}): their outputs are cut short")
        if run.get("identical_to_ar") is False and (cut[mode] or cut.get("ar")):
            lines.append(f"WARNING: {mode} outputs differ from AR where streams stopped at cache_full, "
                         "not (only) because of the decoding")
    return lines


if __name__ == "__main__":
    main()

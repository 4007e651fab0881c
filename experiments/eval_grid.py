"""Evaluation grid for a trained target + DFlash drafter: AR, DFlash and DDTree over node budgets and
streams, at temperature 0 (and optionally 1), on held-out prompts.

    python experiments/eval_grid.py                                  # shipped pair, CPU defaults (~7 min, 2 cores)
    python experiments/eval_grid.py --export-prompts prompts.json    # write the held-out prompts, then exit
    python experiments/eval_grid.py --max-new-tokens 64 --repeats 1 --name eval_grid_h200   # the shipped H200 grid

Per (temperature, mode, budget, streams) it reports, for all prompts decoded in consecutive batches
of ``streams``:
  tau            tokens emitted per stream-round incl. the bonus token (the engine's tau_mean,
                 pooled over batches; AR = 1);
  tok/round      all new tokens / rounds run (a batch runs as many rounds as its longest stream);
  tok/s          all new tokens / wall time of ``Engine.generate`` over all batches (prefill included),
                 median of ``--repeats`` passes after a warm-up that compiles every program the pass
                 uses (the warm-up runs no decode round); decode tok/s leaves prefill out;
  tau_hist[k]    stream-rounds that emitted k tokens.
DFlash's block is fixed by the drafter, so only DDTree runs per budget. At T=0 every DFlash/DDTree
output must equal AR's (same streams) token for token and AR must agree with itself across streams;
any difference is printed at once, recorded in the JSON, and ends the run with an error.

Prompts: held-out prompts exactly as ``run_decode.py`` picks them (at seed 0 the first 16 ship in
``experiments/heldout_prompts.json``, the same on any Python; the H200's grid read them from
``experiments/results/eval_prompts_16.json``, the same 16 as token ids), or read from ``--prompts-file`` (JSON
written by ``--export-prompts``: token ids plus the tokenizer's fingerprint, which must match). Writes
``experiments/results/<name>.json`` (hardware, JAX version, commit, config, results) and
``<name>_tokens_per_s.png``, ``<name>_tau.png``, ``<name>_tau_hist.png``.

Compiles: every configuration's programs (``run_decode.warm_up``) are compiled before any is timed, by
``--compile-workers`` threads at once (default min(#configs, CPU count); XLA compiles release the GIL);
then the configurations are timed one after another with nothing running alongside. A record's
``compile_s`` is its own warm-up's wall (stretched by those alongside); the JSON's top level has the
phase's ``compile_wall_s``, ``compiles_overlapped`` and its XLA compiles; ``compiles_while_timed`` (per
record) must be 0. ``--compile-workers 1`` compiles each configuration right before timing it. On 2 CPU
cores threads gain little (one compile already keeps ~1.5 cores busy; 8 configurations: 64 s serial, 60 s
with 2 threads, means of 5 and 7 runs); on the H200 box (16 cores, f32 matmul precision) the 21
configurations of the shipped grid compiled in 414 s with 16 threads, against ~13 minutes one by one. On GPUs
XLA's autotuner times kernels while compiling, so concurrent compiles may pick other kernels.

CPU cost (2 cores, the shipped 30M pair, 16 prompts x 32 new tokens, budgets 8..128, streams 1/4/16):
``--temperatures 0,1 --repeats 1`` took 12 minutes (724 s), about a third of it XLA compiles (one
program per mode x budget x streams); the old 5.7M pair took 7.2 minutes at T=0 with 3 repeats. Cut
--budgets / --streams / --repeats to stay within a CPU budget. On GPUs keep ``--matmul-precision
float32`` (the default) for f32 models, or greedy outputs may differ from AR through TF32 rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ddtree_jax.engine import Engine, EngineConfig, check_temperature  # noqa: E402
from ddtree_jax.sampling import check_min_p, check_top_k, check_top_p  # noqa: E402
from ddtree_jax.tree import check_budget  # noqa: E402
from experiments import bench_util  # noqa: E402
from experiments import data as data_lib  # noqa: E402
from experiments import run_decode  # noqa: E402

PROMPTS_FORMAT = "ddtree-jax-prompts/1"
MODES = ("ar", "dflash", "ddtree")
DEFAULT_BUDGETS = (8, 16, 32, 64, 128)
CHECKPOINTS = run_decode.CHECKPOINTS


class LosslessError(AssertionError):
    """A speculative greedy output differs from AR's."""


@dataclasses.dataclass
class Pair:
    target: object
    drafter: object
    tokenizer: object
    eos_ids: tuple[int, ...]
    tokenizer_id: str  # fingerprint that a prompts file must carry
    source: dict


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.replace(",", " ").split())


def float_list(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.replace(",", " ").split())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.join(CHECKPOINTS, "target"), help="as in run_decode.py")
    p.add_argument("--drafter", default=os.path.join(CHECKPOINTS, "drafter"), help="as in run_decode.py")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    bench_util.add_matmul_precision_arg(p, "float32")
    p.add_argument("--modes", default="ar,dflash,ddtree", help="subset of ar,dflash,ddtree")
    p.add_argument("--budgets", type=int_list, default=None,
                   help=f"DDTree node budgets (default {','.join(map(str, DEFAULT_BUDGETS))}; only with ddtree in "
                        "--modes)")
    p.add_argument("--streams", type=int_list, default=(1, 4, 16), help="streams decoded together")
    p.add_argument("--temperatures", type=float_list, default=(0.0,), help="e.g. 0 or 0,1")
    run_decode.add_truncation_args(p, "at the sampled points (temperature > 0)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts (from the file: its first N)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--capacity", type=int, default=512, help="cache slots per stream")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per configuration (median)")
    p.add_argument("--seed", type=int, default=0, help="prompt cutting and sampling seed")
    p.add_argument("--compile-workers", type=int, default=None,
                   help="threads that compile all configurations before any is timed (default: min(#configs, "
                        "CPU count); 1: compile each just before timing it)")
    p.add_argument("--prompts-file", help="JSON of token-id prompts written by --export-prompts")
    p.add_argument("--export-prompts", metavar="PATH", help="write the held-out prompts to PATH and exit")
    p.add_argument("--name", default=None, help="result name (default eval_grid_<platform>)")
    p.add_argument("--out-dir", default=bench_util.RESULTS_DIR)
    p.add_argument("--commit", default=None, help="commit hash to record (a checkout copied elsewhere may report a "
                                                   "stale git HEAD)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    given = args.modes.replace(",", " ").split()
    if not given or any(m not in MODES for m in given):
        p.error(f"--modes takes a subset of {','.join(MODES)}, got {args.modes!r}")
    args.modes = tuple(m for m in MODES if m in given)
    if args.budgets is not None and "ddtree" not in args.modes:
        p.error(f"--budgets: --modes {','.join(args.modes)} has no ddtree, the only mode that builds trees")
    args.budgets = (DEFAULT_BUDGETS if args.budgets is None else args.budgets) if "ddtree" in args.modes else ()
    try:
        check_grid(args.modes, args.budgets, args.streams, args.temperatures, args.top_k, args.top_p,
                   args.min_p)
    except ValueError as e:
        p.error(f"--{e}")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--capacity", args.capacity)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least one timed pass")
    if args.compile_workers is not None and args.compile_workers < 1:
        p.error(f"--compile-workers {args.compile_workers}: at least 1 (leave it out for the default)")
    return args


# ----------------------------------------------------------------------------------------------------
# Loading: the models and held-out prompts exactly as run_decode.py loads them
# ----------------------------------------------------------------------------------------------------
def tokenizer_fingerprint(target: str, vocab_size: int) -> str:
    """sha256 of the tokenizer file ``load_tokenizer`` reads for ``target`` (or the byte tokenizer's name)."""
    found = None if target == "random" else data_lib.tokenizer_file_fingerprint(target)
    return found or f"bytes:{vocab_size}"


def load_pair(target: str = os.path.join(CHECKPOINTS, "target"), drafter: str = os.path.join(CHECKPOINTS, "drafter"),
              dtype: str = "float32", seed: int = 0) -> Pair:
    """Target, drafter, tokenizer and EOS ids via ``run_decode.load_pair``."""
    rd_args = run_decode.parse_args(["--target", target, "--drafter", drafter, "--dtype", dtype, "--seed", str(seed)])
    t, d, tok, eos_ids = run_decode.load_pair(rd_args)
    return Pair(t, d, tok, eos_ids, tokenizer_fingerprint(target, t.cfg.vocab_size),
                {"target": os.path.relpath(target, ROOT) if target != "random" else target,
                 "drafter": os.path.relpath(drafter, ROOT) if drafter != "random" else drafter, "dtype": dtype})


def heldout_prompts(pair: Pair, n: int, seed: int = 0) -> tuple[list[list[int]], dict]:
    """``n`` held-out prompts for the pair's tokenizer, as ``run_decode.read_prompts`` picks them."""
    target = pair.source["target"]
    target = target if target == "random" else os.path.join(ROOT, target)
    rd_args = run_decode.parse_args(["--target", target, "--num-prompts", str(n), "--seed", str(seed)])
    prompts, source = run_decode.read_prompts(rd_args, pair.tokenizer)
    return prompts, {"source": f"{source} (run_decode.read_prompts)", "seed": seed}


def export_prompts(path: str, prompts: Sequence[Sequence[int]], pair: Pair, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"format": PROMPTS_FORMAT, "tokenizer": pair.tokenizer_id, **meta,
                   "texts": [pair.tokenizer.decode(p) for p in prompts],
                   "prompts": [list(map(int, p)) for p in prompts]}, f, indent=1)


def read_prompts_file(path: str, pair: Pair, n: int | None = None) -> tuple[list[list[int]], dict]:
    """The first ``n`` prompts of an ``export_prompts`` file, refused if its tokenizer differs."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != PROMPTS_FORMAT:
        raise ValueError(f"{path}: not a {PROMPTS_FORMAT} file (write one with --export-prompts)")
    if data["tokenizer"] != pair.tokenizer_id:
        raise ValueError(f"{path} was cut with tokenizer {data['tokenizer']}, the target's is {pair.tokenizer_id}; "
                         f"re-export it with --export-prompts on a machine with the pinned stdlib")
    prompts = [[int(t) for t in p] for p in data["prompts"]]
    if n is not None:
        if n > len(prompts):
            raise ValueError(f"{path} has {len(prompts)} prompts, {n} asked for")
        prompts = prompts[:n]
    meta = {k: v for k, v in data.items() if k not in ("prompts", "texts", "format")}
    return prompts, dict(meta, source=f"{os.path.basename(path)}: {meta.get('source', '?')}")


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------
# Measuring one configuration and the grid
# ----------------------------------------------------------------------------------------------------
def build_engine(pair: Pair, prompts: Sequence[Sequence[int]], *, mode: str, budget: int | None, streams: int,
                 max_new_tokens: int, capacity: int = 512, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> tuple[Engine, list]:
    """The Engine of one grid point (nothing compiled yet; it references the pair's arrays, copies none)
    and the prompts in consecutive batches of ``streams``; its samples truncated by ``top_k`` / ``top_p`` /
    ``min_p``."""
    if streams > len(prompts):
        raise ValueError(f"{streams} streams need at least {streams} prompts, have {len(prompts)}")
    ecfg = EngineConfig(mode=mode, budget=budget if mode == "ddtree" else EngineConfig.budget,
                        max_new_tokens=max_new_tokens, capacity=capacity, eos_ids=pair.eos_ids, top_k=top_k,
                        top_p=top_p, min_p=min_p)
    engine = Engine(pair.target, pair.drafter if mode != "ar" else None, ecfg)
    return engine, run_decode.split_batches(list(prompts), streams)


def time_passes(engine: Engine, batches: Sequence[Sequence[Sequence[int]]], *, temperature: float,
                repeats: int = 3, seed: int = 0, compile_s: float | None = None) -> dict:
    """``repeats`` timed passes over ``batches`` with an engine whose programs are compiled (warmed up).

    Returns the record (metrics of the first pass, timing medians) with the generated ``tokens``;
    ``compiles_while_timed`` counts XLA compiles inside the passes (0 unless the warm-up missed one)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: at least one timed pass")
    passes, walls = [], []
    with bench_util.counting_compiles() as compiles:
        for _ in range(repeats):
            t0 = time.perf_counter()
            results = [engine.generate(b, temperature, seeds)
                       for b, seeds in zip(batches, run_decode.batch_seeds(seed, batches))]
            walls.append(time.perf_counter() - t0)
            passes.append(run_decode.merge_results(results))
    tokens, status, m = passes[0]
    wall = statistics.median(walls)
    decode = statistics.median(p[2]["decode_s"] for p in passes)
    mode = engine.ecfg.mode
    sampled = temperature > 0
    return {
        "temperature": float(temperature), "mode": mode, "budget": engine.ecfg.budget if mode == "ddtree" else None,
        "streams": len(batches[0]), "block_size": engine.block_size, "depth": engine.depth,
        "top_k": engine.ecfg.top_k if sampled else None, "top_p": engine.ecfg.top_p if sampled else None,
        "min_p": engine.ecfg.min_p if sampled else None,
        "tau": m["tau"], "tokens_per_round": m["tokens_per_round_batch"],
        "tokens_per_s": m["new_tokens"] / wall, "decode_tokens_per_s": m["round_tokens"] / decode,
        "wall_s_median": wall, "wall_s": walls, "decode_s_median": decode, "compile_s": compile_s,
        "compiles_while_timed": len(compiles),
        "rounds": m["rounds"], "new_tokens": m["new_tokens"], "tau_hist": m["tau_hist"],
        "status_counts": {s: status.count(s) for s in sorted(set(status))},
        "repeats_identical": all(p[0] == tokens for p in passes[1:]),
        "tokens_sha256": prompts_digest(tokens), "tokens": tokens,
    }


def check_grid(modes: Sequence[str], budgets: Sequence[int], streams: Sequence[int],
               temperatures: Sequence[float], top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
    """A ValueError, led by the list's name, unless the grid's lists are usable: at least one budget when
    ddtree is measured, each a valid DDTree budget; streams integers >= 1; temperatures finite and >= 0; none
    of them empty; and top_k / top_p / min_p valid, and set only where some temperature samples."""
    if not streams or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in streams):
        raise ValueError(f"streams must be integers >= 1 (at least one), got {tuple(streams)}")
    if "ddtree" in modes and not budgets:
        raise ValueError("budgets: ddtree needs at least one")
    if not temperatures:
        raise ValueError("temperatures: at least one")
    lists = [("budgets", budgets if "ddtree" in modes else (), check_budget),
             ("temperatures", temperatures, check_temperature)]
    for name, values, check in lists:
        for value in values:
            try:
                check(value)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    for name, check, value in (("top-k", check_top_k, top_k), ("top-p", check_top_p, top_p),
                               ("min-p", check_min_p, min_p)):
        try:
            check(value)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if (top_k != 0 or top_p != 1 or min_p != 0) and not any(t > 0 for t in temperatures):
        raise ValueError("top-k / top-p / min-p: they truncate samples, and every temperature is 0 (greedy)")


# ----------------------------------------------------------------------------------------------------
# Compiling the grid's programs: each just before it is timed, or all at once in threads (XLA compiles
# release the GIL, so they overlap), never while anything is timed
# ----------------------------------------------------------------------------------------------------
def grid_points(modes: Sequence[str], budgets: Sequence[int], streams: Sequence[int],
                temperatures: Sequence[float]) -> list[dict]:
    """(temperature, streams, mode, budget) in measuring order: AR first per temperature and streams."""
    return [{"temperature": t, "streams": s, "mode": m, "budget": b} for t in temperatures for s in streams
            for m in MODES if m in modes for b in (budgets if m == "ddtree" else (None,))]


def resolve_compile_workers(requested: int | None, configs: int) -> int:
    """Compile threads: ``requested`` (None: the CPU count; ValueError below 1), at most one per configuration."""
    if requested is not None and requested < 1:
        raise ValueError(f"compile workers {requested}: at least 1")
    return max(1, min(requested if requested is not None else os.cpu_count() or 1, configs))


def compiled_points(build: Callable[[dict], tuple[Engine, list]], points: Sequence[dict], workers: int,
                    summary: dict, log: Callable[[str], None] | None = print):
    """Yields (point, engine, batches, compile_s) in order. One worker: each point is built and compiled
    when reached, right before it is timed. More: all engines are built (cheap: they share the pair's
    arrays) and compiled concurrently before the first is yielded. Sums ``warm_up_all``'s into ``summary``."""
    summary.update(compile_workers=workers, compiles_overlapped=workers > 1, compile_wall_s=0.0, xla_compiles=0,
                   xla_compile_s_sum=0.0)
    for chunk in [points] if workers > 1 else [[p] for p in points]:
        built = [build(p) for p in chunk]
        seconds, info = run_decode.warm_up_all([(e, b, p["temperature"]) for (e, b), p in zip(built, chunk)], workers)
        for k, v in info.items():
            summary[k] += v
        if log and workers > 1:
            log(f"compiled {len(chunk)} configurations in {info['compile_wall_s']:.1f} s with {workers} threads "
                f"({info['xla_compiles']} XLA compiles, {info['xla_compile_s_sum']:.1f} s summed)")
        yield from ((p, e, b, c) for p, (e, b), c in zip(chunk, built, seconds))


def _first_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"prompt {i}, token {j}: {x[j:j + 4]} vs AR {y[j:j + 4]} (lengths {len(x)} / {len(y)})"
    return f"{len(a)} vs {len(b)} streams"


def label(rec: dict) -> str:
    name = {"ar": "AR", "dflash": "DFlash", "ddtree": f"DDTree-{rec['budget']}"}[rec["mode"]]
    return f"{name} streams={rec['streams']} T={rec['temperature']:g}"


def _compare_with_ar(rec: dict, ar_ref: dict, log: Callable[[str], None] | None) -> None:
    """Sets ``identical_to_ar`` (None where not checked: T > 0 or no AR yet) and keeps AR's outputs."""
    rec["identical_to_ar"] = None
    if rec["temperature"] != 0:
        return
    ref = ar_ref.get("any") if rec["mode"] == "ar" else ar_ref.get(rec["streams"])
    if ref is not None:
        rec["identical_to_ar"] = rec["tokens"] == ref
        if not rec["identical_to_ar"]:
            rec["difference"] = _first_difference(rec["tokens"], ref)
            if log:
                log(f"!!! LOSSLESS CHECK FAILED: {label(rec)} differs from AR: {rec['difference']}")
    if rec["mode"] == "ar":
        ar_ref.setdefault("any", rec["tokens"])
        ar_ref[rec["streams"]] = rec["tokens"]


def run_grid(pair: Pair, prompts: Sequence[Sequence[int]], *, modes: Sequence[str] = MODES,
             budgets: Sequence[int] = DEFAULT_BUDGETS, streams: Sequence[int] = (1, 4, 16),
             temperatures: Sequence[float] = (0.0,), max_new_tokens: int = 32, repeats: int = 3, seed: int = 0,
             capacity: int = 512, compile_workers: int | None = None, log: Callable[[str], None] | None = print,
             compile_summary: dict | None = None, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> list[dict]:
    """Every (temperature, streams, mode, budget) point, compiled by ``compiled_points`` in
    ``compile_workers`` threads, then timed one after another by ``time_passes``. AR comes first so that
    each greedy DFlash/DDTree output is compared with AR's at once (``identical_to_ar``; None where not
    checked). ``compile_summary``, if given, receives the compile summary (``compiled_points``). ``top_k`` /
    ``top_p`` / ``min_p`` truncate the sampled points' draws (``EngineConfig``)."""
    check_grid(modes, budgets, streams, temperatures, top_k, top_p, min_p)
    if pair.drafter is None and set(modes) - {"ar"}:
        raise ValueError("DFlash / DDTree need a drafter")
    points = grid_points(modes, budgets, streams, temperatures)
    workers = resolve_compile_workers(compile_workers, len(points))
    summary = {} if compile_summary is None else compile_summary

    def build(p):
        return build_engine(pair, prompts, mode=p["mode"], budget=p["budget"], streams=p["streams"],
                            max_new_tokens=max_new_tokens, capacity=capacity,
                            **(dict(top_k=top_k, top_p=top_p, min_p=min_p) if p["temperature"] > 0 else {}))

    records, ar_ref = [], {}
    for p, engine, batches, compile_s in compiled_points(build, points, workers, summary, log):
        rec = time_passes(engine, batches, temperature=p["temperature"], repeats=repeats, seed=seed,
                          compile_s=compile_s)
        _compare_with_ar(rec, ar_ref, log)
        records.append(rec)
        if log:
            log(f"{label(rec):34s} tau {rec['tau']:5.2f}  tok/round {rec['tokens_per_round']:6.2f}  "
                f"tok/s {rec['tokens_per_s']:8.1f}  compile {rec['compile_s']:5.1f} s"
                + ("" if rec["identical_to_ar"] is None else f"  ==AR {rec['identical_to_ar']}")
                + (f"  !!! {rec['compiles_while_timed']} compiles while timed" if rec["compiles_while_timed"] else ""))
    return records


def lossless_failures(records: Sequence[dict]) -> list[str]:
    return [f"{label(r)}: {r.get('difference', '')}" for r in records if r.get("identical_to_ar") is False]


def assert_lossless(records: Sequence[dict]) -> int:
    """Raises LosslessError naming every greedy output that differs from AR's; returns how many were checked."""
    failures = lossless_failures(records)
    if failures:
        raise LosslessError("greedy outputs differ from AR (the engine is not lossless here):\n  "
                            + "\n  ".join(failures))
    return sum(r.get("identical_to_ar") is True for r in records)


def table_rows(records: Sequence[dict]) -> list[dict]:
    return [{"T": r["temperature"], "mode": r["mode"], "budget": r["budget"] or "-", "streams": r["streams"],
             "tau": r["tau"], "tok/round": r["tokens_per_round"], "tok/s": r["tokens_per_s"],
             "decode tok/s": r["decode_tokens_per_s"], "compile s": r["compile_s"],
             "==AR": "-" if r["identical_to_ar"] is None else ("yes" if r["identical_to_ar"] else "NO")}
            for r in records]


def print_table(records: Sequence[dict]) -> None:
    bench_util.print_table(table_rows(records), ["T", "mode", "budget", "streams", "tau", "tok/round", "tok/s",
                                                 "decode tok/s", "compile s", "==AR"])


# ----------------------------------------------------------------------------------------------------
# Plots (matplotlib figures; main saves them as PNG with the Agg backend, a notebook shows them inline)
# ----------------------------------------------------------------------------------------------------
def _panels(records, title):
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in records})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        ax.set_title(f"{title}, T={t:g}")
    return fig, list(zip(axes[0], temps))


def _budget_axis(ax, records):
    budgets = sorted({r["budget"] for r in records if r["mode"] == "ddtree"})
    ax.set_xscale("log", base=2)
    if budgets:
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()


def _streams(s):
    return f"{s} stream{'s' * (s != 1)}"


def _select(records, **kw):
    return [r for r in records if all(r[k] == v for k, v in kw.items())]


def plot_tokens_per_s(records: Sequence[dict]):
    """tok/s vs DDTree budget, one line per streams; AR (dashed) and DFlash (dotted) at the same streams."""
    fig, panels = _panels(records, "tokens/s")
    for ax, t in panels:
        for i, s in enumerate(sorted({r["streams"] for r in records})):
            color = f"C{i}"
            tree = sorted(_select(records, temperature=t, streams=s, mode="ddtree"), key=lambda r: r["budget"])
            if tree:
                ax.plot([r["budget"] for r in tree], [r["tokens_per_s"] for r in tree], "o-", color=color,
                        label=f"DDTree, {_streams(s)}")
            for mode, style in (("ar", "--"), ("dflash", ":")):
                for r in _select(records, temperature=t, streams=s, mode=mode):
                    ax.axhline(r["tokens_per_s"], ls=style, color=color, lw=1,
                               label=f"{'AR' if mode == 'ar' else 'DFlash'}, {_streams(s)}")
        _budget_axis(ax, records)
        ax.set_yscale("log")
        ax.set_xlabel("DDTree node budget")
        ax.set_ylabel("tokens / s (median wall time of generate)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_tau(records: Sequence[dict]):
    """tau vs DDTree budget (one line per streams; equal at T=0) with DFlash's tau as a dotted line."""
    fig, panels = _panels(records, "tau (tokens per round incl. bonus)")
    for ax, t in panels:
        for i, s in enumerate(sorted({r["streams"] for r in records})):
            tree = sorted(_select(records, temperature=t, streams=s, mode="ddtree"), key=lambda r: r["budget"])
            if tree:
                ax.plot([r["budget"] for r in tree], [r["tau"] for r in tree], "o-", color=f"C{i}",
                        ms=max(8 - 2 * i, 3), label=f"DDTree, {_streams(s)}")
            for r in _select(records, temperature=t, streams=s, mode="dflash"):
                ax.axhline(r["tau"], ls=":", color=f"C{i}", lw=1, label=f"DFlash, {_streams(s)}")
        ax.axhline(1.0, ls="--", color="gray", lw=1, label="AR")
        _budget_axis(ax, records)
        ax.set_xlabel("DDTree node budget")
        ax.set_ylabel("tau")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_tau_hist(records: Sequence[dict]):
    """Share of rounds that emitted k tokens (k = accepted + bonus, after the cut at an end or the token limit),
    DFlash and each DDTree budget, at the fewest streams measured. Records written before 8cae686 hold
    ``tau_hist_accepted`` instead (k accepted, before the cut); their plot says so."""
    key = "tau_hist" if all("tau_hist" in r for r in records) else "tau_hist_accepted"
    counted = "emitted" if key == "tau_hist" else "accepted"
    fig, panels = _panels(records, f"tokens {counted} per round")
    s = min(r["streams"] for r in records)
    for ax, t in panels:
        rows = _select(records, temperature=t, streams=s, mode="dflash") + sorted(
            _select(records, temperature=t, streams=s, mode="ddtree"), key=lambda r: r["budget"])
        width = 0.8 / max(len(rows), 1)
        for j, r in enumerate(rows):
            h = np.asarray(r[key], float)
            k = np.arange(len(h))
            ax.bar(k[1:] + (j - (len(rows) - 1) / 2) * width, h[1:] / max(h.sum(), 1), width,
                   label=("DFlash" if r["mode"] == "dflash" else f"DDTree-{r['budget']}") + f" (tau {r['tau']:.2f})")
        ax.set_xlabel(f"tokens {counted} in a round{'' if key == 'tau_hist' else ', before the cut'} ({_streams(s)})")
        ax.set_ylabel("share of rounds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


PLOTS = {"tokens_per_s": plot_tokens_per_s, "tau": plot_tau, "tau_hist": plot_tau_hist}


def save_plots(records: Sequence[dict], out_dir: str, name: str) -> list[str]:
    import matplotlib.pyplot as plt

    paths = []
    for suffix, plot in PLOTS.items():
        fig = plot(records)
        path = os.path.join(out_dir, f"{name}_{suffix}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    with jax.default_matmul_precision(args.matmul_precision):
        return _main(args)


def _main(args):
    t_start = time.perf_counter()
    pair = load_pair(args.target, args.drafter, args.dtype, args.seed)
    if args.prompts_file:
        try:
            prompts, prompt_meta = read_prompts_file(args.prompts_file, pair, args.num_prompts)
        except (OSError, ValueError) as e:  # a missing, malformed or too short file: a usage error
            print(f"eval_grid.py: error: --prompts-file: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    else:
        prompts, prompt_meta = heldout_prompts(pair, args.num_prompts, args.seed)
    if args.export_prompts:
        export_prompts(args.export_prompts, prompts, pair, prompt_meta)
        print(f"wrote {len(prompts)} prompts ({prompts_digest(prompts)[:12]}) to {args.export_prompts}")
        return None
    too_many = [s for s in args.streams if s > len(prompts)]
    if too_many:
        raise SystemExit(f"streams {too_many} exceed the {len(prompts)} prompts; raise --num-prompts")
    cfg = pair.target.cfg
    print(f"target {pair.source['target']} (layers {cfg.num_layers}, hidden {cfg.hidden_size}), "
          f"drafter {pair.source['drafter']} (block {pair.drafter.cfg.block_size if pair.drafter else '-'}); "
          f"{len(prompts)} prompts; device {jax.devices()[0].device_kind}; jax {jax.__version__}")
    compile_summary = {}
    records = run_grid(pair, prompts, modes=args.modes, budgets=args.budgets, streams=args.streams,
                       temperatures=args.temperatures, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                       seed=args.seed, capacity=args.capacity, compile_workers=args.compile_workers,
                       compile_summary=compile_summary, top_k=args.top_k, top_p=args.top_p,
                       min_p=args.min_p)
    runtime = time.perf_counter() - t_start
    print()
    print_table(records)
    failures = lossless_failures(records)
    name = args.name or f"eval_grid_{jax.devices()[0].platform}"
    config = {k: v for k, v in vars(args).items() if k not in ("export_prompts", "out_dir", "commit")}
    config.update(pair.source, tokenizer=pair.tokenizer_id,
                  drafter_block_size=pair.drafter.cfg.block_size if pair.drafter else None,
                  prompts={**prompt_meta, "count": len(prompts), "sha256": prompts_digest(prompts),
                           "lengths": [len(p) for p in prompts]})
    path = bench_util.write_result(name, {
        "config": config, "runtime_s": runtime, **compile_summary,
        "lossless": {"checked": sum(r["identical_to_ar"] is not None for r in records), "failures": failures},
        "results": [{k: v for k, v in r.items() if k != "tokens"} for r in records],
        **({"commit": args.commit} if args.commit else {})}, args.out_dir)
    print(f"\nwrote {path} (total {runtime:.0f} s)")
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        for p in save_plots(records, args.out_dir, name):
            print(f"wrote {p}")
    checked = assert_lossless(records)  # raises, after the JSON is written, if any greedy output differs
    print(f"lossless: {checked} greedy DFlash/DDTree/AR outputs checked against AR, all identical")
    return records


if __name__ == "__main__":
    main()

"""experiments/eval_grid.py compiles every configuration up front in threads (``--compile-workers``) and
then times them one by one: the records must equal those of the serial path (one worker), and no
program may be compiled inside a timed pass. A tiny random pair, uneven batches (3 prompts, 2 streams);
greedy only: 4 programs, each compiled twice (the sampling programs compile through the same threads)."""

import jax
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import tiny_config
from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
from ddtree_jax.model import KimiModel
from cli_helpers import refused
from experiments import eval_grid

VOCAB = 64
SAME = ("temperature", "mode", "budget", "streams", "tokens", "tau", "tokens_per_round", "rounds", "new_tokens",
        "tau_hist", "status_counts", "identical_to_ar")


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_config(vocab_size=VOCAB, num_layers=2, eos_token_ids=())
    target = KimiModel(cfg, nnx.Rngs(0))
    drafter = DFlashDrafter(tiny_drafter_config(cfg), nnx.Rngs(1))
    return eval_grid.Pair(target, drafter, None, (), "test", {})


def grid(pair, prompts, workers):
    """The grid with fresh jit caches, under a thread-local matmul precision as ``eval_grid.main`` sets it
    (differs from conftest's global one, so a compile thread that ignored it would compile other programs)."""
    jax.clear_caches()
    summary = {}
    with jax.default_matmul_precision("float32"):
        records = eval_grid.run_grid(pair, prompts, modes=("ar", "ddtree"), budgets=(4,), streams=(1, 2),
                                     temperatures=(0.0,), max_new_tokens=6, repeats=1, capacity=64,
                                     compile_workers=workers, log=None, compile_summary=summary)
    return records, summary


def test_concurrent_compile_matches_serial(pair):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 9, 3)]
    concurrent, c_sum = grid(pair, prompts, 2)
    serial, s_sum = grid(pair, prompts, 1)
    assert [eval_grid.label(r) for r in concurrent] == [eval_grid.label(r) for r in serial] and len(serial) == 4
    for c, s in zip(concurrent, serial):
        assert {k: c[k] for k in SAME} == {k: s[k] for k in SAME}, eval_grid.label(s)
        assert c["compiles_while_timed"] == 0 and s["compiles_while_timed"] == 0, eval_grid.label(s)
    assert eval_grid.assert_lossless(serial) == 3  # AR at 2 streams, DDTree at 1 and 2
    for r in serial:  # the histogram weighs the tokens the rounds emitted
        assert sum(k * n for k, n in enumerate(r["tau_hist"])) == round(r["tau"] * r["rounds"]), eval_grid.label(r)
    assert c_sum["compiles_overlapped"] and c_sum["compile_workers"] == 2 and c_sum["xla_compiles"] > 0
    assert not s_sum["compiles_overlapped"] and s_sum["compile_workers"] == 1 and s_sum["xla_compiles"] > 0
    assert s_sum["compile_wall_s"] == pytest.approx(sum(r["compile_s"] for r in serial), rel=0.05)


def test_engines_share_the_pair_arrays_and_workers(pair):
    a, _ = eval_grid.build_engine(pair, [[1], [2]], mode="ddtree", budget=4, streams=2, max_new_tokens=4)
    b, _ = eval_grid.build_engine(pair, [[1], [2]], mode="ar", budget=None, streams=1, max_new_tokens=4)
    assert all(x is y for x, y in zip(jax.tree.leaves(a.target_state), jax.tree.leaves(b.target_state)))
    assert eval_grid.resolve_compile_workers(8, 3) == 3 and eval_grid.resolve_compile_workers(1, 21) == 1
    assert 1 <= eval_grid.resolve_compile_workers(None, 21) <= 21
    points = eval_grid.grid_points(("ar", "dflash", "ddtree"), (8, 16), (1, 4), (0.0,))
    assert [(p["streams"], p["mode"], p["budget"]) for p in points][:4] == [
        (1, "ar", None), (1, "dflash", None), (1, "ddtree", 8), (1, "ddtree", 16)] and len(points) == 8


def test_truncation_reaches_the_sampled_points_only(pair):
    """top_k = 1 leaves one token to sample: every sampled point decodes the greedy point's tokens, and the records
    say which points were truncated."""
    prompts = [[3, 1, 4], [1, 5, 9, 2]]
    records = eval_grid.run_grid(pair, prompts, modes=("ar", "ddtree"), budgets=(4,), streams=(2,),
                                 temperatures=(0.0, 1.0), max_new_tokens=6, repeats=1, capacity=64, log=None, top_k=1)
    by_point = {(r["temperature"], r["mode"]): r for r in records}
    for mode in ("ar", "ddtree"):
        greedy, sampled = by_point[0.0, mode], by_point[1.0, mode]
        assert sampled["tokens"] == greedy["tokens"], mode
        assert (greedy["top_k"], greedy["top_p"], greedy["min_p"]) == (None, None, None)
        assert (sampled["top_k"], sampled["top_p"], sampled["min_p"]) == (1, 1.0, 0.0)


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0"], "--budgets: DDTree budget must be >= 1"),
    (["--budgets", "5000"], "--budgets: DDTree budget 5000 exceeds"),
    (["--budgets", ",", "--modes", "ddtree"], "--budgets: ddtree needs at least one"),
    (["--budgets", "8", "--modes", "ar,dflash"], "--budgets: --modes ar,dflash has no ddtree"),
    (["--streams", "0"], "--streams must be integers >= 1 (at least one), got (0,)"),
    (["--streams", ","], "--streams must be integers >= 1 (at least one), got ()"),
    (["--temperatures", "-1"], "--temperatures: temperature must be finite and >= 0"),
    (["--temperatures", ","], "--temperatures: at least one"),
    (["--temperatures", "0,1", "--top-k", "-1"], "--top-k: top_k must be >= 0 (0: off), got -1"),
    (["--temperatures", "1", "--top-p", "0"], "--top-p: top_p must be in (0, 1] (1: off), got 0.0"),
    (["--top-p", "0.9"], "--top-k / top-p / min-p: they truncate samples, and every temperature is 0 (greedy)"),
    (["--temperatures", "1", "--min-p", "-0.1"], "--min-p: min_p must be in [0, 1] (0: off), got -0.1"),
    (["--min-p", "0.2"], "--top-k / top-p / min-p: they truncate samples"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--capacity", "0"], "--capacity must be >= 1, got 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
])
def test_grid_flags_are_checked_before_any_model_is_built(argv, message, capsys):
    """Each was found only deep in the run (--streams 0 as "range() arg 3 must not be zero"), or, for --budgets
    without ddtree, ignored."""
    assert message in refused(eval_grid.parse_args, argv, capsys), argv


def test_grid_defaults_and_run_grid_checks_its_lists(pair):
    args = eval_grid.parse_args([])
    assert args.budgets == eval_grid.DEFAULT_BUDGETS and args.streams == (1, 4, 16)
    assert eval_grid.parse_args(["--modes", "ar"]).budgets == ()
    for kwargs, match in ((dict(streams=(0,)), "streams must be integers >= 1"),
                          (dict(budgets=()), "budgets: ddtree needs at least one"),
                          (dict(temperatures=(float("inf"),)), "temperatures: temperature must be finite")):
        with pytest.raises(ValueError, match=match):
            eval_grid.run_grid(pair, [[1, 2]], **kwargs, log=None)


def test_repeats_and_compile_workers_below_one_are_refused(capsys):
    """--repeats 0 ran one pass and --compile-workers 0 / -4 became the default / one worker, silently."""
    for argv, message in ((["--repeats", "0"], "--repeats 0"), (["--compile-workers", "0"], "--compile-workers 0"),
                          (["--compile-workers", "-4"], "--compile-workers -4")):
        with pytest.raises(SystemExit) as exc:
            eval_grid.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
    assert eval_grid.parse_args(["--repeats", "1", "--compile-workers", "1"]).compile_workers == 1
    with pytest.raises(ValueError, match="at least 1"):
        eval_grid.resolve_compile_workers(0, 4)
    with pytest.raises(ValueError, match="at least one timed pass"):
        eval_grid.time_passes(None, [], temperature=0.0, repeats=0)


def test_decode_tokens_per_s_counts_the_rounds_tokens_only():
    """decode tok/s divides the tokens the rounds emitted by the decode time: the prefill's first token per stream
    (its time is outside decode_s) is left out, as in run_decode and the engine."""
    import types

    def generate(batch, temperature, seed):
        return {"tokens": [[1, 2, 3, 4]] * len(batch), "status": ["max_new_tokens"] * len(batch),
                "rounds": [3] * len(batch), "batch_rounds": 3, "new_tokens": 4 * len(batch),
                "round_tokens": 3 * len(batch), "decode_s": 0.5,
                "prefill_s": 9.0,
                "tau_hist": [0, 0, 0, 0, 0]}

    engine = types.SimpleNamespace(generate=generate, ecfg=types.SimpleNamespace(mode="ar", budget=None),
                                   block_size=1, depth=0)
    record = eval_grid.time_passes(engine, [[[5], [6]]], temperature=0.0, repeats=1)
    assert record["new_tokens"] == 8 and record["decode_tokens_per_s"] == 6 / 0.5


def test_a_prompts_file_that_cannot_be_read_is_a_usage_error(pair, tmp_path, monkeypatch, capsys):
    """A missing file or one with fewer prompts than asked: argparse's status 2 and the flag named, not a
    traceback after the pair is loaded."""
    import json

    monkeypatch.setattr(eval_grid, "load_pair", lambda *a: pair)
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"format": eval_grid.PROMPTS_FORMAT, "tokenizer": pair.tokenizer_id,
                                 "prompts": [[1, 2, 3]]}))
    for path, message in ((tmp_path / "none.json", "No such file"), (short, "has 1 prompts, 16 asked for")):
        with pytest.raises(SystemExit) as exit_:
            eval_grid.main(["--prompts-file", str(path), "--no-plots"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "error: --prompts-file: " in err and message in err, err


def _histogram_key(record):
    keys = {"tau_hist", "tau_hist_accepted"} & set(record)
    assert len(keys) == 1, eval_grid.label(record)
    return keys.pop()


def test_shipped_grids_histograms_count_what_their_names_say():
    """A shipped grid's ``tau_hist`` counts stream-rounds by the tokens they emitted, so it weighs up to the
    tokens the rounds emitted (tau x rounds); grids written before the engine counted that way call theirs
    ``tau_hist_accepted`` and say so at the top."""
    import glob
    import json
    import os

    paths = sorted(glob.glob(os.path.join(os.path.dirname(eval_grid.__file__), "results", "eval_*.json")))
    grids = [(p, json.load(open(p))) for p in paths]
    grids = [(p, d) for p, d in grids if "results" in d]
    assert len(grids) >= 3, paths
    for path, grid_json in grids:
        for r in grid_json["results"]:
            key = _histogram_key(r)
            weighed = sum(k * n for k, n in enumerate(r[key]))
            assert sum(r[key]) == r["rounds"], (path, eval_grid.label(r))
            if key == "tau_hist":
                assert weighed == round(r["tau"] * r["rounds"]), (path, eval_grid.label(r))
            else:
                assert weighed >= round(r["tau"] * r["rounds"]) and "8cae686" in grid_json["tau_hist_note"], path


@pytest.mark.parametrize("key, label", [("tau_hist", "tokens emitted in a round"),
                                        ("tau_hist_accepted", "tokens accepted in a round, before the cut")])
def test_the_histogram_plot_names_what_it_counts(key, label):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [{"temperature": 0.0, "mode": "ddtree", "budget": 8, "streams": 1, "tau": 2.0, key: [0, 1, 1]}]
    fig = eval_grid.plot_tau_hist(records)
    assert fig.axes[0].get_xlabel().startswith(label), fig.axes[0].get_xlabel()
    plt.close(fig)

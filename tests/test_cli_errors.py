"""run_decode.py's flags, prompts file and cache-capacity check, and the tokenizer loader: bad input is
refused with a clear message before any model is built or decoding runs; nothing is silently dropped."""

import json
import os
import types

import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import tiny_config
from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
from ddtree_jax.engine import Engine, required_capacity
from ddtree_jax.model import KimiModel
from ddtree_jax.processors import LogitProcessing
from ddtree_jax.tokenizer import ByteTokenizer, load_tokenizer
from cli_helpers import refused
from experiments import run_decode

RANDOM = ["--target", "random"]


# ----------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("argv,message", [
    (["--mode", "all", "--budget", "0"], "--budget: DDTree budget must be >= 1"),
    (["--mode", "ddtree", "--budget", "-3"], "--budget: DDTree budget must be >= 1"),
    (["--mode", "dflash", "--budget", "8"], "--mode dflash does not build trees"),
    (["--mode", "ar", "--budget", "8"], "--mode ar does not build trees"),
    (["--streams", "0"], "--streams must be >= 1, got 0"),
    (["--streams", "-1"], "--streams must be >= 1, got -1"),
    (["--streams", "9"], "--streams 9 is more than the 8 prompts given"),
    (["--continuous"], "--continuous refills --streams slots from the prompts waiting: give --streams fewer than"),
    (["--continuous", "--streams", "8"], "--continuous refills --streams slots"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--commit", "abc1234"], "--commit is recorded in the --json report; give --json too"),
    (["--commit", " ", "--json", "report.json"], "--commit must name a commit, got an empty string"),
    (["--capacity", "0"], "--capacity must be >= 1"),
    (["--prefill-chunk", "-1"], "--prefill-chunk must be >= 1, or 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--num-prompts", "3", "--prompt", "x"], "--num-prompts picks held-out prompts"),
    (["--prompt", ""], "--prompt #1 is empty"),
    (["--prompt-ids", "1 2", "--prompt-ids", "3 x"], "--prompt-ids #2 must be space-separated token ids"),
    (["--prompt-ids", "1 -2"], "--prompt-ids #1 must be space-separated token ids >= 0"),
    (["--prompt-ids", " "], "--prompt-ids #1 must be"),
    (["--temperature", "-0.5"], "--temperature: temperature must be finite and >= 0"),
    (["--temperature", "nan"], "--temperature: temperature must be finite and >= 0"),
    (["--temperature", "1", "--top-k", "-2"], "--top-k: top_k must be >= 0 (0: off), got -2"),
    (["--temperature", "1", "--top-p", "0"], "--top-p: top_p must be in (0, 1] (1: off), got 0.0"),
    (["--temperature", "1", "--top-p", "1.5"], "--top-p: top_p must be in (0, 1] (1: off), got 1.5"),
    (["--temperature", "1", "--min-p", "1.5"], "--min-p: min_p must be in [0, 1] (0: off), got 1.5"),
    (["--top-k", "5"], "--top-k, --top-p and --min-p filter what is sampled; greedy decoding"),
    (["--top-p", "0.9"], "--top-k, --top-p and --min-p filter what is sampled"),
    (["--min-p", "0.1"], "--top-k, --top-p and --min-p filter what is sampled"),
    (["--seed", "-1"], "--seed must be in [0, 4294967289) (its 8 prompts sample with --seed + 0..7), got -1"),
    (["--prompt-ids", "1", "--seed", "4294967296"], "--seed must be in [0, 4294967296), got 4294967296"),
    (["--seed", "4294967290"],
     "--seed must be in [0, 4294967289) (its 8 prompts sample with --seed + 0..7), got 4294967290"),
    (["--mode", "ar", "--compare"], "--mode ar is AR alone"),
    (["--mode", "ar", "--drafter", "random"], "--drafter is not used"),
    (["--target", "/no/such/model"], "--target '/no/such/model' is neither a directory nor 'random'"),
    (["--drafter", "/no/such/drafter"], "--drafter '/no/such/drafter' is neither a directory nor 'random'"),
    (["--json", "/no/such/dir/out.json"], "its directory does not exist"),
    (["--json", ""], "--json must name a file, got an empty string"),
    (["--json", "."], "--json '.' is a directory: name the report's file"),
    (["--stop-ids", "1 2", "--stop-ids", "3 x"], "--stop-ids #2 must be space-separated token ids >= 0, got '3 x'"),
    (["--stop-ids", " "], "--stop-ids #1 must be space-separated token ids"),
    (["--repetition-penalty", "0"], "--repetition-penalty: repetition_penalty must be a number in [2^-20, 2^20]"),
    (["--frequency-penalty", "nan"], "--frequency-penalty: frequency_penalty must be a number in [-2, 2] (0: off)"),
    (["--presence-penalty", "inf"], "--presence-penalty: presence_penalty must be a number in [-2, 2] (0: off)"),
    (["--min-new-tokens", "-2"], "--min-new-tokens: min_new_tokens must be >= 0 (0: off), got -2"),
    (["--min-new-tokens", "9", "--max-new-tokens", "8"], "--min-new-tokens 9 passes --max-new-tokens 8"),
    (["--logit-bias", "13:-100", "--logit-bias", "4"], "--logit-bias #2 must be ID:AMOUNT (e.g. 13:-100), got '4'"),
    (["--logit-bias", "x:1"], "--logit-bias #1 must be ID:AMOUNT"),
    (["--logit-bias", "3:1", "--logit-bias", "3:2"], "--logit-bias: logit_bias gives token 3 twice"),
    (["--logit-bias", "3:nan"], "--logit-bias: logit_bias[3] must be a number in [-100, 100]"),
    (["--logprobs", "sampled"], "argument --logprobs: invalid choice: 'sampled'"),
    (["--bad-ids", "1 2", "--bad-ids", "-3"], "--bad-ids #2 must be space-separated token ids >= 0, got '-3'"),
    (["--allowed-ids", "1 x"], "--allowed-ids #1 must be space-separated token ids >= 0, got '1 x'"),
    (["--stop", "\n", "--stop", ""], "--stop: stop_strings[1] must be a non-empty string, got ''"),
])
def test_bad_flags_are_refused_before_any_model_is_built(argv, message, capsys):
    assert message in refused(run_decode.parse_args, RANDOM + argv, capsys)


def test_mode_dependent_defaults():
    args = run_decode.parse_args(RANDOM)
    assert (args.budget, args.num_prompts, run_decode.modes_of(args)) == (64, 8, ["ar", "dflash", "ddtree"])
    assert args.drafter.endswith("drafter")
    args = run_decode.parse_args(RANDOM + ["--mode", "ar", "--prompt", "hi"])
    assert (args.budget, args.drafter, args.num_prompts) == (None, None, None)
    args = run_decode.parse_args(RANDOM + ["--streams", "3", "--seed", "4294967288"])  # its last prompt: 2**32 - 1
    assert args.seed == 4294967288
    assert run_decode.batch_seeds(10, [[[1]] * 3, [[1]] * 3, [[1]] * 2]) == [[10, 11, 12], [13, 14, 15], [16, 17]]
    args = run_decode.parse_args(RANDOM + ["--mode", "dflash", "--compare", "--drafter", "random", "--streams", "8"])
    assert run_decode.modes_of(args) == ["ar", "dflash"] and args.budget is None and args.streams == 8


# ------------------------------------------------------------------------------------------- capacity
def fake_pair(block_size=4, vocab=512):
    """Stand-ins with just the fields ``check_fits`` reads (no model is built)."""
    return (types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=vocab)),
            types.SimpleNamespace(cfg=types.SimpleNamespace(block_size=block_size)))


def test_capacity_too_small_is_refused_with_the_capacity_needed():
    args = run_decode.parse_args(RANDOM + ["--drafter", "random", "--prompt-ids", "1 2 3", "--capacity", "24",
                                           "--max-new-tokens", "64"])
    target, drafter = fake_pair(block_size=4)
    with pytest.raises(ValueError, match=r"--capacity 24 is too small.*need --capacity 69 or more"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1, 2, 3]], target, drafter)
    args.capacity = 69
    run_decode.check_fits(args, run_decode.modes_of(args), [[1, 2, 3]], target, drafter)


def test_prompt_ids_are_checked_against_the_vocabulary_before_decoding():
    args = run_decode.parse_args(RANDOM + ["--drafter", "random", "--prompt-ids", "1 2", "--prompt-ids", "3 7"])
    target, drafter = fake_pair(vocab=8)
    run_decode.check_fits(args, run_decode.modes_of(args), [[1, 2], [3, 7]], target, drafter)
    args.prompt_ids.append("0 8 9")
    with pytest.raises(ValueError, match=r"--prompt-ids #3 holds \[8, 9\], outside the target's vocabulary \[0, 8\)"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1, 2], [3, 7], [0, 8, 9]], target, drafter)


def test_checks_against_the_loaded_models_exit_as_usage_errors(capsys):
    """main refuses what only the models can judge (here a --capacity below the need) like a bad flag: argparse's
    error and exit status 2 (not a ValueError's traceback), before anything is compiled."""
    argv = RANDOM + ["--drafter", "random", "--mode", "ddtree", "--prompt-ids", "1 2 3", "--capacity", "8"]
    assert "error: --capacity 8 is too small" in refused(run_decode.main, argv, capsys)


def test_what_the_engines_refuse_exits_as_a_usage_error_before_decoding(capsys):
    """A capacity past the target's positions, which only the engine checks, is refused as a usage error (it was a
    traceback from the first mode's engine)."""
    argv = RANDOM + ["--mode", "ar", "--prompt-ids", "1 2", "--max-new-tokens", "2", "--capacity", "4096"]
    assert "error: capacity=4096 passes the target's max_position_embeddings" in refused(run_decode.main, argv, capsys)


def test_budget_is_checked_against_the_drafter_before_decoding():
    args = run_decode.parse_args(RANDOM + ["--drafter", "random", "--mode", "ddtree", "--budget", "100",
                                           "--prompt-ids", "1"])
    target, drafter = fake_pair(block_size=2, vocab=8)  # one draft level of 8 tokens: at most 8 nodes
    with pytest.raises(ValueError, match="budget"):
        run_decode.check_fits(args, ["ddtree"], [[1]], target, drafter)


def test_top_k_is_checked_against_the_vocabulary_before_decoding():
    args = run_decode.parse_args(RANDOM + ["--drafter", "random", "--prompt-ids", "1", "--temperature", "1",
                                           "--top-k", "9"])
    target, drafter = fake_pair(vocab=8)
    with pytest.raises(ValueError, match=r"--top-k: top_k must be at most the vocabulary's 8 tokens .*got 9 \(the"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter)
    args.top_k = 8
    run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter)
    assert run_decode.engine_config("ddtree", args).top_k == 8


def test_stop_ids_reach_the_engine_checked_against_the_vocabulary():
    args = run_decode.parse_args(RANDOM + ["--drafter", "random", "--prompt-ids", "1", "--stop-ids", "3 4",
                                           "--stop-ids", "7"])
    target, drafter = fake_pair(vocab=8)
    run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter)
    assert run_decode.engine_config("ar", args).stop_sequences == ((3, 4), (7,))
    args.stop_ids.append("2 8 9")
    with pytest.raises(ValueError, match=r"--stop-ids #3 holds \[8, 9\], outside the target's vocabulary \[0, 8\)"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter)


def test_processing_flags_reach_the_engine_checked_against_the_target():
    """--logit-bias, --min-new-tokens and the penalties become the EngineConfig's; a bias id past the vocabulary,
    and --min-new-tokens with nothing to hold back (no EOS id, no --stop-ids), are refused before any compile."""
    argv = RANDOM + ["--drafter", "random", "--prompt-ids", "1", "--logit-bias", "5:-100", "--logit-bias", "2:1.5",
                     "--min-new-tokens", "3", "--frequency-penalty", "0.5", "--presence-penalty", "-0.25",
                     "--repetition-penalty", "1.1"]
    args = run_decode.parse_args(argv)
    target, drafter = fake_pair(vocab=8)
    run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter, eos_ids=(7,))
    ecfg = run_decode.engine_config("ddtree", args, (7,))
    assert ecfg.processing == LogitProcessing(logit_bias=((2, 1.5), (5, -100.0)), min_new_tokens=True, eos_ids=(7,),
                                              repetition_penalty=True, frequency_penalty=True, presence_penalty=True)
    assert ecfg.settings == dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.1, frequency_penalty=0.5,
                                 presence_penalty=-0.25, min_new_tokens=3)
    with pytest.raises(ValueError, match="--min-new-tokens 3 holds back EOS ids and stop sequences, and this target "
                                         "has no EOS id: give --stop-ids or --stop"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter)
    args.allowed_ids = "1 2 3 7"
    run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter, eos_ids=(7,))
    assert run_decode.engine_config("ar", args, (7,)).allowed_token_ids == (1, 2, 3, 7)
    args.allowed_ids = "1 8"
    with pytest.raises(ValueError, match=r"--allowed-ids #1 holds \[8\], outside the target's vocabulary \[0, 8\)"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter, eos_ids=(7,))
    args.allowed_ids = None
    args.bad_ids = ["3 4", "9"]
    with pytest.raises(ValueError, match=r"--bad-ids #2 holds \[9\], outside the target's vocabulary \[0, 8\)"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter, eos_ids=(7,))
    args.bad_ids = ["3 4", "6"]
    assert run_decode.engine_config("ar", args, (7,)).bad_words == ((3, 4), (6,))
    args.stop.append("\n\n")
    run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter)
    assert run_decode.engine_config("ar", args).stop_strings == ("\n\n",)
    args.logit_bias.append("8:1")
    with pytest.raises(ValueError, match=r"--logit-bias: logit_bias's token id 8 is outside the vocabulary \[0, 8\)"):
        run_decode.check_fits(args, run_decode.modes_of(args), [[1]], target, drafter)


def test_required_capacity_is_exactly_what_the_engine_needs():
    """At the computed capacity no stream stops at cache_full; one slot less, the longest one does (a random
    drafter is rarely accepted, so streams take about one token per round: the worst case)."""
    cfg = tiny_config(vocab_size=64, num_layers=1, eos_token_ids=())
    target = KimiModel(cfg, nnx.Rngs(0))
    drafter = DFlashDrafter(tiny_drafter_config(cfg, num_layers=1), nnx.Rngs(1))
    args = run_decode.parse_args(RANDOM + ["--mode", "dflash", "--drafter", "random", "--prompt-ids", "1 2 3 4 5",
                                           "--max-new-tokens", "12"])
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    need = required_capacity(5, 12, run_decode.tree_depth(run_decode.engine_config("dflash", args), 4))
    assert need == 5 + 3 + 11
    for capacity, longest_status in ((need, "max_new_tokens"), (need - 1, "cache_full")):
        args.capacity = capacity
        engine = Engine(target, drafter, run_decode.engine_config("dflash", args))
        assert engine.generate(prompts)["status"] == [longest_status, "max_new_tokens"]


def test_streams_stopped_by_a_full_cache_are_reported():
    runs = {"ar": {"status": ["max_new_tokens", "eos"]},
            "ddtree": {"status": ["cache_full", "max_new_tokens", "cache_full"], "identical_to_ar": False}}
    report = "\n".join(run_decode.stop_report(runs, capacity=24))
    assert "ddtree stream status: cache_full=2, max_new_tokens=1" in report
    assert "2 of 3 ddtree streams stopped early because the cache was full (--capacity 24)" in report
    assert "ddtree outputs differ from AR where streams stopped at cache_full" in report
    assert "ar stream status" not in report
    assert run_decode.stop_report({"ar": {"status": ["eos", "max_new_tokens"]}}, capacity=24) == []


def test_logprobs_flag_reaches_the_engine_and_the_mean_weighs_every_token():
    """--logprobs: the engine keeps log-probabilities, and merge_results' mean is over tokens (a 1-token stream
    weighs a quarter of 4 tokens, not half), perplexity exp(-mean); without them neither is reported."""
    args = run_decode.parse_args(RANDOM + ["--mode", "ar", "--logprobs"])
    assert run_decode.engine_config("ar", args).kept_logprobs == "raw" and not run_decode.engine_config(
        "ar", run_decode.parse_args(RANDOM + ["--mode", "ar"])).logprobs
    args = run_decode.parse_args(RANDOM + ["--mode", "ar", "--logprobs", "processed"])
    assert run_decode.engine_config("ar", args).kept_logprobs == "processed"

    def result(logprobs):
        return {"tokens": [[0] * len(lp) for lp in logprobs], "status": ["eos"] * len(logprobs), "rounds": [1],
                "batch_rounds": 1,
                "new_tokens": sum(map(len, logprobs)), "round_tokens": sum(len(lp) - 1 for lp in logprobs),
                "decode_s": 1.0, "prefill_s": 0.0, "tau_hist": [0, 1],
                "logprobs": logprobs}

    _, _, metrics = run_decode.merge_results([result([[-1.0, -1.0, -1.0]]), result([[-5.0]])])
    assert metrics["mean_logprob"] == -2.0 and metrics["perplexity"] == pytest.approx(np.exp(2.0))
    _, _, metrics = run_decode.merge_results([dict(result([[-1.0]]), logprobs=None)])
    assert "mean_logprob" not in metrics and "perplexity" not in metrics


# --------------------------------------------------------------------------------------- prompts file
def test_prompts_file_is_read_exactly(tmp_path):
    code = 'print("a\\nb")\r\n'  # a literal backslash-n and a CR that belong to the prompt
    path = tmp_path / "prompts.jsonl"
    path.write_bytes((json.dumps(code) + "\r\n\r\n" + json.dumps("def f():\n    return 1\n") + "\n").encode())
    assert run_decode.read_prompts_file(str(path)) == [code, "def f():\n    return 1\n"]
    args = run_decode.parse_args(RANDOM + ["--mode", "ar", "--prompts-file", str(path)])
    assert run_decode.read_prompts(args, ByteTokenizer(512)) == ([list(code.encode()),
                                                                   list(b"def f():\n    return 1\n")],
                                                                  f"--prompts-file {path}")


def test_default_prompts_are_the_shipped_cut_on_any_stdlib(monkeypatch):
    """With the shipped tokenizer and --seed 0, up to 16 held-out prompts come from experiments/heldout_prompts.json
    without reading the stdlib (another Python's would give other prompts); more prompts, another seed or the
    random model's byte tokenizer are cut from the stdlib as before, and the report names where they came from."""
    from experiments import data as data_lib

    tokenizer = load_tokenizer(os.path.join(run_decode.CHECKPOINTS, "target"), 4096)
    with open(data_lib.PROMPTS_PATH, encoding="utf-8") as f:
        shipped = [q["text"] for q in json.load(f)["prompts"]]
    cuts = []

    def fake_cut(tok, n, *, seed, min_tokens, max_tokens, allow_mismatch):
        cuts.append((n, seed, min_tokens, max_tokens, allow_mismatch))
        return [{"ids": [seed, i]} for i in range(n)]

    monkeypatch.setattr(data_lib, "cut_heldout_prompts", fake_cut)
    prompts, source = run_decode.read_prompts(run_decode.parse_args([]), tokenizer)
    assert prompts == [tokenizer.encode(t) for t in shipped[:8]] and source == "experiments/heldout_prompts.json"
    prompts, _ = run_decode.read_prompts(run_decode.parse_args(["--num-prompts", "16"]), tokenizer)
    assert prompts == [tokenizer.encode(t) for t in shipped] and cuts == []
    for argv, n, seed in ((["--num-prompts", "17"], 17, 0), (["--seed", "3"], 8, 3), (RANDOM, 8, 0)):
        prompts, source = run_decode.read_prompts(run_decode.parse_args(argv), tokenizer)
        assert prompts == [[seed, i] for i in range(n)] and source.startswith("held-out files of this machine's")
        assert cuts.pop() == (n, seed, 64, 128, True)


@pytest.mark.parametrize("content,message", [
    ("plain text, not JSON\n", ":1: not a JSON string"),
    ('"ok"\n{"prompt": "x"}\n', ":2: expected a non-empty JSON string"),
    ('"ok"\n""\n', ":2: expected a non-empty JSON string"),
    ("\n  \n", "holds no prompts"),
])
def test_bad_prompts_file_is_refused_naming_the_line(tmp_path, capsys, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert message in refused(run_decode.parse_args, RANDOM + ["--prompts-file", str(path)], capsys)


# ------------------------------------------------------------------------------------------ tokenizer
def test_model_dir_without_tokenizer_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"no tokenizer in {tmp_path}: looked for tokenizer.json and "
                                                r"tiktoken.model"):
        load_tokenizer(str(tmp_path), 512)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_tokenizer(str(tmp_path / "missing"), 512)
    assert isinstance(load_tokenizer(None, 512), ByteTokenizer)  # the random model, which has no directory


def test_a_target_without_a_tokenizer_is_refused_before_it_is_loaded(tmp_path, capsys):
    """A model directory with no tokenizer file: a usage error naming it at once, not after reading the model."""
    (tmp_path / "config.json").write_text("{}")
    message = refused(run_decode.parse_args, ["--target", str(tmp_path), "--mode", "ar", "--prompt-ids", "1 2"],
                      capsys)
    assert f"--target {str(tmp_path)!r} has no tokenizer (tokenizer.json or tiktoken.model)" in message

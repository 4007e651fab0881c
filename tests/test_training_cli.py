"""The trainers' flags, run length and resume bookkeeping, convert_checkpoint's modes and the data info on
CPU, without training: bad input is refused with a clear message before any data or model work, nothing is
silently clamped or ignored, and what is recorded is what was done."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import tiny_config
from ddtree_jax.model import KimiModel
from cli_helpers import refused
from experiments import convert_checkpoint
from experiments import data as data_lib
from experiments import train_drafter as td
from experiments import train_target as tt


# ------------------------------------------------------------------------------------------- flags
SHARED = [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "-5"], "--steps must be >= 1, got -5"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--save-every", "0"], "--save-every must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--lr", "0"], "--lr must be finite and > 0"),
    (["--lr", "nan"], "--lr must be finite and > 0"),
    (["--minutes", "0"], "--minutes must be finite and > 0"),
    (["--max-minutes", "-1"], "--max-minutes must be finite and > 0"),
    (["--minutes", "5", "--warmup", "12"], "use --warmup >= 13, got 12"),
    (["--config", "{bad"], "--config must be a JSON object"),
    (["--config", "[1]"], "--config must be a JSON object"),
]


@pytest.mark.parametrize("argv,message", SHARED + [
    (["--max-epochs", "2"], "--max-epochs caps a length fixed from --minutes"),
    (["--steps", "5000", "--max-epochs", "2"], "--max-epochs caps a length fixed from --minutes"),
    (["--minutes", "5", "--max-epochs", "0"], "--max-epochs must be finite and > 0"),
    (["--eval-rows", "7"], "--eval-rows must be >= 16, got 7"),
    (["--eval-rows", "15"], "--eval-rows must be >= 16, got 15"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--seq", "0"], "--seq must be >= 1"),
    (["--bias-every", "0"], "--bias-every must be >= 1"),
    (["--bias-rate", "-0.1"], "--bias-rate must be finite and >= 0"),
    (["--config", '{"dtype": "bfloat16"}'], "--config cannot set ['dtype']"),
    (["--config", '{"num_layerz": 2}'], "--config: "),
    (["--config", '{"num_layers": 0}'], "--config: invalid ModelConfig: first_k_dense_replace outside"),
])
def test_target_flags_are_refused_before_any_work(argv, message, capsys):
    assert message in refused(tt.parse_args, argv, capsys)


@pytest.mark.parametrize("argv,message", SHARED + [
    (["--block-size", "1"], "--block-size must be >= 2"),
    (["--num-anchors", "0"], "--num-anchors must be >= 1"),
    (["--batch", "32", "--num-seqs", "16"], "--num-seqs must be >= 32"),
    (["--eval-seqs", "8"], "--eval-seqs must be >= 16"),
    (["--eval-seqs", "40"], "--eval-seqs must be a multiple of 16"),
    (["--gamma", "0"], "--gamma must be finite and > 0"),
    (["--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["--gen-streams", "0"], "--gen-streams must be >= 1"),
    (["--new-tokens", "22"], "--new-tokens must be >= 23"),  # 16 anchors + block 8 - 1
    (["--config", '{"block_size": 4}'], "--config cannot set ['block_size']"),
    (["--config", '{"num_layer": 1}'], "--config names no DrafterConfig field: ['num_layer']"),
])
def test_drafter_flags_are_refused_before_any_work(argv, message, capsys):
    assert message in refused(td.parse_args, argv, capsys)


def test_good_flags_and_the_planned_length():
    assert tt.planned_steps(tt.parse_args([])) == tt.DEFAULT_STEPS
    assert tt.planned_steps(tt.parse_args(["--steps", "1"])) == 1
    args = tt.parse_args(["--minutes", "6", "--max-epochs", "10", "--warmup", "100", "--eval-rows", "256"])
    assert tt.planned_steps(args) is None and args.max_epochs == 10
    args = td.parse_args(["--steps", "7", "--eval-seqs", "256", "--new-tokens", "23"])
    assert tt.planned_steps(args) == 7


# ------------------------------------------------------------------------------------------- training_loop
def _loop(run_step=lambda step, lr: {"loss": 1.0}, **kw):
    saves = []
    kw = dict(dict(start=0, total_steps=None, minutes=None, lr=1e-3, warmup=16, max_minutes=None, save_every=1000,
                   desc="t"), **kw)
    out = tt.training_loop(run_step, save=lambda step, total, curve: saves.append((step, total, len(curve))), **kw)
    return out, saves


def test_max_steps_with_a_fixed_length_is_refused():
    with pytest.raises(ValueError, match="max_steps 3 caps a length fixed from minutes"):
        _loop(total_steps=100, max_steps=3)


def test_max_minutes_before_the_length_is_fixed_saves_and_says_so(tmp_path, capsys):
    import time

    def slow(step, lr):
        time.sleep(0.05)
        return {"loss": 1.0}

    (curve, done, total, _), saves = _loop(slow, minutes=60, max_minutes=0.001, warmup=100)
    assert total is None and 1 <= done < 16 and len(curve) == done
    assert saves == [(done, None, done)]  # what was trained is saved, with the length still open
    assert td.stopped_early(done, total, str(tmp_path)) and tt.stopped_early(done, total, str(tmp_path))
    assert "before --minutes fixed the run's length" in capsys.readouterr().out
    assert tt.stopped_early(5, 10, "s") and not tt.stopped_early(10, 10, "s")
    # the resume times the rest of warmup, and refuses if too little of it is left
    (curve, done, total, _), saves = _loop(slow, start=2, minutes=0.01, warmup=20)
    assert total is not None and done == total and curve[0]["step"] == 2
    with pytest.raises(ValueError, match="only 12 of the 20 warmup steps are left"):
        _loop(start=8, minutes=1, warmup=20)


def test_minutes_left_counts_earlier_segments():
    assert tt.minutes_left(None, [{"seconds": 60.0}]) is None
    assert tt.minutes_left(6.0, [{"seconds": 60.0}, {"seconds": 30.0}]) == pytest.approx(4.5)


# ------------------------------------------------------------------------------------------- evaluation
def test_nll_eval_scores_every_row():
    model = KimiModel(tiny_config(vocab_size=64, num_layers=2), nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rows = np.random.default_rng(0).integers(0, 64, (10, 9)).astype(np.int32)  # 8 + a remainder of 2
    per_token = tt.token_nll(tt.lm_forward(model, jnp.asarray(rows[:, :-1])).logits, jnp.asarray(rows[:, 1:]))
    assert tt.make_nll_eval(graphdef, rows)(state) == pytest.approx(float(per_token.mean()), rel=1e-5)
    assert tt.eval_nll(model, rows[:3]) == pytest.approx(float(per_token[:3].mean()), rel=1e-5)


# ------------------------------------------------------------------------------------------- resume
def test_a_resumed_run_keeps_its_curve_and_segments(tmp_path):
    state_dir = str(tmp_path / "state")
    tree = {"w": jnp.arange(3.0)}
    assert tt.restore_run(state_dir, tree, {"k": 1}, 10) == (tree, 0, 10, [], [])
    curve = [{"step": i, "loss": 1.0 / (i + 1)} for i in range(7)]
    history = [{"start_step": 0, "end_step": 4, "seconds": 2.0}, {"start_step": 4, "end_step": 6, "seconds": 1.0}]
    tt.save_run(state_dir, {"w": jnp.arange(3.0) + 1}, 6, 10, curve, {"k": 1}, history)
    back, start, total, curve_back, history_back = tt.restore_run(state_dir, tree, {"k": 1}, None)
    np.testing.assert_array_equal(np.asarray(back["w"]), [1.0, 2.0, 3.0])
    assert (start, total, curve_back, history_back) == (6, 10, curve[:6], history)
    tt.save_run(state_dir, tree, 2, None, curve[:2], {"k": 1}, history[:1])  # --max-minutes before the length
    assert tt.restore_run(state_dir, tree, {"k": 1}, None)[1:3] == (2, None)
    with pytest.raises(ValueError, match="fresh --state-dir"):
        tt.restore_run(state_dir, tree, {"k": 2}, None)


def test_drafter_resume_key_covers_target_contents_data_and_tokenizer(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "ddtree_checkpoint.json").write_text('{"data": "data-1"}')
    args = td.parse_args(["--target", str(target)])
    info = {"data_hash": "d1", "tokenizer_sha256": "t1"}
    key = td.drafter_resume_key(args, info)
    os.utime(target / "ddtree_checkpoint.json", (0, 0))  # a copy without its file times: same key
    assert td.drafter_resume_key(args, info) == key
    assert td.drafter_resume_key(args, dict(info, data_hash="d2")) != key
    assert td.drafter_resume_key(args, dict(info, tokenizer_sha256="t2")) != key
    (target / "ddtree_checkpoint.json").write_text('{"data": "data-2"}')  # another save of the target
    assert td.drafter_resume_key(args, info) != key
    assert json.loads(json.dumps(key)) == key


def test_target_resume_key_covers_the_tokenizer_and_max_epochs():
    """A resume with another tokenizer (same vocabulary size) or another --max-epochs had gone on silently."""
    args = tt.parse_args(["--minutes", "5", "--max-epochs", "0.5"])
    info = {"data_hash": "d1", "tokenizer_sha256": "t1"}
    key = tt.target_resume_key(args, info)
    assert tt.target_resume_key(args, dict(info, tokenizer_sha256="t2")) != key
    assert tt.target_resume_key(tt.parse_args(["--minutes", "5", "--max-epochs", "2"]), info) != key
    assert tt.target_resume_key(args, dict(info, data_hash="d2")) != key
    assert json.loads(json.dumps(key)) == key


# ------------------------------------------------------------------------------------------- data info
def _corpus(tmp_path):
    root = str(tmp_path / "lib")
    texts = {"os.py": "import sys  # héllo ✓\n", "json/decoder.py": "def f():\n    return 'ü'\n"}
    for rel, text in texts.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
            f.write(text)
    return root, texts


def test_data_info_records_the_local_python_and_the_pinned_one(tmp_path):
    root, _ = _corpus(tmp_path)
    manifest = dict(data_lib.build_manifest(root), python_version="0.0.1")
    path = str(tmp_path / "manifest.json")
    with open(path, "w") as f:
        json.dump(manifest, f)
    _, info = data_lib.load_texts("train", manifest_path=path, root=root)
    assert info["python_version"] == data_lib.python_version() and info["manifest_python_version"] == "0.0.1"


def test_tokenizer_manifest_counts_bytes_not_characters(tmp_path, monkeypatch):
    root, texts = _corpus(tmp_path)
    monkeypatch.setattr(data_lib, "stdlib_dir", lambda: root)
    monkeypatch.setattr(data_lib, "load_texts", lambda split, allow_mismatch=False: (
        [(p, t * 20) for p, t in texts.items()], {"data_hash": "h"}))
    for rel, text in texts.items():  # the files hold what load_texts returns
        with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
            f.write(text * 20)
    out = str(tmp_path / "tok")
    data_lib.main(["tokenizer", "--vocab", "280", "--out", out])
    with open(os.path.join(out, "manifest.json")) as f:
        meta = json.load(f)
    assert meta["train_bytes"] == sum(len((t * 20).encode()) for t in texts.values())
    assert meta["train_bytes"] > sum(len(t * 20) for t in texts.values())


# ------------------------------------------------------------------------------------------- convert
@pytest.mark.parametrize("argv,message", [
    (["--sweep", "w", "--dtype", "float32"], "--dtype does nothing with --sweep"),
    (["--sweep", "w", "--layers", "4", "--shards", "2"], "--shards, --layers do nothing with --sweep"),
    (["--sweep", "w", "--hf", "h", "--out", "o"], "--hf, --out do nothing with --sweep"),
    (["--make-random", "d", "--hf", "h"], "--hf does nothing with --make-random"),
    (["--make-random", "d", "--out", "o", "--dtype", "float32", "--result", "r"],
     "--out, --dtype, --result do nothing with --make-random"),
    (["--hf", "h", "--out", "o", "--shards", "4"], "--shards does nothing with a conversion"),
    (["--hf", "h", "--out", "o", "--layers", "4"], "--layers does nothing with a conversion"),
    (["--make-random", "d", "--sweep", "w"], "separate modes"),
    (["--make-random", "d", "--shards", "0"], "--shards must be >= 1"),
    (["--hf", "h"], "--hf and --out are required"),
])
def test_convert_refuses_flags_its_mode_ignores(argv, message, capsys):
    assert message in refused(convert_checkpoint.main, argv, capsys)


def test_convert_make_random_reads_its_flags(tmp_path):
    files = convert_checkpoint.main(["--make-random", str(tmp_path / "hf"), "--shards", "2", "--layers", "2"])["files"]
    assert len(files) == 2



def test_a_tokenizer_vocabulary_below_the_byte_alphabet_is_refused(tmp_path, capsys):
    """It was raised to 258 silently (the byte alphabet and the two special tokens)."""
    assert "--vocab 10: the byte alphabet and the special tokens alone take 258" in refused(
        data_lib.main, ["tokenizer", "--vocab", "10", "--out", str(tmp_path)], capsys)


def test_a_batch_larger_than_the_training_rows_is_refused_before_the_model(tmp_path, monkeypatch):
    """It ended in a ZeroDivisionError at the first step (no whole batch per epoch)."""
    info = {"data_hash": "d", "tokenizer_sha256": "t", "train_rows": 3, "heldout_rows": 32}
    monkeypatch.setattr(tt, "load_tokenizer_json", lambda path: None)
    monkeypatch.setattr(tt, "prepare_rows", lambda *a, **k: (np.zeros((3, 17)), np.zeros((32, 17)), info))
    monkeypatch.setattr(tt, "KimiModel", None)  # never reached
    args = tt.parse_args(["--batch", "4", "--seq", "16", "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=r"--batch 4 is more than the 3 training rows of 17 tokens \(--seq 16\)"):
        tt.train(args)

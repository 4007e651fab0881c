"""The engine benchmark's round split on the CPU with the tiny pair: every phase gets a wall-clock time and a
device breakdown from one traced call (span, busy time, launches, kernels), and --hlo writes each phase's
optimized HLO. Session 30 read a wall-clock phase time as device time; the breakdown is what tells them apart."""

import json
import os
import subprocess
import sys

import pytest
from flax import nnx

from experiments import bench_engine
from experiments.bench_engine import check_kernel_ms, check_sections, parse_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_round_split_reports_device_breakdown(tmp_path):
    """round_split's phases, each with its kernels and HLO; then no_host_sync's dispatch of 16 rounds on the same
    engine, under a transfer guard (a section that raises reports an error row instead: none may)."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_engine.py"), "--size", "tiny", "--sections",
           "round_split,no_host_sync", "--repeats", "1", "--hlo", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.load(open(tmp_path / "bench_engine_tiny.json"))["rows"]
    phases = {r["phase"]: r for r in rows if r.get("bench") == "round_split"}
    assert set(phases) == {"draft", "build", "verify", "accept+commit"}, rows
    for name, row in phases.items():
        assert row["ms"] > 0 and row["launches"] > 0, row
        assert 0 < row["device_busy_ms"] and 0 < row["device_span_ms"], row
        launches = sum(k[1] for k in row["kernels"])
        assert launches == row["launches"], (name, launches, row["launches"])
        times = [k[2] for k in row["kernels"]]
        assert times == sorted(times, reverse=True), name
        hlo = tmp_path / f"hlo_{name.replace('+', '_')}.txt"
        assert "HloModule" in hlo.read_text(), name
    assert not [r for r in rows if "error" in r], rows
    no_sync = [r for r in rows if r.get("bench") == "no_host_sync"]
    assert len(no_sync) == 1 and no_sync[0]["rounds_in_dispatch"] == 16 and no_sync[0]["ms_per_round"] > 0, no_sync


def test_runs_are_parsed_and_bad_ones_refused():
    assert parse_runs("ar:1,ddtree:4,dflash:2", 32) == [("ar", 1, 1), ("ddtree", 32, 4), ("dflash", 1, 2)]
    for bad in ("tree:1", "ar", "ar:0", "ar:x", "ddtree:1,"):
        with pytest.raises(ValueError, match="--runs item"):
            parse_runs(bad, 32)


def test_layer_floor_reads_shared_expert_and_router_in_full():
    """The floor of one MoE layer at M tokens: attention, norms, the shared expert and the router (weight and
    bias) in full, only the routed experts' w13 / w2 scaled by the share M tokens' top-k touches (until the
    review of session 44 the shared expert and router were scaled too: the M = 1 floor was 18 % low)."""
    from flax import nnx

    from ddtree_jax.config import QuantConfig, tiny_config
    from ddtree_jax.hf_loader import ShapeOnlyRngs
    from ddtree_jax.model import DecoderLayer
    from experiments.bench_engine import bytes_of, expert_share, step_weight_bytes

    cfg = tiny_config(dtype="float32", quant=QuantConfig(group_size=32), hidden_size=256, moe_intermediate_size=256)
    layer = nnx.eval_shape(lambda: DecoderLayer(cfg, cfg.first_k_dense_replace, ShapeOnlyRngs()))
    moe = layer.mlp
    routed = bytes_of((moe.w13.get_value(), moe.w2.get_value()))
    shared, router = bytes_of(nnx.state(moe.shared)), bytes_of((moe.router.get_value(), moe.router_bias.get_value()))
    rest = bytes_of(nnx.state(layer)) - bytes_of(nnx.state(moe))
    assert min(routed, shared, router, rest) > 0
    for m in (1, 3, 65):
        share = expert_share(cfg, m)
        assert 0 < share < 1
        assert step_weight_bytes(nnx.state(layer), cfg, m) == pytest.approx(rest + shared + router + share * routed)


def test_bad_sections_and_kernel_ms_are_refused_before_any_model_is_built(capsys):
    for bad, message in ((["--sections", "layer,kernal"], "unknown ['kernal']"),
                         (["--sections", "no_host_sync,round_split"], "put round_split before it"),
                         (["--sections", "no_host_sync"], "put round_split before it"),
                         (["--sections", "layer,layer"], "twice"),
                         (["--kernel-ms", "1,70"], "M=70"), (["--kernel-ms", "0"], "at least 1"),
                         (["--kernel-ms", "1,x"], "comma-separated integers"), (["--repeats", "0"], "at least 1"),
                         (["--budget", "0"], "--budget 0: must be at least 1"),
                         (["--layers", "1"], "--layers 1: must be at least 2"),
                         (["--time-budget-s", "-5"], "--time-budget-s -5.0: must be > 0")):
        with pytest.raises(SystemExit) as exit_:
            bench_engine.main(bad)
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and message in err and "built:" not in out, (bad, err)
    check_sections("layer,round_split,no_host_sync")
    assert check_kernel_ms("1,65,132") == [1, 65, 132]


def test_a_failed_section_fails_the_run_after_writing_the_json(tmp_path, monkeypatch):
    """A section that raises leaves an error row in the JSON and the script exits non-zero (it exited 0)."""
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench_engine, "bench_layer_cost", broken)
    monkeypatch.setattr(bench_engine, "measure_copy_bandwidth", lambda *a, **k: 1e11)
    monkeypatch.setattr(bench_engine, "measure_torch_copy_bandwidth", lambda *a, **k: None)
    stub = nnx.Linear(2, 2, rngs=nnx.Rngs(0))  # the section fails before it reads a model
    monkeypatch.setattr(bench_engine, "build_models", lambda args: (stub, stub))
    with pytest.raises(SystemExit, match="sections failed: layer"):
        bench_engine.main(["--sections", "layer", "--out", str(tmp_path), "--commit", "abc1234"])
    saved = json.load(open(tmp_path / "bench_engine_tiny.json"))
    assert saved["rows"] == [{"bench": "layer", "error": "RuntimeError: boom"}]
    assert saved["commit"] == "abc1234"  # --commit is the recorded commit, as in the other benchmarks


def test_prefill_section_reports_each_block_size(tmp_path, monkeypatch):
    """Section prefill: a row per prompt length and block size, timed, with the program's scratch memory, which a
    smaller block bounds; bad lengths or block sizes are refused before anything is built."""
    monkeypatch.setattr(bench_engine, "measure_copy_bandwidth", lambda *a, **k: 1e11)
    monkeypatch.setattr(bench_engine, "measure_torch_copy_bandwidth", lambda *a, **k: None)
    bench_engine.main(["--sections", "prefill", "--prefill-lens", "128", "--prefill-chunks", "0,16", "--repeats", "1",
                       "--out", str(tmp_path)])
    rows = [r for r in json.load(open(tmp_path / "bench_engine_tiny.json"))["rows"] if r["bench"] == "prefill"]
    assert [(r["P"], r["chunk"], r["blocks"]) for r in rows] == [(128, "one block", 1), (128, 16, 8)], rows
    assert all("error" not in r and r["ms"] > 0 and r["floor_ms"] > 0 and r["temp_MB"] > 0 for r in rows), rows
    assert rows[1]["temp_MB"] < rows[0]["temp_MB"], rows
    for flag, bad in (("--prefill-lens", "0"), ("--prefill-chunks", "-1"), ("--prefill-chunks", "x")):
        with pytest.raises(SystemExit):
            bench_engine.main(["--sections", "prefill", flag, bad])


def test_layers_sets_the_tiny_target_too():
    import argparse

    target, drafter = bench_engine.build_models(argparse.Namespace(size="tiny", layers=2))
    assert target.cfg.num_layers == 2 and drafter.cfg.num_target_layers == 2

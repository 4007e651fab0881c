"""The engine benchmark's round split on the CPU with the tiny pair: every phase gets a wall-clock time and a
device breakdown from one traced call (span, busy time, launches, kernels), and --hlo writes each phase's
optimized HLO. Session 30 read a wall-clock phase time as device time; the breakdown is what tells them apart."""

import json
import os
import subprocess
import sys

import pytest

from experiments.bench_engine import parse_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_round_split_reports_device_breakdown(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_engine.py"), "--size", "tiny", "--sections",
           "round_split", "--repeats", "1", "--hlo", "--out", str(tmp_path)]
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


def test_runs_are_parsed_and_bad_ones_refused():
    assert parse_runs("ar:1,ddtree:4,dflash:2", 32) == [("ar", 1, 1), ("ddtree", 32, 4), ("dflash", 1, 2)]
    for bad in ("tree:1", "ar", "ar:0", "ar:x", "ddtree:1,"):
        with pytest.raises(ValueError, match="--runs item"):
            parse_runs(bad, 32)

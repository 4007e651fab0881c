"""The split-merge benchmark on the CPU: its rows are the partials the attention op writes, and a smoke run
times the merge in interpret mode, checks it against the twin and writes its JSON."""

import json
import math
import sys

import pytest

from experiments import bench_split_combine as bench
from pallas_kernels.mla_attention_mgpu import splits_for


def test_partial_rows_are_the_ops():
    """The real rows up to 63 (narrow kernel or one partial tile), one tile and a tail at 72, else whole tiles."""
    assert [bench.partial_rows(T, H) for T, H in [(1, 8), (4, 8), (8, 8), (9, 8), (5, 8), (1, 64), (3, 64),
                                                  (256, 8)]] == [8, 32, 64, 72, 40, 64, 192, 2048]
    assert splits_for(16, 9, 8, 8192) == 8 and splits_for(1, 1, 8, 65536) == 128  # the points' split counts


def test_smoke_run_times_and_checks_each_variant(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_split_combine.py", "--smoke", "--out", str(tmp_path), "--name", "smoke",
                                      "--points", "1,8,1,2048", "--variants", '[{}, {"num_warps": 4}]'])
    bench.main()
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    assert [(r["NS"], r["V"], r["variant"]) for r in rows] == [(33, 8, "{}"), (33, 8, '{"num_warps": 4}')]
    for r in rows:
        assert "error" not in r and math.isfinite(r["us"]) and r["us"] > 0
        assert r["floor_us"] == pytest.approx(r["bytes"] / json.loads((tmp_path / "smoke.json").read_text())[
            "copy_bw_Bps"] * 1e6)  # beside its floor, also without PyTorch (XLA's copy)
        assert r["max_abs_err"] < 1e-2  # bf16 output against the twin's


@pytest.mark.parametrize("flag,value", [("--variants", '{"num_warps": 2}'), ("--points", "1,8,1")])
def test_bad_arguments_are_refused(monkeypatch, flag, value):
    monkeypatch.setattr(sys, "argv", ["bench_split_combine.py", "--smoke", flag, value])
    with pytest.raises(SystemExit):
        bench.main()

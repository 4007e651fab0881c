"""experiments/bench_moe.py on the CPU at small dims: the twin and ragged_dot rows each quote their own bytes
(the bf16 ragged_dot row read the INT4 byte count until the review of session 44) and a median over at least
three batches (two batches' median is their mean). Also probe_moe_mgpu's width floors."""

import json

import pytest

from experiments import bench_moe


def test_ragged_row_quotes_its_bf16_bytes_and_rows_take_three_batches(tmp_path, monkeypatch):
    seen, real = [], bench_moe.time_calls
    monkeypatch.setattr(bench_moe, "time_calls", lambda fn, args, calls=10, batches=5, budget_s=None: (
        seen.append(batches) or real(fn, args, calls=calls, batches=batches, budget_s=budget_s)))
    monkeypatch.setattr(bench_moe.bench_util, "measure_copy_bandwidth", lambda *a, **k: 1e11)
    monkeypatch.setattr(bench_moe.bench_util, "measure_torch_copy_bandwidth", lambda *a, **k: None)
    monkeypatch.setattr(bench_moe, "E", bench_moe.E)  # main rebinds the module's dims from --dims
    monkeypatch.setattr(bench_moe, "D", bench_moe.D)
    monkeypatch.setattr(bench_moe, "F", bench_moe.F)
    monkeypatch.setattr(bench_moe, "K", bench_moe.K)
    bench_moe.main(["--dims", "8,512,256,2", "--ms", "3", "--routings", "uniform", "--tiled-configs", "none",
                    "--triton-ms", "999", "--budget-s", "0.05", "--out", str(tmp_path)])
    rows = {r["impl"]: r for r in json.load(open(tmp_path / "bench_moe.json"))["rows"]}
    assert set(rows) == {"twin", "ragged_dot_bf16"} and seen == [3, 3]
    twin, ragged = rows["twin"], rows["ragged_dot_bf16"]
    assert ragged["GB"] == pytest.approx(ragged["active"] * 3 * 512 * 256 * 2 / 1e9) == ragged["bf16_GB"]
    for r in (twin, ragged):
        assert r["TBps"] == pytest.approx(r["GB"] / r["ms"])
    assert twin["GB"] < ragged["GB"]  # INT4 words + scales against bf16


def test_width_floor_is_the_larger_of_bytes_and_flops():
    """gate_up at N = 64 is compute-bound at ~800 TFLOP/s: its floor is the FLOPs' (the bytes' was quoted alone)."""
    from experiments.probe_moe_mgpu import width_floors

    f = width_floors(384, 64, 4096, 7168, 4.2e12, 800e12)
    assert f["gflop"] == pytest.approx(2 * 384 * 64 * 4096 * 7168 / 1e9)
    assert f["gb"] == pytest.approx(384 * (4096 * 7168 // 2 + 4096 * 7168 // 32 * 2) / 1e9)
    assert f["flops_floor_ms"] > f["bytes_floor_ms"] and f["floor_ms"] == f["flops_floor_ms"]
    narrow = width_floors(384, 8, 4096, 7168, 4.2e12, 800e12)
    assert narrow["floor_ms"] == narrow["bytes_floor_ms"] > narrow["flops_floor_ms"]


def test_a_config_that_is_not_key_value_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_moe.bench_util, "measure_copy_bandwidth", lambda *a, **k: 1e11)
    monkeypatch.setattr(bench_moe.bench_util, "measure_torch_copy_bandwidth", lambda *a, **k: None)
    for dim in ("E", "D", "F", "K"):  # main rebinds the module's dims from --dims
        monkeypatch.setattr(bench_moe, dim, getattr(bench_moe, dim))
    with pytest.raises(SystemExit):
        bench_moe.main(["--dims", "8,512,256,2", "--ms", "3", "--tiled-configs", "split=1;split"])
    assert "config item 'split' is not KEY=VALUE" in capsys.readouterr().err

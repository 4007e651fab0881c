"""The top-k benchmark on the CPU: a smoke run checks every method and build against ``lax.top_k`` and the
"sort" build, and the chunked log-softmax against ``jax.nn.log_softmax``, and writes its JSON."""

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_top_k as bench


def test_chunked_log_softmax_is_log_softmax():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 512)) * 4, jnp.float32)
    np.testing.assert_allclose(np.asarray(bench.chunked_log_softmax(x, 64)), np.asarray(jax.nn.log_softmax(x, -1)),
                               atol=2e-6)


def test_smoke_run_checks_each_part(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_top_k.py", "--smoke", "--out", str(tmp_path), "--name", "smoke"])
    bench.main()
    payload = json.loads((tmp_path / "smoke.json").read_text())
    rows = payload["rows"]
    assert (payload["calls"], payload["trace_repeats"]) == (2, 1)
    assert {r["part"] for r in rows} == {"top_k vocab", "top_k beam", "log_softmax", "build_tree from logits",
                                         "sample", "top_p edge", "sample keys", "scores", "stop tables (host)",
                                         "stop advance"}
    for r in rows:
        assert r.get("exact", True) is True and r.get("max_abs_err", 0) < 1e-5
        assert math.isfinite(r["us"]) and r["us"] > 0
        if r["part"] == "stop tables (host)":
            assert r["table_mb"] > 0, r
        if r["part"] in ("top_k vocab", "log_softmax", "sample", "sample keys", "scores"):
            assert r["floor_us"] > 0, r  # beside its floor, also without PyTorch (XLA's copy)


@pytest.mark.parametrize("flag", ["--calls", "--trace-repeats"])
def test_a_chain_of_no_calls_or_no_trace_is_refused(monkeypatch, capsys, flag):
    monkeypatch.setattr(sys, "argv", ["bench_top_k.py", "--smoke", flag, "0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "must be at least 1" in capsys.readouterr().err


def test_unknown_part_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_top_k.py", "--smoke", "--parts", "vocab,heap"])
    with pytest.raises(SystemExit):
        bench.main()

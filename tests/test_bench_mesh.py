"""``experiments/bench_mesh.py`` (issue #7's run) on 8 fake CPU devices with the tiny model: the weights made
in their shards, the engine's caches laid out as ``memory_plan`` predicts (bytes per device equal, byte for
byte), the verify step at each M and the engine's rounds with tau taken from an eval_grid result."""

import json

import jax
import pytest

from experiments import bench_mesh


def test_tiny_run_on_eight_devices(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    evaluation = tmp_path / "eval.json"
    evaluation.write_text(json.dumps({"results": [{"mode": "ddtree", "temperature": 0.0, "budget": 4, "tau": 2.5}]}))
    rows = bench_mesh.main(["--mesh", "1x8", "--size", "tiny", "--layers", "2", "--capacity", "256",
                            "--cache-streams", "2", "--ms", "1,9", "--prefix", "32", "--budget", "4",
                            "--streams", "2", "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1",
                            "--eval", str(evaluation), "--out", str(tmp_path)])
    assert not [r for r in rows if "error" in r], rows
    memory = {r["part"]: r for r in rows if r["bench"] == "memory"}
    assert set(memory) == {"target_weights", "drafter_weights", "caches"}
    for part, r in memory.items():
        assert r["matches_plan"] and r["measured_GB_min_device"] == r["measured_GB_max_device"] > 0, (part, r)
    assert [r["M"] for r in rows if r["bench"] == "step"] == [1, 9]
    assert all(0 < r["floor_ms"] and r["ms"] > 0 for r in rows if r["bench"] == "step")
    engine = [r for r in rows if r["bench"] == "engine"]
    assert [(r["mode"], r["streams"], r["M"]) for r in engine] == [("ar", 1, 1), ("ddtree", 2, 10)]
    ddtree = engine[1]
    assert ddtree["tau"] == 2.5 and ddtree["tau_from"] == "eval (trained pair)"
    assert ddtree["tok_per_s"] == pytest.approx(1e3 * 2 * 2.5 / ddtree["ms_per_round"])
    saved = json.loads((tmp_path / "bench_mesh_tiny_1x8.json").read_text())
    assert saved["mesh_shape"] == {"data": 1, "model": 8} and len(saved["rows"]) == len(rows)


def test_rejects_a_mesh_larger_than_the_machine():
    with pytest.raises(SystemExit):
        bench_mesh.main(["--mesh", "4x8", "--size", "tiny"])


def test_bad_m_values_are_refused_before_any_model_is_built(capsys):
    """M = 70 is no verify step's size (up to 65, else streams of 66): refused up front, not an error row after
    the model build with exit status 0."""
    for argv, message in ((["--ms", "1,70"], "M=70"), (["--ms", "0"], "at least 1"), (["--ms", "1,x"], "integers"),
                          (["--streams", "0"], "at least 1")):
        with pytest.raises(SystemExit) as exc:
            bench_mesh.main(["--size", "tiny", *argv])
        out, err = capsys.readouterr()
        assert exc.value.code == 2 and message in err and "built on" not in out, (argv, err)

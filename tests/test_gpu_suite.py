"""experiments/gpu_suite.py: deals test ids over parallel pytest processes and reports every outcome;
a failing or unfinished test makes it exit 1."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from experiments import gpu_suite


def test_deal_cuts_contiguous_runs_of_equal_length_and_drops_empty_groups():
    assert gpu_suite.deal(list("abcde"), 2) == [list("abc"), list("de")]
    assert gpu_suite.deal(list("abcdefg"), 3) == [list("abc"), list("de"), list("fg")]
    assert gpu_suite.deal(list("ab"), 4) == [["a"], ["b"]]
    with pytest.raises(ValueError, match="--groups"):
        gpu_suite.deal(list("ab"), 0)


def write_tests(tmp_path, body, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(body))
    return str(tmp_path / "test_sample.py")


def test_reports_failures_skips_and_exits_1(tmp_path, monkeypatch):
    path = write_tests(tmp_path, """
        import pytest
        def test_ok(): pass
        def test_bad(): assert 1 == 2
        @pytest.mark.skip(reason="x")
        def test_skipped(): pass
        @pytest.mark.parametrize("n", [1, 2])
        def test_param(n): assert n == 1
    """, monkeypatch)
    out = tmp_path / "out"
    rc = gpu_suite.main(["--out", str(out), "--groups", "3", "--", path])
    summary = json.loads((out / "suite.json").read_text())
    assert rc == 1
    assert summary["counts"] == {"passed": 2, "failed": 2, "skipped": 1, "not run": 0}
    assert sorted(t.split("::")[1] for t in summary["failures"]) == ["test_bad", "test_param[2]"]
    assert len(summary["groups"]) == 3 and all(os.path.exists(out / f"pytest_g{k}.txt") for k in range(3))


def test_a_group_past_the_time_limit_is_killed_and_its_finished_tests_still_count(tmp_path, monkeypatch):
    # One process, and a limit far above what two trivial tests take even on a loaded machine (session 35:
    # most likely this test's earlier form, two processes and an 8 s limit, failed on the busy H200 host).
    path = write_tests(tmp_path, """
        import time
        def test_fast(): pass
        def test_fails_first(): assert False
        def test_hangs(): time.sleep(600)
    """, monkeypatch)
    out = tmp_path / "out"
    rc = gpu_suite.main(["--out", str(out), "--groups", "1", "--timeout-s", "30", "--", path])
    summary = json.loads((out / "suite.json").read_text())
    assert rc == 1
    assert [g["killed"] for g in summary["groups"]] == [True]
    assert summary["counts"] == {"passed": 1, "failed": 1, "not run": 1}  # read from the killed group's log
    assert summary["failures"] == ["test_sample.py::test_fails_first"]


def test_collection_errors_are_reported_not_swallowed(tmp_path, monkeypatch):
    path = write_tests(tmp_path, "import no_such_module_here\ndef test_x(): pass\n", monkeypatch)
    with pytest.raises(RuntimeError, match="collection failed"):
        gpu_suite.main(["--out", str(tmp_path / "out"), "--", path])


def test_tests_outside_the_current_directory_are_refused(tmp_path, monkeypatch):
    path = write_tests(tmp_path, "def test_x(): pass\n", monkeypatch)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="outside the current directory"):
        gpu_suite.main(["--out", str(tmp_path / "o2"), "--", path])


def test_groups_share_the_gpu_and_a_quiet_flag_still_collects(tmp_path, monkeypatch):
    """The groups' processes run without JAX's preallocation of 75 % of the GPU (six of them ran out of memory on
    the H200 in session 48) and with DDTREE_REQUIRE_GPU=1, unless the caller sets them; a '-q' among pytest's
    arguments still collects test ids."""
    path = write_tests(tmp_path, """
        import os
        def test_env():
            assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
            assert os.environ["DDTREE_REQUIRE_GPU"] == "1"
    """, monkeypatch)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("DDTREE_REQUIRE_GPU", raising=False)
    out = tmp_path / "out"
    assert gpu_suite.main(["--out", str(out), "--groups", "1", "--", path, "-q"]) == 0
    assert json.loads((out / "suite.json").read_text())["counts"] == {"passed": 1, "not run": 0}


def test_gpu_tests_under_ddtree_require_gpu_fail_collection_without_a_gpu():
    """tests/conftest.py: with DDTREE_REQUIRE_GPU=1 and no GPU, the collection fails instead of skipping the GPU
    tests (a process whose GPU backend did not start skipped 32 of them on the H200 in session 48)."""
    if jax.default_backend() == "gpu":
        pytest.skip("beside a GPU the GPU tests run")
    env = {**os.environ, "DDTREE_REQUIRE_GPU": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_split_combine.py"], capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "JAX sees no GPU" in done.stdout + done.stderr

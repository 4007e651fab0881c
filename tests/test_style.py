"""The repository passes ruff with pyproject's rules (syntax errors, pyflakes' unused and undefined names,
120 columns): a long line or an unused import fails here, not in a reviewer's eye. ruff is in the test extras;
without it the check skips."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def ruff_command():
    try:
        import ruff  # noqa: F401
        return [sys.executable, "-m", "ruff"]
    except ImportError:
        exe = shutil.which("ruff")
        return [exe] if exe else None


def test_the_code_passes_ruff():
    cmd = ruff_command()
    if cmd is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
    done = subprocess.run(cmd + ["check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff found problems:\n{done.stdout}{done.stderr}"


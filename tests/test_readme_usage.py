"""The README's "Using it" snippet runs as written, on a tiny HF target and DFlash drafter in place of K2.6's.

Only the two directory paths are replaced; every call, argument and result key is the README's own, so a rename
in the API that the README does not follow fails here. The snippet runs in a fresh Python process, as a user runs
it: one device, XLA's default compile flags (this suite's -O0 ones, ``conftest.CPU_COMPILE_FLAGS``, made its 256
tokens' decode 2.5x slower: 82 s against 30 on a 2-core CPU)."""

import json
import math
import pathlib
import re
import subprocess
import sys

from conftest import user_environment
from hf_reference import tiny_hf_model
from dflash_reference import export, random_reference, ref_tensors

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET_PATH, DRAFTER_PATH = "path/to/Kimi-K2.6", "path/to/Kimi-K2.6-DFlash"
# what the test reads back from the snippet's process, appended to the snippet
REPORT = """
import json as _json
with open({path!r}, "w") as _report:
    _json.dump({{"mode": engine.ecfg.mode, "max_new_tokens": engine.ecfg.max_new_tokens,
                "tokens": [[int(t) for t in s] for s in result["tokens"]], "status": list(result["status"]),
                "tau_mean": float(result["tau_mean"]), "last_update_status": list(update.status)}}, _report)
"""


def readme_usage_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using it", 1)
    assert len(section) == 2, "the README has a '## Using it' section"
    block = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert block, "'## Using it' starts with a python block"
    return block.group(1)


def test_readme_usage_snippet_runs(tmp_path):
    snippet = readme_usage_snippet()
    assert snippet.count(f'"{TARGET_PATH}"') == 1 and snippet.count(f'"{DRAFTER_PATH}"') == 1, snippet
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    tiny_hf_model(seed=0, max_position_embeddings=4096).save_pretrained(target_dir)  # capacity=4096
    export(ref_tensors(random_reference(), prefix="model."), drafter_dir)
    code = snippet.replace(f'"{DRAFTER_PATH}"', repr(str(drafter_dir))).replace(f'"{TARGET_PATH}"',
                                                                              repr(str(target_dir)))
    script, report = tmp_path / "readme_usage.py", tmp_path / "report.json"
    script.write_text(code + REPORT.format(path=str(report)))
    done = subprocess.run([sys.executable, str(script)], env=user_environment(str(ROOT), compile_flags=False),
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(report.read_text())

    prompts = [[1, 2, 3], [4, 5]]
    assert got["mode"] == "ddtree" and len(got["tokens"]) == len(got["status"]) == len(prompts)
    for tokens, status in zip(got["tokens"], got["status"]):
        assert 1 <= len(tokens) <= got["max_new_tokens"], (len(tokens), status)
        assert all(0 <= t < 256 for t in tokens)
        assert status in ("max_new_tokens", "eos"), status
    assert math.isfinite(got["tau_mean"]) and got["tau_mean"] >= 1.0, got["tau_mean"]
    assert got["last_update_status"] == got["status"]  # the streamed loop ran to the end, as generate did
    printed = [line for line in done.stdout.splitlines() if line.startswith("[[")]
    assert printed, done.stdout[-2000:]  # the loop's print(update.new_tokens, update.status) ran

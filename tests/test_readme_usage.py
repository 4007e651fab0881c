"""The README's "Using it" snippet runs as written, on a tiny HF target and DFlash drafter in place of K2.6's.

Only the two directory paths are replaced; every call, argument and result key is the README's own, so a rename
in the API that the README does not follow fails here."""

import math
import pathlib
import re

from hf_reference import tiny_hf_model
from dflash_reference import export, random_reference, ref_tensors

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET_PATH, DRAFTER_PATH = "path/to/Kimi-K2.6", "path/to/Kimi-K2.6-DFlash"


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
    namespace: dict = {}
    exec(compile(code, "README.md (Using it)", "exec"), namespace)

    engine, result = namespace["engine"], namespace["result"]
    prompts = [[1, 2, 3], [4, 5]]
    assert engine.ecfg.mode == "ddtree" and len(result["tokens"]) == len(result["status"]) == len(prompts)
    for tokens, status in zip(result["tokens"], result["status"]):
        assert 1 <= len(tokens) <= engine.ecfg.max_new_tokens, (len(tokens), status)
        assert all(0 <= t < 256 for t in tokens)
        assert status in ("max_new_tokens", "eos"), status
    assert math.isfinite(result["tau_mean"]) and result["tau_mean"] >= 1.0, result["tau_mean"]
    assert namespace["update"].status == result["status"]  # the streamed loop ran to the end, as generate did

"""Writes notebooks/eval.ipynb (outputs cleared). The notebook is thin: every step is a function of
experiments/eval_grid.py. Re-run after editing this file:

    python notebooks/make_eval_notebook.py
"""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

CELLS = [
    new_markdown_cell("""\
# DDTree evaluation: τ and tokens/s over budgets and streams

The shipped trained K2-architecture target and its DFlash drafter (`checkpoints/`) decode held-out
standard-library prompts in AR, DFlash and DDTree mode (jit-compiled engine; one compile per mode ×
budget × streams, then timed passes). Every step is a function of `experiments/eval_grid.py`; the full
grid (budgets 8–128, streams 1/4/16, JSON + PNG under `experiments/results/`) is
`python experiments/eval_grid.py`.

τ = tokens emitted per stream per round including the bonus token (AR = 1). At T=0 every DFlash/DDTree
output must equal AR's token for token; `assert_lossless` raises otherwise."""),
    new_code_cell("""\
%matplotlib inline
import pathlib
import sys


def repo_root():
    \"\"\"The checkout holding experiments/eval_grid.py: above the working directory, else beside the
    (editable-installed) ddtree_jax package.\"\"\"
    here = pathlib.Path.cwd().resolve()
    for d in (here, *here.parents):
        if (d / "experiments" / "eval_grid.py").exists():
            return d
    try:
        import ddtree_jax
    except ImportError:
        ddtree_jax = None
    if ddtree_jax is not None:
        d = pathlib.Path(ddtree_jax.__file__).resolve().parent.parent
        if (d / "experiments" / "eval_grid.py").exists():
            return d
    raise RuntimeError("cannot find the ddtree-jax checkout: start Jupyter inside it, or `pip install -e` it")


ROOT = repo_root()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from experiments import eval_grid  # noqa: E402

print(f"repo {ROOT}, jax {jax.__version__}, device {jax.devices()[0].device_kind}")"""),
    new_markdown_cell("Grid (small by default so that it runs on a 2-core CPU in about two minutes; the test suite "
                      "runs a smaller one)."),
    new_code_cell("""\
NUM_PROMPTS = 4
BUDGETS = (8, 32, 64)
STREAMS = (1, 4)
MAX_NEW_TOKENS = 32
TEMPERATURES = (0.0,)  # add 1.0 for sampling (not checked against AR)
REPEATS = 1
SEED = 0""", metadata={"tags": ["parameters"]}),
    new_code_cell("""\
pair = eval_grid.load_pair(str(ROOT / "checkpoints" / "target"), str(ROOT / "checkpoints" / "drafter"))
prompts, prompt_meta = eval_grid.heldout_prompts(pair, NUM_PROMPTS, SEED)
print(f"{len(prompts)} held-out prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
      f"drafter block {pair.drafter.cfg.block_size}")
print(repr(pair.tokenizer.decode(prompts[0])[-200:]))"""),
    new_code_cell("""\
records = eval_grid.run_grid(pair, prompts, budgets=BUDGETS, streams=STREAMS, temperatures=TEMPERATURES,
                             max_new_tokens=MAX_NEW_TOKENS, repeats=REPEATS, seed=SEED)
print(f"\\nlossless: {eval_grid.assert_lossless(records)} greedy outputs identical to AR\\n")
eval_grid.print_table(records)"""),
    new_markdown_cell("τ vs budget (the streams lines coincide at T=0: greedy acceptance does not depend on "
                      "batching)."),
    new_code_cell("fig = eval_grid.plot_tau(records)"),
    new_markdown_cell("How many tokens each round emitted (accepted + bonus), DFlash and each DDTree budget."),
    new_code_cell("fig = eval_grid.plot_tau_hist(records)"),
    new_markdown_cell("""\
Tokens/s vs budget per streams (AR dashed, DFlash dotted). On a compute-bound CPU a tree of budget + 1
nodes costs far more than one token, so speculation loses to AR here; it pays where a step is
bandwidth-bound (a large model on a GPU)."""),
    new_code_cell("fig = eval_grid.plot_tokens_per_s(records)"),
    new_code_cell("""\
best = max((r for r in records if r["mode"] == "ddtree"), key=lambda r: r["tau"])
print(f"highest tau: DDTree-{best['budget']} at {best['streams']} streams, tau {best['tau']:.2f}; "
      f"first stream: {pair.tokenizer.decode(best['tokens'][0])!r}")"""),
]


def build():
    """The notebook as ``main`` writes it (tests/test_notebook.py checks that it equals the committed file)."""
    nb = new_notebook(cells=CELLS)
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating gives the same file
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main():
    path = os.path.join(HERE, "eval.ipynb")
    nb = build()
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

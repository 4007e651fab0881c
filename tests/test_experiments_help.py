"""Every experiment script's ``--help`` renders: argparse expands each help string with ``%`` formatting, so a
bare ``%`` in one (``"op % of peak"``) makes ``--help`` raise instead of printing. Checked statically (no
script is imported: each would import JAX and build its parser at module level)."""

import ast
import collections
import pathlib

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).parent.parent / "experiments").glob("*.py"))


def help_strings(path: pathlib.Path):
    """(line, text) of every ``add_argument(..., help=...)`` in a file; an f-string's literal parts only, its
    replacement fields as a neutral word."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for kw in node.keywords:
                if kw.arg != "help":
                    continue
                if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    yield node.lineno, kw.value.value
                elif isinstance(kw.value, ast.JoinedStr):
                    yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "x" for v in kw.value.values)


def renders(text: str) -> bool:
    try:
        text % collections.defaultdict(str)  # what argparse's HelpFormatter._expand_help does, params aside
        return True
    except (ValueError, TypeError, KeyError):
        return False


def test_a_bare_percent_is_caught():
    assert renders("the op's %% of peak; default %(default)s") and not renders("the op's % beside its ceiling")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_help_string_renders(path):
    bad = [f"line {line}: {text!r}" for line, text in help_strings(path) if not renders(text)]
    assert not bad, f"{path.name}: help strings argparse cannot expand (write % as %%): {bad}"


def test_the_scripts_have_help_strings():
    assert sum(1 for p in SCRIPTS for _ in help_strings(p)) > 50

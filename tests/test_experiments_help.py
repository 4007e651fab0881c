"""Every experiment script's ``--help`` renders: argparse expands each help string with ``%`` formatting, so a
bare ``%`` in one (``"op % of peak"``) makes ``--help`` raise instead of printing. Checked statically (the help
strings written in ``add_argument`` calls), and by building each script's parser as its ``__main__`` does (the
script run up to its ``parse_args``, which is stopped there) and calling ``format_help`` on it and on its
sub-commands' parsers: that also expands help passed by name or through a helper (``help=help``,
``PROMPTS_FILE_HELP``, ``add_matmul_precision_arg``)."""

import argparse
import ast
import collections
import pathlib
import runpy
import sys

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


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser a script built."""


def built_parser(path: pathlib.Path, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``path`` builds when run as __main__, stopped at its first parse (no device work runs)."""
    def stop(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.syspath_prepend(str(path.parent.parent))
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(path), run_name="__main__")
    return parsed.value.args[0]


ARGPARSE_SCRIPTS = [p for p in SCRIPTS if "argparse" in p.read_text()]


@pytest.mark.parametrize("path", ARGPARSE_SCRIPTS, ids=lambda p: p.name)
def test_every_parser_formats_its_help(path, monkeypatch):
    parser = built_parser(path, monkeypatch)
    parsers = [parser] + [sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                          for sub in action.choices.values()]
    for p in parsers:
        assert p.format_help(), p.prog  # raises on a help string argparse cannot expand (write % as %%)


def test_a_bare_percent_in_a_built_parser_is_caught(tmp_path, monkeypatch):
    script = tmp_path / "experiments" / "bad.py"
    script.parent.mkdir()
    script.write_text("import argparse\nHELP = 'op % of peak'\np = argparse.ArgumentParser()\n"
                      "p.add_argument('--x', help=HELP)\np.parse_args()\n")
    with pytest.raises((ValueError, TypeError)):
        built_parser(script, monkeypatch).format_help()

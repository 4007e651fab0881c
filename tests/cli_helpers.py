"""What the CLI tests share: argparse's refusal of a command line, read from its exit and stderr."""

import pytest


def refused(parse, argv, capsys) -> str:
    """argparse's error message when ``parse(argv)`` refuses ``argv`` (exit status 2); fails if it is accepted."""
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2, argv
    return capsys.readouterr().err

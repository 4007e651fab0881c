"""CI runs the README's test command: the pytest line of ``.ci/run`` is the second command of the README's first
code block (``python3`` there for ``python``), so what the README promises is what CI checks."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README starts with a bash block of two commands"
    commands = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2 and "run_decode.py" in commands[0] and "pytest" in commands[1], commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if "pytest" in line and not line.lstrip().startswith("#")]
    assert ci == [re.sub(r"^python ", "python3 ", commands[1])], (ci, commands[1])

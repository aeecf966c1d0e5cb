"""The README's examples run, and its two opening commands are the ones CI and users run.

These tests check what the README's code does, not how its prose is worded: the Python blocks
are executed in order in one namespace, and the first shell block must hold a set-up + main-job
command and a set-up + test command, the latter run verbatim by ``.ci/run``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _first_shell_commands() -> list[str]:
    """Command lines (comments stripped) of the README's first ``bash`` block."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert block, "README.md has no ```bash block"
    lines = [line.split(" #", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_readme_python_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    # The ModelZoo example builds a Group whose RigL follows the block's update cadence.
    groups = [v for v in namespace.values() if type(v).__name__ == "Group"]
    assert groups, "no README example builds a Group (the ModelZoo configure example)"
    rigl = [m for g in groups for m in g if type(m).__name__ == "RigL"]
    assert rigl and rigl[0].update_schedule(100) and not rigl[0].update_schedule(3600)


def test_readme_opens_with_main_job_and_test_commands_that_ci_runs() -> None:
    commands = _first_shell_commands()
    assert len(commands) >= 2, commands
    setup = ["bash", ".ci/setup"]
    main_job, tests = [], []
    for command in commands:
        steps = [shlex.split(part) for part in command.split("&&")]
        if steps[0] != setup:
            continue
        if steps[-1][0].endswith("lightning-sparse") and "fit" in steps[-1]:
            main_job.append(command)
        if steps[-1][1:3] == ["-m", "pytest"]:
            tests.append(command)
    assert main_job, f"no 'set up, then lightning-sparse fit' command among {commands}"
    assert tests, f"no 'set up, then python -m pytest' command among {commands}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests[0] in ci, f".ci/run does not run the README's test command {tests[0]!r}"

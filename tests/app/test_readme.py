"""The README's Python examples run as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    sparsity = namespace["sparsity"]  # the last example: configure(...) of a ModelZoo block
    assert type(sparsity).__name__ == "Group" and type(sparsity[0]).__name__ == "RigL"
    assert sparsity[0].update_schedule(100) and not sparsity[0].update_schedule(3600)


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one() -> None:
    lines = README.read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in lines[3:5]]
    assert commands[0] == "bash .ci/setup && .venv/bin/lightning-sparse fit"
    assert commands[1] == "bash .ci/setup && .venv/bin/python -m pytest -q"
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci

"""Every `lightning-sparse` command shown in README.md and docs/ parses as written.

Quick forms: LightningCLI commands run with ``--print_config`` (the whole command line is parsed
and validated, nothing trains), ``compare`` through its own parser with every recipe resolved,
``sweep`` with ``--dry-run`` on a real sweep file, ``export`` and ``generate`` through their own
parsers.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from lightning_sparse.app import cli, compare

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def documented_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv after 'lightning-sparse')`` of every command line in a fenced block."""
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in block.splitlines():
                line = line.split(" #", 1)[0].strip()
                if line.startswith("bash .ci/setup && .venv/bin/lightning-sparse"):
                    line = line.split(".venv/bin/", 1)[1]
                if not re.match(r"lightning-sparse(\s|$)", line):  # not an output line
                    continue
                found.append((f"{page.name}: {line}", shlex.split(line)[1:]))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands() -> None:
    subcommands = {argv[0] if argv else "fit" for _, argv in COMMANDS}
    assert {"fit", "compare", "sweep"} <= subcommands, subcommands


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(
    where: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(cli.DEBUG_ENV, "1")  # a failure shows its traceback here
    monkeypatch.setenv("LIGHTNING_SPARSE_THREADS", str(torch.get_num_threads()))
    monkeypatch.chdir(ROOT)
    sub = argv[0] if argv and not argv[0].startswith("-") else "fit"
    if sub == "compare":
        args = argv[1:]
        args = args[: args.index("--")] if "--" in args else args
        options = compare._parser().parse_args(args)
        for recipe in options.recipes:
            assert compare.resolve_recipe(recipe).is_file(), (where, recipe)
        return
    if sub == "sweep":
        args = [a if a != "CONFIG" else "recipes/sweeps/algorithm_x_sparsity.yaml" for a in argv]
        if "--dry-run" not in args:
            args.insert(2, "--dry-run")
        if "--out" not in args:
            args[2:2] = ["--out", str(tmp_path / "sweep")]
        cli.main(args)
        return
    if sub == "export":  # parsed only: the documented checkpoint exists after a real fit
        from lightning_sparse.app import export_cmd

        options = export_cmd._parser().parse_args(argv[1:])
        assert options.ckpt_path.endswith(".ckpt"), where
        return
    if sub == "generate":  # parsed only: tests/integrations/test_serve.py runs it on an export
        from lightning_sparse.app import generate

        options = generate._parser().parse_args(argv[1:])
        assert options.prompt and options.max_new_tokens > 0, where
        return
    args = list(argv) if argv else ["fit"]
    with pytest.raises(SystemExit) as done:
        cli.main([*args, "--print_config"])
    assert done.value.code in (0, None), where

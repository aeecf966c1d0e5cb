"""``fit --help`` from a cache (`lightning_sparse.app.help_cache`): the same text, without
torch or Lightning after the first call, and a new text whenever what it depends on changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sparse.app import help_cache

PROBE = (
    "import sys\n"
    "from lightning_sparse.app.cli import main\n"
    "try:\n"
    "    main(['fit', '--help'])\n"
    "except SystemExit as done:\n"
    "    assert done.code in (0, None), done.code\n"
    "sys.stderr.write('torch imported: %s' % ('torch' in sys.modules))\n"
)


def probe(cache: Path) -> tuple[str, str]:
    env = {**os.environ, "LIGHTNING_SPARSE_CACHE": str(cache), "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr.strip().splitlines()[-1]


def test_the_second_fit_help_is_the_first_without_torch(tmp_path: Path) -> None:
    first, first_imports = probe(tmp_path)
    second, second_imports = probe(tmp_path)
    assert "--trainer" in first and "--ckpt_path" in first
    assert second == first
    assert first_imports == "torch imported: True"
    assert second_imports == "torch imported: False"
    assert len(list((tmp_path / "help").glob("*.txt"))) == 1


def test_a_cache_that_cannot_be_written_still_prints_the_help(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    text, imports = probe(blocker)
    assert "--trainer" in text and imports == "torch imported: True"


def test_the_key_follows_the_command_the_terminal_and_the_package_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(help_cache, "_ROOT", package)
    monkeypatch.setenv("COLUMNS", "100")
    base = help_cache.key(["fit", "--help"])
    assert help_cache.key(["fit", "--help"]) == base
    assert help_cache.key(["validate", "--help"]) != base
    monkeypatch.setenv("COLUMNS", "80")
    assert help_cache.key(["fit", "--help"]) != base
    monkeypatch.setenv("COLUMNS", "100")
    (package / "a.py").write_text("x = 22\n")  # another size: an edited file
    assert help_cache.key(["fit", "--help"]) != base


@pytest.mark.parametrize(
    ("args", "only"),
    [(["fit", "--help"], True), (["fit", "-h"], True), (["fit", "--help", "--x"], False)],
)
def test_help_only(args: list[str], only: bool) -> None:
    assert help_cache.help_only(args) is only

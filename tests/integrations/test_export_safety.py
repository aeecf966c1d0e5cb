"""`export` loses nothing: ``overwrite`` replaces only this package's own export (its marker, and
nothing else in it), and an export killed at any point (SIGKILL, so no cleanup code runs) leaves
the old export in place or nothing at the output path; the next export cleans up.

Models are tiny and random (nothing downloaded).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from lightning_sparse import Static, export  # noqa: E402
from lightning_sparse.integrations import export_dir  # noqa: E402
from lightning_sparse.models import Llama, LlamaConfig  # noqa: E402
from tests.helpers import one_thread  # noqa: E402, F401  (autouse: one torch thread)

MARKER = "lightning_sparse_export.json"


def tiny(seed: int) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.from_preset("tiny", vocab_size=64, n_layers=1))
    model.apply(Static(0.8))
    return model.eval()


def contents(directory: Path) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under ``directory``."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def user_folder(path: Path) -> dict[str, bytes]:
    (path / "notes").mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "notes/ideas.md").write_text("more")
    (path / "config.json").write_text("{}")  # a name an export also writes
    return contents(path)


# ---------------------------------------------------------------- overwrite


def test_overwrite_refuses_a_folder_that_is_not_an_export_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "my_folder"
    before = user_folder(out)
    with pytest.raises(ValueError, match=rf"output='{out}' exists and has no valid {MARKER}"):
        export(tiny(0), out, overwrite=True)
    assert contents(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["my_folder"]  # no temporary left

    fake = tmp_path / "fake"  # a marker, but files it does not list
    user_folder(fake)
    (fake / MARKER).write_text(json.dumps({"writer": "lightning_sparse", "files": ["x"]}))
    with pytest.raises(ValueError, match=r"also holds \['config.json', 'notes', 'notes/ideas.md'"):
        export(tiny(0), fake, overwrite=True)
    assert (fake / "thesis.tex").read_text() == "years of work"

    file = tmp_path / "model.bin"
    file.write_text("weights")
    with pytest.raises(ValueError, match="is not a directory"):
        export(tiny(0), file, overwrite=True)
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    with pytest.raises(ValueError, match="is a symbolic link"):
        export(tiny(0), link, overwrite=True)
    assert contents(out) == before and file.read_text() == "weights"


def test_overwrite_refuses_an_export_a_user_added_files_to(tmp_path: Path) -> None:
    out = tmp_path / "out"
    export(tiny(0), out)
    (out / "README.md").write_text("my model card")
    (out / "eval").mkdir()
    before = contents(out)
    with pytest.raises(ValueError, match=r"also holds \['README.md', 'eval'\]"):
        export(tiny(1), out, overwrite=True)
    assert contents(out) == before


def test_overwrite_replaces_an_export_or_an_empty_folder(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")  # the compressed format's (an optional package)
    out = tmp_path / "out"
    export(tiny(0), out, format="compressed")
    first = contents(out)
    export(tiny(1), out, overwrite=True)
    second = contents(out)
    assert second != first and json.loads(second[MARKER])["format"] == "hf"
    empty = tmp_path / "empty"
    empty.mkdir()
    export(tiny(1), empty, overwrite=True)
    assert contents(empty) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]


def test_a_failed_swap_puts_the_old_export_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    export(tiny(0), out)
    before = contents(out)
    real = export_dir._move
    calls: list[Path] = []

    def move(source: Path, target: Path) -> None:
        calls.append(target)
        if len(calls) == 2:  # new -> output, after old -> aside
            raise OSError(28, "No space left on device")
        real(source, target)

    monkeypatch.setattr(export_dir, "_move", move)
    with pytest.raises(OSError, match="No space left"):
        export(tiny(1), out, overwrite=True)
    assert contents(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ---------------------------------------------------------------- killed exports


def killed_during_export(out: Path, step: str, call: int, seed: int) -> None:
    """Run ``export(tiny(seed), out, overwrite=True)`` in a forked child that SIGKILLs itself
    at its ``call``-th call of ``export_dir.<step>``, before the step runs."""
    pid = os.fork()
    if pid == 0:  # the child: no cleanup code may run after the kill
        try:
            real: Callable[..., Any] = getattr(export_dir, step)
            count = [0]

            def die(*args: Any) -> Any:
                count[0] += 1
                if count[0] == call:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args)

            setattr(export_dir, step, die)
            export(tiny(seed), out, overwrite=True)
        finally:
            os._exit(3)  # not killed: the step was never reached
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the export child hung before {step}")
        time.sleep(0.05)
    status = done[1]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


# (step killed before, its call number) -> what the output path holds afterwards
KILL_POINTS = {
    "writing": ("write_marker", 1, "old"),  # staging half written, no marker
    "before_swap": ("_move", 1, "old"),  # staging complete, marker written
    "between_renames": ("_move", 2, "missing"),  # old aside, new not yet in
    "before_delete": ("_discard", 1, "new"),  # new in place, old still aside
}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork to SIGKILL an export")
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_an_export_killed_at_any_point_loses_nothing_and_the_next_one_cleans_up(
    tmp_path: Path, point: str
) -> None:
    step, call, expected = KILL_POINTS[point]
    out = tmp_path / "out"
    export(tiny(0), out)
    old = contents(out)
    export(tiny(1), tmp_path / "reference")
    new = contents(tmp_path / "reference")
    (tmp_path / "reference").rename(tmp_path.parent / f"{tmp_path.name}-reference")

    killed_during_export(out, step, call, seed=1)

    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "out")
    assert leftovers and all(name.startswith(".out.lightning_sparse-") for name in leftovers)
    partial = [tmp_path / n for n in leftovers if "-partial-" in n]
    if expected == "old":
        assert contents(out) == old
    elif expected == "new":
        assert contents(out) == new
        assert contents(tmp_path / ".out.lightning_sparse-old") == old
    else:
        assert not out.exists()  # nothing at the output path, and the old export kept aside
        assert contents(tmp_path / ".out.lightning_sparse-old") == old
    if point == "writing":
        assert partial and not (partial[0] / MARKER).exists()  # cannot pass for an export

    # The next export finishes the job: the old export back (or the new kept), no leftover.
    if expected == "missing":
        with pytest.raises(ValueError, match="already exists"):
            export(tiny(2), out)  # without overwrite: the old export is restored, then kept
        assert contents(out) == old
    export(tiny(2), out, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert json.loads((out / MARKER).read_text())["writer"] == "lightning_sparse"


def test_staging_directories_of_running_exports_are_not_touched(tmp_path: Path) -> None:
    """Only a dead process's staging directory is stale (another export may be writing)."""
    out = tmp_path / "out"
    alive = tmp_path / f".out.lightning_sparse-partial-{os.getppid()}-0000"
    alive.mkdir()
    (alive / "config.json").write_text("{}")
    export(tiny(0), out)
    assert (alive / "config.json").is_file()


def test_recover_keeps_the_set_aside_export_when_a_user_folder_stands_at_the_output(
    tmp_path: Path,
) -> None:
    """An export killed between its two renames left the old export aside; then the user made
    a folder of their own at the output. `recover` deletes the set-aside export only when the
    output is an export (its marker): here both stay, untouched (a data-loss path otherwise)."""
    out = tmp_path / "out"
    export(tiny(0), out)
    old = tmp_path / ".out.lightning_sparse-old"
    out.rename(old)  # as the kill between the renames leaves it
    saved = contents(old)
    mine = user_folder(out)
    export_dir.recover(out)
    assert contents(old) == saved and contents(out) == mine
    # With the new export in place instead, the set-aside one is the stale copy: deleted.
    shutil.rmtree(out)
    export(tiny(1), tmp_path / "new")
    (tmp_path / "new").rename(out)
    export_dir.recover(out)
    assert not old.exists() and export_dir.read_marker(out) is not None

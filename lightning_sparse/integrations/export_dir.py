"""The export directory on disk: a marker that proves a directory is an export, the check before
``overwrite`` replaces one, and a write that a crash (even SIGKILL) cannot leave half done.

Marker: every export holds ``lightning_sparse_export.json`` (writer, version, format and the list
of the files the export wrote). ``overwrite=True`` replaces only an empty directory or a
directory that holds that marker and nothing but the files it lists (plus their folders): a
user's folder, or an export someone added a file to, is refused, and nothing is deleted.

Write: the files go to a hidden staging directory beside the output,
``.<name>.lightning_sparse-partial-<pid>-<token>``, the marker last; then it is renamed into
place. Replacing an export moves the old one aside to ``.<name>.lightning_sparse-old`` first,
renames the new one in, then deletes the old one. A killed export leaves one of:

- the staging directory (a "partial" name; with or without the marker) and the old export
  in place: the next export to the same output deletes staging directories whose process is
  gone;
- the old export only at ``.<name>.lightning_sparse-old`` (killed between the two renames): the
  next export first moves it back to the output (`recover`), then proceeds;
- the new export in place and the old one aside (killed before the delete): the next export
  deletes the old one.

One export at a time per output path: two concurrent exports to one path are not coordinated.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

__all__ = ["MARKER", "check_replaceable", "publish", "read_marker", "recover", "staging_dir"]

MARKER = "lightning_sparse_export.json"
_WRITER = "lightning_sparse"
_PARTIAL = ".lightning_sparse-partial-"
_OLD = ".lightning_sparse-old"


def staging_dir(output: Path) -> Path:
    """A new, empty, hidden directory beside ``output`` for this process to write into."""
    path = output.with_name(f".{output.name}{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}")
    path.mkdir()  # the umask's permissions, like any directory the user makes
    return path


def write_marker(directory: Path, format: str) -> None:  # noqa: A002  (export's argument)
    """Write the marker into ``directory``, listing every file already in it (call it last)."""
    from lightning_sparse import __version__

    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    marker = {"writer": _WRITER, "version": __version__, "format": format, "files": files}
    (directory / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker of ``directory`` if it holds a valid one this package wrote, else ``None``."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("writer") != _WRITER:
        return None
    files = marker.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return marker


def check_replaceable(output: Path) -> None:
    """Raise unless ``output`` is an empty directory or this package's export, untouched.

    Raises:
        ValueError: ``output`` is a file or a link, has no marker, or holds an entry the marker
            does not list; the message names it and the fix.
    """
    fix = (
        "overwrite=True replaces only an export written by lightning_sparse; choose a new "
        "output directory, or move or delete this one yourself"
    )
    if output.is_symlink() or not output.is_dir():
        kind = "a symbolic link" if output.is_symlink() else "not a directory"
        raise ValueError(f"output={str(output)!r} is {kind}; {fix}")
    entries = list(output.rglob("*"))
    if not entries:
        return
    marker = read_marker(output)
    if marker is None:
        raise ValueError(
            f"output={str(output)!r} exists and has no valid {MARKER}, so it is not an export "
            f"written by lightning_sparse and nothing in it was deleted; {fix}"
        )
    listed = {*marker["files"], MARKER}
    folders = {parent.as_posix() for name in listed for parent in Path(name).parents}
    extra = sorted(
        rel
        for entry in entries
        if (rel := entry.relative_to(output).as_posix()) not in listed
        and (entry.is_symlink() or not entry.is_dir() or rel not in folders)
    )
    if extra:
        raise ValueError(
            f"output={str(output)!r} is a lightning_sparse export but also holds {extra[:5]}, "
            f"which the export did not write, so nothing in it was deleted; {fix}"
        )


def recover(output: Path) -> None:
    """Finish what a killed export left: restore or delete the moved-aside old export, and
    delete the staging directories of processes that no longer run."""
    old = _old(output)
    if old.is_dir() and not old.is_symlink() and read_marker(old) is not None:
        if not (output.exists() or output.is_symlink()):
            old.rename(output)  # killed between the two renames: the old export comes back
        elif output.is_dir() and read_marker(output) is not None:
            shutil.rmtree(old)  # killed after the new export was in place
        # else: something else now sits at output; the old export stays where it is
    pattern = f".{glob.escape(output.name)}{_PARTIAL}*"
    for stale in output.parent.glob(pattern):
        pid = stale.name[len(f".{output.name}{_PARTIAL}") :].split("-")[0]
        if stale.is_dir() and not stale.is_symlink() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def publish(staging: Path, output: Path) -> None:
    """Move the finished ``staging`` directory to ``output`` (checked replaceable if it exists).

    The old export is renamed aside before the new one is renamed in, so ``output`` is never a
    mix of both; on an error the old one is put back.
    """
    if not (output.exists() or output.is_symlink()):
        _move(staging, output)
        return
    check_replaceable(output)  # again: the user may have added a file while we wrote
    if not any(output.iterdir()):
        output.rmdir()  # empty: nothing to keep aside
        _move(staging, output)
        return
    old = _old(output)
    _move(output, old)
    try:
        _move(staging, output)
    except BaseException:
        _move(old, output)
        raise
    _discard(old)


def _move(source: Path, target: Path) -> None:
    source.rename(target)


def _discard(directory: Path) -> None:
    # The new export is in place; a leftover old one is deleted by the next export (`recover`).
    shutil.rmtree(directory, ignore_errors=True)


def _old(output: Path) -> Path:
    return output.with_name(f".{output.name}{_OLD}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True

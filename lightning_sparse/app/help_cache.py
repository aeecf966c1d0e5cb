"""``lightning-sparse fit --help`` (and validate / test / predict) answered from a cache.

Those helps are built by LightningCLI from Lightning's classes, so printing one imports torch and
Lightning: seconds on a small machine before a line shows. The text depends only on the
installed code and the terminal's width, so the first call keeps it in a file and later calls
print the file, importing nothing. The file's name is a digest of everything the text depends
on (`key`): the command line, the versions of the packages that build it, every file of this
package (path, size and modification time: an edited checkout or a new install makes a new
key), and the terminal's width. A cache that cannot be read or written is skipped silently:
the help is then built as before.

Where: ``$LIGHTNING_SPARSE_CACHE`` when set, else ``$XDG_CACHE_HOME/lightning_sparse`` (default
``~/.cache/lightning_sparse``), in ``help/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import TextIO

__all__ = ["cached_help", "help_only", "key"]

PACKAGES = ("lightning", "jsonargparse", "torch", "torchmetrics")  # what builds the text
_ROOT = Path(__file__).resolve().parents[1]  # the lightning_sparse package


def help_only(args: list[str]) -> bool:
    """Whether ``args`` (subcommand first) ask for the subcommand's help and nothing else."""
    return len(args) == 2 and args[1] in ("--help", "-h")


def _cache_dir() -> Path:
    explicit = os.environ.get("LIGHTNING_SPARSE_CACHE")
    if explicit:
        return Path(explicit) / "help"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning_sparse" / "help"


def _package_files() -> Iterator[str]:
    """``path:size:mtime_ns`` of every file of the package (recipes included)."""
    for directory, subdirs, files in os.walk(_ROOT):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(files):
            with contextlib.suppress(OSError):
                stat = os.stat(os.path.join(directory, name))
                yield f"{directory}/{name}:{stat.st_size}:{stat.st_mtime_ns}"


def key(args: list[str]) -> str:
    """The digest of everything the help text of ``args`` depends on (module docstring)."""
    digest = hashlib.sha256()
    parts = [" ".join(args), sys.version]
    for package in PACKAGES:
        try:
            parts.append(f"{package}=={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{package} missing")
    parts.append(f"columns={shutil.get_terminal_size().columns}")
    parts.extend(_package_files())
    digest.update("\n".join(parts).encode())
    return digest.hexdigest()[:32]


def cached_help(args: list[str], build: Callable[[], None]) -> None:
    """Print the help of ``args`` from the cache, or run ``build`` (which prints it and may exit
    with status 0, as argparse does) and keep what it printed for the next call."""
    path = _cache_dir() / f"{key(args)}.txt"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        sys.stdout.write(path.read_text(encoding="utf-8"))
        return
    printed = io.StringIO()
    tee = _Tee(sys.stdout, printed)
    try:
        with contextlib.redirect_stdout(tee):
            build()
    except SystemExit as done:
        if done.code not in (0, None):
            raise
        _keep(path, printed.getvalue())
        raise
    _keep(path, printed.getvalue())


def _keep(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a concurrent reader sees all of it or nothing)."""
    if not text:
        return
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)


class _Tee(io.TextIOBase):
    """A text stream writing to two others."""

    def __init__(self, first: TextIO, second: io.StringIO) -> None:
        self.first, self.second = first, second

    def write(self, text: str) -> int:
        self.second.write(text)
        return self.first.write(text)

    def flush(self) -> None:
        self.first.flush()

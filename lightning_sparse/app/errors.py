"""Expected failures of a `lightning-sparse` subcommand, as a few lines instead of a traceback.

`run_or_exit` runs a subcommand and turns what a user can fix into text on stderr and a non-zero
exit status:

- `CLIError` (a config file that is missing or not a YAML mapping, a missing ``--ckpt_path``, a
  run directory that cannot be created, a full disk, a run stopped by SIGTERM): one line naming
  the file (and key) and the fix; exit status 2 for the command line, 1 for a failed run, 143
  for SIGTERM.
- A configuration value that a class refuses (`SparseCLI` adds a note naming the key:
  `note_key`): the message, the key and how to see more (`short_error`, three lines).

``--debug`` or ``LIGHTNING_SPARSE_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from jsonargparse import Namespace

from lightning_sparse.app.common import DEBUG_ENV, PROG, class_entries, class_of

__all__ = [
    "CONFIG_ERROR_NOTE",
    "EXIT_FAILED",
    "EXIT_SIGTERM",
    "EXIT_USAGE",
    "CLIError",
    "describe_os_error",
    "note_key",
    "run_or_exit",
    "short_error",
]

CONFIG_ERROR_NOTE = f"{PROG}: raised while building the configured objects"
EXIT_FAILED = 1  # the run failed (disk full, no permission, ...)
EXIT_USAGE = 2  # the command line or a file it names is wrong (as argparse exits)
EXIT_SIGTERM = 128 + 15  # stopped by SIGTERM, as a shell reports a process the signal ended


class CLIError(Exception):
    """An expected failure: ``message`` (one line, naming the file or key and the fix) is printed
    after ``lightning-sparse: `` and the command exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever it quotes
        self.exit_code = exit_code


def run_or_exit(main: Callable[[list[str]], None], args: list[str], debug: bool) -> None:
    """``main(args)``; an expected failure exits (`SystemExit`) with a short message on stderr
    unless ``debug``, when it propagates with its traceback."""
    try:
        main(args)
    except CLIError as err:
        if debug:
            raise
        print(f"{PROG}: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except Exception as err:  # only those `note_key` marked: a configured object refused
        if debug or not any(n.startswith(CONFIG_ERROR_NOTE) for n in _notes(err)):
            raise
        sys.exit(short_error(err))


def describe_os_error(err: OSError, doing: str = "", path: str | os.PathLike | None = None) -> str:
    """One line for a failed file operation: the path, the cause and the fix (this package's own
    messages, e.g. `AtomicCheckpointIO`'s, are kept as they are). ``doing``: what failed
    (``"cannot create the run directory"``); ``path``: what it was done to (default: the error's
    file name)."""
    path = err.filename if path is None else path
    text = err.strerror or str(err)
    if path is None:  # already a full message (a checkpoint write names its file and fix)
        return f"{doing}: {text}" if doing else text
    path = Path(path)
    where = f"{doing} {str(path)!r}" if doing else repr(str(path))
    code = err.errno
    if code in (errno.EACCES, errno.EPERM) or isinstance(err, PermissionError):
        parent = _existing_ancestor(path)
        fix = (
            f"make {str(parent)!r} writable for this user (chmod / chown), or run from (or point "
            "the logger's save_dir / ModelCheckpoint's dirpath at) a directory you can write"
        )
        return f"{where}: permission denied; {fix}"
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return f"{where}: no space left on device; free space there or write elsewhere"
    if code == errno.EROFS:
        return f"{where}: read-only file system; write to a writable disk instead"
    blocker = _file_in_the_way(path)
    if blocker is not None and code in (errno.ENOTDIR, errno.EEXIST):
        return (
            f"{where}: {str(blocker)!r} is a file, not a directory; move it away or write "
            "elsewhere (the logger's save_dir, ModelCheckpoint's dirpath)"
        )
    if isinstance(err, FileNotFoundError):
        return f"{where}: no such file or directory; check the path"
    return f"{where}: {text}; check the path (full traceback: {DEBUG_ENV}=1 or --debug)"


def _file_in_the_way(path: Path) -> Path | None:
    """The first of ``path``'s parents (from the top), or ``path``, that is not a directory."""
    for candidate in [*reversed(path.parents), path]:
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def note_key(err: BaseException, config: Namespace) -> None:
    """Mark ``err`` (raised while building the objects of ``config``) as a configuration error,
    naming the key of the object whose constructor raised it where it can be found."""
    key = _offending_key(config, err)
    note = (
        f"{CONFIG_ERROR_NOTE}{f' ({key})' if key else ''}, before any training step; "
        "fix the recipe value named above (or its command-line override)"
    )
    if sys.version_info >= (3, 11):
        err.add_note(note)
    else:  # Python 3.10 has no add_note (PEP 678); _notes() reads the list it would append to
        setattr(err, "__notes__", [*_notes(err), note])  # noqa: B010  (not in 3.10's typeshed)


def short_error(err: BaseException) -> str:
    """A few lines: the library's message (the innermost cause), the key, how to see more."""
    cause = _innermost(err)
    where = next((n for n in _notes(err) if n.startswith(CONFIG_ERROR_NOTE)), "")
    key = re.search(r"\((.+)\), before", where)
    return "\n".join(
        [
            f"{PROG}: configuration error{f' in {key[1]}' if key else ''}:",
            f"  {type(cause).__name__}: {cause}",
            "Fix the recipe value (or its command-line override); nothing was trained. "
            f"Full traceback: {DEBUG_ENV}=1 or --debug.",
        ]
    )


def _offending_key(config: Namespace, err: BaseException) -> str | None:
    """The config key of the object whose constructor raised ``err`` (its innermost cause),
    with the argument the message starts with (``sparsity=1.5 ...``) when it is one of its."""
    cause = _innermost(err)
    raised_in = next(
        (
            type(frame.f_locals["self"])
            for frame, _ in traceback.walk_tb(cause.__traceback__)
            if frame.f_code.co_name == "__init__" and "self" in frame.f_locals
        ),
        None,
    )
    if raised_in is None:
        return None
    for key, entry in class_entries(config):
        if class_of(entry) is raised_in:
            match = re.match(r"(\w+)=", str(cause))
            args = entry.get("init_args") or Namespace()
            if match and match[1] in args:
                return f"{key}.init_args.{match[1]} ({entry.class_path})"
            return f"{key} ({entry.class_path})"
    return None


def _innermost(err: BaseException) -> BaseException:
    cause = err
    while (inner := cause.__cause__ or cause.__context__) is not None:
        cause = inner
    return cause


def _notes(err: BaseException) -> list[str]:
    return list(getattr(err, "__notes__", []))

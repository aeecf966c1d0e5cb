"""Expected failures of a `lightning-sparse` subcommand, as a few lines instead of a traceback.

A configuration value that a class refuses (`SparseCLI` adds a note naming the key: `note_key`)
is printed as the message, the key and how to see more; ``--debug`` or
``LIGHTNING_SPARSE_DEBUG=1`` shows the traceback instead (`run_or_exit`).
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable

from jsonargparse import Namespace

from lightning_sparse.app.common import DEBUG_ENV, PROG, class_entries, class_of

__all__ = ["CONFIG_ERROR_NOTE", "note_key", "run_or_exit", "short_error"]

CONFIG_ERROR_NOTE = f"{PROG}: raised while building the configured objects"


def run_or_exit(main: Callable[[list[str]], None], args: list[str], debug: bool) -> None:
    """``main(args)``; a configuration error exits (`SystemExit`) with `short_error`'s lines
    unless ``debug``, when it propagates with its traceback."""
    try:
        main(args)
    except (ValueError, TypeError) as err:
        if debug or not any(n.startswith(CONFIG_ERROR_NOTE) for n in _notes(err)):
            raise
        sys.exit(short_error(err))


def note_key(err: BaseException, config: Namespace) -> None:
    """Mark ``err`` (raised while building the objects of ``config``) as a configuration error,
    naming the key of the object whose constructor raised it where it can be found."""
    key = _offending_key(config, err)
    err.add_note(
        f"{CONFIG_ERROR_NOTE}{f' ({key})' if key else ''}, before any training step; "
        "fix the recipe value named above (or its command-line override)"
    )


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
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    return cause


def _notes(err: BaseException) -> list[str]:
    return list(getattr(err, "__notes__", []))

"""Checks before a ``fit`` / ``validate`` / ``test`` / ``predict`` run starts: the files the command
line names exist and are what they should be.

- Every ``--config`` file (`check_config_files`, before LightningCLI parses): it exists, can be
  read, is YAML (a syntax error names the file, line and column) and holds a mapping (a recipe is
  ``trainer:`` / ``model:`` / ``data:`` ...; a list or a bare value is refused).
- ``--ckpt_path`` (`check_ckpt_path`, after parsing, before any object is built): a path that is
  not a file is refused at once instead of after the model and data are set up.

Each failure is a `CLIError`: one line naming the file (and the option) and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lightning_sparse.app.errors import CLIError, describe_os_error
from lightning_sparse.recipes import RECIPES_DIR

__all__ = ["check_ckpt_path", "check_config_files", "config_paths"]

# --ckpt_path values Lightning resolves itself (not files).
_CKPT_KEYWORDS = ("last", "best", "hpc")


def config_paths(args: list[str]) -> list[str]:
    """The values of ``--config`` / ``-c`` / ``--config=...`` in ``args``, in order."""
    values = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith("--config="):
            values.append(arg.split("=", 1)[1])
    return values


def check_config_files(args: list[str]) -> None:
    """Refuse a ``--config`` that is missing, unreadable, not YAML or not a mapping.

    A value that is not an existing path but parses as a YAML mapping or list is an inline
    configuration (``--config '{trainer: {max_steps: 5}}'``), which LightningCLI handles.

    Raises:
        CLIError: naming the file, the problem (line and column of a YAML error) and the fix.
    """
    for value in config_paths(args):
        path = Path(value)
        if not path.exists():
            if _inline_config(value):
                continue
            raise CLIError(
                f"config file {value!r} (--config) does not exist; pass the path of a recipe "
                f"YAML file (the shipped recipes are in {str(RECIPES_DIR)!r})"
            )
        if path.is_dir():
            raise CLIError(
                f"config file {value!r} (--config) is a directory; pass the YAML file inside it"
            )
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise CLIError(
                f"config file {value!r} (--config) is not text (a YAML recipe was expected); "
                "check the path"
            ) from None
        except OSError as err:
            raise CLIError(describe_os_error(err, "cannot read config file (--config)")) from err
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise CLIError(f"config file {value!r} (--config): {_yaml_problem(err)}") from err
        if data is not None and not isinstance(data, dict):
            kind = "a list" if isinstance(data, list) else f"a single {type(data).__name__} value"
            raise CLIError(
                f"config file {value!r} (--config) holds {kind} at the top level; a recipe is a "
                "mapping of keys (trainer:, model:, data:, ...): see the shipped recipes in "
                f"{str(RECIPES_DIR)!r}"
            )


def check_ckpt_path(ckpt_path: Any, subcommand: str | None) -> None:
    """Refuse a ``--ckpt_path`` that names no file (``last``, ``best``, ``hpc``, ``registry...``
    and remote URLs are left to Lightning).

    Raises:
        CLIError: naming the path and the fix.
    """
    if ckpt_path is None:
        return
    value = str(ckpt_path)
    if value in _CKPT_KEYWORDS or value.startswith("registry") or "://" in value:
        return
    path = Path(value)
    if path.is_file():
        return
    if path.is_dir():
        raise CLIError(
            f"checkpoint {value!r} (--ckpt_path) is a directory; pass the .ckpt file inside it"
        )
    resume = " or --ckpt_path last to resume the latest run" if subcommand == "fit" else ""
    raise CLIError(
        f"checkpoint {value!r} (--ckpt_path) does not exist; pass a checkpoint written by fit "
        f"(e.g. outputs/<recipe>/version_N/checkpoints/last.ckpt){resume}"
    )


def _inline_config(value: str) -> bool:
    try:
        return isinstance(yaml.safe_load(value), dict | list)
    except yaml.YAMLError:
        return False


def _yaml_problem(err: yaml.YAMLError) -> str:
    """``line L, column C: <problem> (<context>)``; fix the YAML there."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    context_mark = getattr(err, "context_mark", None)
    if context and context_mark is not None:
        context = f"{context} at line {context_mark.line + 1}"
    detail = f"{problem} ({context})" if context else problem
    return f"{where}YAML syntax error: {detail}; fix the YAML there"

"""Checks before a ``fit`` / ``validate`` / ``test`` / ``predict`` run starts: the files the command
line names exist and are what they should be.

- Every ``--config`` file (`check_config_files`, before LightningCLI parses): it exists, can be
  read, is YAML (a syntax error names the file, line and column) and holds a mapping (a recipe is
  ``trainer:`` / ``model:`` / ``data:`` ...; a list or a bare value is refused).
- ``--ckpt_path`` (`check_ckpt_path`, after parsing, before any object is built): a path that is
  not a file is refused at once instead of after the model and data are set up; a file that is
  not a Lightning checkpoint read weights-only (text, a truncated file, a pickle of other
  objects, a bare state dict) is refused naming the file, never with torch's advice to load it
  unsafely.

Each failure is a `CLIError`: one line naming the file (and the option) and the fix.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning_sparse.app.errors import CLIError, describe_os_error
from lightning_sparse.recipes import RECIPES_DIR

__all__ = ["check_checkpoint_file", "check_ckpt_path", "check_config_files", "config_paths"]

# --ckpt_path values Lightning resolves itself (not files).
_CKPT_KEYWORDS = ("last", "best", "hpc")
_WRITTEN_BY_FIT = (
    "a checkpoint written by fit (e.g. outputs/<recipe>/version_N/checkpoints/last.ckpt)"
)
# What Lightning reads from every checkpoint it loads.
_LIGHTNING_KEYS = ("state_dict", "pytorch-lightning_version")


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
        if data is None:
            raise CLIError(
                f"config file {value!r} (--config) is empty (no keys, or comments only); a "
                "recipe is a mapping of keys (trainer:, model:, data:, ...): start from one of "
                f"the shipped recipes in {str(RECIPES_DIR)!r}"
            )
        if not isinstance(data, dict):
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
        f"checkpoint {value!r} (--ckpt_path) does not exist; pass {_WRITTEN_BY_FIT}{resume}"
    )


def check_checkpoint_file(path: str) -> None:
    """Refuse a ``--ckpt_path`` file that is not a Lightning checkpoint ``torch.load`` reads
    weights-only (tensors and plain values: what ``fit`` writes). Read with ``mmap`` where the
    format allows, so that a large checkpoint costs little here.

    Raises:
        CLIError: naming the file, what it is instead, and the fix.
    """
    import torch  # here: the command's other checks run before torch is loaded

    where = f"checkpoint {path!r} (--ckpt_path)"
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except pickle.UnpicklingError as err:
        if "global" in str(err).lower():
            raise CLIError(
                f"{where} holds Python objects other than tensors and plain values, which "
                f"lightning-sparse does not unpickle (that would run code from the file); pass "
                f"{_WRITTEN_BY_FIT}"
            ) from None
        raise _not_a_checkpoint(where) from None
    except (RuntimeError, KeyError, EOFError, ValueError, AttributeError, TypeError):
        raise _not_a_checkpoint(where) from None
    except OSError as err:
        raise CLIError(describe_os_error(err, "cannot read checkpoint (--ckpt_path)")) from err
    missing = [k for k in _LIGHTNING_KEYS if not isinstance(loaded, Mapping) or k not in loaded]
    if missing:
        kind = "a mapping" if isinstance(loaded, Mapping) else f"a {type(loaded).__name__}"
        raise CLIError(
            f"{where} is a torch file holding {kind} without {' or '.join(map(repr, missing))}, "
            f"not a Lightning checkpoint (a bare state_dict?); pass {_WRITTEN_BY_FIT}"
        )


def _not_a_checkpoint(where: str) -> CLIError:
    return CLIError(
        f"{where} is not a checkpoint: torch.load cannot read it (text, another format, or a "
        f"truncated file); pass {_WRITTEN_BY_FIT}"
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

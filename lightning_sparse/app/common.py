"""What every `lightning-sparse` subcommand shares: the table of subcommands (and the
``lightning-sparse --help`` made from it), the ``--debug`` option, and reading the class entries
of a LightningCLI configuration.

Adding a subcommand: write ``lightning_sparse/app/<module>.py`` with ``main(args: list[str])``
(``args``: the command line after the subcommand's name) and add one `Subcommand` line to
`SUBCOMMANDS`. The entry point (`lightning_sparse.app.cli`) dispatches to it, and ``--help`` and
the unknown-subcommand message list it.

This module imports neither torch nor Lightning: ``lightning-sparse --help`` is answered from it
alone (`top_level_help`), and each subcommand loads what it needs when it runs.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from jsonargparse import Namespace

__all__ = [
    "DEBUG_ENV",
    "LIGHTNING_SUBCOMMANDS",
    "PROG",
    "RUN_ENV",
    "SUBCOMMANDS",
    "SUBCOMMAND_HELP",
    "Subcommand",
    "as_list",
    "class_entries",
    "class_of",
    "split_debug",
    "subcommand_for",
    "subcommands_epilog",
    "top_level_help",
]

PROG = "lightning-sparse"
DEBUG_ENV = "LIGHTNING_SPARSE_DEBUG"
# The run directory chosen by the launching process, for the DDP workers Lightning starts (they
# parse the same command line and must not pick the next version_N; `run_dirs`). Here, not in
# `run_dirs`, so that `compare` and `sweep` read it without loading Lightning.
RUN_ENV = "LIGHTNING_SPARSE_RUN"


@dataclass(frozen=True)
class Subcommand:
    """One ``lightning-sparse <name>``: ``lightning_sparse.app.<module>.main`` runs it.

    ``lightning``: a LightningCLI subcommand (fit / validate / test / predict); its ``main`` gets
    the whole command line (the name included) and the entry point sets torch's threads first.
    Every other ``main`` gets the arguments after the name.
    """

    name: str
    module: str
    help: str
    lightning: bool = False

    def main(self) -> Callable[[list[str]], None]:
        """The module's ``main``, imported now (so a subcommand's dependencies load only when it
        runs)."""
        return importlib.import_module(f"lightning_sparse.app.{self.module}").main


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("fit", "fit", "train (default; no --config: recipes/rigl_llama.yaml)", True),
    Subcommand("validate", "fit", "one validation epoch (a checkpoint: --ckpt_path)", True),
    Subcommand("test", "fit", "loss on the held-out test split (a checkpoint: --ckpt_path)", True),
    Subcommand("predict", "fit", "continue test prompts -> predictions.jsonl (--ckpt_path)", True),
    Subcommand("compare", "compare", "train recipes in turn; table and plot (compare --help)"),
    Subcommand("sweep", "sweep", "run a W&B sweep config locally (sweep --help)"),
    Subcommand("export", "export_cmd", "checkpoint -> Hugging Face directory (export --help)"),
    Subcommand("generate", "generate", "text from an export or checkpoint (generate --help)"),
)
LIGHTNING_SUBCOMMANDS = tuple(s.name for s in SUBCOMMANDS if s.lightning)
SUBCOMMAND_HELP = {s.name: s.help for s in SUBCOMMANDS}


def subcommand_for(args: list[str]) -> Subcommand | None:
    """The subcommand ``args`` run: ``fit`` when empty or when it starts with an option (as
    LightningCLI takes it), ``None`` for an unknown name."""
    if not args or args[0].startswith("-"):
        return SUBCOMMANDS[0]
    return next((s for s in SUBCOMMANDS if s.name == args[0]), None)


def subcommands_epilog() -> str:
    """One sentence listing the subcommands, for the unknown-subcommand message."""
    lightning = ", ".join(LIGHTNING_SUBCOMMANDS)
    others = ", ".join(
        f"{s.name} ({s.help.split(' (')[0]}: {PROG} {s.name} --help)"
        for s in SUBCOMMANDS
        if not s.lightning
    )
    return f"subcommands: {lightning} (LightningCLI; fit is the default), {others}"


def top_level_help() -> str:
    """``lightning-sparse --help``: the subcommands, one line each, and the options every one
    takes (a subcommand's own: ``lightning-sparse <subcommand> --help``)."""
    width = max(len(s.name) for s in SUBCOMMANDS) + 4
    rows = [f"  {s.name:<{width}}{s.help}" for s in SUBCOMMANDS]
    return "\n".join(
        [
            f"usage: {PROG} [subcommand] [options]",
            "",
            "Train, evaluate, compare and export models with unstructured weight sparsity.",
            "",
            "subcommands:",
            *rows,
            "",
            "options:",
            f"  {'-h, --help':<{width}}this message; {PROG} <subcommand> --help: its options",
            f"  {'--debug':<{width}}a failure's full traceback ({DEBUG_ENV}=1 does the same)",
            "",
            f"Without a subcommand the options are fit's: {PROG} --config recipes/set_llama.yaml",
            f"trains that recipe, {PROG} alone the default one.",
        ]
    )


def split_debug(args: list[str]) -> tuple[list[str], bool]:
    """``args`` without ``--debug``, and whether a full traceback was asked for (``--debug``
    anywhere, or ``LIGHTNING_SPARSE_DEBUG`` set to anything but ``0``)."""
    debug = "--debug" in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    return [a for a in args if a != "--debug"], debug


# ------------------------------------------------------------------ LightningCLI config entries
def as_list(value: Any) -> list[Any]:
    """A config value that may be one entry or a list of them, as a list (``None`` / a bool:
    none)."""
    if isinstance(value, list):
        return value
    return [] if value is None or isinstance(value, bool) else [value]


def class_of(entry: Any) -> type | None:
    """The class a config entry (``class_path`` + ``init_args``) names; ``None`` otherwise."""
    class_path = entry.get("class_path") if isinstance(entry, Namespace) else None
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


def class_entries(value: Any, key: str = "") -> Iterator[tuple[str, Namespace]]:
    """Every ``(key, entry)`` with a ``class_path`` in a parsed configuration, depth first
    (``trainer.callbacks[2]``, ``model``, ...)."""
    if isinstance(value, Namespace):
        if isinstance(value.get("class_path"), str):
            yield key, value
        for name, item in vars(value).items():
            if name != "init_args":
                yield from class_entries(item, f"{key}.{name}" if key else name)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from class_entries(item, f"{key}[{index}]")

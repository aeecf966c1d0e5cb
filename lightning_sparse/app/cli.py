"""`lightning-sparse`: LightningCLI (fit / validate / test / predict), ``compare`` and ``sweep``.

With no ``--config`` it runs the default recipe, ``recipes/rigl_llama.yaml``: a small Llama
decoder on byte-level text from the Python standard library, RigL at 80% on the decoder's linear
layers. Any recipe, or any LightningCLI option, can be given on the command line::

    lightning-sparse fit                                   # the default recipe
    lightning-sparse fit --config recipes/static_llama.yaml --trainer.max_steps 50
    lightning-sparse fit --ckpt_path last                  # resume the default recipe's run
    lightning-sparse compare --steps 100                   # dense / static / SET / RigL / GraNet
    lightning-sparse sweep ...                             # see lightning_sparse/sweep.py

Every run gets a `SparseRunSummary` callback (options under ``summary:``). Weights & Biases runs
offline unless an account is configured (``WANDB_API_KEY`` or an ``api.wandb.ai`` entry in
``~/.netrc``); ``WANDB_MODE`` set by the user always wins.
"""

from __future__ import annotations

import netrc
import os
import sys
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import lightning_sparse.wse  # noqa: F401  (registers accelerator="wse" for recipes)
from lightning_sparse.lightning import ModelZooSparsity, SparseRunSummary
from lightning_sparse.recipes import RECIPES_DIR

__all__ = [
    "DEFAULT_RECIPE",
    "RECIPES_DIR",
    "ModelZooSparsity",
    "SparseCLI",
    "build_args",
    "main",
    "run",
    "wandb_mode",
]

DEFAULT_RECIPE = RECIPES_DIR / "rigl_llama.yaml"
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


class SparseCLI(LightningCLI):
    """LightningCLI with any LightningModule / LightningDataModule (``class_path`` in the recipe)
    and a `SparseRunSummary` on every run (configured under ``summary:``)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(SparseRunSummary, "summary")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            err.add_note(
                "lightning-sparse: raised while building the configured objects, before any "
                "training step; fix the recipe value named above (or its command-line override)"
            )
            raise
        for logger in self.trainer.loggers:
            if logger.save_dir:  # W&B looks for a git repository there and warns if it is missing
                Path(logger.save_dir).mkdir(parents=True, exist_ok=True)


def wandb_mode() -> str:
    """``WANDB_MODE`` if set; ``online`` when a W&B account is configured; else ``offline``.

    An account is ``WANDB_API_KEY`` or a ``~/.netrc`` (``$NETRC``) entry for the W&B host
    (``api.wandb.ai``, or the host of ``WANDB_BASE_URL``).
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host or "api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        entry = None
    return "online" if entry and entry[2] else "offline"


def build_args(args: list[str]) -> list[str]:
    """The LightningCLI argument list: ``fit`` when empty; the default recipe when no config.

    Raises:
        FileNotFoundError: the default recipe is needed but missing (not a source checkout).
    """
    args = list(args) or ["fit"]
    has_config = any(a in ("--config", "-c") or a.startswith("--config=") for a in args)
    if args[0] in LIGHTNING_SUBCOMMANDS and not has_config:
        if not DEFAULT_RECIPE.is_file():
            raise FileNotFoundError(
                f"default recipe {DEFAULT_RECIPE} not found: the installation is incomplete "
                "(reinstall lightning-sparse) or pass --config path/to/recipe.yaml"
            )
        args[1:1] = ["--config", str(DEFAULT_RECIPE)]
    return args


def run(args: list[str]) -> SparseCLI:
    """Run a LightningCLI subcommand (after `build_args`) and return the CLI object."""
    if not os.environ.get("WANDB_MODE"):
        # Decided once here; DDP workers and wandb itself inherit the environment variable.
        os.environ["WANDB_MODE"] = wandb_mode()
        if os.environ["WANDB_MODE"] == "offline":
            rank_zero_info(
                "W&B: offline (no account configured): runs are kept under the logger's "
                "save_dir; upload them later with `wandb sync`"
            )
    # No base classes: model and data are any LightningModule / LightningDataModule named by
    # class_path, and data is optional (a LightningModule may bring its own dataloaders).
    with warnings.catch_warnings():
        # We pass the (possibly completed) command line as `args` on purpose.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return SparseCLI(
            args=build_args(args),
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "lightning-sparse", "epilog": _EPILOG},
        )


def main(args: list[str] | None = None) -> None:
    """Entry point: ``compare`` and ``sweep`` go to their modules, the rest to `SparseCLI`."""
    args = list(sys.argv[1:] if args is None else args)
    if args and args[0] == "compare":
        from lightning_sparse.app import compare

        compare.main(args[1:])
    elif args and args[0] == "sweep":
        from lightning_sparse.app import sweep  # written separately; imported only when asked for

        sweep.main(args[1:])
    elif args and not args[0].startswith("-") and args[0] not in LIGHTNING_SUBCOMMANDS:
        sys.exit(f"lightning-sparse: unknown subcommand {args[0]!r}; {_EPILOG}")
    else:
        run(args)


_EPILOG = (
    "subcommands: fit (default), validate, test, predict (LightningCLI), compare (train and "
    "tabulate several recipes: lightning-sparse compare --help), sweep (lightning-sparse sweep "
    "--help)"
)


if __name__ == "__main__":
    main()

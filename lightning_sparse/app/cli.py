"""`lightning-sparse`: the command's entry point (`main`; `lightning_sparse.app.command` runs the
command line: each subcommand in its module, expected failures as a few lines).

    lightning-sparse fit                                   # the default recipe (app/fit.py)
    lightning-sparse fit --config recipes/static_llama.yaml --trainer.max_steps 50
    lightning-sparse fit --ckpt_path last                  # resume the recipe's latest run
    lightning-sparse compare --steps 100                   # dense / static / SET / RigL / GraNet
    lightning-sparse sweep ...                             # see lightning_sparse/app/sweep.py
    lightning-sparse export --ckpt_path last.ckpt --output hf_model   # see app/export_cmd.py
    lightning-sparse generate --model hf_model --prompt "def "         # see app/generate.py

The subcommands and their modules are listed in `lightning_sparse.app.common.SUBCOMMANDS`
(adding one is a line there and a module with ``main(args)``); ``fit`` / ``validate`` / ``test``
/ ``predict`` are LightningCLI (`lightning_sparse.app.fit`), each run in its own directory
(`lightning_sparse.app.run_dirs`). Weights & Biases runs offline unless an account is configured
(`lightning_sparse.app.wandb_mode`). Configuration errors print a few lines
(``LIGHTNING_SPARSE_DEBUG=1`` or ``--debug``: the traceback; `lightning_sparse.app.errors`);
Lightning's and W&B's advice that does not apply here is filtered out
(`lightning_sparse.app.quiet`).

The names this module held before it was split (``run``, ``SparseCLI``, ``plan_run_dir``,
``wandb_mode``, ...) are still importable from it; they live in the modules above.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning_sparse.app.command import run_command

__all__ = ["main"]

# Where the names imported from `cli` before the split live now (imported on first use).
_MOVED = {
    **dict.fromkeys(("DEBUG_ENV", "LIGHTNING_SUBCOMMANDS", "SUBCOMMAND_HELP"), "app.common"),
    **dict.fromkeys(("DEFAULT_RECIPE", "SparseCLI", "build_args", "run"), "app.fit"),
    **dict.fromkeys(("RunDir", "RUN_ENV", "plan_run_dir"), "app.run_dirs"),
    **dict.fromkeys(("quiet", "drop_zero_flops", "plain_model_summary"), "app.quiet"),
    "wandb_mode": "app.wandb_mode",
    "RECIPES_DIR": "recipes",
    **dict.fromkeys(("ModelZooSparsity", "SparseRunSummary"), "lightning"),
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_sparse.{_MOVED[name]}"), name)


def main(args: list[str] | None = None) -> None:
    """Entry point: run ``lightning-sparse <args>`` (default: ``sys.argv[1:]``; `run_command`).

    Configuration errors exit with a few lines naming the key; ``--debug`` (anywhere) or
    ``LIGHTNING_SPARSE_DEBUG=1`` shows the full traceback instead.
    """
    run_command(sys.argv[1:] if args is None else args)


if __name__ == "__main__":
    main()

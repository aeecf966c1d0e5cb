"""One `lightning-sparse` command line, run in this process (`run_command`).

The subcommand's module (`lightning_sparse.app.common.SUBCOMMANDS`) gets the arguments, with
Lightning's and W&B's advice that does not apply here filtered out (`quiet`); a configuration
error exits with a few lines naming the key (`lightning_sparse.app.errors`), or, with ``--debug``
anywhere or ``LIGHTNING_SPARSE_DEBUG=1``, raises with its traceback. The entry point
(`lightning_sparse.app.cli.main`) and a sweep's in-process points (`lightning_sparse.app.sweep`)
both run commands through here. ``lightning-sparse --help`` is answered here, from the table
of subcommands, without loading torch or Lightning; ``fit --help`` (validate, test, predict)
from a cache after its first call (`help_cache`).
"""

from __future__ import annotations

import sys

from lightning_sparse.app.common import (
    PROG,
    Subcommand,
    split_debug,
    subcommand_for,
    subcommands_epilog,
    top_level_help,
)
from lightning_sparse.app.errors import run_or_exit
from lightning_sparse.app.help_cache import cached_help, help_only
from lightning_sparse.app.quiet import quiet

__all__ = ["run_command"]


def run_command(args: list[str]) -> None:
    """Run ``lightning-sparse <args>``.

    Raises:
        SystemExit: an unknown subcommand, a parse error, a configuration error (a few lines).
    """
    args, debug = split_debug(list(args))
    if args in (["--help"], ["-h"]):
        print(top_level_help())
        return
    subcommand = subcommand_for(args)
    if subcommand is None:
        sys.exit(f"{PROG}: unknown subcommand {args[0]!r}; {subcommands_epilog()}")
    if subcommand.lightning and help_only(args) and not debug:
        # LightningCLI's help imports torch and Lightning: kept, and printed from then on.
        cached_help(args, lambda: _run(subcommand, args, debug))
        return
    _run(subcommand, args, debug)


def _run(subcommand: Subcommand, args: list[str], debug: bool) -> None:
    with quiet():
        run_or_exit(subcommand.main(), args if subcommand.lightning else args[1:], debug)

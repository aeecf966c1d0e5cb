"""`lightning-sparse export`: a ``fit`` checkpoint as a Hugging Face ``save_pretrained`` directory::

    lightning-sparse export --ckpt_path outputs/rigl_llama/version_0/checkpoints/last.ckpt \
        --output hf_model
    lightning-sparse export --ckpt_path last.ckpt --format compressed --output hf_sparse

``--format hf`` writes dense safetensors (pruned weights exactly zero) that
``AutoModelForCausalLM.from_pretrained`` loads; ``--format compressed`` the compressed-tensors
sparse-bitmask format (see `lightning_sparse.integrations.compressed`). See `export`.

Every expected failure (a missing or refused checkpoint, an output that exists, no permission,
a full disk, a bad option) is one line on stderr naming the file and the fix, and exit status 1
(2 for a bad option); no traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

from lightning_sparse.integrations.choices import EXPORT_FORMATS

__all__ = ["main"]

_PROG = "lightning-sparse export"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line instead of argparse's usage block."""
        self.exit(2, f"{_PROG}: {message}; see `{_PROG} --help`\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        allow_abbrev=False,
        description="Export a lightning-sparse fit checkpoint as a Hugging Face directory.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by fit (.ckpt)")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="hf",
        help="hf (dense) or compressed (%(default)s)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory to copy along")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --output if it is an export this command wrote (nothing else is deleted)",
    )
    parser.add_argument(
        "--run_config",
        default=None,
        help="the run's config.yaml (default: the one of the run directory holding checkpoints/)",
    )
    parser.add_argument(
        "--trust-file",
        dest="trust_file",
        action="store_true",
        help="unpickle arbitrary objects in --ckpt_path (runs code from a crafted file: only "
        "for a checkpoint from a source you trust)",
    )
    return parser


def main(args: list[str]) -> None:
    """Parse ``args`` (after ``export``) and export; errors exit with one line."""
    options = _parser().parse_args(args)
    from lightning_sparse.integrations.export import export  # torch: only when it runs

    _quiet_transformers()
    try:
        out = export(
            options.ckpt_path,
            options.output,
            format=options.format,
            tokenizer=options.tokenizer,
            overwrite=options.overwrite,
            run_config=options.run_config,
            trust_file=options.trust_file,
        )
    except (ValueError, OSError, ModuleNotFoundError) as err:
        print(f"{_PROG}: {_as_flags(' '.join(str(err).split()))}", file=sys.stderr)
        sys.exit(1)
    print(f"{_PROG}: wrote {out} ({options.format})")


# The library's messages name `export`'s keyword arguments; the command's user types flags.
_FLAGS = {
    "trust_file=True (CLI: --trust-file)": "--trust-file",
    "overwrite=True": "--overwrite",
    "trust_file=True": "--trust-file",
    "output=": "--output ",
    "tokenizer=": "--tokenizer ",
    "run_config=": "--run_config ",
}


def _as_flags(message: str) -> str:
    """``message`` with `export`'s argument names replaced by this command's flags."""
    for argument, flag in _FLAGS.items():
        message = re.sub(rf"(?<![\w-]){re.escape(argument)}", flag, message)
    return message


def _quiet_transformers() -> None:
    """No "Writing model shards" progress bar on stderr: the command's output is its one line."""
    try:
        from transformers.utils import logging
    except ModuleNotFoundError:
        return  # export says what to install
    logging.disable_progress_bar()

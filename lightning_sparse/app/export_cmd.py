"""`lightning-sparse export`: a ``fit`` checkpoint as a Hugging Face ``save_pretrained`` directory::

    lightning-sparse export --ckpt_path outputs/rigl_llama/version_0/checkpoints/last.ckpt \
        --output hf_model
    lightning-sparse export --ckpt_path last.ckpt --format compressed --output hf_sparse

``--format hf`` writes dense safetensors (pruned weights exactly zero) that
``AutoModelForCausalLM.from_pretrained`` loads; ``--format compressed`` the compressed-tensors
sparse-bitmask format (see `lightning_sparse.integrations.compressed`). See `export`.
"""

from __future__ import annotations

import argparse
import sys

from lightning_sparse.integrations.export import FORMATS, export

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-sparse export",
        allow_abbrev=False,
        description="Export a lightning-sparse fit checkpoint as a Hugging Face directory.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by fit (.ckpt)")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument(
        "--format", choices=FORMATS, default="hf", help="hf (dense) or compressed (%(default)s)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory to copy along")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    return parser


def main(args: list[str]) -> None:
    """Parse ``args`` (after ``export``) and export; errors exit with one line."""
    options = _parser().parse_args(args)
    try:
        out = export(
            options.ckpt_path,
            options.output,
            format=options.format,
            tokenizer=options.tokenizer,
            overwrite=options.overwrite,
        )
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        sys.exit(f"lightning-sparse export: {err}")
    print(f"lightning-sparse export: wrote {out} ({options.format})")

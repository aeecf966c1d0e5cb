"""`lightning-sparse`: the LightningCLI entry point (fit / validate / test / predict).

With no ``--config`` it runs the default recipe, ``recipes/rigl_llama.yaml``: a small Llama
decoder on byte-level text from the Python standard library, RigL at 80% on the decoder's linear
layers. Any recipe, or any LightningCLI option, can be given on the command line::

    lightning-sparse fit                                   # the default recipe
    lightning-sparse fit --config recipes/rigl_llama.yaml --trainer.max_steps 50
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from lightning_sparse.data import ByteTextDataModule
from lightning_sparse.models import LitCausalLM

__all__ = ["DEFAULT_RECIPE", "RECIPES_DIR", "main"]

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "rigl_llama.yaml"


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI; ``args`` defaults to ``sys.argv[1:]`` and to ``["fit"]`` when empty."""
    args = list(sys.argv[1:] if args is None else args)
    if not args:
        args = ["fit"]
    has_config = any(a == "--config" or a.startswith("--config=") or a == "-c" for a in args)
    if args[0] == "fit" and not has_config:
        if not DEFAULT_RECIPE.is_file():
            raise FileNotFoundError(
                f"default recipe {DEFAULT_RECIPE} not found; run from a source checkout "
                "(pip install -e .) or pass --config path/to/recipe.yaml"
            )
        args[1:1] = ["--config", str(DEFAULT_RECIPE)]
    return LightningCLI(
        LitCausalLM,
        ByteTextDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()

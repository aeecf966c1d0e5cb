"""The recipes shipped with lightning-sparse (this folder is installed as
``lightning_sparse.recipes``, so ``lightning-sparse fit`` finds them from any directory)."""

from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent

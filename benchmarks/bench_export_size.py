"""File size of `export`: dense ``hf`` safetensors against compressed-tensors ``sparse-bitmask``.

The model is the ``small`` Llama preset (3.3M weights, the 28 block projections 96% of them)
with `Static` at each sparsity on the default filter, fp32. A sparse-bitmask weight costs
``(1 - sparsity) * 4`` bytes per entry for the kept values plus 1/8 for the bitmask (and 8 per
row for the offsets), so at 80% about 0.23x of the dense 4; the dense embedding and head stay.

    python benchmarks/bench_export_size.py [--sparsity 0.5 0.8 0.9]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lightning_sparse import Static, export  # noqa: E402
from lightning_sparse.models.llama import Llama, LlamaConfig  # noqa: E402


def sizes(sparsity: float) -> tuple[int, int]:
    """(dense bytes, compressed bytes) of ``model.safetensors`` at ``sparsity``."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("small"))
    model.apply(Static(sparsity))
    with tempfile.TemporaryDirectory() as tmp:
        dense = export(model, Path(tmp) / "hf") / "model.safetensors"
        small = export(model, Path(tmp) / "c", format="compressed") / "model.safetensors"
        return dense.stat().st_size, small.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.8, 0.9])
    args = parser.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"date {now}; {platform.machine()} {platform.system()}; torch {torch.__version__}")
    print(f"{'sparsity':>8}  {'dense bytes':>12}  {'compressed bytes':>16}  {'ratio':>6}")
    for sparsity in args.sparsity:
        dense, small = sizes(sparsity)
        print(f"{sparsity:>8.2f}  {dense:>12,}  {small:>16,}  {small / dense:>6.3f}")
    print("goal: compressed / dense <= 0.35 at sparsity 0.80")


if __name__ == "__main__":
    main()

"""Fit the float64 regressor of ``lightning_ddp.py`` on a cluster of two emulated WSE systems.

Run as ``python tests/scripts/wse_ddp.py OUTDIR``: ``strategy="wse_ddp"`` uses Lightning's ddp
launcher, which re-executes this file for rank 1. Each rank writes ``OUTDIR/rank{r}.pt`` =
``{kind: fit(...)}``; ``tests/test_wse_device.py`` compares them with ``lightning_ddp.fit(kind,
devices=1)``, one CPU process on the global batch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_sparse.wse import WSEDDPStrategy
from tests.scripts.lightning_ddp import KINDS, STEPS, WORLD, Regressor, make_algorithm


def fit(kind: str) -> dict[str, Any]:
    """Fit for STEPS steps on two systems; return masks, weights and the device statistics."""
    algorithm = make_algorithm(kind)
    history: dict[int, dict[str, torch.Tensor]] = {}
    algorithm.register_update_hook(
        lambda a, step, stats: history.__setitem__(
            step, {n: sp.mask.clone() for n, sp in a.sparse_params.items()}
        )
    )
    module = Regressor()
    path = os.environ.get("WSE_TEST_KERNEL_PATH")
    trainer = pl.Trainer(
        devices=WORLD,
        strategy=WSEDDPStrategy(kernel_path=path),
        max_steps=STEPS,
        callbacks=[algorithm],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "accelerator": type(trainer.accelerator).__name__,
        "backend": trainer.strategy.process_group_backend,
        "step": algorithm.step,
        "history": history,
        "masks": {n: sp.mask.clone() for n, sp in algorithm.sparse_params.items()},
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "linear_classes": sorted(
            {type(m).__name__ for m in module.modules() if "Linear" in type(m).__name__}
        ),
        "stats": trainer.accelerator.stats.as_dict(),
    }


def main(outdir: Path) -> None:
    results = {kind: fit(kind) for kind in KINDS}
    rank = results[KINDS[0]]["rank"]
    torch.save(results, outdir / f"rank{rank}.pt")
    torch.distributed.barrier()  # rank 0's exit ends the test's wait: rank 1 has written by then


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Tear the gloo group down before interpreter exit: left running, its threads can abort the
    # process at shutdown ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

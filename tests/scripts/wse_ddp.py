"""Fit the float64 regressor of ``lightning_ddp.py`` on a cluster of two emulated WSE systems.

Run as ``python tests/scripts/wse_ddp.py OUTDIR``: ``strategy="wse_ddp"`` uses Lightning's ddp
launcher, which re-executes this file for rank 1. Each rank writes ``OUTDIR/rank{r}.pt`` =
``{kind: fit(...)}``; ``tests/test_wse_device.py`` compares them with ``lightning_ddp.fit(kind,
devices=1)``, one CPU process on the global batch.

The module, data, Trainer and the saved record come from ``lightning_ddp.py`` (imported as
``tests.scripts.lightning_ddp``: the test puts the repository root on ``PYTHONPATH``, and rank 1,
re-executed by Lightning, inherits it); only the strategy and the device entries differ here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_sparse.wse import WSEDDPStrategy
from tests.scripts.lightning_ddp import WORLD, main, train


def fit(kind: str) -> dict[str, Any]:
    """Fit for STEPS steps on two systems; return masks, weights and the device statistics."""
    strategy = WSEDDPStrategy(kernel_path=os.environ.get("WSE_TEST_KERNEL_PATH"))
    # "cpu", upgraded to "wse" by the strategy ("auto" would be CUDA on a GPU machine).
    record, trainer, _, module = train(kind, accelerator="cpu", devices=WORLD, strategy=strategy)
    record.update(
        accelerator=type(trainer.accelerator).__name__,
        backend=trainer.strategy.process_group_backend,
        linear_classes=sorted(
            {type(m).__name__ for m in module.modules() if "Linear" in type(m).__name__}
        ),
        stats=trainer.accelerator.stats.as_dict(),
    )
    return record


if __name__ == "__main__":
    main(Path(sys.argv[1]), fit)
    # As in lightning_ddp.py: tear the gloo group down before interpreter exit (left running, its
    # threads can abort the process at shutdown).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""`VariableSPDF`: sparse pre-training, then dense pre-training from the sparse weights, in one run.

Thangarasa et al., "SPDF: Sparse Pre-training and Dense Fine-tuning for Large Language Models",
arXiv:2303.10464 (UAI 2023), and Cerebras' Variable SPDF (seed 003): Stage 1 trains with
unstructured sparsity (static random masks in the paper), Stage 2 densifies the model so the
masked weights, still zero, are free to learn, and pre-training goes on dense. The Stage-1 length
and sparsity set the FLOPs saved; e.g. 90% sparsity for 5/6 of the steps is "effective 75%".

The sparse stage is whatever sparsity callback the trainer has (``Static``, ``RigL``, ...);
``VariableSPDF`` only decides when it ends::

    callbacks = [Static(sparsity=0.9), FlopCounter(), VariableSPDF(dense_from_step=500)]

At the first training batch with ``global_step >= dense_from_step`` it calls
:func:`~lightning_sparse.densify`: masks and hooks are removed, weights and optimizer state are kept
as they are (zeros included). The sparsity callback stays in ``trainer.callbacks`` with no sparse
parameters, so its hooks do nothing from then on. Add a ``FlopCounter`` for the FLOPs saved.

Checkpoints written after the switch hold the dense weights and the sparsity callback's state of
a removed algorithm (no parameters), so ``fit(ckpt_path=...)`` resumes exactly: the sparsity
callback re-applies its masks at setup, restoring that state makes them all ones (nothing is
pruned, the loaded weights are kept), and the model is densified again at the first batch. A
plain dense model loads them as they are.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_sparse.core import validate
from lightning_sparse.core.conversion import densify
from lightning_sparse.core.report import sparsity_report
from lightning_sparse.lightning.flop_counter import mask_names

__all__ = ["VariableSPDF"]


class VariableSPDF(pl.Callback):
    """Densify the model after ``dense_from_step`` optimizer steps; training goes on dense.

    Args:
        dense_from_step: completed optimizer steps of the sparse stage; step ``dense_from_step``
            is the first dense one.
        verbose: print a line at the switch.

    Raises:
        TypeError / ValueError: ``dense_from_step`` is not an int >= 1.
    """

    def __init__(self, dense_from_step: int, verbose: bool = True) -> None:
        dense_from_step = validate.integer(
            dense_from_step,
            "dense_from_step",
            1,
            unit="optimizer steps",
            fix="pass the sparse stage's length in optimizer steps, e.g. 500 (a stage of 0 steps "
            "still prunes the initial weights, as masks are applied at setup; for dense training "
            "remove the sparsity callback instead)",
        )
        self.dense_from_step = dense_from_step
        self.verbose = verbose
        self.densified_at: int | None = None
        self.mask_shapes: dict[str, list[int]] = {}  # formerly sparse parameter -> shape
        self._checked = False  # whether the model was checked for masks after the switch

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Densify at the first batch of the dense stage (before its forward)."""
        if self._checked or trainer.global_step < self.dense_from_step:
            return
        self._checked = True
        names = mask_names(pl_module)
        if not names:
            return
        before = sparsity_report(pl_module, masked_only=True).totals["sparse_sparsity"]
        buffers = dict(pl_module.named_buffers())
        self.mask_shapes.update({n[: -len("_mask")]: list(buffers[n].shape) for n in names})
        count = densify(pl_module)
        if self.densified_at is not None:
            return  # a resumed run: the masks were the all-ones ones of the checkpoint
        self.densified_at = trainer.global_step
        if self.verbose and trainer.is_global_zero:
            print(
                f"VariableSPDF: step {trainer.global_step}: densified {count} parameters "
                f"(sparsity {before:.2%} -> dense); training continues dense",
                flush=True,
            )

    def state_dict(self) -> dict[str, Any]:
        """When the switch happened and which parameters were sparse."""
        return {"densified_at": self.densified_at, "mask_shapes": dict(self.mask_shapes)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output; the next batch re-checks the model for masks."""
        self.densified_at = state_dict.get("densified_at")
        self.mask_shapes = dict(state_dict.get("mask_shapes", {}))
        self._checked = False

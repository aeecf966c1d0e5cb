"""The progress bar of `lightning-sparse` runs: Lightning's rich bar, told apart from it in two
ways (`StepProgressBar`, swapped in by `step_progress_bar`).

- A run limited by steps (the recipes: ``max_steps``, ``max_epochs`` unset) reads ``Epoch 0``
  instead of ``Epoch 0/-2`` (Lightning prints ``max_epochs - 1``, and Lightning's ``-1`` means
  no limit).
- The bar stops when training ends, so its last frame is drawn before the run summary that
  `SparseRunSummary` prints at the end of ``fit``, not after it (Lightning stops it at teardown).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["StepProgressBar", "step_progress_bar"]


class StepProgressBar(RichProgressBar):
    """`RichProgressBar` with no epoch total when the epochs are unlimited, stopped at the end
    of training."""

    def _get_train_description(self, current_epoch: int) -> str:
        limit = self.trainer.max_epochs
        if limit is not None and limit >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"  # padded as Lightning pads it (no flicker)
        return f"{description:{max(len(description), len(self.validation_description))}}"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._stop_progress()


def step_progress_bar(callbacks: list[Any]) -> None:
    """Swap Lightning's `RichProgressBar` (its class exactly, chosen when ``rich`` is installed)
    for a `StepProgressBar` with the same settings, in place."""
    for i, callback in enumerate(callbacks):
        if type(callback) is RichProgressBar:
            callbacks[i] = StepProgressBar(
                refresh_rate=callback._refresh_rate,
                leave=callback._leave,
                theme=callback.theme,
                console_kwargs=callback._console_kwargs,
            )

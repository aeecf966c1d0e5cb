"""`FlopCounter`: the training FLOPs a run actually spent, batch by batch, against dense training.

Every training batch costs ``3 x`` its forward FLOPs (Chinchilla appendix F, as in
``lightning_sparse.core.flop_account``), the forward cost from
:func:`~lightning_sparse.core.flops.model_flops` with the masks the batch was trained with; mask-
update steps that read dense weight gradients (RigL, GraNet) add them. The dense reference is the
same model with every weight kept. Consecutive batches with the same cost form one
:class:`~lightning_sparse.core.flop_account.FlopSegment` (a sparse stage, a dense stage, one level
of iterative pruning), so the summary reads as a per-stage table.

The measuring is `FlopMeter`'s (``flop_meter.py``), the arithmetic `FlopLedger`'s: the run summary
(`SparseRunSummary`) reads the same two, so both report the same figures. This callback adds the
table, the logging and chains of runs (``previous``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_sparse.core.flop_account import FlopSegment
from lightning_sparse.core.safe_load import load_torch_file
from lightning_sparse.lightning.flop_meter import (  # noqa: F401  (re-exported: their old home)
    FlopMeter,
    lm_flops,
    mask_names,
    tokens_in_batch,
)

__all__ = ["FlopCounter", "FlopSegment", "lm_flops", "mask_names", "tokens_in_batch"]


class FlopCounter(pl.Callback):
    """Count training FLOPs per batch with the masks in use, log them and print a summary.

    Logs ``flop_counter/train`` and ``flop_counter/dense`` (cumulative, previous runs included)
    and ``flop_counter/saved`` (``1 - train / dense``) every ``log_every_n_steps``; prints the
    per-segment table at the end of ``fit``. ``summary()`` returns the same figures. (The CLI's
    ``SparseRunSummary`` totals one run from the same ledger; this adds stages, chains of runs
    and their savings.)

    Args:
        previous: checkpoints of earlier runs in a chain (e.g. the sparse stage of a chained
            Variable SPDF run) trained with a ``FlopCounter``; their segments are prepended, so
            the totals cover the whole chain.
        verbose: print the table at the end of ``fit``.
        trust_file: read ``previous`` with arbitrary objects unpickled (a crafted file runs code
            when read); off, they are read weights-only (`load_torch_file`).

    Raises:
        ValueError: (at setup) a ``previous`` checkpoint without ``FlopCounter`` state, or one
            holding objects other than tensors and plain values (``trust_file`` off).
        TypeError: a training batch that is neither token windows nor floating examples.
    """

    def __init__(
        self,
        previous: str | list[str] | None = None,
        verbose: bool = True,
        trust_file: bool = False,
    ) -> None:
        self.previous = [previous] if isinstance(previous, str) else list(previous or [])
        self.verbose = verbose
        self.trust_file = trust_file
        self.earlier: list[FlopSegment] = []
        self.meter = FlopMeter("FlopCounter", strict=True)
        self.meter.ledger.run = len(self.previous)

    # ------------------------------------------------------------------ totals
    @property
    def segments(self) -> list[FlopSegment]:
        """This run's segments."""
        return self.meter.ledger.segments

    @property
    def ever_masked(self) -> dict[str, int]:
        """Parameter name -> numel of every parameter that has had a mask in this run."""
        return self.meter.ever_masked

    def all_segments(self) -> list[FlopSegment]:
        """Segments of the previous runs, then of this run."""
        return self.earlier + self.segments

    def summary(self) -> dict[str, float]:
        """Totals over the previous runs and this one: ``flops`` (dense weight gradients of mask
        updates included), ``dense_flops``, ``saved`` (fraction), ``tokens``,
        ``dense_grad_flops``, ``dense_grad_steps`` (this run) and ``effective_sparsity``
        (token-weighted mean sparsity of the masked parameters)."""
        return self.meter.ledger.totals(self.earlier)

    def table(self) -> str:
        """The segments and totals as a text table."""
        head = (
            f"{'run':>3} {'steps':>11} {'batches':>8} {'tokens':>11} {'sparsity':>9} "
            f"{'FLOPs/token':>12} {'train FLOPs':>12} {'dense FLOPs':>12}"
        )
        lines = ["Training FLOPs (3 x forward, lightning_sparse.FlopCounter)", head]
        for s in self.all_segments():
            steps = f"{s.first_step}-{s.last_step}"
            lines.append(
                f"{s.run:>3} {steps:>11} {s.batches:>8} {s.tokens:>11} {s.sparsity:>9.2%} "
                f"{s.forward_flops_per_token:>12.4e} {s.flops:>12.4e} {s.dense_flops:>12.4e}"
            )
        t = self.summary()
        lines.append(
            f"total: {t['flops']:.4e} FLOPs vs {t['dense_flops']:.4e} dense over {t['tokens']} "
            f"tokens: {t['saved']:.2%} saved (effective sparsity {t['effective_sparsity']:.2%})"
        )
        if t["dense_grad_flops"]:
            lines.append(
                f"  including {t['dense_grad_flops']:.4e} FLOPs of dense weight gradients on "
                "mask-update steps"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Read the segments of the ``previous`` runs; record Conv2d output sizes."""
        self.meter.setup(pl_module)
        self.earlier = []
        for run, path in enumerate(self.previous):
            checkpoint = load_torch_file(
                path,
                trust_file=self.trust_file,
                what="FlopCounter: previous checkpoint",
                opt_in="FlopCounter(trust_file=True) (in a recipe: init_args: {trust_file: true})",
            )
            state = checkpoint.get("callbacks", {}).get(self.state_key)
            if state is None:
                raise ValueError(
                    f"checkpoint {path!r} has no {self.state_key} state; train that run with "
                    "lightning_sparse.FlopCounter in its callbacks, or drop it from "
                    "previous="
                )
            for segment in state["segments"]:
                self.earlier.append(FlopSegment(**{**segment, "run": run}))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Note the batch's step and tokens (all ranks); listen to new algorithms' updates."""
        self.meter.batch_start(trainer, pl_module, batch)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """This batch's forward and backward ran with the current masks: cost them."""
        self.meter.after_backward(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Charge the batch to its segment; log the totals."""
        self.meter.batch_end(trainer)
        # Trainer.log_every_n_steps is set by Lightning's logger connector, undeclared on the class.
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]
        if trainer.global_step % max(every, 1) == 0:
            t = self.summary()
            metrics = {
                "flop_counter/train": float(t["flops"]),
                "flop_counter/dense": float(t["dense_flops"]),
                "flop_counter/saved": t["saved"],
            }
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the Conv2d recorder's hooks (the sizes recorded stay)."""
        self.meter.teardown()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the table."""
        if self.verbose and trainer.is_global_zero and self.all_segments():
            print(self.table(), flush=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This run's segments and totals, and the parameters that have had masks."""
        return self.meter.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (a resumed run continues its segments)."""
        self.meter.load_state_dict(state_dict)

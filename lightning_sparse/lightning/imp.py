"""`IterativePruning`: iterative magnitude pruning with learning-rate rewinding.

Renda, Frankle & Carbin, "Comparing Rewinding and Fine-tuning in Neural Network Pruning",
arXiv:2003.02389 (ICLR 2020), as Cerebras applied it to GPT-3 1.3B (seed 004): train dense, then
repeat "prune ``prune_fraction`` of the remaining weights by magnitude, retrain with the learning
rate schedule rewound". Level 0 is dense; level ``k`` (1..``levels``) starts at step
``k * level_steps`` at sparsity ``1 - (1 - p)^k``. As for every library algorithm, the masks change
just before optimizer step ``k * level_steps``, whose gradients came from the previous masks.

Composed from library pieces: the masks are a :class:`~lightning_sparse.GMP` (top-|w| per layer,
or one global ranking) whose sparsity schedule is ``step -> 1 - (1 - p)^level(step)`` and whose
updates are the level starts, so the mask, gradient and optimizer-state handling is the library's.
This callback adds what is not sparsity: rewinding every LR scheduler at each level start,
optionally resetting the optimizer state, and the validation curve and per-level table (let
``val_check_interval`` divide ``level_steps`` so each level ends with a validation; the LR
schedule's length should be ``level_steps``, e.g. ``LitCausalLM(max_steps=level_steps)``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_sparse.core import validate
from lightning_sparse.core.filters import ParamFilter
from lightning_sparse.core.report import sparsity_report
from lightning_sparse.lightning.algorithms import GMP
from lightning_sparse.lightning.callback import SparsityStateCallback
from lightning_sparse.lightning.flop_counter import lm_flops, tokens_in_batch

__all__ = ["IterativePruning", "imp_sparsity", "rewind_lr_scheduler"]


def imp_sparsity(level: int, prune_fraction: float) -> float:
    """Sparsity after ``level`` rounds that each prune ``prune_fraction`` of the remaining
    weights: ``1 - (1 - prune_fraction) ** level``."""
    return 1.0 - (1.0 - prune_fraction) ** level


def rewind_lr_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    initial: tuple[dict[str, Any], list[float]],
    step: int,
) -> None:
    """Put ``scheduler`` (and its optimizer's learning rates) where it was after ``step`` steps.

    Exact for every step-driven scheduler, recursive ones included: the state captured before the
    first step is restored and ``step()`` replayed ``step`` times.

    Args:
        scheduler: the scheduler.
        initial: ``(scheduler.state_dict(), [group["lr"] for group in param_groups])`` taken
            before the first optimizer step.
        step: scheduler steps to replay.
    """
    state, lrs = initial
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for _ in range(step):
        scheduler.step()


class IterativePruning(SparsityStateCallback):
    """Dense training, then ``levels`` rounds of magnitude pruning with LR rewinding.

    Train for ``(levels + 1) * level_steps`` steps. Each level's pruning keeps the largest
    ``|w|`` at sparsity ``1 - (1 - prune_fraction) ** k`` (a keep count of ``int((1 - s) * n)``,
    the library's rule); pruned weights stay pruned, so every level prunes only surviving weights.

    Args:
        level_steps: optimizer steps per level (level 0 is the dense training).
        levels: pruning rounds.
        prune_fraction: share of the remaining weights pruned per round, in (0, 1); 0.2 in Renda
            et al., 0.2-0.33 in Cerebras' GPT-3 runs.
        scope: ``"layer"`` (every layer at the same sparsity, as Cerebras) or ``"global"`` (one
            magnitude ranking over all selected weights, as Renda et al.).
        param_filter: which parameters to prune (see ``SparsityAlgorithm``).
        rewind_lr: rewind the LR schedules at each level start (False: fine-tune at the schedule's
            current, late learning rate, Renda et al.'s "fine-tuning" baseline).
        rewind_to: scheduler step to rewind to (0: the start, warmup included; Cerebras often
            rewound to a later point).
        reset_optimizer: clear the optimizer state (e.g. Adam moments) at each level start.
        monitor: the logged validation loss to record.
        verbose: print the level table at the end of ``fit``.

    Raises:
        TypeError / ValueError: for an argument of the wrong type or outside its range, naming it.
    """

    def __init__(
        self,
        level_steps: int,
        levels: int,
        prune_fraction: float = 0.2,
        scope: str = "layer",
        param_filter: str | list[str] | ParamFilter | None = None,
        rewind_lr: bool = True,
        rewind_to: int = 0,
        reset_optimizer: bool = False,
        monitor: str = "val/loss",
        verbose: bool = True,
    ) -> None:
        level_steps = validate.integer(level_steps, "level_steps", 1, unit="optimizer steps")
        levels = validate.integer(levels, "levels", 1)
        rewind_to = validate.integer(rewind_to, "rewind_to", 0, unit="optimizer steps")
        prune_fraction = validate.real(prune_fraction, "prune_fraction")
        if not 0.0 < prune_fraction < 1.0:
            raise ValueError(
                f"prune_fraction={prune_fraction!r} must be in (0, 1): the share of the remaining "
                "weights pruned per level, e.g. 0.2"
            )
        if scope not in ("layer", "global"):
            raise ValueError(f"scope={scope!r} must be 'layer' or 'global'")
        self.level_steps, self.levels = level_steps, levels
        self.prune_fraction, self.scope = prune_fraction, scope
        self.rewind_lr, self.rewind_to = rewind_lr, rewind_to
        self.reset_optimizer, self.monitor, self.verbose = reset_optimizer, monitor, verbose
        self.algorithm = GMP(
            sparsity=self.target_sparsity,
            update={"steps": [k * level_steps for k in range(1, levels + 1)]},
            param_filter=param_filter,
            distribution="global" if scope == "global" else "uniform",
            track_itop=False,
        )
        self.records: list[dict[str, float]] = []  # one per validation
        self.rewound_level = 0
        self._initial_schedulers: list[tuple[dict[str, Any], list[float]]] | None = None
        self._seq_len: int | None = None

    # ------------------------------------------------------------------ schedule
    def level_of(self, step: int) -> int:
        """Level whose masks train optimizer step ``step`` (0 = dense)."""
        return min(step // self.level_steps, self.levels)

    def target_sparsity(self, step: int) -> float:
        """Sparsity at optimizer step ``step``: ``1 - (1 - p) ** level``."""
        return imp_sparsity(self.level_of(step), self.prune_fraction)

    # ------------------------------------------------------------------ level start
    def _start_level(self, trainer: pl.Trainer, level: int) -> None:
        """Rewind the LR schedules and (optionally) reset the optimizer state."""
        if self.rewind_lr:
            configs = trainer.lr_scheduler_configs
            if self._initial_schedulers is None or len(configs) != len(self._initial_schedulers):
                raise RuntimeError(
                    "IterativePruning could not rewind the LR schedule: no scheduler state was "
                    "captured at train start; return an LR scheduler from configure_optimizers or "
                    "pass rewind_lr=False"
                )
            for config, initial in zip(configs, self._initial_schedulers, strict=True):
                rewind_lr_scheduler(config.scheduler, initial, self.rewind_to)
        if self.reset_optimizer:
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
        self.rewound_level = level

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Apply the pruning masks (all ones: level 0 is dense)."""
        self.algorithm.setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Hook the optimizers, as every sparsity callback does."""
        self.algorithm.on_fit_start(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Capture the LR schedules before their first step (kept in checkpoints)."""
        planned = (self.levels + 1) * self.level_steps
        if trainer.max_steps not in (-1, planned):
            rank_zero_warn(
                f"IterativePruning plans {self.levels + 1} levels x {self.level_steps} steps = "
                f"{planned} steps but trainer.max_steps={trainer.max_steps}; set max_steps to "
                f"{planned} so every level trains level_steps"
            )
        for config in trainer.lr_scheduler_configs:
            if config.interval != "step" or config.reduce_on_plateau:
                raise ValueError(
                    "IterativePruning rewinds step-driven LR schedulers; got one with "
                    f"interval={config.interval!r}, reduce_on_plateau={config.reduce_on_plateau}; "
                    "use interval='step', or rewind_lr=False"
                )
        if self._initial_schedulers is None:
            self._initial_schedulers = [
                (c.scheduler.state_dict(), [g["lr"] for g in c.scheduler.optimizer.param_groups])
                for c in trainer.lr_scheduler_configs
            ]

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """At a level start, rewind before its first optimizer step (the masks change just
        before that step, in ``on_before_optimizer_step``)."""
        self._seq_len = tokens_in_batch(batch)[1]
        step = trainer.global_step
        level = self.level_of(step)
        if level > self.rewound_level and step == level * self.level_steps:
            self._start_level(trainer, level)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Prune at level starts (GMP's update), then prune gradients and optimizer state."""
        self.algorithm.on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Log sparsity (GMP's logging)."""
        self.algorithm.on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Record the validation loss with the level and sparsity it was measured at."""
        loss = trainer.callback_metrics.get(self.monitor)
        if trainer.sanity_checking or loss is None:
            return
        step = trainer.global_step
        level = self.level_of(max(step - 1, 0))  # validation at k * L closes level k - 1
        report = sparsity_report(pl_module, masked_only=True).totals
        record = {
            "step": step,
            "level": level,
            "sparsity": report["sparse_sparsity"],
            "val_loss": float(loss),
        }
        if self._seq_len is not None:
            flops = lm_flops(pl_module, self._seq_len)
            record["inference_reduction"] = flops.inference_reduction
            record["nonzero_params"] = flops.nonzero_params
        self.records.append(record)
        if step % self.level_steps == 0:
            metrics = {f"imp/{k}": float(v) for k, v in record.items() if k != "step"}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the validation curve and the level table."""
        if self.verbose and trainer.is_global_zero and self.records:
            print(self.curve(), flush=True)
            print(self.table(), flush=True)

    # ------------------------------------------------------------------ reporting
    def level_rows(self) -> list[dict[str, float]]:
        """Per level, the last validation inside it (the end-of-level model)."""
        rows: dict[int, dict[str, float]] = {}
        for record in self.records:
            rows[int(record["level"])] = record
        return [rows[k] for k in sorted(rows)]

    def curve(self) -> str:
        """Every validation: step, level, sparsity, loss (the sawtooth)."""
        lines = [
            "Iterative pruning: validation curve",
            f"{'step':>7} {'level':>5} {'sparsity':>9} {self.monitor:>9}",
        ]
        for r in self.records:
            lines.append(
                f"{r['step']:>7} {r['level']:>5} {r['sparsity']:>9.2%} {r['val_loss']:>9.4f}"
            )
        return "\n".join(lines)

    def table(self) -> str:
        """Level, sparsity (target and actual), end-of-level val loss, inference FLOP reduction."""
        lines = [
            f"Iterative pruning with LR rewinding: {self.levels} levels x {self.level_steps} "
            f"steps, {self.prune_fraction:.0%} of the remaining weights per level, "
            + ("ranked within each layer" if self.scope == "layer" else "ranked globally"),
            f"{'level':>5} {'target':>8} {'sparsity':>9} {self.monitor:>9} "
            f"{'inference FLOPs dense/sparse':>29} {'nonzero params':>15}",
        ]
        for r in self.level_rows():
            target = imp_sparsity(int(r["level"]), self.prune_fraction)
            reduction = r.get("inference_reduction")
            flops = f"{reduction:.2f}x" if reduction is not None else "-"
            params = int(r["nonzero_params"]) if "nonzero_params" in r else "-"
            lines.append(
                f"{int(r['level']):>5} {target:>8.2%} {r['sparsity']:>9.2%} "
                f"{r['val_loss']:>9.4f} {flops:>29} {params:>15}"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The GMP state, the rewind point, the captured schedules and the records."""
        return {
            "algorithm": self.algorithm.state_dict(),
            "rewound_level": self.rewound_level,
            "initial_schedulers": self._initial_schedulers,
            "records": list(self.records),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output."""
        self.algorithm.load_state_dict(state_dict["algorithm"])
        self.rewound_level = int(state_dict.get("rewound_level", 0))
        self._initial_schedulers = state_dict.get("initial_schedulers")
        self.records = list(state_dict.get("records", []))

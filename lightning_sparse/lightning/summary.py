"""`SparseRunSummary`: what a run reached and what it cost, printed at the end and saved as JSON.

At the end of ``fit`` it prints, and writes to ``<log dir>/summary.json`` for
``lightning-sparse compare``:

- validation loss and perplexity of the last validation, with the unigram baseline when the data
  module exposes its byte corpora (the JSON also has the curve); the key read is ``monitor``, else
  the `ModelCheckpoint` monitor, else ``val/loss`` or ``val_loss``, and when none was logged the
  summary says which keys it looked for and why (validation did not run, or logged other keys);
- the sparsity stages as they ran (``sparse 90.0% for steps 0-300, then dense for steps
  300-360``: measured whenever the masks or the set of masked layers change) and per-layer
  sparsity at the end (`sparsity_report`);
- training and inference FLOPs, sparse versus the same model dense (`model_flops`, Chinchilla
  conventions, see ``flops.py``; a Conv2d costs ``2 * kept * H_out * W_out`` per example, with
  the output size recorded from the training forwards). Training FLOPs are counted batch by
  batch by a `FlopMeter` into a `FlopLedger` (``core/flop_account.py``, the same accountant as
  `FlopCounter`'s and the device's): ``3 x`` the forward FLOPs per token of the masks the batch
  trained with times its tokens, so a schedule that changes the sparsity (GraNet) is costed as it
  ran; mask updates that read dense weight gradients (RigL, GraNet) add them on their step.

During training it logs ``flops/train``, ``flops/train_dense`` and ``tokens`` (cumulative) at the
trainer's logging interval. Its counters are callback state, so a resumed run continues them.
On the emulated wafer-scale device (``accelerator="wse"``) it adds the device's statistics:
executed versus dense-equivalent FLOPs, CSR versus dense weight bytes, CSR rebuilds.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_sparse.core import legacy
from lightning_sparse.core.algorithms import SparsityAlgorithm, algorithms_of
from lightning_sparse.core.report import sparsity_report
from lightning_sparse.lightning.flop_meter import FlopMeter, attention_dims
from lightning_sparse.lightning.summary_text import final_metrics, flat_summary, format_summary

__all__ = [
    "SparseRunSummary",
    "attention_dims",
    "flat_summary",
    "format_summary",
    "unigram_cross_entropy",
]

VAL_KEYS = ("val/loss", "val_loss")  # looked for, in order, when no monitor is configured


class SparseRunSummary(pl.Callback):
    """Prints and saves a run's validation loss, per-layer sparsity and FLOPs versus dense.

    Works with any LightningModule whose training batches are token tensors [B, T + 1] (inputs
    plus shifted targets) or tuples whose first element is one; nothing is needed from the model.

    Args:
        path: JSON file to write; default ``<trainer.log_dir>/summary.json``, and none under
            ``fast_dev_run`` (Lightning's check run, which logs and checkpoints nothing).
        monitor: the logged validation loss (nats per token); default: the `ModelCheckpoint`
            ``monitor`` if one is set, else the first of ``val/loss``, ``val_loss`` logged. The
            perplexity is the same key with ``loss`` -> ``ppl`` if logged, else ``exp(loss)``.
        seq_len: tokens per training sequence; default ``T`` of the batch shape above.
        print_layers: print the per-layer sparsity table (the JSON always has it).
    """

    def __init__(
        self,
        path: str | None = None,
        monitor: str | None = None,
        seq_len: int | None = None,
        print_layers: bool = True,
    ) -> None:
        self.path = path
        self.monitor = monitor
        self.print_layers = print_layers
        self.meter = FlopMeter("SparseRunSummary", seq_len=seq_len)
        self.val_curve: list[list[float]] = []
        self.train_curve: list[list[float]] = []
        self.wall_time = 0.0  # seconds of fit before the current process's fit started
        self._fit_start: float | None = None
        self._step_at_batch_start = 0
        self._hooked: set[int] = set()
        self.summary: dict[str, Any] | None = None
        # What actually ran: sparsity stages, algorithms, validations.
        self.stages: list[dict[str, Any]] = []
        self.algorithm_names: set[str] = set()
        self.val_runs = 0
        self._val_key: str | None = None
        self._val_logged: list[str] = []
        self._stage_layers = -1
        self._stage_dirty = True
        # This process's optimizer steps: seconds each (from the end of the one before) and
        # the tokens they trained (`run_figures`).
        self.step_seconds: list[float] = []
        self._step_clock: float | None = None
        self._tokens_at_start = 0

    # ------------------------------------------------------------------ counting
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Conv2d FLOPs scale with the output size the batches produce (flops.model_flops).
        self.meter.setup(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self.step_seconds, self._step_clock = [], None
        self._tokens_at_start = int(self.counters["tokens"])

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._step_clock is None:
            self._step_clock = time.perf_counter()
        # The sparse layers themselves can change too (densify at a Variable SPDF switch).
        layers = sum(len(a.sparse_params) for a in algorithms_of(pl_module))
        self._note_stage(pl_module, trainer.global_step, layers)
        self.meter.batch_start(trainer, pl_module, batch)
        for algorithm in algorithms_of(pl_module):  # a mask update ends the stage's sparsity
            if id(algorithm) not in self._hooked:
                algorithm.register_update_hook(self._on_mask_update)
                self._hooked.add(id(algorithm))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The batch's forward and backward ran with the masks now: the meter costs them."""
        self.meter.after_backward(pl_module)

    @property
    def seq_len(self) -> int | None:
        """Tokens per training sequence, overriding the batch shape's (``None``: the batch's)."""
        return self.meter.seq_len

    @seq_len.setter
    def seq_len(self, value: int | None) -> None:
        self.meter.seq_len = value

    @property
    def counters(self) -> dict[str, int]:
        """Running totals (`lightning_sparse.core.flop_account.COUNTERS`): ``tokens``,
        ``train_flops`` (``3 x`` forward), ``dense_train_flops``, ``dense_grad_flops``,
        ``dense_grad_steps``."""
        return self.meter.ledger.counters

    def _note_stage(self, pl_module: pl.LightningModule, step: int, layers: int) -> None:
        """Extend the current sparsity stage to ``step``, or (masks changed) measure the sparsity
        and start a new stage when the model went from sparse to dense or back."""
        if self._stage_dirty or layers != self._stage_layers:
            self._stage_dirty, self._stage_layers = False, layers
            self.algorithm_names.update(type(a).__name__ for a in algorithms_of(pl_module))
            totals = sparsity_report(pl_module, masked_only=True).totals
            sparse = totals["sparse_params"] > 0
            sparsity = totals["sparse_sparsity"] if sparse else None
            last = self.stages[-1] if self.stages else None
            if last is not None and last["kind"] == ("sparse" if sparse else "dense"):
                if sparse:
                    last["sparsity"][1] = sparsity
            else:
                kind = "sparse" if sparse else "dense"
                pair = [sparsity, sparsity] if sparse else None
                self.stages.append({"kind": kind, "steps": [step, step + 1], "sparsity": pair})
        self.stages[-1]["steps"][1] = step + 1

    def _on_mask_update(self, algorithm: SparsityAlgorithm, step: int, stats: Any) -> None:
        self._stage_dirty = True

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.meter.batch_end(trainer)
        step = trainer.global_step
        if step == self._step_at_batch_start:
            return  # accumulating gradients: no optimizer step yet
        now = time.perf_counter()
        if self._step_clock is not None:
            self.step_seconds.append(now - self._step_clock)
        self._step_clock = now
        # Trainer.log_every_n_steps and .datamodule are set by Lightning's connectors, undeclared
        # on the class: mypy finds no such attributes.
        if step % max(trainer.log_every_n_steps, 1) == 0:  # type: ignore[attr-defined]
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, Tensor):
                self.train_curve.append([step, float(loss)])
            pl_module.log_dict(
                {
                    "flops/train": self.train_flops,
                    "flops/train_dense": self.counters["dense_train_flops"],
                    "tokens": self.counters["tokens"],
                },
                on_step=True,
                on_epoch=False,
            )

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.val_runs += 1
        metrics = trainer.callback_metrics
        key = next((k for k in self.monitor_keys(trainer) if k in metrics), None)
        if key is not None:
            self._val_key = key
            self.val_curve.append([trainer.global_step, float(metrics[key])])
        else:
            self._val_logged = sorted(k for k in metrics if "val" in k)

    def monitor_keys(self, trainer: pl.Trainer) -> list[str]:
        """The validation-loss keys looked for, in order: ``monitor``; else the
        `ModelCheckpoint` monitor, ``val/loss``, ``val_loss``."""
        if self.monitor is not None:
            return [self.monitor]
        keys = [
            c.monitor
            for c in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(c, ModelCheckpoint) and c.monitor is not None
        ]
        return list(dict.fromkeys([*keys, *VAL_KEYS]))

    @property
    def train_flops(self) -> float:
        """Sparse training FLOPs so far, dense-gradient extras included."""
        return self.meter.ledger.train_flops

    # ------------------------------------------------------------------ state
    def _elapsed(self) -> float:
        running = time.perf_counter() - self._fit_start if self._fit_start is not None else 0.0
        return self.wall_time + running

    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),  # what earlier versions read
            "flops": self.meter.state_dict(),
            "val_curve": [list(p) for p in self.val_curve],
            "train_curve": [list(p) for p in self.train_curve],
            "wall_time": self._elapsed(),
            "stages": [
                {**st, "steps": list(st["steps"]), "sparsity": _copy(st["sparsity"])}
                for st in self.stages
            ],
            "algorithm_names": sorted(self.algorithm_names),
            "val_runs": self.val_runs,
            "val_key": self._val_key,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        flops = state_dict.get("flops")
        if flops is None:  # an earlier version's checkpoint: the totals only
            flops = legacy.summary_totals(state_dict)
        self.meter.load_state_dict(flops)
        self.val_curve = [list(p) for p in state_dict["val_curve"]]
        self.train_curve = [list(p) for p in state_dict["train_curve"]]
        self.wall_time = float(state_dict["wall_time"])
        self.stages = [
            {**st, "steps": list(st["steps"]), "sparsity": _copy(st["sparsity"])}
            for st in state_dict.get("stages", [])
        ]
        self.algorithm_names = set(state_dict.get("algorithm_names", []))
        self.val_runs = int(state_dict.get("val_runs", 0))
        self._val_key = state_dict.get("val_key")
        self._stage_dirty = True
        self._fit_start = time.perf_counter()

    # ------------------------------------------------------------------ the summary
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary = self.build(trainer, pl_module)
        for logger in trainer.loggers:
            logger.log_metrics(final_metrics(self.summary), step=trainer.global_step)
        # a check run: Lightning writes nothing (fast_dev_run is set by a connector, undeclared)
        if trainer.fast_dev_run and self.path is None:  # type: ignore[attr-defined]
            self._emit(None, self.summary)
            return
        # trainer.log_dir is a collective under DDP: every rank asks, rank 0 writes.
        path = Path(self.path or Path(trainer.log_dir or trainer.default_root_dir) / "summary.json")
        self._emit(path, self.summary)
        self._to_wandb(trainer, self.summary)

    @rank_zero_only
    def _to_wandb(self, trainer: pl.Trainer, summary: dict[str, Any]) -> None:
        """Put the summary (flat keys, `flat_summary`) into every W&B run's summary."""
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.summary.update(flat_summary(summary))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.meter.teardown()  # the Conv2d sizes recorded stay, for later build() calls

    def build(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The summary as plain Python values (what ``summary.json`` holds)."""
        report = sparsity_report(pl_module)
        totals = report.totals
        seq_len = self.meter.seq_len_seen or self.seq_len or 1
        flops = self.meter.flop_report(pl_module, seq_len)
        step, loss = self.val_curve[-1] if self.val_curve else (None, None)
        key = self._val_key if loss is not None else None
        ppl = trainer.callback_metrics.get(key.replace("loss", "ppl")) if key else None
        algorithms = self.algorithm_names | {type(a).__name__ for a in algorithms_of(pl_module)}
        return {
            "steps": trainer.global_step,
            "world_size": trainer.world_size,
            "wall_time_s": self._elapsed(),
            "tokens": int(self.counters["tokens"]),
            "algorithms": sorted(algorithms) or ["dense"],
            "stages": [
                {**st, "steps": list(st["steps"]), "sparsity": _copy(st["sparsity"])}
                for st in self.stages
            ],
            "val": {
                "step": step,
                "loss": loss,
                "ppl": float(ppl) if ppl is not None and loss is not None else _exp(loss),
                "unigram_loss": _unigram_of(trainer.datamodule),  # type: ignore[attr-defined]
                "key": key,
                "looked_for": self.monitor_keys(trainer),
                "runs": self.val_runs,
                "note": None if loss is not None else self._no_validation(trainer, pl_module),
            },
            "val_curve": self.val_curve,
            "train_curve": self.train_curve,
            "sparsity": {
                "sparse_layers": totals["sparse_sparsity"],
                "model": totals["sparsity"],
                "params": totals["params"],
                "nonzeros": totals["nonzeros"],
                "layers": {n: r["sparsity"] for n, r in report.rows.items() if r["masked"]},
            },
            "flops": {
                "seq_len": seq_len,
                "train": self.train_flops,
                "train_dense": self.counters["dense_train_flops"],
                "dense_grad_extra": self.counters["dense_grad_flops"],
                "dense_grad_steps": int(self.counters["dense_grad_steps"]),
                "inference_per_token": flops.forward_flops_per_token,
                "inference_per_token_dense": flops.dense_forward_flops_per_token,
            },
            "device": _device_stats(trainer),
            "run": run_figures(
                self.step_seconds, int(self.counters["tokens"]) - self._tokens_at_start
            ),
        }

    def _no_validation(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """Why there is no validation loss to report, and what to change."""
        if self.val_runs:
            logged = ", ".join(repr(k) for k in self._val_logged) or "no validation metrics"
            return (
                f"validation ran {self.val_runs} times and logged {logged}; set "
                "--summary.monitor to the validation loss key"
            )
        if not is_overridden("validation_step", pl_module):
            return "validation did not run: the module has no validation_step"
        if trainer.limit_val_batches == 0:
            return "validation did not run: limit_val_batches is 0"
        interval, steps = trainer.val_check_interval, trainer.global_step
        if trainer.check_val_every_n_epoch is None and isinstance(interval, int):
            return (
                f"validation did not run: val_check_interval {interval} > {steps} steps; "
                "lower --trainer.val_check_interval"
            )
        return (
            f"validation did not run in {steps} steps (check_val_every_n_epoch "
            f"{trainer.check_val_every_n_epoch}, val_check_interval {interval})"
        )

    @rank_zero_only
    def _emit(self, path: Path | None, summary: dict[str, Any]) -> None:
        """Print the summary and write it to ``path`` (None: print only, as under fast_dev_run)."""
        if path is None:
            text = format_summary(summary, layers=self.print_layers)
            print(f"{text}\nsummary not saved (fast_dev_run; --summary.path saves it)")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1) + "\n")
        shown = path.resolve()  # as given with --summary.path, else relative to the cwd
        if self.path is None and shown.is_relative_to(Path.cwd().resolve()):
            shown = shown.relative_to(Path.cwd().resolve())
        elif self.path is not None:
            shown = path
        print(format_summary(summary, layers=self.print_layers) + f"\nsummary saved to {shown}")


def _copy(value: list[Any] | None) -> list[Any] | None:
    return list(value) if value is not None else None


def _device_stats(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The accelerator's own run totals (``summary_figures()``, e.g. the emulated wafer-scale
    device's); ``None`` on accelerators without them. Duck-typed: this layer is below the device."""
    figures = getattr(trainer.accelerator, "summary_figures", None)
    return figures() if callable(figures) else None


def unigram_cross_entropy(train: Tensor, val: Tensor, vocab_size: int = 256) -> float:
    """Cross-entropy (nats/token) on ``val`` of the add-one token frequencies of ``train``.

    The loss of a model that ignores context: a trained language model should be well below it.
    """
    counts = torch.bincount(train.long().flatten(), minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    val_counts = torch.bincount(val.long().flatten(), minlength=vocab_size).double()
    return float(-(val_counts * log_p).sum() / val_counts.sum())


def _unigram_of(datamodule: Any) -> float | None:
    train, val = getattr(datamodule, "train_data", None), getattr(datamodule, "val_data", None)
    if isinstance(train, Tensor) and isinstance(val, Tensor) and train.dtype == torch.uint8:
        return unigram_cross_entropy(train, val)
    return None


def _exp(loss: float | None) -> float | None:
    return math.exp(loss) if loss is not None else None


def run_figures(step_seconds: list[float], tokens: int) -> dict[str, float | None]:
    """This process's training speed and memory: the median seconds of an optimizer step
    (from the end of the step before; the first step, which also times the device's kernels
    and builds Adam's state, is left out where there are others), the tokens those steps
    trained per second of them, and the process's peak resident memory so far (Linux and
    macOS report ``ru_maxrss`` in KiB and bytes)."""
    timed = step_seconds[1:] or step_seconds
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    total = sum(step_seconds)
    return {
        "seconds_per_step": statistics.median(timed) if timed else None,
        "tokens_per_s": tokens / total if total > 0 else None,
        "peak_rss_gb": peak / 1e9,
    }

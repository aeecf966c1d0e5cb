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
  the output size recorded from the training forwards). Training FLOPs are counted step by step
  as ``3 x`` the forward FLOPs per token of the masks in force times the tokens trained, so a
  schedule that changes the sparsity (GraNet) is costed as it ran; algorithms that need dense
  weight gradients on mask updates (RigL, GraNet) add `FlopReport.extra_dense_grad_flops` on
  each update step.

During training it logs ``flops/train``, ``flops/train_dense`` and ``tokens`` (cumulative) at the
trainer's logging interval. Its counters are callback state, so a resumed run continues them.
On the emulated wafer-scale device (``accelerator="wse"``) it adds the device's statistics:
executed versus dense-equivalent FLOPs, CSR versus dense weight bytes, CSR rebuilds.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from lightning_sparse.core.algorithms import SparsityAlgorithm, algorithms_of
from lightning_sparse.core.flops import ConvPositionRecorder, FlopReport, batch_shape, model_flops
from lightning_sparse.core.report import sparsity_report

__all__ = ["SparseRunSummary", "attention_dims", "flat_summary", "unigram_cross_entropy"]

_COUNTERS = ("tokens", "train_flops", "dense_train_flops", "dense_grad_flops", "dense_grad_steps")
VAL_KEYS = ("val/loss", "val_loss")  # looked for, in order, when no monitor is configured


class SparseRunSummary(pl.Callback):
    """Prints and saves a run's validation loss, per-layer sparsity and FLOPs versus dense.

    Works with any LightningModule whose training batches are token tensors [B, T + 1] (inputs
    plus shifted targets) or tuples whose first element is one; nothing is needed from the model.

    Args:
        path: JSON file to write; default ``<trainer.log_dir>/summary.json``.
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
        self.seq_len = seq_len
        self.print_layers = print_layers
        self.counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self.val_curve: list[list[float]] = []
        self.train_curve: list[list[float]] = []
        self.wall_time = 0.0  # seconds of fit before the current process's fit started
        self._fit_start: float | None = None
        self._report: FlopReport | None = None
        self._pending_sequences = 0  # sequences since the last optimizer step
        self._step_at_batch_start = 0
        self._world_size = 1
        self._last_dense_grad_step = -1
        self._hooked: set[int] = set()
        self._warned = False
        self._seq_len_seen: int | None = None
        self.summary: dict[str, Any] | None = None
        self._layers: tuple[int, int] = (-1, -1)  # (sparse tensors, Conv2d sizes known)
        # What actually ran: sparsity stages, algorithms, validations.
        self.stages: list[dict[str, Any]] = []
        self.algorithm_names: set[str] = set()
        self.val_runs = 0
        self._val_key: str | None = None
        self._val_logged: list[str] = []
        self._stage_layers = -1
        self._stage_dirty = True

    # ------------------------------------------------------------------ counting
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()
        # Conv2d FLOPs scale with the output size the batches produce (flops.model_flops).
        self._conv = ConvPositionRecorder(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._world_size = trainer.world_size
        for algorithm in algorithms_of(pl_module):
            if id(algorithm) not in self._hooked:  # leaf algorithms, Group members included
                algorithm.register_update_hook(self._on_mask_update)
                self._hooked.add(id(algorithm))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Charged here: forward and backward run with the masks in force now (updates come
        # after the backward, before the optimizer step).
        self._step_at_batch_start = trainer.global_step
        # The sparse layers themselves can change too (densify at a Variable SPDF switch).
        layers = sum(len(a.sparse_params) for a in algorithms_of(pl_module))
        self._note_stage(pl_module, trainer.global_step, layers)
        shape = self._batch_shape(batch)
        if shape is None:
            return
        conv = getattr(self, "_conv", None)
        if conv is not None and not conv.complete:  # Conv2d sizes come with the first forward
            self._deferred = (layers, *shape)
            return
        self._count(pl_module, layers, *shape)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Count a batch deferred until its forward recorded the Conv2d output sizes (the
        masks are still those of the batch start: updates come before the optimizer step)."""
        deferred, self._deferred = getattr(self, "_deferred", None), None
        if deferred is not None:
            self._count(pl_module, *deferred)

    def _count(
        self, pl_module: pl.LightningModule, layers: int, sequences: int, seq_len: int
    ) -> None:
        """Add one batch's tokens and training FLOPs (dense and with the masks in force)."""
        self._seq_len_seen = seq_len
        conv = getattr(self, "_conv", None)
        key = (layers, len(conv.positions) if conv is not None else 0)
        if self._report is None or self._report.seq_len != seq_len or key != self._layers:
            self._report = model_flops(pl_module, seq_len, **self._flop_kwargs(pl_module))
            self._layers = key
        tokens = sequences * seq_len * self._world_size
        self._pending_sequences += sequences
        self.counters["tokens"] += tokens
        self.counters["train_flops"] += 3 * self._report.forward_flops_per_token * tokens
        self.counters["dense_train_flops"] += (
            3 * self._report.dense_forward_flops_per_token * tokens
        )

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
        # Runs inside the optimizer step, after the new masks are set: the cached report still
        # describes the masks this step's dense gradients were computed against.
        if getattr(algorithm, "needs_dense_grad", False) and step != self._last_dense_grad_step:
            if self._report is not None:
                extra = self._report.extra_dense_grad_flops(1, self._pending_sequences)
                self.counters["dense_grad_flops"] += extra * self._world_size
            self.counters["dense_grad_steps"] += 1
            self._last_dense_grad_step = step
        self._report = None  # masks changed: recount before the next batch

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step == self._step_at_batch_start:
            return  # accumulating gradients: no optimizer step yet
        self._pending_sequences = 0
        if step % max(trainer.log_every_n_steps, 1) == 0:
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

    def _flop_kwargs(self, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Attention dimensions and the Conv2d output sizes seen so far, for `model_flops`."""
        conv = getattr(self, "_conv", None)
        positions = dict(conv.positions) if conv is not None else {}
        return {**attention_dims(pl_module), "conv_positions": positions}

    @property
    def train_flops(self) -> float:
        """Sparse training FLOPs so far, dense-gradient extras included."""
        return self.counters["train_flops"] + self.counters["dense_grad_flops"]

    def _batch_shape(self, batch: Any) -> tuple[int, int] | None:
        """(sequences, tokens per sequence) of a batch (`batch_shape`; ``seq_len`` overrides the
        second); ``None`` (and a warning, once) for other batches, whose tokens and FLOPs are
        not counted."""
        shape = batch_shape(batch)
        if shape is not None:
            return shape[0], self.seq_len or shape[1]
        if not self._warned:
            first = batch[0] if isinstance(batch, list | tuple) and batch else batch
            rank_zero_warn(
                "SparseRunSummary counts integer token windows [B, T + 1] or floating examples "
                f"[B, ...] (or tuples whose first element is one), not {type(first).__name__}: "
                "tokens and training FLOPs are not counted (inference FLOPs still are; set "
                "summary.seq_len for them)"
            )
            self._warned = True
        return None

    # ------------------------------------------------------------------ state
    def _elapsed(self) -> float:
        running = time.perf_counter() - self._fit_start if self._fit_start is not None else 0.0
        return self.wall_time + running

    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "val_curve": [list(p) for p in self.val_curve],
            "train_curve": [list(p) for p in self.train_curve],
            "wall_time": self._elapsed(),
            "last_dense_grad_step": self._last_dense_grad_step,
            "stages": [
                {**st, "steps": list(st["steps"]), "sparsity": _copy(st["sparsity"])}
                for st in self.stages
            ],
            "algorithm_names": sorted(self.algorithm_names),
            "val_runs": self.val_runs,
            "val_key": self._val_key,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counters = {**dict.fromkeys(_COUNTERS, 0), **state_dict["counters"]}
        self.val_curve = [list(p) for p in state_dict["val_curve"]]
        self.train_curve = [list(p) for p in state_dict["train_curve"]]
        self.wall_time = float(state_dict["wall_time"])
        self._last_dense_grad_step = int(state_dict.get("last_dense_grad_step", -1))
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
            logger.log_metrics(_final_metrics(self.summary), step=trainer.global_step)
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
        conv = getattr(self, "_conv", None)
        if conv is not None:
            conv.remove()  # the positions recorded stay, for later build() calls

    def build(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The summary as plain Python values (what ``summary.json`` holds)."""
        report = sparsity_report(pl_module)
        totals = report.totals
        seq_len = self._seq_len_seen or self.seq_len or 1
        flops = model_flops(pl_module, seq_len, **self._flop_kwargs(pl_module))
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
                "unigram_loss": _unigram_of(trainer.datamodule),
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
    def _emit(self, path: Path, summary: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1) + "\n")
        shown = path.resolve()  # as given with --summary.path, else relative to the cwd
        if self.path is None and shown.is_relative_to(Path.cwd().resolve()):
            shown = shown.relative_to(Path.cwd().resolve())
        elif self.path is not None:
            shown = path
        print(format_summary(summary, layers=self.print_layers) + f"\nsummary saved to {shown}")


def format_summary(summary: dict[str, Any], layers: bool = True) -> str:
    """The human-readable form of a `SparseRunSummary.build` result."""
    val, sp, fl = summary["val"], summary["sparsity"], summary["flops"]
    lines = [
        "",
        "=" * 30 + " lightning-sparse run summary " + "=" * 30,
        f"steps {summary['steps']}  tokens {summary['tokens']:,}  wall time "
        f"{summary['wall_time_s']:.0f} s  algorithms {', '.join(summary['algorithms'])}",
    ]
    if val["loss"] is None:
        looked = " or ".join(repr(k) for k in val.get("looked_for", ["val/loss"]))
        lines.append(f"validation: no {looked} logged ({val.get('note')})")
    else:
        baseline = val["unigram_loss"]
        extra = f"   (unigram baseline {baseline:.4f})" if baseline is not None else ""
        lines.append(
            f"validation at step {val['step']} ({val.get('key')!r}): loss {val['loss']:.4f} "
            f"nats/token, perplexity {val['ppl']:.3f}{extra}"
        )
    if summary.get("stages"):
        lines.append("stages: " + ", then ".join(_stage_text(st) for st in summary["stages"]))
    if sp["layers"]:
        lines.append(
            f"sparsity at the end: {sp['sparse_layers']:.2%} of the sparse layers "
            f"({len(sp['layers'])} tensors), {sp['model']:.2%} of all {sp['params']:,} "
            f"parameters ({sp['nonzeros']:,} nonzero)"
        )
    else:
        lines.append(
            f"sparsity at the end: no masked layers; {sp['model']:.2%} of all {sp['params']:,} "
            f"parameters are zero ({sp['nonzeros']:,} nonzero)"
        )
    if layers and sp["layers"]:
        width = max(len(n) for n in sp["layers"])
        lines += [f"  {name:<{width}}  {s:7.2%}" for name, s in sp["layers"].items()]
    train, dense_train = fl["train"], fl["train_dense"]
    inf, inf_dense = fl["inference_per_token"], fl["inference_per_token_dense"]
    lines.append(f"{'FLOPs':<22}{'sparse':>12}{'dense':>12}{'dense/sparse':>14}")
    for what, sparse, dense in (
        ("training (total)", train, dense_train),
        ("inference (per token)", inf, inf_dense),
    ):
        lines.append(f"{what:<22}{sparse:>12.3e}{dense:>12.3e}{_ratio(dense, sparse):>13.2f}x")
    if fl["dense_grad_steps"]:
        lines.append(
            f"  training includes {fl['dense_grad_extra']:.3e} FLOPs of dense weight gradients "
            f"on {fl['dense_grad_steps']} mask-update steps"
        )
    device = summary.get("device")
    if device:
        lines += [
            f"WSE device ({device['steps']} steps; Linear-layer matmuls, training and validation):",
            f"  FLOPs executed {device['flops_executed']:.3e} vs {device['flops_dense']:.3e} "
            f"dense ({_ratio(device['flops_dense'], device['flops_executed']):.2f}x fewer), "
            f"{device['dense_grad_steps']} steps with dense weight gradients",
            f"  weights in CSR {device['weight_bytes_csr_both']:,} bytes for training "
            f"({device['weight_bytes_csr_forward']:,} for inference) vs "
            f"{device['weight_bytes_dense']:,} dense",
            f"  CSR rebuilds {device['rebuilds']} ({device['rebuild_seconds']:.2f} s)",
        ]
    return "\n".join(lines)


def flat_summary(summary: dict[str, Any], prefix: str = "summary") -> dict[str, Any]:
    """A `SparseRunSummary.build` result as flat ``<prefix>/<key>/<key>`` -> scalar (for a W&B
    run summary): nested dicts are followed, ``algorithms`` joined with ``+``, ``stages`` as
    text (``sparse 80.0% for steps 0-40``); the curves are left out (they are logged metrics)."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}/{key}"
        if key in ("val_curve", "train_curve", "looked_for"):
            continue
        if key == "stages":
            out[name] = ", then ".join(_stage_text(st) for st in value)
        elif key == "algorithms":
            out[name] = "+".join(value)
        elif isinstance(value, Mapping):
            out.update(flat_summary(dict(value), name))
        elif value is None or isinstance(value, str | int | float | bool):
            out[name] = value
    return out


def _stage_text(stage: dict[str, Any]) -> str:
    """``sparse 90.0% for steps 0-300`` / ``sparse 50.0% -> 80.0% ...`` / ``dense for ...``."""
    first, end = stage["steps"]
    if stage["kind"] == "dense":
        return f"dense for steps {first}-{end}"
    start, last = stage["sparsity"]
    ramp = f" -> {last:.1%}" if f"{start:.1%}" != f"{last:.1%}" else ""
    return f"sparse {start:.1%}{ramp} for steps {first}-{end}"


def _copy(value: list[Any] | None) -> list[Any] | None:
    return list(value) if value is not None else None


def _device_stats(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The accelerator's own run totals (``summary_figures()``, e.g. the emulated wafer-scale
    device's); ``None`` on accelerators without them. Duck-typed: this layer is below the device."""
    figures = getattr(trainer.accelerator, "summary_figures", None)
    return figures() if callable(figures) else None


def attention_dims(module: nn.Module) -> dict[str, int]:
    """``n_layers``, ``d_model``, ``n_heads`` from a ``config`` attribute in ``module``'s tree.

    Reads `LlamaConfig` (``n_layers``, ``dim``, ``n_heads``) and Hugging Face configs
    (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``); empty when neither is
    found, and `model_flops` then leaves the attention terms out.
    """
    for sub in module.modules():
        config = getattr(sub, "config", None)
        for names in _CONFIG_NAMES:
            values = [getattr(config, n, None) for n in names]
            if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                return dict(zip(("n_layers", "d_model", "n_heads"), values, strict=True))
    return {}


_CONFIG_NAMES = (
    ("n_layers", "dim", "n_heads"),  # LlamaConfig
    ("num_hidden_layers", "hidden_size", "num_attention_heads"),  # Hugging Face
)


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


def _final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    values = {
        "summary/val_loss": summary["val"]["loss"],
        "summary/val_ppl": summary["val"]["ppl"],
        "summary/train_flops": summary["flops"]["train"],
        "summary/train_flops_dense": summary["flops"]["train_dense"],
        "summary/inference_flops_per_token": summary["flops"]["inference_per_token"],
        "summary/sparsity": summary["sparsity"]["sparse_layers"],
        "summary/wall_time_s": summary["wall_time_s"],
    }
    return {k: float(v) for k, v in values.items() if v is not None}


def _exp(loss: float | None) -> float | None:
    return math.exp(loss) if loss is not None else None


def _ratio(dense: float, sparse: float) -> float:
    return dense / sparse if sparse else float("nan")

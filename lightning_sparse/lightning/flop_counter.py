"""`FlopCounter`: the training FLOPs a run actually spent, batch by batch, against dense training.

Every training batch costs ``3 x`` its forward FLOPs (Chinchilla appendix F, as in
``lightning_sparse.core.flops``): ``3 * forward_flops_per_token * tokens``, where the forward cost
comes from :func:`~lightning_sparse.core.flops.model_flops` with the masks the batch was trained
with. The dense reference is the same model with every weight kept. Consecutive batches with the
same cost form one :class:`FlopSegment` (a sparse stage, a dense stage, one level of iterative
pruning), so the summary reads as a per-stage table. RigL's dense weight gradients on update
steps are not counted (at most ``1 / update freq`` of the steps; see
``FlopReport.extra_dense_grad_flops``).

The cost is measured after the backward (``on_after_backward``), so a densify at batch start (SPDF)
and a mask update before the optimizer step (GMP, iterative pruning) are charged to the right
batch. It is recomputed only when the set of masks changes or an algorithm reports a mask update,
so a step costs no host sync.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_sparse.core.algorithms import SparsityAlgorithm, algorithms_of
from lightning_sparse.core.flops import ConvPositionRecorder, FlopReport, batch_shape, model_flops
from lightning_sparse.core.report import sparsity_report
from lightning_sparse.core.safe_load import load_torch_file
from lightning_sparse.lightning.summary import attention_dims

__all__ = ["FlopCounter", "FlopSegment", "lm_flops", "mask_names", "tokens_in_batch"]


@dataclass
class FlopSegment:
    """Consecutive training batches that cost the same per token.

    Attributes:
        run: index of the run in a chain of runs (0 for the first; see ``FlopCounter.previous``).
        first_step, last_step: ``trainer.global_step`` of the first and the last batch.
        batches: training batches (micro-batches under gradient accumulation).
        tokens: tokens trained on.
        forward_flops_per_token: forward FLOPs per token with the masks in use.
        dense_forward_flops_per_token: the same with every weight kept.
        sparsity: fraction of zeros (by mask) over the parameters that have had a mask in this run;
            0.0 once they are densified.
    """

    run: int
    first_step: int
    last_step: int
    batches: int
    tokens: int
    forward_flops_per_token: int
    dense_forward_flops_per_token: int
    sparsity: float

    @property
    def flops(self) -> int:
        """Training FLOPs: forward plus a backward of twice the forward."""
        return 3 * self.forward_flops_per_token * self.tokens

    @property
    def dense_flops(self) -> int:
        """Training FLOPs of the same tokens on the dense model."""
        return 3 * self.dense_forward_flops_per_token * self.tokens


def tokens_in_batch(batch: Any) -> tuple[int, int]:
    """``(tokens, seq_len)`` of a batch (`lightning_sparse.core.flops.batch_shape`): integer
    token windows ``[B, T + 1]`` give ``(B * T, T)``; floating examples ``[B, ...]`` (images)
    give ``(B, 1)``, one "token" per example; a tuple or list is read through its first tensor.

    Raises:
        TypeError: if the batch is neither.
    """
    shape = batch_shape(batch)
    if shape is None:
        first = batch[0] if isinstance(batch, list | tuple) and batch else batch
        raise TypeError(
            "FlopCounter expects integer token windows [B, T + 1] or floating examples [B, ...] "
            f"(or a tuple starting with one), got {type(first).__name__}"
            + (f" of shape {tuple(first.shape)}" if torch.is_tensor(first) else "")
        )
    sequences, seq_len = shape
    return sequences * seq_len, seq_len


def lm_flops(
    module: nn.Module, seq_len: int, conv_positions: dict[str, int] | None = None
) -> FlopReport:
    """``model_flops`` of ``module`` with attention terms from its ``config`` (``attention_dims``:
    ``LlamaConfig`` or a Hugging Face config; left out when none is found) and Conv2d layers at
    ``conv_positions`` (``{name: H_out * W_out}``, recorded from the forward)."""
    return model_flops(module, seq_len, **attention_dims(module), conv_positions=conv_positions)


def mask_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the ``<param>_mask`` buffers of ``model`` (Python only, no host sync)."""
    params = {name for name, _ in model.named_parameters()}
    return tuple(
        name for name, _ in model.named_buffers() if name.endswith("_mask") and name[:-5] in params
    )


class FlopCounter(pl.Callback):
    """Count training FLOPs per batch with the masks in use, log them and print a summary.

    Logs ``flop_counter/train`` and ``flop_counter/dense`` (cumulative, previous runs included)
    and ``flop_counter/saved`` (``1 - train / dense``) every ``log_every_n_steps``; prints the
    per-segment table at the end of ``fit``. ``summary()`` returns the same figures. (The CLI's
    ``SparseRunSummary`` totals one run; this adds stages, chains of runs and their savings.)

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
        self.segments: list[FlopSegment] = []
        self.ever_masked: dict[str, int] = {}  # parameter name -> numel
        self._cost: tuple[int, int, float] | None = None  # (forward, dense forward, sparsity)
        self._cost_key: tuple[Any, ...] | None = None
        self._dirty = True
        self._hooked: set[int] = set()
        self._batch: tuple[int, int, int] | None = None  # (step, tokens, seq_len) in flight
        self._batch_cost: tuple[int, int, float] | None = None
        self._conv: ConvPositionRecorder | None = None  # Conv2d output sizes, from the forward

    # ------------------------------------------------------------------ totals
    def all_segments(self) -> list[FlopSegment]:
        """Segments of the previous runs, then of this run."""
        return self.earlier + self.segments

    def summary(self) -> dict[str, float]:
        """Totals: ``flops``, ``dense_flops``, ``saved`` (fraction), ``tokens`` and
        ``effective_sparsity`` (token-weighted mean sparsity of the masked parameters)."""
        segments = self.all_segments()
        flops = sum(s.flops for s in segments)
        dense = sum(s.dense_flops for s in segments)
        tokens = sum(s.tokens for s in segments)
        return {
            "flops": flops,
            "dense_flops": dense,
            "saved": 1.0 - flops / dense if dense else 0.0,
            "tokens": tokens,
            "effective_sparsity": (
                sum(s.sparsity * s.tokens for s in segments) / tokens if tokens else 0.0
            ),
        }

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
        return "\n".join(lines)

    # ------------------------------------------------------------------ measuring
    def _hook_algorithms(self, pl_module: pl.LightningModule) -> None:
        for algorithm in algorithms_of(pl_module):
            if id(algorithm) not in self._hooked:
                algorithm.register_update_hook(self._on_mask_update)
                self._hooked.add(id(algorithm))

    def _on_mask_update(self, algorithm: SparsityAlgorithm, step: int, stats: Any) -> None:
        self._dirty = True

    def _measure(self, pl_module: pl.LightningModule, seq_len: int) -> tuple[int, int, float]:
        positions = dict(self._conv.positions) if self._conv is not None else {}
        report = lm_flops(pl_module, seq_len, positions)
        rows = sparsity_report(pl_module, masked_only=True).rows
        for name, row in rows.items():
            self.ever_masked[name] = int(row["numel"])  # type: ignore[arg-type]
        total = sum(self.ever_masked.values())
        kept = sum(
            int(rows[n]["nonzeros"]) if n in rows else numel  # type: ignore[arg-type]
            for n, numel in self.ever_masked.items()
        )
        sparsity = 1.0 - kept / total if total else 0.0
        return report.forward_flops_per_token, report.dense_forward_flops_per_token, sparsity

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Read the segments of the ``previous`` runs; record Conv2d output sizes."""
        if self._conv is None:
            self._conv = ConvPositionRecorder(pl_module)
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
        tokens, seq_len = tokens_in_batch(batch)
        self._batch = (trainer.global_step, tokens * trainer.world_size, seq_len)
        self._hook_algorithms(pl_module)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """This batch's forward and backward ran with the current masks: cost them."""
        if self._batch is None:
            return
        seq_len = self._batch[2]
        key = (seq_len, mask_names(pl_module), len(self._conv.positions) if self._conv else 0)
        if self._dirty or key != self._cost_key or self._cost is None:
            self._cost, self._cost_key, self._dirty = self._measure(pl_module, seq_len), key, False
        self._batch_cost = self._cost

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Add the batch to the current segment (or start a new one); log the totals."""
        if self._batch is None or self._batch_cost is None:
            return
        (step, tokens, _), cost = self._batch, self._batch_cost
        self._batch = self._batch_cost = None
        last = self.segments[-1] if self.segments else None
        if last is not None and cost == (
            last.forward_flops_per_token,
            last.dense_forward_flops_per_token,
            last.sparsity,
        ):
            last.last_step, last.batches, last.tokens = step, last.batches + 1, last.tokens + tokens
        else:
            self.segments.append(FlopSegment(len(self.previous), step, step, 1, tokens, *cost))
        if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            t = self.summary()
            metrics = {
                "flop_counter/train": float(t["flops"]),
                "flop_counter/dense": float(t["dense_flops"]),
                "flop_counter/saved": t["saved"],
            }
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the Conv2d recorder's hooks (the sizes recorded stay)."""
        if self._conv is not None:
            self._conv.remove()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the table."""
        if self.verbose and trainer.is_global_zero and self.all_segments():
            print(self.table(), flush=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This run's segments and the parameters that have had masks."""
        return {
            "segments": [asdict(s) for s in self.segments],
            "ever_masked": dict(self.ever_masked),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (a resumed run continues its segments)."""
        self.segments = [FlopSegment(**s) for s in state_dict.get("segments", [])]
        self.ever_masked = dict(state_dict.get("ever_masked", {}))
        self._dirty = True

"""The one FLOP accountant: the formulas, a model's cost per token, and a run's account.

Every FLOP figure of the package comes from here: the run summary (`SparseRunSummary`), the
`FlopCounter` and the emulated device's statistics (`WSEStats`) read these functions, so they
cannot disagree. Conventions (appendix F of "Training Compute-Optimal Large Language Models",
Hoffmann et al., 2022, arXiv:2203.15556):

- a matmul of ``tokens`` rows through a weight with ``kept`` nonzeros costs
  ``2 * tokens * kept`` FLOPs (:func:`matmul_flops`; a multiply-add is 2 FLOPs);
- training costs ``3 x`` the forward (:func:`training_flops`): the backward computes the input
  gradient and the weight gradient, each as costly as the forward;
- RigL-style mask updates read the dense weight gradient on their step: the weight-gradient
  matmul then costs ``2 * tokens * numel`` instead of ``2 * tokens * kept``, i.e.
  ``FlopReport.dense_grad_flops_per_token`` more per token.

`FlopReport` is what one model costs per token (``flops.model_flops`` and
``flops.transformer_flops`` build it); `FlopLedger` is what a run spent, batch by batch, in
segments of equal cost. Pure: no Lightning, no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from . import validate

__all__ = [
    "TRAINING_FACTOR",
    "BatchCost",
    "FlopLedger",
    "FlopReport",
    "FlopSegment",
    "matmul_flops",
    "report_from_matrices",
    "training_flops",
]

TRAINING_FACTOR = 3
"""Training FLOPs over forward FLOPs: forward, input gradient, weight gradient."""


def matmul_flops(tokens: int, kept: int) -> int:
    """FLOPs of ``tokens`` rows through a weight with ``kept`` nonzeros: ``2 * tokens * kept``."""
    return 2 * tokens * kept


def training_flops(forward_flops_per_token: int, tokens: int) -> int:
    """Training FLOPs of ``tokens`` tokens: ``3 * forward_flops_per_token * tokens``."""
    return TRAINING_FACTOR * forward_flops_per_token * tokens


@dataclass(frozen=True)
class FlopReport:
    """FLOPs and parameters of one model, sparse and dense; everything else is derived.

    Attributes:
        seq_len: tokens per sequence.
        forward_flops_per_token: sparse forward FLOPs per token.
        dense_forward_flops_per_token: the same model with every weight kept.
        params: parameter count (the dense model's count).
        nonzero_params: parameters kept by the masks.
        dense_grad_flops_per_token: extra FLOPs per token of one dense weight-gradient pass over
            the sparse matrices, ``sum 2 * (numel - kept)``. RigL ("Rigging the Lottery: Making All
            Tickets Winners", Evci et al., 2020, arXiv:1911.11134) needs it on mask-update steps
            to score the pruned connections; the input gradient and forward stay sparse, so this
            is the only extra cost assumed.
    """

    seq_len: int
    forward_flops_per_token: int
    dense_forward_flops_per_token: int
    params: int
    nonzero_params: int
    dense_grad_flops_per_token: int

    @property
    def forward_flops(self) -> int:
        """Sparse forward FLOPs per sequence."""
        return self.forward_flops_per_token * self.seq_len

    @property
    def dense_forward_flops(self) -> int:
        """Dense forward FLOPs per sequence."""
        return self.dense_forward_flops_per_token * self.seq_len

    @property
    def training_flops(self) -> int:
        """Sparse training FLOPs per sequence: forward plus a backward of twice the forward."""
        return training_flops(self.forward_flops_per_token, self.seq_len)

    @property
    def dense_training_flops(self) -> int:
        """Dense training FLOPs per sequence."""
        return training_flops(self.dense_forward_flops_per_token, self.seq_len)

    @property
    def inference_flops(self) -> int:
        """Sparse inference FLOPs per sequence: one forward over all of it (no KV cache)."""
        return self.forward_flops

    @property
    def dense_inference_flops(self) -> int:
        """Dense inference FLOPs per sequence."""
        return self.dense_forward_flops

    @property
    def inference_reduction(self) -> float:
        """Dense over sparse inference FLOPs (``3.0`` means three times fewer)."""
        return self.dense_forward_flops_per_token / self.forward_flops_per_token

    @property
    def param_reduction(self) -> float:
        """All parameters over kept parameters."""
        return self.params / self.nonzero_params

    def extra_dense_grad_flops(self, n_updates: int, batch_size: int = 1) -> int:
        """Extra FLOPs of dense weight gradients on mask-update steps.

        Args:
            n_updates: steps that compute dense weight gradients.
            batch_size: sequences per step.

        Returns:
            ``n_updates * batch_size * seq_len * dense_grad_flops_per_token``.
        """
        check_count("n_updates", n_updates, minimum=0)
        check_count("batch_size", batch_size)
        return n_updates * batch_size * self.seq_len * self.dense_grad_flops_per_token

    def total_training_flops(
        self, tokens: int, dense_gradient_steps: int = 0, batch_size: int = 1
    ) -> int:
        """Training FLOPs over ``tokens`` tokens, plus dense gradients on some steps.

        Args:
            tokens: tokens trained on.
            dense_gradient_steps: steps that also compute dense weight gradients (RigL's mask
                updates; 0 for static sparsity, SET, GMP).
            batch_size: sequences per such step.

        Returns:
            ``3 * forward_flops_per_token * tokens`` plus :meth:`extra_dense_grad_flops`.
        """
        check_count("tokens", tokens, minimum=0)
        extra = self.extra_dense_grad_flops(dense_gradient_steps, batch_size)
        return training_flops(self.forward_flops_per_token, tokens) + extra

    def as_dict(self) -> dict[str, float]:
        """Fields and derived figures, for loggers."""
        derived = (
            "forward_flops",
            "dense_forward_flops",
            "training_flops",
            "dense_training_flops",
            "inference_flops",
            "dense_inference_flops",
            "inference_reduction",
            "param_reduction",
        )
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}

    def __str__(self) -> str:
        rows = [
            ("params", self.nonzero_params, self.params),
            (
                "forward FLOPs / token",
                self.forward_flops_per_token,
                self.dense_forward_flops_per_token,
            ),
            ("inference FLOPs / sequence", self.inference_flops, self.dense_inference_flops),
            ("training FLOPs / sequence", self.training_flops, self.dense_training_flops),
        ]
        lines = [f"{'':28}{'sparse':>12}{'dense':>12}{'dense/sparse':>14}"]
        lines += [f"{name:28}{s:>12.3e}{d:>12.3e}{d / s:>13.2f}x" for name, s, d in rows]
        return "\n".join(lines)


def report_from_matrices(
    seq_len: int, matrices: list[tuple[int, int]], other: int, params: int, nonzero: int
) -> FlopReport:
    """A report from ``(numel, kept)`` weight matrices (``numel`` already multiplied by the output
    positions of a convolution) and ``other``, the weight-free FLOPs per token."""
    return FlopReport(
        seq_len=seq_len,
        forward_flops_per_token=sum(matmul_flops(1, k) for _, k in matrices) + other,
        dense_forward_flops_per_token=sum(matmul_flops(1, n) for n, _ in matrices) + other,
        params=params,
        nonzero_params=nonzero,
        dense_grad_flops_per_token=sum(matmul_flops(1, n - k) for n, k in matrices),
    )


def check_count(name: str, value: int, minimum: int = 1) -> int:
    """A size or count (`validate.integer`), the fix naming the model's figure."""
    return validate.integer(value, name, minimum, fix=f"pass the model's actual {name}")


# --------------------------------------------------------------------------------------------
# A run's account
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchCost:
    """What one token of a training batch costs with the masks in force (from a `FlopReport`),
    and the sparsity those masks have (for the segment table)."""

    forward_flops_per_token: int
    dense_forward_flops_per_token: int
    dense_grad_flops_per_token: int
    sparsity: float = 0.0

    @classmethod
    def of(cls, report: FlopReport, sparsity: float = 0.0) -> BatchCost:
        """The cost per token ``report`` gives."""
        return cls(
            report.forward_flops_per_token,
            report.dense_forward_flops_per_token,
            report.dense_grad_flops_per_token,
            sparsity,
        )


@dataclass
class FlopSegment:
    """Consecutive training batches that cost the same per token.

    Attributes:
        run: index of the run in a chain of runs (0 for the first).
        first_step, last_step: ``global_step`` of the first and the last batch.
        batches: training batches (micro-batches under gradient accumulation).
        tokens: tokens trained on.
        forward_flops_per_token: forward FLOPs per token with the masks in use.
        dense_forward_flops_per_token: the same with every weight kept.
        sparsity: fraction of zeros of the parameters that have had a mask; 0.0 once densified.
        dense_grad_flops: extra FLOPs of dense weight gradients on mask-update steps.
    """

    run: int
    first_step: int
    last_step: int
    batches: int
    tokens: int
    forward_flops_per_token: int
    dense_forward_flops_per_token: int
    sparsity: float
    dense_grad_flops: int = 0

    @property
    def flops(self) -> int:
        """Training FLOPs spent: ``3 x`` forward, plus the dense weight gradients."""
        return training_flops(self.forward_flops_per_token, self.tokens) + self.dense_grad_flops

    @property
    def dense_flops(self) -> int:
        """Training FLOPs of the same tokens on the dense model."""
        return training_flops(self.dense_forward_flops_per_token, self.tokens)

    def costs(self, cost: BatchCost) -> bool:
        """Whether a batch of ``cost`` belongs to this segment (same cost per token)."""
        return (
            self.forward_flops_per_token,
            self.dense_forward_flops_per_token,
            self.sparsity,
        ) == (cost.forward_flops_per_token, cost.dense_forward_flops_per_token, cost.sparsity)


COUNTERS = ("tokens", "train_flops", "dense_train_flops", "dense_grad_flops", "dense_grad_steps")
"""The running totals of a `FlopLedger`: ``train_flops`` is ``3 x`` forward (without the dense
weight gradients, which are ``dense_grad_flops``), ``dense_train_flops`` the dense model's."""


class FlopLedger:
    """What a run spent: every training batch charged at the cost its masks had.

    Keeps running totals (`COUNTERS`) and the segments of equal cost; both are updated by the
    one method `charge`, so they agree (a ledger loaded from an earlier version's totals has
    totals only).

    Args:
        run: the run's index in a chain of runs (segments carry it).
    """

    def __init__(self, run: int = 0) -> None:
        self.run = run
        self.segments: list[FlopSegment] = []
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def charge(self, step: int, tokens: int, cost: BatchCost, dense_grad_tokens: int = 0) -> None:
        """Charge one training batch.

        Args:
            step: ``global_step`` when the batch started.
            tokens: tokens trained on (all ranks).
            cost: the cost per token with the masks the batch trained with.
            dense_grad_tokens: tokens of the optimizer step this batch ends (its micro-batches,
                all ranks) when that step's mask update read dense weight gradients, else 0.
        """
        extra = cost.dense_grad_flops_per_token * dense_grad_tokens
        c = self.counters
        c["tokens"] += tokens
        c["train_flops"] += training_flops(cost.forward_flops_per_token, tokens)
        c["dense_train_flops"] += training_flops(cost.dense_forward_flops_per_token, tokens)
        c["dense_grad_flops"] += extra
        c["dense_grad_steps"] += 1 if dense_grad_tokens else 0
        last = self.segments[-1] if self.segments else None
        if last is not None and last.run == self.run and last.costs(cost):
            last.last_step, last.batches = step, last.batches + 1
            last.tokens += tokens
        else:
            last = FlopSegment(
                self.run, step, step, 1, tokens, cost.forward_flops_per_token,
                cost.dense_forward_flops_per_token, cost.sparsity,
            )  # fmt: skip
            self.segments.append(last)
        last.dense_grad_flops += extra

    @property
    def train_flops(self) -> int:
        """Training FLOPs spent so far, dense weight gradients included."""
        return self.counters["train_flops"] + self.counters["dense_grad_flops"]

    def totals(self, earlier: Iterable[FlopSegment] = ()) -> dict[str, float]:
        """``flops`` (spent, dense gradients included), ``dense_flops``, ``saved`` (fraction),
        ``tokens``, ``dense_grad_flops``, ``dense_grad_steps`` and ``effective_sparsity``
        (token-weighted segment sparsity), over ``earlier`` segments (previous runs) and this
        run."""
        earlier = list(earlier)
        flops = self.train_flops + sum(s.flops for s in earlier)
        dense = self.counters["dense_train_flops"] + sum(s.dense_flops for s in earlier)
        tokens = self.counters["tokens"] + sum(s.tokens for s in earlier)
        segments = earlier + self.segments
        weighted = sum(s.sparsity * s.tokens for s in segments)
        counted = sum(s.tokens for s in segments)
        return {
            "flops": flops,
            "dense_flops": dense,
            "saved": 1.0 - flops / dense if dense else 0.0,
            "tokens": tokens,
            "dense_grad_flops": self.counters["dense_grad_flops"]
            + sum(s.dense_grad_flops for s in earlier),
            "dense_grad_steps": self.counters["dense_grad_steps"],
            "effective_sparsity": weighted / counted if counted else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        """Segments and totals (a resumed run continues them)."""
        return {"segments": [asdict(s) for s in self.segments], "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output; totals alone (an earlier summary's ``counters``) or
        segments alone (an earlier `FlopCounter`'s) load too."""
        self.segments = [FlopSegment(**s) for s in state.get("segments", [])]
        counters = state.get("counters")
        if counters is None:  # segments only: the totals are their sums
            counters = {
                "tokens": sum(s.tokens for s in self.segments),
                "train_flops": sum(
                    training_flops(s.forward_flops_per_token, s.tokens) for s in self.segments
                ),
                "dense_train_flops": sum(s.dense_flops for s in self.segments),
                "dense_grad_flops": sum(s.dense_grad_flops for s in self.segments),
            }
        self.counters = {**dict.fromkeys(COUNTERS, 0), **{k: int(v) for k, v in counters.items()}}

"""`FlopMeter`: charges every training batch to a `FlopLedger`, from Lightning's hooks.

The one place the Lightning layer measures FLOPs; `SparseRunSummary` and `FlopCounter` each own a
meter and read its ledger, so they agree by construction. What a batch costs comes from
`lightning_sparse.core.flops.model_flops` with the masks the batch trained with, measured after
its backward (``on_after_backward``): a densify at batch start (SPDF), a mask update before the
optimizer step (GMP, iterative pruning) and Conv2d output sizes recorded by the forward are all
in place by then, whatever the order of the callbacks. The cost is recomputed only when the set of
masks, the sequence length or the recorded sizes change, or an algorithm reports a mask update,
so a step costs no host sync. An optimizer step whose mask update read the dense weight gradient
(RigL, GraNet) is charged `FlopReport.dense_grad_flops_per_token` more per token of that step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_sparse.core.algorithms import SparsityAlgorithm, algorithms_of
from lightning_sparse.core.flop_account import BatchCost, FlopLedger
from lightning_sparse.core.flops import ConvPositionRecorder, FlopReport, batch_shape, model_flops
from lightning_sparse.core.report import sparsity_report

__all__ = ["FlopMeter", "attention_dims", "lm_flops", "mask_names", "tokens_in_batch"]


class FlopMeter:
    """Measures each training batch's FLOPs and charges them to `ledger`.

    Args:
        owner: the callback's name, for messages.
        seq_len: tokens per sequence, overriding the batch shape's.
        strict: raise on a batch that is neither token windows nor floating examples (else warn
            once and leave such batches out).
    """

    def __init__(self, owner: str, seq_len: int | None = None, strict: bool = False) -> None:
        self.owner, self.seq_len, self.strict = owner, seq_len, strict
        self.ledger = FlopLedger()
        self.ever_masked: dict[str, int] = {}  # parameter name -> numel, for segment sparsity
        self.last_dense_grad_step = -1
        self.report: FlopReport | None = None  # the cost of the masks now
        self.seq_len_seen: int | None = None
        self._cost: BatchCost | None = None
        self._cost_key: tuple[Any, ...] | None = None
        self._conv: ConvPositionRecorder | None = None
        self._hooked: set[int] = set()
        self._batch: tuple[int, int, int] | None = None  # (step, tokens, seq_len) in flight
        self._batch_cost: BatchCost | None = None
        self._step_tokens = 0  # tokens of the optimizer step in progress (micro-batches)
        self._dense_grad = False  # the step in progress reads dense weight gradients
        self._warned = False

    # ------------------------------------------------------------------ hooks
    def setup(self, pl_module: pl.LightningModule) -> None:
        """Record Conv2d output sizes from the forwards (once)."""
        if self._conv is None:
            self._conv = ConvPositionRecorder(pl_module)

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Note the batch's step and tokens (all ranks); listen to new algorithms' updates."""
        for algorithm in algorithms_of(pl_module):  # leaf algorithms, Group members included
            if id(algorithm) not in self._hooked:
                algorithm.register_update_hook(self._on_mask_update)
                self._hooked.add(id(algorithm))
        shape = self.batch_shape(batch)
        if shape is None:
            self._batch = None
            return
        sequences, seq_len = shape
        self._batch = (trainer.global_step, sequences * seq_len * trainer.world_size, seq_len)

    def after_backward(self, pl_module: pl.LightningModule) -> None:
        """This batch's forward and backward ran with the current masks: cost them."""
        if self._batch is None:
            return
        seq_len = self._batch[2]
        positions = len(self._conv.positions) if self._conv is not None else 0
        key = (seq_len, mask_names(pl_module), positions)
        if self._cost is None or key != self._cost_key:
            self._cost, self._cost_key = self.measure(pl_module, seq_len), key
        self._batch_cost = self._cost
        self._step_tokens += self._batch[1]

    def _on_mask_update(self, algorithm: SparsityAlgorithm, step: int, stats: Any) -> None:
        # Inside the optimizer step, after the backward: this step's weight gradients were dense
        # for the masks the batch was costed with. Recount before the next batch.
        self._cost = None
        if getattr(algorithm, "needs_dense_grad", False) and step != self.last_dense_grad_step:
            self._dense_grad, self.last_dense_grad_step = True, step

    def batch_end(self, trainer: pl.Trainer) -> None:
        """Charge the batch; at the end of an optimizer step, with its dense gradients."""
        if self._batch is None or self._batch_cost is None:
            return
        (step, tokens, _), cost = self._batch, self._batch_cost
        self._batch = self._batch_cost = None
        stepped = trainer.global_step != step  # else mid gradient accumulation
        dense_grad_tokens = self._step_tokens if stepped and self._dense_grad else 0
        self.ledger.charge(step, tokens, cost, dense_grad_tokens)
        if stepped:
            self._step_tokens, self._dense_grad = 0, False

    def teardown(self) -> None:
        """Remove the Conv2d recorder's hooks (the sizes recorded stay)."""
        if self._conv is not None:
            self._conv.remove()

    # ------------------------------------------------------------------ measuring
    def flop_report(self, pl_module: nn.Module, seq_len: int) -> FlopReport:
        """`lm_flops` of the masks now, with the Conv2d sizes recorded so far."""
        positions = dict(self._conv.positions) if self._conv is not None else {}
        return lm_flops(pl_module, seq_len, positions)

    def measure(self, pl_module: nn.Module, seq_len: int) -> BatchCost:
        """The cost per token of the masks now, and the sparsity of every parameter that has had
        a mask in this run (densified ones count as dense)."""
        self.report = self.flop_report(pl_module, seq_len)
        self.seq_len_seen = seq_len
        rows = sparsity_report(pl_module, masked_only=True).rows
        for name, row in rows.items():
            self.ever_masked[name] = row["numel"]
        total = sum(self.ever_masked.values())
        kept = sum(
            rows[n]["nonzeros"] if n in rows else numel for n, numel in self.ever_masked.items()
        )
        return BatchCost.of(self.report, 1.0 - kept / total if total else 0.0)

    def batch_shape(self, batch: Any) -> tuple[int, int] | None:
        """(sequences, tokens per sequence) of a batch (`batch_shape`, ``seq_len`` overriding
        the second); for other batches a TypeError (``strict``) or ``None`` and one warning."""
        shape = batch_shape(batch)
        if shape is not None:
            return shape[0], self.seq_len or shape[1]
        expected = _expected(batch)
        if self.strict:
            raise TypeError(f"{self.owner} expects {expected}")
        if not self._warned:
            rank_zero_warn(
                f"{self.owner} counts {expected}: tokens and training FLOPs are not counted "
                "(inference FLOPs still are; set seq_len for them)"
            )
            self._warned = True
        return None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The ledger, the parameters that have had masks, the last dense-gradient step."""
        return {
            **self.ledger.state_dict(),
            "ever_masked": dict(self.ever_masked),
            "last_dense_grad_step": self.last_dense_grad_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output (earlier versions' summary counters or counter segments
        load too); a resumed run continues the totals."""
        self.ledger.load_state_dict(state)
        self.ever_masked = dict(state.get("ever_masked", {}))
        self.last_dense_grad_step = int(state.get("last_dense_grad_step", -1))
        self._cost = None


def tokens_in_batch(batch: Any) -> tuple[int, int]:
    """``(tokens, seq_len)`` of a batch (`lightning_sparse.core.flops.batch_shape`): integer
    token windows ``[B, T + 1]`` give ``(B * T, T)``; floating examples ``[B, ...]`` (images)
    give ``(B, 1)``, one "token" per example; a tuple or list is read through its first tensor.

    Raises:
        TypeError: if the batch is neither.
    """
    shape = batch_shape(batch)
    if shape is None:
        raise TypeError(f"FlopCounter expects {_expected(batch)}")
    sequences, seq_len = shape
    return sequences * seq_len, seq_len


def _expected(batch: Any) -> str:
    """What the FLOP counts read, and what ``batch`` is instead."""
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    shape = f" of shape {tuple(first.shape)}" if torch.is_tensor(first) else ""
    return (
        "integer token windows [B, T + 1] or floating examples [B, ...] (or a tuple whose first "
        f"element is one), got {type(first).__name__}{shape}"
    )


def lm_flops(
    module: nn.Module, seq_len: int, conv_positions: dict[str, int] | None = None
) -> FlopReport:
    """``model_flops`` of ``module`` with attention terms from its ``config`` (`attention_dims`:
    ``LlamaConfig`` or a Hugging Face config; left out when none is found) and Conv2d layers at
    ``conv_positions`` (``{name: H_out * W_out}``, recorded from the forward)."""
    dims = attention_dims(module)
    return model_flops(
        module,
        seq_len,
        n_layers=dims.get("n_layers"),
        d_model=dims.get("d_model"),
        n_heads=dims.get("n_heads"),
        conv_positions=conv_positions,
    )


def mask_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the ``<param>_mask`` buffers of ``model`` (Python only, no host sync)."""
    params = {name for name, _ in model.named_parameters()}
    return tuple(
        name for name, _ in model.named_buffers() if name.endswith("_mask") and name[:-5] in params
    )


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
            ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
            if len(ints) == len(values):
                return dict(zip(("n_layers", "d_model", "n_heads"), ints, strict=True))
    return {}


_CONFIG_NAMES = (
    ("n_layers", "dim", "n_heads"),  # LlamaConfig
    ("num_hidden_layers", "hidden_size", "num_attention_heads"),  # Hugging Face
)

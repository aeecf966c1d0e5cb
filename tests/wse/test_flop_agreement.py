"""One FLOP accountant: the run summary, `FlopCounter` and the device's statistics report the same
training FLOPs for the same run, exactly (``core/flop_account.py`` is the one place they come
from), dense weight gradients of RigL's update steps and gradient accumulation included."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse import FlopCounter, RigL, Static
from lightning_sparse.lightning.summary import SparseRunSummary
from lightning_sparse.wse import WSEAccelerator
from tests.helpers import one_thread, token_loader, trainer  # noqa: F401  (autouse fixture)

VOCAB, HIDDEN = 16, 32


class OneHotMLP(pl.LightningModule):
    """Every FLOP is in its two Linear layers (no embedding, no attention), and the first one's
    input needs a gradient (a learned per-token scale), so the device executes the forward, the
    input gradient and the weight gradient of both: the ``3 x`` forward the accountant charges."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(VOCAB))
        self.fc1 = nn.Linear(VOCAB, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        x = F.one_hot(tokens[:, :-1], VOCAB).float() * self.scale
        logits = self.fc2(torch.relu(self.fc1(x)))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("make", "accumulate", "dense_grad_steps"),
    [
        (lambda: RigL(0.75, update={"freq": 2}), 1, 1),
        (lambda: RigL(0.5, update={"freq": 1}), 2, 3),
        (lambda: Static(0.75), 1, 0),
    ],
    ids=["rigl", "rigl-accumulate", "static"],
)
def test_summary_flop_counter_and_device_agree_exactly(
    tmp_path: Path, make: object, accumulate: int, dense_grad_steps: int
) -> None:
    summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    counter = FlopCounter(verbose=False)
    fit = trainer(
        # The CSR kernels on every layer (``auto`` may time the dense path faster on so small a
        # layer, and the device then executes, and counts, dense FLOPs).
        tmp_path, accelerator=WSEAccelerator(kernel_path="torch"), deterministic=False,
        max_steps=4, limit_val_batches=0, accumulate_grad_batches=accumulate,
        callbacks=[make(), summary, counter],  # type: ignore[operator]
    )  # fmt: skip
    fit.fit(OneHotMLP(), token_loader(batch=4))
    flops, device, totals = summary.summary["flops"], summary.summary["device"], counter.summary()
    tokens = 4 * accumulate * 4 * 8  # steps x micro-batches x sequences x tokens
    assert summary.summary["tokens"] == totals["tokens"] == tokens
    # Sparse training FLOPs: summary == FlopCounter == what the device executed.
    assert flops["train"] == totals["flops"] == device["flops_executed"]
    assert flops["train_dense"] == totals["dense_flops"] == device["flops_dense"]
    assert flops["dense_grad_extra"] == totals["dense_grad_flops"]
    assert flops["dense_grad_steps"] == totals["dense_grad_steps"] == device["dense_grad_steps"]
    # And the hand count: 2 * kept per token, 3 x for training, dense weight gradients on updates.
    kept = sum(int(m.sum()) for m in (fit.lightning_module.fc1.weight_mask,
                                      fit.lightning_module.fc2.weight_mask))  # fmt: skip
    numel = 2 * VOCAB * HIDDEN
    per_step = tokens // 4  # RigL updates at steps 1, 2, 3 (freq 1) or 2 (freq 2), not at 0
    assert flops["dense_grad_steps"] == dense_grad_steps
    extra = 2 * (numel - kept) * per_step * dense_grad_steps
    assert flops["train"] == 3 * 2 * kept * tokens + extra
    assert flops["train_dense"] == 3 * 2 * numel * tokens

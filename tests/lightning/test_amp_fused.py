"""One set of masks whatever the optimizer: fused steps under a ``GradScaler``.

A ``GradScaler`` skips ``optimizer.step()`` on an overflow, except for an optimizer that
unscales in its own kernel (``fused=True``): that one's ``step()`` runs, with the scaler's
``found_inf`` set, and its kernel skips itself. The step must not count, and a mask update due
at it must wait for the next step, as with a non-fused optimizer (`core.scaler_steps`). Here an
overflow is injected at a kept position on an update step, and the fused and non-fused runs
must hold the same masks and the same step count after every batch, in a plain loop and in
Lightning (fp16 + GradScaler on the CPU: ``MixedPrecision("16-mixed", "cpu")``).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_sparse import RigL
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.lightning.test_amp import TinyModule, first_index, inject_inf, loader, mlp

BATCHES = 6
INJECT = 2  # step 2 is an update step (freq 2): the overflow lands on it


def rigl() -> RigL:
    return RigL(0.5, update={"freq": 2}, drop_fraction=0.5, seed=0)


def kept_index(model: nn.Module) -> tuple[int, ...]:
    twin = rigl()
    model.apply(twin)
    index = first_index(twin.sparse_params["0.weight"].mask, True)
    twin.remove()
    return index


Record = tuple[int, dict[str, torch.Tensor]]


def plain_loop(fused: bool) -> list[Record]:
    """fp16 autocast + GradScaler + Adam, an inf gradient at a kept position in batch INJECT."""
    model = mlp()
    index = kept_index(mlp())
    sparsity = rigl()
    model.apply(sparsity)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    sparsity.apply(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    records: list[Record] = []
    for t in range(BATCHES):
        optimizer.zero_grad()
        handle = inject_inf(model[0].weight, index) if t == INJECT else None
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(t))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        scaler.step(optimizer)
        scaler.update()
        masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
        records.append((sparsity.step, masks))
    return records


def assert_same_runs(fused: list[Record], plain: list[Record]) -> None:
    assert [r[0] for r in fused] == [r[0] for r in plain]
    for batch, ((_, a), (_, b)) in enumerate(zip(fused, plain, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"batch {batch}: {name}"


def assert_update_retried(records: list[Record]) -> None:
    """The overflowed batch neither counts nor updates; the next batch runs the update."""
    steps = [r[0] for r in records]
    assert steps == [1, 2, 2, 3, 4, 5], steps
    masks = [r[1] for r in records]
    same = [all(torch.equal(masks[i][n], masks[i - 1][n]) for n in masks[i]) for i in (2, 3)]
    assert same == [True, False], "the update ran on the overflow, or was not retried"


def test_plain_loop_fused_adam_gives_the_masks_of_adam() -> None:
    plain, fused = plain_loop(fused=False), plain_loop(fused=True)
    assert_update_retried(plain)
    assert_same_runs(fused, plain)


class FusedChoice(TinyModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1, fused=self.fused)


def lightning_run(fused: bool) -> list[Record]:
    module = FusedChoice(fused)
    twin = rigl()
    copy.deepcopy(module.net).apply(twin)
    index = first_index(twin.sparse_params["0.weight"].mask, True)
    module.inject = (INJECT, index)
    module.sparsity = sparsity = rigl()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=BATCHES,
        callbacks=[sparsity],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader())
    return [(step, masks) for step, masks, _ in module.records]


def test_lightning_fused_adamw_gives_the_masks_of_adamw() -> None:
    plain, fused = lightning_run(fused=False), lightning_run(fused=True)
    assert_update_retried(plain)
    assert_same_runs(fused, plain)

"""Fit a tiny float64 regressor with RigL and with SET under Lightning; save what each rank saw.

Run as ``python tests/scripts/lightning_ddp.py OUTDIR``: Lightning's ``"ddp"`` launcher
re-executes this file for rank 1, so it must be a standalone script, not a pytest function. Each
rank writes ``OUTDIR/rank{r}.pt`` = ``{kind: fit(...)}``; ``tests/test_distributed.py`` compares
them with ``fit(kind, devices=1)`` run in a single process.

Data order: the sampler Lightning injects for training data always shuffles (Lightning 2.6
passes ``shuffle=True`` for the training stage whatever the DataLoader says), so
``train_dataloader`` builds its own ``DistributedSampler(shuffle=False)``, which Lightning keeps.
It gives rank ``r`` the indices ``r, r + 2, ...``, so the two per-rank batches of step ``s``
together hold samples ``16 s .. 16 s + 15``: exactly the single-process batch ``s`` of a
sequential loader with ``batch_size=16``. The loss is a mean and DDP averages gradients, so both
see the same gradient up to float64 rounding.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_sparse import SET, RigL
from tests.helpers import broadcast_bytes

WORLD = 2
GLOBAL_BATCH = 16
# Updates at steps 2, 4 and 6: the last one runs inside the 7th (last) optimizer step. DDP does not
# broadcast the masks (`core.ddp_ignore`), so a rank-1 mask that diverged would show at any step;
# were they broadcast again, a rank-1 mask diverged at the last update would still show.
STEPS = 7
KINDS = ("rigl", "set")


def make_algorithm(kind: str) -> SET:
    """The algorithm under test; RigL is a subclass of SET."""
    cls = {"rigl": RigL, "set": SET}[kind]
    return cls(sparsity=0.75, update={"freq": 2}, drop_fraction=0.3, seed=11)


class Regressor(pl.LightningModule):
    """Three Linear layers (all sparsified by the default filter), float64, mean-squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
        ).double()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        if world == 1:
            return DataLoader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
        sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(dataset(), batch_size=GLOBAL_BATCH // world, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class BroadcastCounter(pl.Callback):
    """The bytes DDP broadcast from training start to teardown (`tests.helpers.broadcast_bytes`:
    its buffers, before each forward) and the names it ignores (None without DDP)."""

    def __init__(self) -> None:
        self.ignored: list[str] | None = None
        self._counting = ExitStack()
        self._sent = [0]

    @property
    def sent(self) -> int:
        """Bytes counted so far."""
        return self._sent[0]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ignored = getattr(trainer.strategy.model, "parameters_to_ignore", None)
        self.ignored = sorted(ignored) if ignored is not None else None
        self._sent = self._counting.enter_context(broadcast_bytes())

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._counting.close()  # also after an exception: torch.distributed is restored


def dataset() -> TensorDataset:
    """STEPS * GLOBAL_BATCH deterministic samples."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g, dtype=torch.float64)
    y = torch.sin(x @ torch.randn(8, 4, generator=g, dtype=torch.float64))
    return TensorDataset(x, y)


def _masks(algorithm: SET) -> dict[str, torch.Tensor]:
    return {name: sp.mask.clone() for name, sp in algorithm.sparse_params.items()}


def train(kind: str, **trainer_kwargs: Any) -> tuple[dict[str, Any], pl.Trainer, SET, Regressor]:
    """Fit a fresh ``Regressor`` with ``make_algorithm(kind)`` for STEPS steps on a quiet Trainer
    (``trainer_kwargs`` pick the accelerator, devices and strategy).

    Returns the record every script saves (rank, world size, algorithm step, masks after every
    update, final masks and weights, the bytes DDP broadcast per step and the names it ignores)
    and the trainer, algorithm and module for further entries.
    """
    algorithm = make_algorithm(kind)
    history: dict[int, dict[str, torch.Tensor]] = {}
    algorithm.register_update_hook(lambda a, step, stats: history.__setitem__(step, _masks(a)))
    module = Regressor()
    counter = BroadcastCounter()
    trainer = pl.Trainer(
        **trainer_kwargs,
        max_steps=STEPS,
        callbacks=[algorithm, counter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "step": algorithm.step,
        "history": history,
        "masks": _masks(algorithm),
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "broadcast_per_step": counter.sent / STEPS,  # one forward per step
        "ddp_ignored": counter.ignored,
    }
    return record, trainer, algorithm, module


def fit(kind: str, devices: int) -> dict[str, Any]:
    """Fit for STEPS steps; return masks after every update, final masks and weights, counters."""
    # gloo named, not left to Lightning to choose (the CPU, on a GPU machine too).
    strategy = DDPStrategy(process_group_backend="gloo") if devices > 1 else "auto"
    record, trainer, algorithm, _ = train(
        kind, accelerator="cpu", devices=devices, strategy=strategy
    )
    record["global_step"] = trainer.global_step
    record["ever_active"] = {name: m.clone() for name, m in algorithm.ever_active.items()}
    return record


def main(outdir: Path, fit_kind: Callable[[str], dict[str, Any]] | None = None) -> None:
    """Save ``{kind: fit_kind(kind)}`` to ``OUTDIR/rank{r}.pt`` (default: ``fit`` on WORLD
    processes), then wait for every rank."""
    if fit_kind is None:
        fit_kind = partial(fit, devices=WORLD)
    results = {kind: fit_kind(kind) for kind in KINDS}
    rank = results[KINDS[0]]["rank"]
    torch.save(results, outdir / f"rank{rank}.pt")
    # Rank 0's exit ends the test's wait: make sure rank 1 has written its file by then.
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Tear the gloo group down before interpreter exit: left running, its threads can abort the
    # process at shutdown ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""``strategy="ddp_spawn"``: the callback crosses into the spawned workers (it pickles), and
there, as under ``"ddp"`` (``tests/lightning/test_distributed.py``), DDP ignores the masks in its
buffer broadcast and every rank holds the same masks.

The checks run inside the workers (`RankCheck`): a failed one fails the worker, and Lightning's
launcher raises it in this process.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SET, GraNet, Group, RigL, Static
from lightning_sparse.core.algorithms.registry import available_algorithms
from tests.helpers import gpus_hidden_from_workers

STEPS = 5


def test_every_algorithm_and_a_group_pickle_before_apply() -> None:
    """``ddp_spawn`` pickles the Trainer's callbacks before their ``setup`` runs."""
    package = {  # the package's own (tests register local classes too)
        name: cls
        for name, cls in available_algorithms().items()
        if cls.__module__.startswith("lightning_sparse")
    }
    assert {"static", "set", "rigl", "granet"} <= set(package)
    cubic = {"type": "cubic", "init": 0.0, "final": 0.5, "begin": 0, "end": 4}
    made = [
        cls(cubic, update={"freq": 2}) if name == "gmp" else cls(0.5)
        for name, cls in package.items()
    ]
    made += [RigL(0.5), Group({"0.weight": RigL(0.5), "*": Static(0.5)})]
    for algorithm in made:
        copy = pickle.loads(pickle.dumps(algorithm))
        assert type(copy) is type(algorithm) and copy.step == 0


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> object:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
        return DataLoader(data, batch_size=8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class RankCheck(pl.Callback):
    """In each worker, after training: DDP ignores every mask and ever-active buffer, and the
    masks' digest is the same on every rank; each rank then writes its digest to ``outdir``."""

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.global_step == STEPS, trainer.global_step
        sparse = sorted(
            name
            for name, _ in pl_module.named_buffers()
            if name.endswith(("_mask", "_ever_active"))
        )
        assert sparse, "no mask on this rank"
        ignored = set(getattr(trainer.strategy.model, "parameters_to_ignore", ()))
        assert set(sparse) <= ignored, sorted(set(sparse) - ignored)
        digest = hashlib.sha256()
        for name, buffer in sorted(pl_module.named_buffers()):
            if name.endswith("_mask"):
                digest.update(name.encode() + buffer.cpu().numpy().tobytes())
        digests: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest.hexdigest())
        assert len(set(digests)) == 1, f"rank {dist.get_rank()}: masks differ {digests}"
        (self.outdir / f"rank{dist.get_rank()}.txt").write_text(digest.hexdigest())


@pytest.mark.parametrize(
    "make",
    [
        lambda: RigL(0.5, update={"freq": 2}, seed=3),
        lambda: GraNet(
            {"type": "cubic", "init": 0.2, "final": 0.6, "begin": 0, "end": 4},
            update={"freq": 2},
            seed=3,
        ),
        lambda: SET(0.5, update={"freq": 2}, seed=3),
    ],
    ids=["rigl", "granet", "set"],
)
def test_ddp_spawn_ignores_the_masks_and_every_rank_holds_the_same(
    make: object, tmp_path: Path
) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(start_method="spawn", process_group_backend="gloo"),  # ddp_spawn
        max_steps=STEPS,
        callbacks=[make(), RankCheck(tmp_path)],  # type: ignore[operator]
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with gpus_hidden_from_workers():
        trainer.fit(Regressor())
    digests = {path.name: path.read_text() for path in tmp_path.glob("rank*.txt")}
    assert sorted(digests) == ["rank0.txt", "rank1.txt"] and len(set(digests.values())) == 1

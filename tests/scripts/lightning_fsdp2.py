"""Lightning ModelParallelStrategy (FSDP2 via configure_model) on 2 CPU processes with RigL.

Usage: python lightning_fsdp2.py OUTDIR  — each rank writes OUTDIR/rank{r}.pt with the gathered
state dict, whether the masks are sharded, and the callback's step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import RigL

STEPS = int(os.environ.get("STEPS", "4"))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).double()


def data() -> TensorDataset:
    """Every sample the same: how Lightning splits a global batch over ranks cannot matter."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 12, generator=g, dtype=torch.float64)
    y = torch.randn(1, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x.repeat(64, 1), y.repeat(64, 1))


class Module(pl.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.net = model()
        self.shard = shard

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run(out: Path, distributed: bool) -> None:
    torch.set_num_threads(1)
    callback = RigL(
        sparsity=float(os.environ.get("SPARSITY", "0.75")),
        update={"freq": 2},
        drop_fraction=0.5,
        param_filter="*weight",
    )
    module = Module(shard=distributed)
    kwargs = dict(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    if distributed:
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
        )
        trainer = pl.Trainer(devices=2, strategy=strategy, **kwargs)
        loader = DataLoader(data(), batch_size=4)  # Lightning adds a DistributedSampler
    else:
        trainer = pl.Trainer(devices=1, **kwargs)
        loader = DataLoader(data(), batch_size=8)
    trainer.fit(module, loader)
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for k, v in module.state_dict().items()
    }
    for name, sp in callback.sparse_params.items():  # the masks (non-persistent buffers)
        mask = sp.mask.full_tensor() if hasattr(sp.mask, "full_tensor") else sp.mask
        state[f"{name}_mask"] = mask.clone()
    sharded = {n: type(sp.mask).__name__ for n, sp in callback.sparse_params.items()}
    torch.save(
        {"state": state, "sharded": sharded, "step": callback.step},
        out / f"rank{trainer.global_rank}.pt" if distributed else out / "single.pt",
    )


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    run(out_dir, distributed=sys.argv[2] == "fsdp2")
    # Tear the gloo group down before interpreter exit: left running, its threads can abort the
    # process at shutdown ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

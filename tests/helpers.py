"""Small models and LightningModules shared by the tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyNet(nn.Module):
    """Embedding -> two Linear layers -> norm -> head; the head and embedding stay dense."""

    def __init__(self, vocab: int = 16, dim: int = 24, hidden: int = 40) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.lm_head(self.norm(h))


class TinyLM(pl.LightningModule):
    """Next-token prediction on random tokens with a ``TinyNet``."""

    def __init__(self, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = TinyNet()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


def token_loader(n: int = 64, seq: int = 9, batch: int = 8, seed: int = 0) -> DataLoader:
    """Deterministic data: the same batches in the same order on every call."""
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, 16, (n, seq), generator=g)), batch_size=batch)


def repeated_batch_loader(n_batches: int = 64, seq: int = 9, batch: int = 8) -> DataLoader:
    """Every batch is the same: a resumed run sees the same data whatever Lightning's data-resume
    semantics (a plain DataLoader restarts its epoch on resume), so resume tests isolate the
    model, optimizer and sparsity state."""
    g = torch.Generator().manual_seed(0)
    one = torch.randint(0, 16, (batch, seq), generator=g)
    return DataLoader(TensorDataset(one.repeat(n_batches, 1)), batch_size=batch)


def trainer(tmp_path: object = None, **kwargs: object) -> pl.Trainer:
    """A quiet CPU trainer."""
    defaults: dict = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    if tmp_path is not None:
        defaults["default_root_dir"] = str(tmp_path)
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def assert_state_equal(a: object, b: object, path: str = "state") -> None:
    """Recursive exact equality of nested dicts / lists / tensors / scalars."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {a.keys()} != {b}"
        for key in a:
            assert_state_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and torch.equal(a, b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"

"""The run summary costs a convnet's Conv2d layers at their recorded output size
(``2 * kept * H_out * W_out`` per example), so a sparse convnet no longer reports 1.0x."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import Static
from lightning_sparse.lightning.summary import SparseRunSummary
from tests.helpers import one_thread, trainer  # noqa: F401  (one_thread: autouse fixture)


class TinyConvNet(pl.LightningModule):
    """Conv2d 1 -> 4, 3x3 (36 weights) on 6x6 images, padding 1 (36 output pixels); a
    Linear 144 -> 3 classifier (432 weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.fc = nn.Linear(144, 3, bias=False)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.fc(self.conv(x).flatten(1)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_summary_counts_conv2d_at_its_output_size(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(8, 1, 6, 6), torch.randint(0, 3, (8,)))
    summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    sparsity = Static(0.75, param_filter="conv.weight")
    trainer(tmp_path, max_steps=2, callbacks=[sparsity, summary]).fit(
        TinyConvNet(), DataLoader(data, batch_size=4)
    )
    flops = summary.summary["flops"]
    assert flops["inference_per_token_dense"] == 2 * 36 * 36 + 2 * 432
    assert flops["inference_per_token"] == 2 * 9 * 36 + 2 * 432


def test_summary_and_flop_counter_count_conv2d_training_flops_per_example(tmp_path: Path) -> None:
    """Image batches count one "token" per example; both callbacks agree on the FLOPs."""
    from lightning_sparse import FlopCounter

    data = TensorDataset(torch.randn(8, 1, 6, 6), torch.randint(0, 3, (8,)))
    summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    counter = FlopCounter(verbose=False)
    sparsity = Static(0.75, param_filter="conv.weight")
    trainer(tmp_path, max_steps=2, callbacks=[sparsity, summary, counter]).fit(
        TinyConvNet(), DataLoader(data, batch_size=4)
    )
    sparse, dense = 2 * 9 * 36 + 2 * 432, 2 * 36 * 36 + 2 * 432  # per example
    totals = counter.summary()
    assert totals["tokens"] == 8
    assert totals["flops"] == 3 * sparse * 8
    assert totals["dense_flops"] == 3 * dense * 8
    assert [s.forward_flops_per_token for s in counter.segments] == [sparse]
    flops = summary.summary["flops"]
    assert summary.summary["tokens"] == 8
    assert flops["train"] == totals["flops"] and flops["train_dense"] == totals["dense_flops"]

"""On a CUDA GPU the command sets TF32 matmuls; on the CPU (even beside a GPU) it sets nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lightning.fabric.accelerators.cuda as fabric_cuda
import lightning.pytorch.accelerators.cuda as pytorch_cuda
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

from lightning_sparse.app import fit
from lightning_sparse.app.tensor_cores import use_tensor_cores
from lightning_sparse.wse import WSEAccelerator

REPO = Path(__file__).resolve().parents[2]
TINY = [
    *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
    *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
    *("--trainer.logger", "false"),
]


@pytest.fixture(autouse=True)
def _precision() -> Iterator[None]:
    """Every test starts at torch's default and leaves the process as it found it."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning counts one CUDA device (as on the H200 of issue 26); torch is untouched."""
    for module in (fabric_cuda, pytorch_cuda):
        monkeypatch.setattr(module, "num_cuda_devices", lambda: 1)


def test_cuda_accelerator_gets_tf32_and_others_nothing() -> None:
    assert not use_tensor_cores(CPUAccelerator())
    assert not use_tensor_cores(WSEAccelerator())
    assert torch.get_float32_matmul_precision() == "highest"
    assert use_tensor_cores(CUDAAccelerator())
    assert torch.get_float32_matmul_precision() == "high"


def test_a_precision_the_user_chose_stands() -> None:
    torch.set_float32_matmul_precision("medium")
    assert not use_tensor_cores(CUDAAccelerator())
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize(("accelerator", "expected"), [("auto", "high"), ("cpu", "highest")])
def test_the_cli_sets_it_only_where_the_run_uses_the_gpu(
    one_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accelerator: str, expected: str
) -> None:
    """The default recipe (``accelerator: auto``) on a machine with a GPU: TF32; the same recipe
    pinned to the CPU there: torch's default precision is left alone."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(fit.DEFAULT_RECIPE), *TINY, "--trainer.accelerator", accelerator]
    cli = fit.SparseCLI(args=args, run=False)
    expected_class = CUDAAccelerator if accelerator == "auto" else CPUAccelerator
    assert isinstance(cli.trainer.accelerator, expected_class)
    assert torch.get_float32_matmul_precision() == expected

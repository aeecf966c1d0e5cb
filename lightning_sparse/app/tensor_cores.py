"""TF32 matmuls for a run on a CUDA GPU (`use_tensor_cores`).

Lightning, on a CUDA device with tensor cores, tells the user to call
``torch.set_float32_matmul_precision('medium' | 'high')`` and leaves float32 matmuls in full
precision. The `lightning-sparse` command makes that choice for its runs: on the CUDA accelerator
it sets ``"high"`` (TF32 matmuls, float32 accumulation; the default recipe trains in float32),
unless the user already chose a precision. A run on the CPU (or the emulated ``wse`` device)
changes nothing, even on a machine that has a GPU. Only the CLI does this; importing the package
changes nothing.
"""

from __future__ import annotations

import torch
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["use_tensor_cores"]

PRECISION = "high"


def use_tensor_cores(accelerator: Accelerator) -> bool:
    """Set float32 matmul precision to ``"high"`` when ``accelerator`` is Lightning's CUDA
    accelerator and the precision is still torch's default (``"highest"``).

    Args:
        accelerator: the run's ``trainer.accelerator``.

    Returns:
        Whether the precision was changed.
    """
    if not isinstance(accelerator, CUDAAccelerator):
        return False
    if torch.get_float32_matmul_precision() != "highest":  # the user's choice stands
        return False
    torch.set_float32_matmul_precision(PRECISION)
    rank_zero_info(
        f"lightning-sparse: float32 matmuls use TF32 on the GPU "
        f"(torch.set_float32_matmul_precision({PRECISION!r}))"
    )
    return True

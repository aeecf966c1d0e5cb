"""The sparse linear layer of the emulated wafer-scale device: `sparse_linear`, the public entry.

`sparse_linear(x, weight, mask_or_csr, bias)` equals masked dense training,
`F.linear(x, weight * mask, bias)`, in value and in gradients (`grad_weight` is dense with zeros at
pruned positions, so optimizers see exactly what masked dense training gives them), while only
kept weights cost FLOPs. The work is split by job:

- `native.py`: the C++/OpenMP kernels (`csrc/wse_kernels.cpp`), built with the system compiler
  and loaded with ctypes;
- `ops.py`: the autograd ops on each path ("compiled", "torch", "dense") and the inference
  runner;
- `policy.py`: which path runs, a pure function of shape, density, machine and measured times,
  with every tuned constant in one table (`policy.TUNED`) naming its benchmark;
- `autotune.py`: "auto", which measures the candidates once per key and caches the choice.

Force a path with the `path=` argument or the `LIGHTNING_SPARSE_WSE_PATH` environment variable
("auto", "compiled", "torch", "dense"); `LIGHTNING_SPARSE_WSE_COMPILE=0` (read once per process)
never builds the native library. `resolve_path` reports which path a call takes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse.wse.autotune import (
    PATH_ENV,
    autotune_choices,
    clear_autotune_cache,
    resolve_path,
)
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.native import compiled_available
from lightning_sparse.wse.ops import inference_runner, run_path
from lightning_sparse.wse.policy import PATHS

__all__ = [
    "PATHS",
    "PATH_ENV",
    "autotune_choices",
    "clear_autotune_cache",
    "compiled_available",
    "inference_runner",
    "resolve_path",
    "sparse_linear",
]


def sparse_linear(
    x: Tensor,
    weight: Tensor,
    mask_or_csr: Tensor | CSRWeight,
    bias: Tensor | None = None,
    *,
    path: str | None = None,
) -> Tensor:
    """Masked linear layer `F.linear(x, weight * mask, bias)` executed in CSR.

    Args:
        x: input `[..., in]`.
        weight: dense weight `[out, in]` (the live parameter; values are gathered each call).
        mask_or_csr: bool mask `[out, in]` (True = kept; converted on every call) or a prebuilt
            `CSRWeight` (reuse it until the mask changes).
        bias: optional `[out]`.
        path: "compiled", "torch", "dense" or "auto"; None follows `LIGHTNING_SPARSE_WSE_PATH`.

    Returns:
        `[..., out]`. Gradients w.r.t. `x`, `weight` (dense, zero where pruned) and `bias` equal
        those of masked dense training.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or an unusable forced path.
    """
    csr = (
        mask_or_csr
        if isinstance(mask_or_csr, CSRWeight)
        else CSRWeight.from_dense(weight, mask_or_csr)
    )
    check_inputs(x, weight, csr, bias)
    requires_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    chosen = resolve_path(x, weight, csr, path, requires_grad)
    return run_path(chosen, x, weight, csr, bias)


def check_inputs(x: Tensor, weight: Tensor, csr: CSRWeight, bias: Tensor | None) -> None:
    """Raise a ValueError naming the mismatch unless the operands fit together."""
    if tuple(weight.shape) != csr.shape:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} != CSRWeight shape {csr.shape}; rebuild the "
            "CSRWeight with CSRWeight.from_dense(weight, mask)"
        )
    if x.dim() == 0 or x.shape[-1] != csr.shape[1]:
        raise ValueError(f"x must be [..., {csr.shape[1]}], got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        bias_dtype = None if bias is None else bias.dtype
        raise ValueError(
            f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, {bias_dtype}"
        )
    if not x.device == weight.device == csr.device:
        raise ValueError(
            f"x, weight and CSRWeight must share a device, got {x.device}, {weight.device}, "
            f"{csr.device}"
        )
    if bias is not None and tuple(bias.shape) != (csr.shape[0],):
        raise ValueError(f"bias must be [{csr.shape[0]}], got shape {tuple(bias.shape)}")

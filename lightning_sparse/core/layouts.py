"""Weight layouts: which dimension of a weight is the input one.

``nn.Linear`` stores ``[out, in]`` (``y = x @ W.T + b``) and convolutions ``[out, in, *k]``.
Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT-2-derived models) stores
``[in, out]`` (``y = x @ W + b``; see its docstring: "Basically works like a linear layer but the
weights are transposed"). Code that reasons about input and output dimensions (FLOPs, N:M and
group shapers, CSR kernels) uses :func:`is_in_out` to see a Conv1D weight as the transpose of a
Linear one. Detected by class name and module, so transformers is never imported here.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["as_out_in", "is_hf_conv1d", "is_in_out"]


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (not ``nn.Conv1d``)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def is_in_out(module: nn.Module, param_name: str) -> bool:
    """Whether ``module.<param_name>`` is a 2-D weight stored ``[in, out]`` (HF ``Conv1D``)."""
    return param_name == "weight" and is_hf_conv1d(module)


def as_out_in(p: torch.Tensor) -> torch.Tensor:
    """A detached ``[out, in]`` view of an ``[in, out]`` weight, its ``.grad`` transposed too."""
    view = p.detach().t()
    view.grad = p.grad.t() if p.grad is not None else None
    return view

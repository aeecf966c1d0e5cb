"""The weight and bias of a layer the device runs (an `nn.Linear` or a Hugging Face ``Conv1D``).

``nn.Module`` types attribute access as ``Tensor | Module``; these read the two tensors typed,
and raise where a module holds something else there (a layer the device cannot run)."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["bias_of", "weight_of"]


def weight_of(module: nn.Module) -> Tensor:
    """``module.weight`` (``[out, in]``; ``[in, out]`` for a ``Conv1D``)."""
    weight = module.weight
    if not isinstance(weight, Tensor):
        raise TypeError(
            f"{type(module).__name__}.weight is a {type(weight).__name__}, not a tensor"
        )
    return weight


def bias_of(module: nn.Module) -> Tensor | None:
    """``module.bias`` (``[out]``), or None for a layer without one."""
    bias = module.bias
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"{type(module).__name__}.bias is a {type(bias).__name__}, not a tensor")
    return bias

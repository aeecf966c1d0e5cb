"""Sparse <-> dense conversions: `densify` (SPDF's switch to dense) and Cerebras 1.x checkpoints.

Sparse Pre-training and Dense Fine-tuning (Thangarasa et al. 2023, "SPDF", arXiv:2303.10464) and
Variable SPDF train sparse, then continue dense from the sparse weights: ``densify`` removes the
masks and every hook so the zeros are free to grow. Cerebras 1.x ("sideband") checkpoints store
pruned weights as NaN; ``convert_nan_checkpoint`` turns them into zeros plus ``<param>_mask``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .algorithms import algorithms_of

__all__ = ["convert_nan_checkpoint", "densify"]


def densify(model: nn.Module) -> int:
    """Remove every sparsity algorithm's masks and hooks from ``model``; weights are kept as is.

    Training continues dense: gradients are no longer masked and the optimizer updates every
    weight. The model's ``state_dict`` no longer has ``*_mask`` keys.

    Returns:
        Number of parameters that were sparse.
    """
    algorithms = algorithms_of(model)
    count = 0
    for algorithm in algorithms:
        count += len(algorithm.sparse_params)
        algorithm.remove()
    return count


def convert_nan_checkpoint(
    state_dict: Mapping[str, Any], optimizer_state: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Cerebras 1.x NaN-sentinel weights -> zeros plus a ``<name>_mask`` bool buffer per tensor.

    Args:
        state_dict: model state dict where pruned weights are NaN.
        optimizer_state: optional ``optimizer.state_dict()``; NaNs in its tensors become 0 in place.

    Returns:
        A new model state dict: every floating tensor with a NaN gets its NaNs replaced by 0 and
        a ``<name>_mask`` entry (True = kept) next to it; other entries are copied unchanged.
    """
    converted: dict[str, Any] = {}
    for key, value in state_dict.items():
        if torch.is_tensor(value) and value.is_floating_point() and bool(value.isnan().any()):
            mask = ~value.isnan()
            converted[key] = torch.where(mask, value, torch.zeros((), dtype=value.dtype))
            converted[f"{key}_mask"] = mask
        else:
            converted[key] = value
    if optimizer_state is not None:
        _zero_nans_(optimizer_state)
    return converted


def _zero_nans_(obj: Any) -> None:
    if isinstance(obj, Mapping):
        for value in obj.values():
            _zero_nans_(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _zero_nans_(value)
    elif torch.is_tensor(obj) and obj.is_floating_point():
        obj.nan_to_num_(nan=0.0)

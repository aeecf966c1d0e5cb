"""Sparse state dicts in and out: `strip_masks` (mask-free, for a dense model), `restore_masks`.

A sparse model's ``state_dict()`` holds ``<param>_mask`` bool entries next to the parameters
(`SparseParameter`). A model without those buffers refuses them ("Unexpected key(s)"):

- `strip_masks` gives the state dict a dense model of the same architecture loads: no mask
  entries, pruned weights exactly zero; the live model is not touched;
- `restore_masks` registers the mask buffers a fresh model lacks, so the sparse state dict loads
  as it is and the model carries the masks again (for inference, export or the device; an
  algorithm applied later with ``init_method="topk"`` re-chooses masks from the loaded zeros).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .masking import zero_pruned_
from .sparse_parameter import mask_buffer_name

__all__ = ["mask_keys", "restore_masks", "strip_masks"]

_SUFFIX = mask_buffer_name("")  # "_mask"


def mask_keys(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """``{mask key: parameter key}`` for every ``<name>_mask`` entry whose ``<name>`` is present."""
    return {
        key: key[: -len(_SUFFIX)]
        for key in state_dict
        if key.endswith(_SUFFIX) and key[: -len(_SUFFIX)] in state_dict
    }


def _check_mask(key: str, mask: Any, name: str, shape: tuple[int, ...], fix: str) -> torch.Tensor:
    """``mask`` as bool, or a ``ValueError`` naming ``key`` and both shapes (a wrong shape, not a
    tensor) or the values (a non-bool mask holding anything but 0/1); ``fix`` ends the message."""
    if not torch.is_tensor(mask) or tuple(mask.shape) != tuple(shape):
        got = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(
            f"mask {key!r} has shape {got} but {name!r} has shape {tuple(shape)}; {fix}"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                f"mask {key!r} holds values other than 0/1 (dtype {mask.dtype}); a "
                f"mask is bool or 0/1, True = kept: {fix}"
            )
        mask = mask.to(torch.bool)
    return mask


def strip_masks(source: nn.Module | Mapping[str, Any]) -> dict[str, Any]:
    """A mask-free copy of a sparse state dict: no ``*_mask`` entries, pruned weights zero.

    Args:
        source: a model (its ``state_dict()`` is read) or a state dict.

    Returns:
        A new dict in the source's key order. Masked weights are new tensors (the source's
        values with pruned positions set to +0.0); every other value is the source's own.

    Raises:
        ValueError: a mask's shape differs from its weight's, or it is not 0/1.
    """
    state = source.state_dict() if isinstance(source, nn.Module) else source
    masks = mask_keys(state)
    weights = {param: key for key, param in masks.items()}
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key in masks:
            continue
        if key in weights:
            fix = "the state dict is corrupt or mixes two models"
            mask = _check_mask(weights[key], state[weights[key]], key, value.shape, fix)
            value = zero_pruned_(value.detach().clone(), mask.to(value.device))
        out[key] = value
    return out


def restore_masks(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Register on ``model`` the ``<param>_mask`` buffers ``state_dict`` has and ``model`` lacks.

    Each buffer is registered with the state dict's mask (bool, on the parameter's device), so
    afterwards ``model.load_state_dict(state_dict)`` loads as it is. Masks ``model`` already has
    are left to ``load_state_dict``. Everything is checked before anything is registered.

    Args:
        model: the module the state dict belongs to (a LightningModule for a Lightning
            checkpoint's ``state_dict``).
        state_dict: holds ``<name>`` and ``<name>_mask`` entries.

    Returns:
        The mask keys registered, in state-dict order.

    Raises:
        ValueError: a mask's shape differs from its parameter's (the state dict is from another
            model), or a non-bool mask holds values other than 0/1; nothing was registered.
    """
    params = dict(model.named_parameters())
    todo: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    for key, name in mask_keys(state_dict).items():
        if name not in params:
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if mask_buffer_name(attr) in module._buffers:
            continue
        fix = "load the state dict into the model it was saved from"
        mask = _check_mask(key, state_dict[key], name, params[name].shape, fix)
        todo.append((module, mask_buffer_name(attr), key, mask.to(params[name].device)))
    for module, buffer_name, _, mask in todo:
        module.register_buffer(buffer_name, mask.clone(), persistent=True)
    return [key for _, _, key, _ in todo]

"""Masks in and out of saved state: `checkpoint_masks`, `restore_masks`, `strip_masks`.

A sparse model's ``state_dict()`` holds the weights only (pruned ones exactly 0): the mask
buffers are non-persistent, and the one saved copy of the masks is the algorithm's state
(``sparsity.state_dict()["masks"]``, packed bits; in a Lightning checkpoint under
``checkpoint["sparsity"]``). So a plain model of the same architecture loads any sparse state
dict as it is. Earlier versions saved ``<param>_mask`` entries in the model state dict instead;
everything here reads both layouts.

- `checkpoint_masks`: ``{param name: bool mask}`` from a Lightning checkpoint, a
  ``{"model": ..., "sparsity": ...}`` dict, an algorithm's state or an old state dict;
- `restore_masks`: register those masks on a model that has none (no algorithm), for
  inference, export or the device;
- `strip_masks`: a state dict without ``*_mask`` entries and with pruned weights zero, for a
  dense model.

The earlier layout's entries are read with `legacy` (``mask_entries``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .bitpack import unpack_bits
from .legacy import adopt_mask_entries, mask_keys
from .masking import zero_pruned_
from .sparse_parameter import as_mask, mask_buffer_name

__all__ = ["checkpoint_masks", "model_masks", "restore_masks", "strip_masks"]


def model_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: mask buffer}`` of ``model``: every ``<param>_mask`` buffer next to its
    parameter (an algorithm's, or registered by `restore_masks`)."""
    return {
        f"{path}.{attr}" if path else attr: mask
        for path, module in model.named_modules(remove_duplicate=False)
        for attr in module._parameters
        if (mask := module._buffers.get(mask_buffer_name(attr))) is not None
    }


def _algorithm_states(obj: Any) -> Iterator[Mapping[str, Any]]:
    """The algorithm states with packed masks inside ``obj`` (a checkpoint, a `Group` state,
    a callback or workflow state that holds one), depth first."""
    if not isinstance(obj, Mapping):
        return
    if (
        "step" in obj
        and isinstance(obj.get("masks"), Mapping)
        and isinstance(obj.get("params"), Mapping)
    ):
        yield obj
    elif isinstance(obj.get("groups"), list):
        for member in obj["groups"]:
            yield from _algorithm_states(member)
    else:
        for value in obj.values():
            yield from _algorithm_states(value)


def checkpoint_masks(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every mask ``checkpoint`` holds, as ``{parameter name: bool mask}`` (CPU, full shape).

    Args:
        checkpoint: a Lightning checkpoint (masks in the sparsity callback's state, or, written
            by an earlier version, ``<param>_mask`` entries of ``checkpoint["state_dict"]``), a
            ``{"model": model.state_dict(), "sparsity": sparsity.state_dict(), ...}`` dict, an
            algorithm's or `Group`'s ``state_dict()``, or a state dict with ``*_mask`` entries.
            Names are those of the model the algorithm was applied to (for a Lightning
            checkpoint, the LightningModule's: ``"net.fc1.weight"``).

    Returns:
        The masks; ``{}`` if there are none (a dense checkpoint).

    Raises:
        ValueError: a packed mask is corrupt (wrong size or dtype, bits set past its end), or
            an old-layout mask is not 0/1 or has another shape than its weight.
    """
    state = checkpoint
    for key in ("state_dict", "model"):
        if isinstance(checkpoint.get(key), Mapping):
            state = checkpoint[key]
            break
    fix = "the checkpoint is corrupt or mixes two models"
    masks = {
        name: as_mask(state[key], key, name, tuple(state[name].shape), fix)
        for key, name in mask_keys(state).items()
        if torch.is_tensor(state[name])
    }
    for saved in _algorithm_states(checkpoint):
        for name, packed in saved["masks"].items():
            try:
                masks[name] = unpack_bits(packed, saved["params"][name])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(
                    f"sparsity state mask {name!r}: {err}; the checkpoint is corrupt"
                ) from None
    return masks


def strip_masks(source: nn.Module | Mapping[str, Any]) -> dict[str, Any]:
    """A mask-free copy of a sparse state dict: no ``*_mask`` entries, pruned weights zero.

    Args:
        source: a model (its ``state_dict()``, pruned by its mask buffers) or a state dict
            (pruned by its ``*_mask`` entries, the layout of earlier versions).

    Returns:
        A new dict in the source's key order. Masked weights are new tensors (the source's
        values with pruned positions set to +0.0); every other value is the source's own.

    Raises:
        ValueError: a mask's shape differs from its weight's, or it is not 0/1.
    """
    state = source.state_dict() if isinstance(source, nn.Module) else source
    entries = mask_keys(state)
    masks = {param: state[key] for key, param in entries.items()}
    if isinstance(source, nn.Module):
        masks.update(model_masks(source))
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key in entries:
            continue
        if key in masks:
            fix = "the state dict is corrupt or mixes two models"
            mask = as_mask(masks[key], f"{key}_mask", key, tuple(value.shape), fix)
            value = zero_pruned_(value.detach().clone(), mask.to(value.device))
        out[key] = value
    return out


def restore_masks(model: nn.Module, source: Mapping[str, Any]) -> list[str]:
    """Register on ``model`` the masks of ``source`` (`checkpoint_masks`) that ``model`` lacks.

    For a model without a sparsity algorithm that should carry its masks again: the device
    (``on_wse``), export, a report. Each mask becomes the non-persistent buffer
    ``<param>_mask`` (bool, on the parameter's device); masks ``model`` already has are left as
    they are. The model also takes ``*_mask`` entries of a state dict it loads later (an earlier
    version's layout) as its masks, so ``restore_masks(model, sd); model.load_state_dict(sd)``
    loads such a state dict as it is. Everything is checked before anything is registered; the
    weights are not touched (a checkpoint's are already 0 where pruned). An algorithm applied
    later replaces these masks with its own.

    Example (a plain LightningModule, its checkpoint written with a sparsity callback)::

        module = MyModule.load_from_checkpoint(path)  # the weights, pruned ones 0
        restore_masks(module, torch.load(path, weights_only=True))  # and the masks

    Args:
        model: the module the masks belong to (names as in the checkpoint: the LightningModule
            for a Lightning checkpoint).
        source: anything `checkpoint_masks` reads.

    Returns:
        The mask buffer names registered (``"net.fc1.weight_mask"``), in ``source`` order.

    Raises:
        ValueError: a mask's shape differs from its parameter's (the source is from another
            model), a non-bool mask holds values other than 0/1, or a packed mask is corrupt;
            nothing was registered.
    """
    params = dict(model.named_parameters())
    todo: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    for name, mask in checkpoint_masks(source).items():
        if name not in params:
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if mask_buffer_name(attr) in module._buffers:
            continue
        fix = "load the checkpoint into the model it was saved from"
        mask = as_mask(mask, f"{name}_mask", name, tuple(params[name].shape), fix)
        todo.append((module, mask_buffer_name(attr), name, mask.to(params[name].device)))
    for module, buffer_name, _, mask in todo:
        module.register_buffer(buffer_name, mask.clone(), persistent=False)
    if todo:
        adopt_mask_entries(model)
    return [f"{name}_mask" for _, _, name, _ in todo]

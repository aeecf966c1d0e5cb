"""Which algorithms are applied to which model, and which masks they own.

A registry keyed weakly by the model an algorithm was applied to (`Group` members individually),
so a model loading a state dict, `restore_masks` or a second algorithm can tell masks an algorithm
owns from masks nothing owns (restored from a checkpoint, or carried by a deep copy). It holds the
algorithms duck-typed (``sparse_params``) and never imports them.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["algorithms_of", "forget", "mask_paths", "owned_masks", "owners", "record"]

_APPLIED: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def algorithms_of(model: nn.Module) -> list[Any]:
    """The algorithms applied to ``model`` (Group members individually), in order of application."""
    return list(_APPLIED.get(model, []))


def owners(module: nn.Module, param_name: str) -> list[Any]:
    """The algorithms (applied to any model, ``module`` itself or a model containing it) that
    sparsify ``module``'s parameter ``param_name``, in order of application."""
    found: list[Any] = []
    for algorithms in list(_APPLIED.values()):
        for algorithm in algorithms:
            if algorithm not in found and any(
                sp.module is module and sp.param_name == param_name
                for sp in algorithm.sparse_params.values()
            ):
                found.append(algorithm)
    return found


def record(model: nn.Module, algorithm: Any) -> None:
    """``algorithm`` is now applied to ``model``."""
    _APPLIED.setdefault(model, []).append(algorithm)


def forget(model: nn.Module | None, algorithm: Any) -> None:
    """``algorithm`` is no longer applied to ``model`` (it was removed)."""
    if model is not None and algorithm in _APPLIED.get(model, []):
        _APPLIED[model].remove(algorithm)


def owned_masks(model: nn.Module | None = None) -> set[tuple[int, str]]:
    """``(id(module), mask buffer name)`` of every mask owned by an algorithm applied to
    ``model`` (to any model if None)."""
    models = [model] if model is not None else list(_APPLIED.keys())
    return {
        (id(sp.module), sp.mask_name)
        for root in models
        for algorithm in _APPLIED.get(root, [])
        for sp in algorithm.sparse_params.values()
    }


def mask_paths(root: nn.Module) -> dict[tuple[int, str], str]:
    """``{(id(module), mask buffer name): state-dict key below root}`` of every ``*_mask`` buffer
    where it is now: a wrapper that moved a layer (peft's ``q_proj`` -> ``q_proj.base_layer``)
    moves its key, while the algorithm keeps the parameter names of ``apply``."""
    return {
        (id(module), buffer): f"{path}.{buffer}" if path else buffer
        for path, module in root.named_modules(remove_duplicate=False)
        for buffer in module._buffers
        if buffer.endswith("_mask")
    }

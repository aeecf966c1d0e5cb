"""What an object holds: every tensor reachable from it (its attributes, mappings, sequences and
functions' closures), and the bytes per masked weight an algorithm adds to a model.

Shared by ``tests/core/test_devices.py`` (nothing outlives a move) and
``bench_mask_memory.py`` (bytes per masked weight).
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import torch
from torch import nn


def held_tensors(obj: object, path: str = "algorithm") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor reachable from ``obj``: attributes, mappings,
    sequences, sets and the cells of functions' closures, each object once; modules and
    optimizers are not entered (they own their tensors), nor weak references."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [(path, obj)]
    while stack:
        where, value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield where, value
        elif isinstance(value, (nn.Module, torch.optim.Optimizer, type, types.ModuleType)):
            continue
        elif isinstance(value, dict):
            stack.extend((f"{where}[{k!r}]", v) for k, v in value.items())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, types.FunctionType):
            cells = value.__closure__ or ()
            stack.extend((f"{where}<cell {i}>", c.cell_contents) for i, c in enumerate(cells))
        elif isinstance(value, types.MethodType):
            stack.append((f"{where}.__self__", value.__self__))
        elif hasattr(value, "__dict__") and not isinstance(value, torch.Generator):
            stack.extend((f"{where}.{k}", v) for k, v in vars(value).items())


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def bytes_per_masked_weight(
    model: nn.Module, algorithm: object, optimizer: torch.optim.Optimizer
) -> tuple[float, dict[str, int]]:
    """What ``algorithm`` adds to ``model`` beyond the weights and the optimizer's state, per
    masked weight: the buffers it registered (masks, ever-active sets) and every tensor it holds
    that is none of the model's or the optimizer's. Returns the figure and the bytes by kind.

    0-d tensors it holds (the last update's figures, a few per masked tensor, kept on the device
    so that reading them is no host sync) are a cost per masked tensor, not per weight: they are
    left out of the figure and given as ``kinds["scalars"]`` (on a small model they would
    otherwise read as a fraction of a byte per weight)."""
    params = {id(p) for p in model.parameters()}
    owned = {t.untyped_storage().data_ptr() for t in model.parameters()}
    owned |= {
        v.untyped_storage().data_ptr()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    }
    buffers = [b for n, b in model.named_buffers() if n.endswith(("_mask", "_ever_active"))]
    buffer_ptrs = {b.untyped_storage().data_ptr() for b in buffers}
    held = [
        t
        for _, t in held_tensors(algorithm)
        if id(t) not in params
        and t.untyped_storage().data_ptr() not in owned | buffer_ptrs
        and not t.is_meta
    ]
    masked = sum(b.numel() for n, b in model.named_buffers() if n.endswith("_mask"))
    kinds = {
        "buffers": _storage_bytes(buffers),
        "held": _storage_bytes([t for t in held if t.ndim > 0]),
        "scalars": _storage_bytes([t for t in held if t.ndim == 0]),
    }
    return (kinds["buffers"] + kinds["held"]) / max(masked, 1), kinds

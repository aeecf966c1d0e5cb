"""Observer hooks of an algorithm: who is told when masks change (Cerebras' sparsity hooks).

Kept apart from the algorithm so the algorithm's file holds its state and rules only. Hooks get
0-d tensors, never Python numbers, so observing a mask update forces no host sync.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.hooks import RemovableHandle

__all__ = ["Observers", "SparsityHook", "UpdateHook"]

SparsityHook = Callable[[Any, str, Any], None]
"""``hook(algorithm, name, value)``: a target (float) or computed (0-d tensor) sparsity."""
UpdateHook = Callable[[Any, int, dict], None]
"""``hook(algorithm, step, stats)``; ``stats[name]`` holds 0-d tensors ``dropped``, ``grown``,
``sparsity`` and ``itop`` (if tracked)."""


class Observers:
    """Three hook registries: mask updates, target sparsity and computed sparsity."""

    def __init__(self) -> None:
        self.update: OrderedDict[int, UpdateHook] = OrderedDict()
        self.target: OrderedDict[int, SparsityHook] = OrderedDict()
        self.computed: OrderedDict[int, SparsityHook] = OrderedDict()

    @staticmethod
    def add(
        registry: OrderedDict[int, Callable[..., None]], hook: Callable[..., None]
    ) -> RemovableHandle:
        """Register ``hook`` in ``registry``; the handle's ``remove()`` unregisters it."""
        handle = RemovableHandle(registry)
        registry[handle.id] = hook
        return handle

    def emit_update(self, algorithm: Any, step: int, stats: dict) -> None:
        """Tell every update hook about the mask update ``stats`` made at ``step``."""
        for hook in self.update.values():
            hook(algorithm, step, stats)

    def emit_sparsity(
        self, algorithm: Any, sparse_params: Mapping[str, Any], mask_target: Callable[[str], float]
    ) -> None:
        """Tell the sparsity hooks each parameter's target (``mask_target``) and actual sparsity
        (``algorithm`` is passed through to the hooks)."""
        if not (self.target or self.computed):
            return
        for name, sp in sparse_params.items():
            for hook in self.target.values():
                hook(algorithm, name, mask_target(name))
            if self.computed:
                actual = 1.0 - sp.nnz / sp.mask.numel()
                for hook in self.computed.values():
                    hook(algorithm, name, actual)

    def __getstate__(self) -> dict[str, Any]:
        # User hooks are often closures; copies of an algorithm start without observers.
        return {"update": OrderedDict(), "target": OrderedDict(), "computed": OrderedDict()}

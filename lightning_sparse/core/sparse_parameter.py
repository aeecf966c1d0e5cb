"""`SparseParameter`: one parameter under sparsity, and where its mask lives.

The mask is a persistent ``torch.bool`` buffer named ``<param>_mask`` registered on the module that
owns the parameter (True = kept), exactly as Cerebras' ``cstorch.sparse`` stores it, so
``model.state_dict()`` carries ``fc1.weight_mask`` next to ``fc1.weight`` and any checkpoint format
that saves module state saves the masks.

Sharding note: the mask is always read through the owning module (``getattr(module, mask_name)``)
and every per-step operation on it is elementwise with the parameter. A sharded parameter (an FSDP2
``DTensor``) therefore only needs a mask sharded with the same placements; nothing here holds a
full-size copy or caches a tensor across steps.
"""

from __future__ import annotations

import torch
from torch import nn

from .masking import zero_pruned_
from .sharding import full

__all__ = ["SparseParameter", "mask_buffer_name"]


def mask_buffer_name(param_name: str) -> str:
    """Name of the mask buffer of parameter ``param_name`` on its owning module."""
    return f"{param_name}_mask"


class SparseParameter:
    """A parameter and its mask. It references the owning module; it owns no tensors.

    Args:
        module: the module whose ``_parameters`` holds the parameter.
        name: full dotted name from the root the algorithm was applied to
            (``"layers.0.fc1.weight"``).
        param_name: attribute name on ``module`` (``"weight"``).
    """

    def __init__(self, module: nn.Module, name: str, param_name: str) -> None:
        self.module = module
        self.name = name
        self.param_name = param_name
        self.mask_name = mask_buffer_name(param_name)

    @property
    def param(self) -> nn.Parameter:
        """The parameter, read through the module so a replaced parameter is followed."""
        return getattr(self.module, self.param_name)

    @property
    def mask(self) -> torch.Tensor:
        """Bool mask of the parameter's shape; True = kept."""
        return getattr(self.module, self.mask_name)

    @property
    def has_mask(self) -> bool:
        """Whether the mask buffer is (still) registered on the owning module."""
        return self.mask_name in self.module._buffers

    def register_mask(self, mask: torch.Tensor) -> None:
        """Register ``mask`` as the persistent buffer ``<param>_mask`` on the owning module."""
        self.module.register_buffer(self.mask_name, mask.to(torch.bool), persistent=True)

    def remove_mask(self) -> None:
        """Delete the mask buffer (used by ``densify``)."""
        self.module._buffers.pop(self.mask_name, None)

    def prune_(self) -> None:
        """Zero the parameter at pruned positions, in place."""
        zero_pruned_(self.param, self.mask)

    @property
    def nnz(self) -> torch.Tensor:
        """Number of kept positions, a plain 0-d tensor on the mask's device (no host sync;
        for a sharded mask one scalar all-reduce)."""
        return full(self.mask.count_nonzero())

    def __repr__(self) -> str:
        return f"SparseParameter({self.name!r}, shape={tuple(self.param.shape)})"

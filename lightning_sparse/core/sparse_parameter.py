"""`SparseParameter`: one parameter under sparsity, and where its mask lives.

The mask is a ``torch.bool`` buffer named ``<param>_mask`` registered on the module that owns the
parameter (True = kept), where Cerebras' ``cstorch.sparse`` keeps it, so the device, DDP and the
reports find it next to the weight. It is registered *non-persistent*: ``model.state_dict()``
holds the weights only (pruned ones exactly 0), so a plain model of the same architecture loads
it. The one saved copy of the masks is the algorithm's state (``sparsity.state_dict()["masks"]``,
packed bits, `checkpoint`), saved like an optimizer's state.

Sharding note: the mask is always read through the owning module (``getattr(module, mask_name)``)
and every per-step operation on it is elementwise with the parameter. A sharded parameter (an FSDP2
``DTensor``) therefore only needs a mask sharded with the same placements; nothing here holds a
full-size copy or caches a tensor across steps.
"""

from __future__ import annotations

import torch
from torch import nn

from . import held
from .masking import zero_pruned_
from .sharding import full

__all__ = ["SparseParameter", "as_mask", "ever_active_buffer_name", "mask_buffer_name"]


def mask_buffer_name(param_name: str) -> str:
    """Name of the mask buffer of parameter ``param_name`` on its owning module."""
    return f"{param_name}_mask"


def ever_active_buffer_name(param_name: str) -> str:
    """Name of the ever-active (ITOP) buffer of parameter ``param_name`` on its owning module."""
    return f"{param_name}_ever_active"


def as_mask(value: object, key: str, name: str, shape: tuple[int, ...], fix: str) -> torch.Tensor:
    """A mask read from a file (entry ``key``, for parameter ``name`` of ``shape``) as bool.

    Raises:
        ValueError: ``value`` is not a tensor of ``shape``, or a non-bool one holds values other
            than 0/1 (one host sync); the message names ``key``, both shapes or the dtype, and
            ends with ``fix``.
    """
    if not torch.is_tensor(value) or tuple(value.shape) != tuple(shape):
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(
            f"mask {key!r} has shape {got} but {name!r} has shape {tuple(shape)}; {fix}"
        )
    if value.dtype != torch.bool:
        if not bool(((value == 0) | (value == 1)).all()):
            raise ValueError(
                f"mask {key!r} holds values other than 0/1 (dtype {value.dtype}); a mask is "
                f"bool or 0/1, True = kept: {fix}"
            )
        value = value.to(torch.bool)
    return value


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
        self.ever_name = ever_active_buffer_name(param_name)

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
        """Register ``mask`` as the non-persistent buffer ``<param>_mask`` on the owning module."""
        self.module.register_buffer(self.mask_name, mask.to(torch.bool), persistent=False)

    def remove_mask(self) -> None:
        """Delete the mask buffer and the ever-active one (used by ``densify``)."""
        self.module._buffers.pop(self.mask_name, None)
        self.module._buffers.pop(self.ever_name, None)

    @property
    def ever_active(self) -> torch.Tensor | None:
        """Bool, the parameter's shape: positions ever kept (ITOP), or None if not tracked."""
        return self.module._buffers.get(self.ever_name)

    def register_ever_active(self, mask: torch.Tensor) -> None:
        """Register ``mask`` as the non-persistent buffer ``<param>_ever_active``: a buffer, so
        it follows ``model.to(device)`` like the mask (Lightning moves the model after
        ``apply``)."""
        self.module.register_buffer(self.ever_name, mask.to(torch.bool), persistent=False)

    def prune_(self) -> None:
        """Zero the parameter at pruned positions, in place; a parameter whose values are held
        elsewhere (`held`: the device's compact training) has its holder follow the mask."""
        holder = held.holder_of(self.param)
        if holder is not None:
            holder.mask_changed()
        else:
            zero_pruned_(self.param, self.mask)

    @property
    def nnz(self) -> torch.Tensor:
        """Number of kept positions, a plain 0-d tensor on the mask's device (no host sync;
        for a sharded mask one scalar all-reduce)."""
        return full(self.mask.count_nonzero())

    def __repr__(self) -> str:
        return f"SparseParameter({self.name!r}, shape={tuple(self.param.shape)})"

"""Zeroing pruned positions in place (the only per-step tensor work the package does), and the
values a prune zeroed, kept to put back.

Multiplying a float tensor by a bool mask would turn NaN/inf at pruned positions into NaN, and
``torch.where(mask, t, 0, out=t)`` runs as a slow scalar loop on CPU. Multiplying the tensor's
*bit pattern* (an integer view of the same memory) by the mask zeroes pruned positions exactly
(+0.0), whatever they held, at the speed of a vectorised integer multiply. Tensor subclasses
(``DTensor``) and other dtypes use ``torch.where``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .bitpack import pack_bits, unpack_bits
from .fused_mask import mul_by_masks_
from .sharding import full

__all__ = [
    "FUSED_FOREACH_DEVICES",
    "PrunedValues",
    "all_finite",
    "finite",
    "fill_pruned_foreach_",
    "pruned_values",
    "zero_pruned_",
    "zero_pruned_foreach_",
]

_BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


# The exponent bits of each float dtype: all set means inf or NaN.
_EXPONENT = {
    torch.float32: 0x7F800000,
    torch.float64: 0x7FF0000000000000,
    torch.float16: 0x7C00,
    torch.bfloat16: 0x7F80,
}


def finite(t: torch.Tensor) -> torch.Tensor:
    """``t.isfinite()``, as two integer ops on the bit view where there is one (``isfinite``
    is several kernels on a GPU: ``abs``, two comparisons, ``and``)."""
    bits = _bits(t)
    if bits is None:
        return t.isfinite()
    exponent = _EXPONENT[t.dtype]
    return (bits & exponent) != exponent


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """Integer view of ``t``'s memory, or None where that is not possible."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype not in _BITS:
        return None
    return t.detach().view(_BITS[t.dtype])


@torch.no_grad()
def zero_pruned_(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t[~mask] = 0`` in place (NaN/inf-safe). ``mask``: bool, ``t``'s shape (True = kept)."""
    bits = _bits(t)
    if bits is not None:
        bits.mul_(mask)
    else:
        torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device), out=t)
    return t


@torch.no_grad()
def zero_pruned_foreach_(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> None:
    """``zero_pruned_`` over lists: one pass where every tensor has a bit view (on a GPU one
    fused kernel, `fused_mask`), else ``zero_pruned_`` per tensor. ``masks``: bool, each of
    its tensor's shape and device."""
    if not tensors:
        return
    views = [v for t in tensors if (v := _bits(t)) is not None]
    if len(views) != len(tensors):  # a subclass or another dtype among them
        for t, mask in zip(tensors, masks, strict=True):
            zero_pruned_(t, mask)
    elif masks[0].device.type in FUSED_FOREACH_DEVICES:
        mul_by_masks_(views, list(masks))
    else:
        torch._foreach_mul_(views, list(masks))


@torch.no_grad()
def fill_pruned_foreach_(
    tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], value: float
) -> None:
    """``t[~mask] = value`` in place for tensors that are exactly +0.0 where ``mask`` is False
    (pruned): the bit pattern ``K`` of ``value`` is added there, ``bits + K * ~mask`` (one
    integer pass; ``masked_fill_`` and ``torch.where`` run as slow scalar loops on CPU)."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, mask in zip(tensors, masks, strict=True):
        bits = _bits(t)
        if bits is None:
            t.masked_fill_(~mask, value)
        else:
            views, group_masks = groups.setdefault(t.dtype, ([], []))
            views.append(bits)
            group_masks.append(mask)
    for dtype, (views, group_masks) in groups.items():
        k = int(torch.tensor(value, dtype=dtype).view(_BITS[dtype]))
        torch._foreach_add_(views, [~mask for mask in group_masks], alpha=k)


# Devices where a foreach op over tensors of several dtypes (an integer view and a bool mask)
# loops over the tensors, a kernel launch each: there the product is one compiled kernel
# (`fused_mask`). On the CPU a foreach op is a loop over the tensors either way, and the bool
# masks serve as they are (`benchmarks/step_ops.py` counts launches as on a GPU).
FUSED_FOREACH_DEVICES = {"cuda", "xpu", "hpu", "mps"}


@dataclass
class PrunedValues:
    """Values pruning zeroed in a weight, to put back if the masks change before it is written.

    ``positions``: packed bits (`bitpack`) of the zeroed positions; ``values``: their values in
    order; both on the weight's device (no copy to the host). Valid for ``weight`` while its
    version counter is ``version`` (`seal`): a write since makes them stale.
    """

    positions: torch.Tensor
    values: torch.Tensor
    weight: torch.Tensor | None = None
    version: int = -1

    def seal(self, weight: torch.Tensor, version: int) -> None:
        """Bind to ``weight`` as pruned (its version counter now)."""
        self.weight, self.version = weight, version

    def put_back_(self, weight: torch.Tensor, local: torch.Tensor) -> None:
        """Write the values back into ``local`` (``weight``'s tensor on this rank) unless the
        weight was replaced or written since `seal`."""
        if weight is not self.weight or local._version != self.version:
            return
        positions = unpack_bits(self.positions, local.shape).to(local.device)
        local.data.masked_scatter_(positions, self.values.to(local.device))


def pruned_values(weight: torch.Tensor, mask: torch.Tensor) -> PrunedValues | None:
    """The entries of ``weight`` that pruning with ``mask`` zeroes: nonzero (or -0.0) ones at
    pruned positions (one host sync); None if there are none."""
    positions = ~mask & (weight.ne(0) | weight.signbit())
    values = weight[positions]
    if values.numel() == 0:
        return None
    return PrunedValues(pack_bits(positions), values)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one host sync; a sharded tensor's whole)."""
    return not tensors or bool(torch.stack([full(t.isfinite().all()) for t in tensors]).all())

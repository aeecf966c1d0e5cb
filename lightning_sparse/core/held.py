"""Weights whose values are held elsewhere between steps.

On the wafer-scale device a masked layer trains its kept values only (`wse.compact`): the
weight parameter stays registered, so the algorithm's references, hooks and state-dict keys
stay, but it holds no values. The device registers itself here as that weight's *holder*, and
the algorithms ask it, not the weight, in the two places they read or write a weight's values
outside the per-step path (which never sees such a weight: the optimizer steps the values):

- a mask update reads the weight (``|w|``, RigL's ``|grad|``): `dense_of` gives a dense copy
  with the gradient the holder keeps (`Holder.dense_grad`), built one parameter at a time and
  dropped after that parameter's new mask is computed;
- pruning after a mask was written (`SparseParameter.prune_`): the holder rebuilds its values,
  gradient and optimizer state under the new mask (`Holder.mask_changed`), exactly as pruning
  the dense weight, gradient and state would leave them.

This module knows no device: a holder is anything with these two methods (a protocol), kept
weakly per parameter, by identity.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

__all__ = ["Holder", "dense_of", "hold", "holder_of", "release"]


class Holder(Protocol):
    """What holds a weight's values while the weight parameter holds none."""

    def dense_weight(self) -> torch.Tensor:
        """The weight's values as a new dense tensor of its shape (zeros where pruned)."""
        ...

    def dense_grad(self) -> torch.Tensor | None:
        """The weight's gradient as the update reads it, dense (None when it has none): the
        holder may keep only what the update's rule says it reads of it outside the mask (a
        drop-and-grow rule's grow candidates, `DropAndGrow.grow_candidates`), zeros elsewhere."""
        ...

    def mask_changed(self) -> None:
        """The weight's mask was written: keep the values at kept positions (grown ones start
        at zero, with zero optimizer state), drop the rest."""
        ...


# id(param) -> (weak ref to param, its holder). Keyed by identity: a tensor's ``==`` is
# elementwise, so a `weakref.WeakKeyDictionary` cannot compare two of them.
_HOLDERS: dict[int, tuple[weakref.ref[torch.Tensor], Holder]] = {}


def hold(param: torch.Tensor, holder: Holder) -> None:
    """``holder`` holds ``param``'s values from now on (until `release`, or ``param`` dies)."""
    key = id(param)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _HOLDERS.get(key)
        if entry is not None and entry[0] is ref:
            del _HOLDERS[key]

    _HOLDERS[key] = (weakref.ref(param, forget), holder)


def release(param: torch.Tensor) -> None:
    """``param`` holds its own values again."""
    entry = _HOLDERS.get(id(param))
    if entry is not None and entry[0]() is param:
        del _HOLDERS[id(param)]


def holder_of(param: torch.Tensor) -> Holder | None:
    """The holder of ``param``'s values, or None when ``param`` holds them itself."""
    entry = _HOLDERS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def dense_of(param: torch.Tensor) -> torch.Tensor:
    """``param`` itself, or, when its values are held elsewhere, a dense copy of them carrying
    the holder's dense gradient (for a mask update to read; nothing is written back)."""
    holder = holder_of(param)
    if holder is None:
        return param
    dense = holder.dense_weight()
    dense.grad = holder.dense_grad()
    return dense

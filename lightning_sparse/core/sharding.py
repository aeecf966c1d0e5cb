"""Masks for sharded parameters (FSDP2 ``fully_shard``: parameters are ``DTensor``s).

A mask is stored sharded exactly like its parameter, so no rank holds a full-size mask. Mask
*decisions* (top-k over the whole tensor, never over a local shard) are taken on the gathered
tensor, identically on every rank (deterministic ties, ``(seed, step, name)`` randomness), and
each rank then keeps its own shard without communication. Plain tensors pass through unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["full", "is_sharded", "local", "shard_like"]

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch built without distributed support
    # None marks the absence (is_sharded checks it); mypy sees the class and function.
    DTensor = None  # type: ignore[assignment,misc]
    distribute_tensor = None  # type: ignore[assignment]


def is_sharded(t: torch.Tensor) -> TypeIs[DTensor]:
    """Whether ``t`` is a ``DTensor``."""
    return DTensor is not None and isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathers a ``DTensor``, returns a plain tensor as is."""
    return t.full_tensor() if is_sharded(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; a plain tensor as is."""
    return t.to_local() if is_sharded(t) else t


def shard_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Shard full tensor ``t`` with the mesh and placements of ``like`` (no communication:
    every rank holds the same ``t`` and keeps its own shard)."""
    if not is_sharded(like):
        return t
    return distribute_tensor(t, like.device_mesh, like.placements, src_data_rank=None)

"""Shared drop-and-grow step of SET, RigL and GraNet in the shaper's ``[groups, n]`` view."""

from __future__ import annotations

import torch

from lightning_sparse.mask_ops import drop_and_grow
from lightning_sparse.shapers import Shaper


def shaped_drop_and_grow(
    shaper: Shaper,
    p: torch.Tensor,
    grow_score: torch.Tensor,
    mask: torch.Tensor,
    sparsity: float,
    drop_fraction: float,
    prune_to_target: bool = False,
) -> torch.Tensor:
    """Drop ``drop_fraction`` of the active weights by ``|p|``, regrow by ``grow_score``.

    Args:
        shaper: maps ``[*shape]`` tensors to ``[groups, n]`` rows that compete independently.
        p: weight, any shape. grow_score: same shape, higher = grow first.
        mask: current bool mask, same shape.
        sparsity: target sparsity after the update.
        drop_fraction: share of the target's active connections replaced, in [0, 1].
        prune_to_target: GraNet: also drop the surplus above the target count by magnitude.

    Returns:
        bool mask of ``p``'s shape with ``shaper.keep_per_row(sparsity, n)`` kept per row (or
        fewer removed while a row is still denser than its target and ``prune_to_target`` is off).
    """
    w2d, g2d, m2d = shaper.shape(p.abs()), shaper.shape(grow_score), shaper.shape(mask)
    n_total = shaper.keep_per_row(sparsity, m2d.shape[-1])
    n_drop = int(min(max(drop_fraction, 0.0), 1.0) * n_total)
    if prune_to_target:
        surplus = (m2d.sum(-1) - n_total).clamp(min=0)
        n_drop = surplus + n_drop
    new = drop_and_grow(w2d, g2d, m2d, n_drop, n_total)
    return shaper.unshape(new, p.shape)

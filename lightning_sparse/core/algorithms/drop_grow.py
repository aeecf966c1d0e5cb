"""The drop-and-grow step SET, RigL and GraNet share, in the shaper's ``[groups, n]`` view."""

from __future__ import annotations

import torch

from ..mask_ops import drop_and_grow, drop_and_grow_random
from ..shapers import Shaper


def shaped_drop_and_grow(
    shaper: Shaper,
    p: torch.Tensor,
    grow_score: torch.Tensor | torch.Generator,
    mask: torch.Tensor,
    sparsity: float,
    drop_fraction: float,
    prune_to_target: bool = False,
) -> torch.Tensor:
    """Drop ``drop_fraction`` of the active weights by ``|p|``, regrow by ``grow_score``.

    Counts follow Cerebras (``cstorch.sparse`` RigL/SET): of ``a`` active weights in a row,
    ``int((1 - d) * a)`` survive the drop and the row grows back up to its target
    ``int((1 - s) * n)``; a row still denser than its target (a dense start) only shrinks.
    With ``prune_to_target`` (GraNet) the surplus above the target is pruned first and the drop
    fraction applies to the target count.

    Args:
        shaper: maps ``[*shape]`` tensors to ``[groups, n]`` rows that compete independently.
        p: weight, any shape.
        grow_score: same shape, higher = grow first; or a generator: grow uniformly at random
            among the positions not kept (``mask_ops.drop_and_grow_random``, SET).
        mask: current bool mask, same shape.
        sparsity: target sparsity after the update.
        drop_fraction: share of the target's active connections replaced, in [0, 1].
        prune_to_target: GraNet: also drop the surplus above the target count by magnitude.

    Returns:
        bool mask of ``p``'s shape with ``shaper.keep_per_row(sparsity, n)`` kept per row (or
        fewer removed while a row is still denser than its target and ``prune_to_target`` is off).
    """
    w2d, m2d = shaper.shape(p.abs()), shaper.shape(mask)
    n_total = shaper.keep_per_row(sparsity, m2d.shape[-1])
    keep_share = 1.0 - min(max(drop_fraction, 0.0), 1.0)
    counts = m2d.sum(-1)
    low, high = (int(c) for c in counts.aminmax())  # one host sync per parameter per update
    if low == high:  # the usual case: ints keep top-k on its fast path
        base = min(low, n_total) if prune_to_target else low
        n_drop: int | torch.Tensor = low - int(keep_share * base)
    else:
        base_t = counts.clamp(max=n_total) if prune_to_target else counts
        n_drop = counts - torch.floor(base_t.double() * keep_share).long()
    if isinstance(grow_score, torch.Generator):
        if m2d.shape[0] == 1:  # one row: random positions are drawn, not a score per weight
            new = drop_and_grow_random(w2d, m2d, n_drop, n_total, grow_score)
            return shaper.unshape(new, p.shape)
        grow_score = torch.rand(p.shape, generator=grow_score, device=p.device)
    new = drop_and_grow(w2d, shaper.shape(grow_score), m2d, n_drop, n_total)
    return shaper.unshape(new, p.shape)


def dense_grad_score(p: torch.Tensor, name: str) -> torch.Tensor:
    """RigL's grow score ``|grad|`` of the dense accumulated gradient of ``p``."""
    if p.grad is None:
        raise RuntimeError(
            f"RigL needs the dense gradient of {name!r} at an update step, but it is None; run "
            "backward before the optimizer step (and don't zero_grad in between)"
        )
    return p.grad.abs()

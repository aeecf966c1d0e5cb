"""`DropAndGrow`: the rule and the constructor SET, RigL and GraNet share.

At each update the smallest-|w| ``drop_fraction`` of the active weights is dropped and as many
are grown back where ``grow_score`` is highest (Mocanu et al. 2018; Evci et al. 2020). An
algorithm is its grow score (`set.py`: random; `rigl.py`: |dense gradient|) plus, for GraNet
(`granet.py`), ``prune_to_target``: its schedule rises, so the surplus above the new target is
dropped first. The counts, per row of the shaper's ``[groups, n]`` view, are
`shaped_drop_and_grow`'s.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from .. import validate
from ..mask_ops import drop_and_grow, drop_and_grow_random
from ..schedules import ScheduleSpec, bind
from ..shapers import Shaper, Unstructured
from .base import SparsityAlgorithm

__all__ = ["DropAndGrow", "dense_grad_score", "shaped_drop_and_grow"]


class DropAndGrow(SparsityAlgorithm):
    """Drop the smallest-|w| ``drop_fraction`` of active weights; grow as many by `grow_score`.

    Args:
        sparsity: target sparsity or schedule (see ``SparsityAlgorithm``).
        drop_fraction: share of active weights replaced per update, in [0, 1]; a float or a
            schedule (e.g. ``{"type": "cosine", "init": 0.3, "half_period": 3584}``).
        **kwargs: see ``SparsityAlgorithm`` (``update``, ``init_method``, ``shaper``, ...).
    """

    prune_to_target: ClassVar[bool] = False  # GraNet: drop the surplus above the target first
    grows_by_grad_magnitude: ClassVar[bool] = False  # RigL, GraNet: grow_score is |dense grad|

    def __init__(
        self, sparsity: ScheduleSpec, drop_fraction: ScheduleSpec = 0.3, **kwargs: Any
    ) -> None:
        super().__init__(sparsity, **kwargs)
        self.drop_fraction = bind(
            drop_fraction, self.update_schedule, False, check=validate.drop_fraction
        )
        self.check_range(self.horizon())

    @abstractmethod
    def grow_score(self, p: torch.Tensor) -> torch.Tensor | torch.Generator:
        """Where to grow in ``p``: a score of its shape (higher grows first) or a generator
        (uniformly at random)."""

    def grow_candidates(self, name: str) -> int | None:
        """The grow count of this step's update of ``name`` (`shaped_drop_and_grow`'s counts,
        capped at the positions outside the mask), for a ``|grad|`` grow score over one row
        (the `Unstructured` shaper); None otherwise (see `SparsityAlgorithm.grow_candidates`).
        One host sync (the mask's count)."""
        sp = self.sparse_params[name]
        if not self.grows_by_grad_magnitude or not isinstance(self.shaper, Unstructured):
            return None
        n = sp.mask.numel()
        active = int(sp.nnz)
        n_total = self.shaper.keep_per_row(self.target_sparsity(name, self.step), n)
        keep_share = 1.0 - min(max(self.drop_fraction_at(self.step), 0.0), 1.0)
        base = min(active, n_total) if self.prune_to_target else active
        return min(max(n_total - int(keep_share * base), 0), n - active)

    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Drop by ``|p|``, grow by `grow_score` (`shaped_drop_and_grow`)."""
        drop = self.drop_fraction_at(self.step)
        return shaped_drop_and_grow(
            self.shaper, p, self.grow_score(p), mask, sparsity, drop, self.prune_to_target
        )


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

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
from ..shapers import Shaper
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

    def __init__(
        self, sparsity: ScheduleSpec, drop_fraction: ScheduleSpec = 0.3, **kwargs: Any
    ) -> None:
        super().__init__(sparsity, **kwargs)
        self.drop_fraction = bind(
            drop_fraction, self.update_schedule, False, check=validate.drop_fraction
        )
        self.check_range(self.horizon())
        self._count_ranges: dict[str, tuple[int, int]] = {}  # read once per update

    @abstractmethod
    def grow_score(self, p: torch.Tensor) -> torch.Tensor | torch.Generator:
        """Where to grow in ``p``: a score of its shape (higher grows first) or a generator
        (uniformly at random)."""

    def compute_masks(self, targets: dict[str, float]) -> dict[str, torch.Tensor]:
        """The base's, with every mask's fewest and most kept per shaper row read to the host
        in one transfer first (`row_count_ranges`): one host sync per update, not two per
        parameter."""
        self._count_ranges = row_count_ranges(
            self.shaper, {n: self.rule_view(n) for n in self.sparse_params}
        )
        try:
            return super().compute_masks(targets)
        finally:
            self._count_ranges = {}

    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Drop by ``|p|``, grow by `grow_score` (`shaped_drop_and_grow`)."""
        drop = self.drop_fraction_at(self.step)
        return shaped_drop_and_grow(
            self.shaper,
            p,
            self.grow_score(p),
            mask,
            sparsity,
            drop,
            self.prune_to_target,
            self._count_ranges.get(self.name_of(p)),
        )


def row_count_ranges(shaper: Shaper, masks: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """``{name: (fewest, most)}`` kept per row of each mask's ``[groups, n]`` view, read to the
    host together (one sync)."""
    if not masks:
        return {}
    ranges = torch.stack([torch.stack(shaper.shape(m).sum(-1).aminmax()) for m in masks.values()])
    return {name: (low, high) for name, (low, high) in zip(masks, ranges.tolist(), strict=True)}


def shaped_drop_and_grow(
    shaper: Shaper,
    p: torch.Tensor,
    grow_score: torch.Tensor | torch.Generator,
    mask: torch.Tensor,
    sparsity: float,
    drop_fraction: float,
    prune_to_target: bool = False,
    count_range: tuple[int, int] | None = None,
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
        count_range: the fewest and most kept per row of ``mask``, if the caller read them
            (`row_count_ranges`); else they are read here (one host sync).

    Returns:
        bool mask of ``p``'s shape with ``shaper.keep_per_row(sparsity, n)`` kept per row (or
        fewer removed while a row is still denser than its target and ``prune_to_target`` is off).
    """
    w2d, m2d = shaper.shape(p.abs()), shaper.shape(mask)
    n_total = shaper.keep_per_row(sparsity, m2d.shape[-1])
    keep_share = 1.0 - min(max(drop_fraction, 0.0), 1.0)
    counts = m2d.sum(-1)
    if count_range is None:
        count_range = (int(counts.amin()), int(counts.amax()))
    low, high = count_range
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

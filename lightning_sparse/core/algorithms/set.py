"""`SET`: sparse evolutionary training, drop by magnitude and regrow at random.

Mocanu et al., "Scalable training of artificial neural networks with adaptive sparse connectivity
inspired by network science", Nature Communications 2018, arXiv:1707.04780.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import validate
from ..schedules import ScheduleSpec, bind
from .base import SparsityAlgorithm
from .drop_grow import shaped_drop_and_grow

__all__ = ["SET"]


class SET(SparsityAlgorithm):
    """Drop the smallest-|w| ``drop_fraction`` of active weights; regrow as many at random.

    Args:
        drop_fraction: share of active weights replaced per update, in [0, 1]; a float or a
            schedule (e.g. ``{"type": "cosine", "init": 0.3, "half_period": 3584}``).
        **kwargs: see ``SparsityAlgorithm`` (``sparsity``, ``update``, ...).
    """

    def __init__(
        self, sparsity: ScheduleSpec, drop_fraction: ScheduleSpec = 0.3, **kwargs: Any
    ) -> None:
        super().__init__(sparsity, **kwargs)
        self.drop_fraction = bind(
            drop_fraction, self.update_schedule, False, check=validate.drop_fraction
        )
        self.check_range(self.horizon())

    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Drop by ``|p|``; grow uniformly at random from the ``(seed, step, name)`` stream."""
        drop = self.drop_fraction_at(self.step)
        return shaped_drop_and_grow(self.shaper, p, self.generator(p), mask, sparsity, drop)

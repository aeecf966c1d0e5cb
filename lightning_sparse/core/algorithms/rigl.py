"""`RigL`: drop by magnitude, regrow by the magnitude of the dense gradient.

Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020, arXiv:1911.11134.
SET's rule with another grow score. The dense gradient is the full accumulated (and, under DDP,
all-reduced) gradient: on update steps the gradient hooks leave it dense through backward, so
nothing extra is held in memory and nothing goes into checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import validate
from ..schedules import ScheduleSpec, bind
from .base import SparsityAlgorithm
from .drop_grow import dense_grad_score, shaped_drop_and_grow

__all__ = ["RigL"]


class RigL(SparsityAlgorithm):
    """Drop the smallest-|w| ``drop_fraction`` of active weights; regrow the largest-|grad|.

    Args:
        drop_fraction: as ``SET``.
        **kwargs: see ``SparsityAlgorithm``. (Cerebras' ``balance_in_groups`` /
            ``balance_out_groups`` are accepted by ``configure`` and become ``shaper``.)
    """

    needs_dense_grad = True

    def __init__(
        self, sparsity: ScheduleSpec, drop_fraction: ScheduleSpec = 0.3, **kwargs: Any
    ) -> None:
        super().__init__(sparsity, **kwargs)
        self.drop_fraction = bind(
            drop_fraction, self.update_schedule, False, check=validate.drop_fraction
        )
        self.check_range(self.horizon())

    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Drop by ``|p|``; grow by ``|dense gradient|``."""
        drop = self.drop_fraction_at(self.step)
        grow = dense_grad_score(p, self.name_of(p))
        return shaped_drop_and_grow(self.shaper, p, grow, mask, sparsity, drop)

"""`GraNet`: gradual magnitude pruning with RigL-style prune-and-regrow.

Liu et al., "Sparse Training via Boosting Pruning Plasticity with Neuroregeneration", NeurIPS
2021, arXiv:2106.10404. RigL's rule under a nondecreasing sparsity schedule (normally cubic, from
``init`` to ``final``; dense-to-sparse when ``init=0``): each update prunes the surplus above the
new target by magnitude, then drops ``drop_fraction`` of the rest by magnitude and regrows as many
by dense-gradient magnitude. Like GMP it updates at the ramp's end whatever the cadence.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import validate
from ..schedules import ScheduleSpec, bind, evaluate, steps_to_check
from .base import SparsityAlgorithm
from .drop_grow import dense_grad_score, shaped_drop_and_grow

__all__ = ["GraNet"]


class GraNet(SparsityAlgorithm):
    """Arguments as ``RigL``; ``sparsity`` is normally ``{"type": "cubic", "init": s_i,
    "final": s_f, "begin": t0, "end": t1}`` and must not decrease."""

    needs_dense_grad = True

    def __init__(
        self, sparsity: ScheduleSpec, drop_fraction: ScheduleSpec = 0.3, **kwargs: Any
    ) -> None:
        super().__init__(sparsity, **kwargs)
        self.drop_fraction = bind(
            drop_fraction, self.update_schedule, False, check=validate.drop_fraction
        )
        self.check_range(self.horizon())

    def milestones(self) -> tuple[int, ...]:
        """The ramp's end, so the final sparsity is reached whatever the cadence."""
        return self.sparsity.milestones()

    def check_range(self, horizon: int) -> None:
        """Also: the sparsity never decreases (GraNet only prunes the surplus, never regrows it)."""
        super().check_range(horizon)
        steps = steps_to_check(self.update_schedule, horizon, (0, *self.milestones()))
        values = [evaluate(self.sparsity, step, "sparsity") for step in steps]
        for i in range(1, len(steps)):
            (s0, v0), (s1, v1) = (steps[i - 1], values[i - 1]), (steps[i], values[i])
            if v1 < v0:
                raise ValueError(
                    f"GraNet sparsity schedule {self.sparsity!r} decreases from {v0:g} (step {s0}) "
                    f"to {v1:g} (step {s1}); GraNet needs a nondecreasing schedule such as cubic "
                    "from init to final (use RigL for a schedule that goes down)"
                )

    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Prune the surplus to ``sparsity`` by ``|p|``, then drop and regrow by ``|grad|``."""
        drop = self.drop_fraction_at(self.step)
        grow = dense_grad_score(p, self.name_of(p))
        return shaped_drop_and_grow(
            self.shaper, p, grow, mask, sparsity, drop, prune_to_target=True
        )

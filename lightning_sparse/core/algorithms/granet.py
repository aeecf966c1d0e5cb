"""`GraNet`: gradual magnitude pruning with RigL-style prune-and-regrow.

Liu et al., "Sparse Training via Boosting Pruning Plasticity with Neuroregeneration", NeurIPS
2021, arXiv:2106.10404. RigL's rule under a nondecreasing sparsity schedule (normally cubic, from
``init`` to ``final``; dense-to-sparse when ``init=0``): each update prunes the surplus above the
new target by magnitude, then drops ``drop_fraction`` of the rest by magnitude and regrows as many
by dense-gradient magnitude. Like GMP it updates at the ramp's end whatever the cadence.
"""

from __future__ import annotations

import torch

from ..schedules import evaluate, steps_to_check
from .drop_grow import DropAndGrow, dense_grad_score

__all__ = ["GraNet"]


class GraNet(DropAndGrow):
    """Arguments as ``RigL``; ``sparsity`` is normally ``{"type": "cubic", "init": s_i,
    "final": s_f, "begin": t0, "end": t1}`` and must not decrease."""

    needs_dense_grad = True
    grows_by_grad_magnitude = True
    prune_to_target = True  # the schedule rises: drop the surplus above the new target first

    def grow_score(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """RigL's: ``|dense gradient|``."""
        return dense_grad_score(p, name)

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

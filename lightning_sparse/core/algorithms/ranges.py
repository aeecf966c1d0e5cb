"""Range checks of an algorithm's schedules: every value it will use must be valid.

Run when the algorithm is built (over the steps its cadence or ramp defines), by the Lightning
layer up to ``max_steps``, and on every value when it is used: a sparsity outside [0, 1), a drop
fraction outside [0, 1], overflow or NaN is a ``ValueError`` naming value, step and fix
(`validate.sparsity`, `validate.drop_fraction`). A schedule that cannot be computed at an update
step however long the run (an ``Exp`` whose ``exp(gamma * step)`` overflows) is refused when built,
naming that step, even when the run's length is not known yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import validate
from ..schedules import evaluate, first_undefined_use, steps_to_check

if TYPE_CHECKING:
    from .base import SparsityAlgorithm


def check_range(algorithm: SparsityAlgorithm, horizon: int) -> None:
    """Check every scheduled value used in steps ``[0, horizon]``: in range and finite; and that
    no schedule overflows at a later update step."""
    extra = (0, *algorithm.milestones())
    for step in steps_to_check(algorithm.update_schedule, horizon, extra):
        value = evaluate(algorithm.sparsity, step, "sparsity")
        validate.sparsity(value, step=step, schedule=algorithm.sparsity)
        if algorithm.drop_fraction is not None:
            algorithm.drop_fraction_at(step)
    schedules = {"sparsity": algorithm.sparsity, "drop_fraction": algorithm.drop_fraction}
    for what, schedule in schedules.items():
        if schedule is None:
            continue
        step = first_undefined_use(schedule, algorithm.update_schedule, extra)
        if step is not None:
            evaluate(schedule, step, what)  # raises naming the step (the overflow)


def drop_fraction_at(algorithm: SparsityAlgorithm, step: int) -> float:
    """The drop fraction at ``step``, checked to be in [0, 1] (drop-and-grow algorithms)."""
    value = evaluate(algorithm.drop_fraction, step, "drop_fraction")
    return validate.drop_fraction(value, step=step, schedule=algorithm.drop_fraction)


def horizon(algorithm: SparsityAlgorithm) -> int:
    """The last step known without the run's length: the cadence's or the ramp's end (the
    Lightning layer checks up to ``max_steps``; each value is checked again when used)."""
    last = algorithm.update_schedule.last()
    return last if last is not None else max((*algorithm.sparsity.milestones(), 0))

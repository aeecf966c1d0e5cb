"""Range checks of an algorithm's schedules: every value it will use must be valid.

Run when the algorithm is built (over the steps its cadence or ramp defines), by the Lightning
layer up to ``max_steps``, and on every value when it is used: a sparsity outside [0, 1), a drop
fraction outside [0, 1], overflow or NaN is a ``ValueError`` naming value, step and fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schedules import check_drop_fraction_value, check_sparsity_value, evaluate, steps_to_check

if TYPE_CHECKING:
    from .base import SparsityAlgorithm


def check_range(algorithm: SparsityAlgorithm, horizon: int) -> None:
    """Check every scheduled value used in steps ``[0, horizon]``: in [0, 1), finite."""
    for step in steps_to_check(algorithm.update_schedule, horizon, (0, *algorithm.milestones())):
        check_sparsity_value(
            evaluate(algorithm.sparsity, step, "sparsity"), step, algorithm.sparsity
        )
        if algorithm.drop_fraction is not None:
            algorithm.drop_fraction_at(step)


def drop_fraction_at(algorithm: SparsityAlgorithm, step: int) -> float:
    """The drop fraction at ``step``, checked to be in [0, 1] (drop-and-grow algorithms)."""
    value = evaluate(algorithm.drop_fraction, step, "drop_fraction")
    check_drop_fraction_value(value, step, algorithm.drop_fraction)
    return value


def horizon(algorithm: SparsityAlgorithm) -> int:
    """The last step known without the run's length: the cadence's or the ramp's end (the
    Lightning layer checks up to ``max_steps``; each value is checked again when used)."""
    last = algorithm.update_schedule.last()
    return last if last is not None else max((*algorithm.sparsity.milestones(), 0))

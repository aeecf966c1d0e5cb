"""One validator per kind of argument, so every bad value gets the same message wherever it is met.

Each validator returns the value as a plain Python ``float`` / ``int`` or raises naming the
argument, its value, the rule and the fix: a ``TypeError`` for the wrong kind of value, a
``ValueError`` for one out of range. Numbers numpy users pass (``np.float32(0.8)``,
``np.int64(100)``) and 0-d tensors are accepted wherever a float or an int is; ``bool`` never is.

=================  =========================================  ==================================
kind               rule                                       validator
=================  =========================================  ==================================
real number        finite                                     :func:`real`
count / step       an int ``>= minimum``                      :func:`integer`
sparsity           a fraction of zeros in ``[0, 1)``          :func:`sparsity`
drop fraction      a share of active weights in ``[0, 1]``    :func:`drop_fraction`
seed               an int, or ``None`` (the run's own seed)   :func:`seed`
=================  =========================================  ==================================

``sparsity`` and ``drop_fraction`` also check a value a schedule gives at a step (``step`` and
``schedule`` given): the message then names the schedule and the step.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "drop_fraction",
    "integer",
    "is_integer",
    "is_number",
    "real",
    "seed",
    "sparsity",
]


def _scalar(value: object) -> object:
    """A 0-d tensor as its Python number (other values unchanged)."""
    if torch.is_tensor(value) and value.ndim == 0 and value.dtype != torch.bool:
        return value.item()
    return value


def is_number(value: object) -> bool:
    """Whether ``value`` is a real number: ``int``, ``float``, numpy, a 0-d tensor; not ``bool``."""
    value = _scalar(value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer: ``int``, ``np.int64``, a 0-d int tensor; not ``bool``."""
    value = _scalar(value)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _who(owner: str, name: str) -> str:
    return f"{owner} {name}" if owner else name


def _kind(value: object) -> str:
    return type(value).__name__


def real(value: object, name: str, *, owner: str = "") -> float:
    """A finite real number as a ``float``.

    Args:
        value: the argument.
        name: its name, e.g. ``"gamma"``.
        owner: what it belongs to, e.g. ``"Exp"`` (message: ``Exp gamma must be ...``).

    Raises:
        TypeError: not a real number.
        ValueError: NaN or infinite.
    """
    if not is_number(value):
        raise TypeError(
            f"{_who(owner, name)} must be a real number, got {value!r} ({_kind(value)}); pass a "
            "float such as 0.5"
        )
    # is_number(value) held above; _scalar returns it as an object.
    number = float(_scalar(value))  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError(f"{_who(owner, name)} must be finite, got {value!r}; pass a finite float")
    return number


def integer(
    value: object, name: str, minimum: int = 0, *, owner: str = "", unit: str = "", fix: str = ""
) -> int:
    """An ``int >= minimum`` (a count, a step, a size).

    Args:
        value: the argument.
        name: its name, e.g. ``"freq"``.
        minimum: the smallest value allowed.
        owner: what it belongs to, e.g. ``"FreqSchedule"``.
        unit: what it counts, e.g. ``"steps"`` (said in the messages).
        fix: the fix to suggest instead of the default (``pass a positive int``, ...).

    Raises:
        TypeError: not an integer (``2.0`` included: a count is never fractional).
        ValueError: below ``minimum``.
    """
    who = _who(owner, name)
    wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if not is_integer(value):
        counts = f" (a number of {unit})" if unit else ""
        whole = f"a whole number of {unit}" if unit else wanted
        fix = fix or f"pass {whole}"
        raise TypeError(f"{who} must be an int{counts}, got {value!r} ({_kind(value)}); {fix}")
    # is_integer(value) held above; _scalar returns it as an object.
    number = int(_scalar(value))  # type: ignore[call-overload]
    if number < minimum:
        raise ValueError(f"{who} must be >= {minimum}, got {value!r}; {fix or f'pass {wanted}'}")
    return number


def _for(where: str) -> str:
    return f" for {where!r}" if where else ""


def sparsity(
    value: object,
    name: str = "sparsity",
    *,
    where: str = "",
    step: int | None = None,
    schedule: object = None,
) -> float:
    """A sparsity: the fraction of zeros, a ``float`` in ``[0, 1)`` (1.0 would prune everything).

    Args:
        value: the sparsity.
        name: what to call it, e.g. ``"erk sparsity"``.
        where: the parameter it is for, e.g. ``"fc1.weight"``.
        step, schedule: the step and schedule the value comes from (a scheduled value).

    Raises:
        TypeError: not a real number.
        ValueError: outside ``[0, 1)``, NaN included.
    """
    if not is_number(value):
        raise TypeError(
            f"{name}={value!r}{_for(where)} must be a number: a float in [0, 1) (the fraction of "
            "zeros), e.g. 0.8"
        )
    # is_number(value) held above; _scalar returns it as an object.
    number = float(_scalar(value))  # type: ignore[arg-type]
    if 0.0 <= number < 1.0:
        return number
    if step is not None:
        raise ValueError(
            f"{name} schedule {schedule!r} gives {number:g} at step {step}{_for(where)}; "
            f"{name} must stay in [0, 1) over the whole run (1.0 would prune every weight): "
            "lower its final value or end it before it leaves the range"
        )
    raise ValueError(
        f"{name}={value!r}{_for(where)} must be in [0, 1): it is the fraction of zeros, so 0.8 "
        "keeps 20% of the weights"
    )


def drop_fraction(
    value: object, name: str = "drop_fraction", *, step: int | None = None, schedule: object = None
) -> float:
    """A drop fraction: the share of active weights replaced per update, in ``[0, 1]``.

    Args:
        value: the drop fraction.
        name: what to call it.
        step, schedule: the step and schedule the value comes from (a scheduled value).

    Raises:
        TypeError: not a real number.
        ValueError: outside ``[0, 1]``, NaN included.
    """
    if not is_number(value):
        raise TypeError(
            f"{name}={value!r} must be a number: a float in [0, 1] (the share of active weights "
            "replaced per update), e.g. 0.3"
        )
    # is_number(value) held above; _scalar returns it as an object.
    number = float(_scalar(value))  # type: ignore[arg-type]
    if 0.0 <= number <= 1.0:
        return number
    if step is not None:
        raise ValueError(
            f"{name} schedule {schedule!r} gives {number:g} at step {step}; it is the share of "
            "active weights replaced per update, so it must stay in [0, 1] (the RigL paper uses "
            "0.3 decayed by a cosine)"
        )
    raise ValueError(
        f"{name}={value!r} must be in [0, 1]: it is the share of active weights replaced per "
        "update (the RigL paper uses 0.3)"
    )


def seed(value: object) -> int | None:
    """A seed: an int, or ``None`` for the experiment's torch seed.

    Raises:
        TypeError: anything else.
    """
    if value is None:
        return None
    if not is_integer(value):
        raise TypeError(
            f"seed={value!r} must be an int, or None for the experiment's seed (e.g. seed=0)"
        )
    # is_integer(value) held above; _scalar returns it as an object.
    return int(_scalar(value))  # type: ignore[call-overload]

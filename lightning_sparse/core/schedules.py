"""Schedules: hyper-parameters as ``step -> float`` (mask-update cadences, ``step -> bool``, are in
`cadences` and re-exported here).

Everything here is host-side Python arithmetic on an ``int`` step (completed optimizer steps), so
evaluating a schedule never creates a tensor or forces a host sync. The classes and their dict
form (``{"type": "cosine", "init": 0.3, "half_period": 3584}``) follow Cerebras
``cstorch.sparse`` (2.2-2.10) and fix its bugs: an unknown ``type`` names the valid ones,
``Cycling`` state survives ``load_state_dict``, and a callable update cadence works.
``Cubic``/``Polynomial`` (GMP and GraNet sparsity ramps) are additions.
"""

from __future__ import annotations

import inspect
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from . import validate
from .cadences import (  # noqa: F401  (re-exported: their home before `cadences`; `legacy`)
    CallableSchedule,
    FreqSchedule,
    ListSchedule,
    NeverSchedule,
    StepFunction,
    UpdateSchedule,
    _callable_name,
    _int,
    _repr_from_init,
    make_update_schedule,
)


def _real(owner: str, name: str, value: object) -> float:
    return validate.real(value, name, owner=owner)


_LOG_MAX = math.log(sys.float_info.max)  # exp(x) overflows a float beyond this x


def _last_finite(power: Callable[[int], float], estimate: float) -> int:
    """The last step ``t`` at which ``power(t)`` does not overflow, near ``estimate`` (the
    logarithm's answer, off by one either way from rounding)."""

    def finite(t: int) -> bool:
        try:
            return math.isfinite(power(t))
        except OverflowError:
            return False

    t = math.floor(estimate)
    while t > 0 and not finite(t):
        t -= 1
    while finite(t + 1):
        t += 1
    return t


# --------------------------------------------------------------------------------------------
# Hyper-parameter schedules: step -> float
# --------------------------------------------------------------------------------------------


class HyperParameterSchedule(ABC):
    """A hyper-parameter (sparsity, drop fraction, ...) as a pure function of the step.

    Subclasses store each constructor argument under its own name; ``__repr__`` and the dict
    form (``make_hyperparam_schedule``) rely on that. No schedule holds state: a resumed run
    evaluates the same function at the restored step.
    """

    @abstractmethod
    def __call__(self, step: int) -> float:
        """Return the value at ``step`` (completed optimizer steps)."""

    def milestones(self) -> tuple[int, ...]:
        """Steps where the value reaches a final level and an update must happen (GMP ramps)."""
        return ()

    def defined_until(self) -> int | None:
        """The last step at which the formula can be computed in floating point (``None``: every
        step); past it the schedule overflows (`Exp`, `Power` growing without bound)."""
        return None

    def __repr__(self) -> str:
        return _repr_from_init(self)


class Constant(HyperParameterSchedule):
    """``y(t) = value``."""

    def __init__(self, value: float) -> None:
        self.value = _real("Constant", "value", value)

    def __call__(self, step: int) -> float:
        return self.value


class Linear(HyperParameterSchedule):
    """``y(t) = init + slope * t`` (not clamped; algorithms clamp sparsity to [0, 1))."""

    def __init__(self, init: float, slope: float) -> None:
        init, slope = _real("Linear", "init", init), _real("Linear", "slope", slope)
        self.init, self.slope = init, slope

    def __call__(self, step: int) -> float:
        return self.init + self.slope * step


class Exp(HyperParameterSchedule):
    """``y(t) = final - (final - init) * exp(gamma * t)``; approaches ``final`` when gamma < 0."""

    def __init__(self, init: float, gamma: float, final: float = 1.0) -> None:
        init, gamma = _real("Exp", "init", init), _real("Exp", "gamma", gamma)
        self.init, self.gamma, self.final = init, gamma, _real("Exp", "final", final)

    def __call__(self, step: int) -> float:
        return self.final - (self.final - self.init) * math.exp(self.gamma * step)

    def defined_until(self) -> int | None:
        """``exp(gamma * t)`` overflows once ``gamma * t > log(float max)`` (gamma > 0)."""
        if self.gamma <= 0:
            return None
        return _last_finite(lambda t: math.exp(self.gamma * t), _LOG_MAX / self.gamma)


class Power(HyperParameterSchedule):
    """``y(t) = init * beta ** t``."""

    def __init__(self, init: float, beta: float) -> None:
        init, beta = _real("Power", "init", init), _real("Power", "beta", beta)
        self.init, self.beta = init, beta

    def __call__(self, step: int) -> float:
        return self.init * self.beta**step

    def defined_until(self) -> int | None:
        """``beta ** t`` overflows once ``t * log|beta| > log(float max)`` (``|beta| > 1``)."""
        if abs(self.beta) <= 1:
            return None
        return _last_finite(lambda t: self.beta**t, _LOG_MAX / math.log(abs(self.beta)))


class Cosine(HyperParameterSchedule):
    """``y(t) = o + a * cos(pi * t / half_period)``, ``o = (init + minimum) / 2``, ``a = init - o``.

    ``init`` at t = 0, ``minimum`` at t = half_period, ``init`` again at 2 * half_period
    (``half_period`` is half a cycle, not the full cycle Cerebras' docstring claims).
    """

    def __init__(self, init: float, half_period: float, minimum: float = 0.0) -> None:
        init, minimum = _real("Cosine", "init", init), _real("Cosine", "minimum", minimum)
        half_period = _real("Cosine", "half_period", half_period)
        if half_period <= 0:
            raise ValueError(
                f"Cosine half_period must be > 0 steps, got {half_period!r}; pass the number of "
                f"steps from init down to minimum"
            )
        self.init, self.half_period, self.minimum = init, half_period, minimum

    def __call__(self, step: int) -> float:
        offset = (self.init + self.minimum) / 2
        return offset + (self.init - offset) * math.cos(math.pi * step / self.half_period)


class Cycling(HyperParameterSchedule):
    """``y(t) = values[k % len(values)]``, ``k`` = mask updates before step ``t``.

    A pure function once bound to the algorithm's update cadence (``bind``; algorithms do this),
    so nothing needs saving: paired with ``ListSchedule`` it is piecewise constant, value i
    used from the i-th update on. Unbound, every step counts as an update.
    """

    def __init__(self, values: list[float]) -> None:
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(f"Cycling values must be a list of floats, got {values!r}")
        values = [_real("Cycling", f"values[{i}]", v) for i, v in enumerate(values)]
        if not values:
            raise ValueError("Cycling values must be non-empty, got []; pass at least one value")
        self.values = values
        self._cadence: UpdateSchedule | None = None
        self._count_zero = True

    def bind(self, cadence: UpdateSchedule, count_zero: bool = True) -> Cycling:
        """A copy whose index counts the update steps of ``cadence`` before the step
        (step 0 included when ``count_zero``: the initial mask is the first update)."""
        bound = Cycling(self.values)
        bound._cadence, bound._count_zero = cadence, count_zero
        return bound

    def __call__(self, step: int) -> float:
        if self._cadence is None:
            return self.values[step % len(self.values)]
        k = self._cadence.count(step)
        if not self._count_zero and step > 0 and self._cadence(0):
            k -= 1
        return self.values[k % len(self.values)]


class Lambda(StepFunction, HyperParameterSchedule):
    """``y(t) = float(fn(t))`` for any Python callable ``fn: int -> float``."""

    cast = float


class Polynomial(HyperParameterSchedule):
    """Polynomial ramp from ``init`` (until ``begin``) to ``final`` (from ``end`` on).

    ``y(t) = final + (init - final) * (1 - (t - begin) / (end - begin)) ** power`` for
    ``begin <= t <= end``. With ``power=3`` this is the gradual-pruning ramp of "To prune, or
    not to prune" (Zhu & Gupta, arXiv:1710.01878) also used by GraNet (Liu et al.,
    arXiv:2106.10404): it prunes fast early, while many redundant weights remain.
    """

    def __init__(self, init: float, final: float, begin: int, end: int, power: float = 3.0) -> None:
        owner = type(self).__name__
        init, final = _real(owner, "init", init), _real(owner, "final", final)
        begin, end = _int(owner, "begin", begin, 0), _int(owner, "end", end, 0)
        power = _real(owner, "power", power)
        if end <= begin:
            raise ValueError(
                f"{owner} end must be > begin, got begin={begin!r}, end={end!r}; "
                f"pass the step where the ramp finishes"
            )
        if power <= 0:
            raise ValueError(f"{owner} power must be > 0, got {power!r}")
        self.init, self.final, self.begin, self.end, self.power = init, final, begin, end, power

    def __call__(self, step: int) -> float:
        if step <= self.begin:  # exact endpoints: no rounding through the formula
            return self.init
        if step >= self.end:
            return self.final
        progress = (step - self.begin) / (self.end - self.begin)
        return self.final + (self.init - self.final) * (1.0 - progress) ** self.power

    def milestones(self) -> tuple[int, ...]:
        """The ramp's end: GMP/GraNet update there whatever their cadence, to reach ``final``."""
        return (self.end,)


class Cubic(Polynomial):
    """``Polynomial`` with ``power=3``: the GMP / GraNet sparsity ramp (arXiv:1710.01878)."""

    def __init__(self, init: float, final: float, begin: int, end: int) -> None:
        super().__init__(init, final, begin, end, power=3.0)


SCHEDULES: dict[str, type[HyperParameterSchedule]] = {
    cls.__name__.lower(): cls
    for cls in (Constant, Linear, Exp, Power, Cosine, Cycling, Lambda, Polynomial, Cubic)
}
"""``type`` name -> class: the explicit registry. Add yours with ``SCHEDULES["mine"] = Mine``."""


def _from_dict(config: dict[str, Any]) -> HyperParameterSchedule:
    kwargs = dict(config)
    name = kwargs.pop("type", None)
    if not isinstance(name, str):
        raise ValueError(
            f"schedule dict {config!r} needs a string 'type' key, e.g. "
            f"{{'type': 'cosine', 'init': 0.3, 'half_period': 1000}}"
        )
    classes = SCHEDULES
    cls = classes.get(name.lower())
    if cls is None:
        raise ValueError(
            f"unknown schedule type {name!r}; valid types: {', '.join(sorted(classes))} "
            f"(register your own with SCHEDULES['name'] = YourSchedule)"
        )
    signature = inspect.signature(cls)
    try:  # check the keys first, so a bad *value* keeps its own error message
        signature.bind(**kwargs)
    except TypeError as err:
        raise TypeError(
            f"schedule type {name!r} got keys {sorted(kwargs)} ({err}); accepted keys: "
            f"{', '.join(signature.parameters)}"
        ) from None
    return cls(**kwargs)


def make_hyperparam_schedule(value: Any) -> HyperParameterSchedule:
    """Build a schedule from any of its accepted forms.

    Args:
        value: a ``HyperParameterSchedule`` (returned as is); an int or float (``Constant``); a
            list or tuple of numbers (``Cycling``); a dict with ``"type"`` naming a class (by
            lower-cased name) and its constructor arguments as the other keys; or a callable
            ``step -> float`` (``Lambda``).

    Returns:
        The schedule.

    Raises:
        ValueError: for an unsupported form, a dict without ``type``, an unknown ``type`` or an
            out-of-range argument.
        TypeError: for missing or unexpected dict keys, or a non-numeric argument.
    """
    if isinstance(value, HyperParameterSchedule):
        return value
    if validate.is_number(value):
        return Constant(value)
    if isinstance(value, (list, tuple)):
        return Cycling(list(value))
    if isinstance(value, dict):
        return _from_dict(value)
    if callable(value) and not isinstance(value, type):
        return Lambda(value)
    raise ValueError(
        f"cannot build a hyper-parameter schedule from {value!r} ({type(value).__name__}); "
        f"pass a number, a list of numbers, a dict with 'type', a callable step -> float, or a "
        f"HyperParameterSchedule instance"
    )


# --------------------------------------------------------------------------------------------
# Validation over the training range
# --------------------------------------------------------------------------------------------

_MAX_CHECKED_STEPS = 20_000


def steps_to_check(cadence: UpdateSchedule, horizon: int, extra: Iterable[int] = ()) -> list[int]:
    """The update steps of ``cadence`` in ``[0, horizon]`` plus ``extra``, at most ~20k of them
    (evenly thinned beyond that: schedules here are smooth, so a thinned check finds a range
    error within one thinning interval)."""
    stride = max(1, (horizon + 1) // _MAX_CHECKED_STEPS)
    steps = {s for s in range(0, horizon + 1, stride) if cadence(s)}
    steps |= {s for s in extra if 0 <= s <= horizon}
    last = cadence.last()
    if last is not None and last <= horizon and cadence(last):
        steps.add(last)
    return sorted(steps)


def evaluate(schedule: HyperParameterSchedule, step: int, what: str) -> float:
    """``schedule(step)`` as a finite float, or a ``ValueError`` naming ``what``, step and fix."""
    try:
        value = float(schedule(step))
    except (OverflowError, ZeroDivisionError, ValueError, TypeError) as err:
        raise ValueError(
            f"{what} schedule {schedule!r} fails at step {step} ({type(err).__name__}: {err}); "
            "choose parameters that stay finite over the whole run (Exp: gamma < 0 decays "
            "towards final; a smaller gamma or |beta| overflows later)"
        ) from None
    if not math.isfinite(value):
        raise ValueError(
            f"{what} schedule {schedule!r} gives {value} at step {step}; it must stay finite "
            "over the whole run"
        )
    return value


def first_undefined_use(
    schedule: HyperParameterSchedule, cadence: UpdateSchedule, extra: Iterable[int] = ()
) -> int | None:
    """The first step at which ``schedule`` would be used (an update step of ``cadence``, or one
    of ``extra``) past its `~HyperParameterSchedule.defined_until`, however long the run is;
    ``None`` when it is never used there. Such a schedule fails at that step in any run that
    reaches it, so algorithms refuse it when built (an ``Exp`` whose gamma overflows)."""
    limit = schedule.defined_until()
    if limit is None:
        return None
    uses = [s for s in (cadence.next_update(limit + 1), *extra) if s is not None and s > limit]
    return min(uses, default=None)


def check_schedule(
    schedule: HyperParameterSchedule,
    what: str,
    cadence: UpdateSchedule,
    horizon: int,
    extra: Iterable[int],
    check: Callable[..., float],
) -> None:
    """Check the values of ``schedule`` used in ``[0, horizon]`` (`steps_to_check`) with
    ``check``, the validator of their kind (`validate.sparsity`, `validate.drop_fraction`), and
    refuse a schedule that fails at any later update step (`first_undefined_use`).

    Raises:
        ValueError: a value out of range or not finite, naming ``what``, the step and the fix.
    """
    for step in steps_to_check(cadence, horizon, extra):
        check(evaluate(schedule, step, what), step=step, schedule=schedule)
    undefined = first_undefined_use(schedule, cadence, extra)
    if undefined is not None:
        evaluate(schedule, undefined, what)  # raises naming the step (the overflow)


# --------------------------------------------------------------------------------------------
# What algorithms accept
# --------------------------------------------------------------------------------------------

ScheduleSpec = float | list | dict | Callable[[int], float] | HyperParameterSchedule
UpdateSpec = int | list | dict | Callable[[int], bool] | UpdateSchedule | None


def _scalar_like(value: object) -> bool:
    return value is None or isinstance(value, str | bytes | bool)


def bind(
    schedule: ScheduleSpec,
    cadence: UpdateSchedule,
    count_zero: bool,
    check: Callable[..., float] | None = None,
) -> HyperParameterSchedule:
    """A schedule from any accepted form; a `Cycling` one counts ``cadence``'s updates.

    Args:
        schedule: the spec (see `make_hyperparam_schedule`).
        cadence: the algorithm's update cadence.
        count_zero: whether step 0 counts as an update for `Cycling`.
        check: the validator of the value's kind (`validate.sparsity`, `validate.drop_fraction`),
            run on a number or each number of a list, so the error names the argument and its
            range rather than the schedule class.
    """
    if check is not None and (validate.is_number(schedule) or _scalar_like(schedule)):
        schedule = check(schedule)  # a bad scalar (str, bool, None) gets the kind's TypeError
    elif check is not None and isinstance(schedule, list | tuple):
        schedule = [check(v) if validate.is_number(v) else v for v in schedule]
    built = make_hyperparam_schedule(schedule)
    return built.bind(cadence, count_zero) if isinstance(built, Cycling) else built

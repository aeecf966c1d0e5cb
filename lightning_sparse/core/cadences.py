"""Update cadences: when masks are recomputed, as pure ``step -> bool`` functions.

The forms follow Cerebras ``cstorch.sparse`` (2.2-2.10): ``None`` = every step, an int ``n``
(every ``n`` steps), ``{"freq", "start", "stop"}`` (stop exclusive), ``{"steps": [...]}``, or a
callable; ``step`` counts completed optimizer steps. Host-side Python on an ``int``: evaluating a
cadence never creates a tensor. Hyper-parameter schedules (``step -> float``) are in
`schedules`.
"""

from __future__ import annotations

import bisect
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from . import validate

__all__ = [
    "CallableSchedule",
    "FreqSchedule",
    "ListSchedule",
    "NeverSchedule",
    "UpdateSchedule",
    "make_update_schedule",
]


def _int(owner: str, name: str, value: object, minimum: int) -> int:
    return validate.integer(value, name, minimum, owner=owner, unit="steps")


def _repr_from_init(obj: object) -> str:
    """``Name(arg=value, ...)`` from the constructor's argument names stored on ``obj``."""
    names = inspect.signature(type(obj).__init__).parameters
    args = ", ".join(f"{n}={getattr(obj, n)!r}" for n in names if hasattr(obj, n))
    return f"{type(obj).__name__}({args})"


def _callable_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of ``fn``: a repr without a memory address."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


class StepFunction:
    """A schedule that is a Python function of the step: ``cast(fn(step))``. Mixed into
    `CallableSchedule` (``cast = bool``) and `schedules.Lambda` (``cast = float``), before
    their schedule base."""

    cast: ClassVar[type]  # bool or float

    def __init__(self, fn: Callable[[int], Any]) -> None:
        if not callable(fn):
            raise TypeError(
                f"{type(self).__name__} fn must be callable step -> {self.cast.__name__}, "
                f"got {fn!r}"
            )
        self.fn = fn

    def __call__(self, step: int) -> Any:
        return self.cast(self.fn(step))

    def __repr__(self) -> str:  # stable across processes (checkpoints compare it)
        return f"{type(self).__name__}(fn={_callable_name(self.fn)})"


class UpdateSchedule(ABC):
    """When masks are recomputed: ``schedule(step)`` is True on update steps."""

    @abstractmethod
    def __call__(self, step: int) -> bool:
        """Return whether masks are updated at ``step`` (completed optimizer steps)."""

    def count(self, step: int) -> int:
        """Number of update steps in ``[0, step)`` (the generic form walks the steps)."""
        return sum(1 for s in range(step) if self(s))

    def last(self) -> int | None:
        """The last step that can be an update step, or ``None`` when updates never end."""
        return None

    def next_update(self, step: int) -> int | None:
        """The first update step ``>= step``, or ``None`` when none comes (the generic form
        walks the steps up to `last`; an open-ended cadence is assumed to reach ``step``)."""
        last = self.last()
        if last is None:
            return step
        return next((s for s in range(step, last + 1) if self(s)), None)

    def __repr__(self) -> str:
        return _repr_from_init(self)


class FreqSchedule(UpdateSchedule):
    """Every ``freq`` steps from ``start`` up to, not including, ``stop``.

    ``update(t) = t >= start and (t - start) % freq == 0 and (stop is None or t < stop)``.
    """

    def __init__(self, freq: int = 1, start: int = 0, stop: int | None = None) -> None:
        freq = _int("FreqSchedule", "freq", freq, 1)
        start = _int("FreqSchedule", "start", start, 0)
        if stop is not None:
            stop = _int("FreqSchedule", "stop", stop, 0)
            if stop <= start:
                raise ValueError(
                    f"FreqSchedule stop must be > start (stop is exclusive), got start={start!r}, "
                    f"stop={stop!r}; pass stop=None to update until the end of training"
                )
        self.freq, self.start, self.stop = freq, start, stop

    def __call__(self, step: int) -> bool:
        in_range = step >= self.start and (self.stop is None or step < self.stop)
        return in_range and (step - self.start) % self.freq == 0

    def count(self, step: int) -> int:
        end = step if self.stop is None else min(step, self.stop)
        return max(0, -(-(end - self.start) // self.freq))

    def last(self) -> int | None:
        return None if self.stop is None else self.stop - 1

    def next_update(self, step: int) -> int | None:
        first = self.start + max(0, -(-(step - self.start) // self.freq)) * self.freq
        return first if self.stop is None or first < self.stop else None


class ListSchedule(UpdateSchedule):
    """At exactly the listed steps: ``update(t) = t in steps``."""

    def __init__(self, steps: Iterable[int]) -> None:
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise TypeError(f"ListSchedule steps must be a list of ints, got {steps!r}")
        checked = [_int("ListSchedule", f"steps[{i}]", s, 0) for i, s in enumerate(steps)]
        if not checked:
            raise ValueError("ListSchedule steps must be non-empty, got []; pass at least one step")
        self.steps = tuple(sorted(set(checked)))
        self._lookup = frozenset(self.steps)

    def __call__(self, step: int) -> bool:
        return step in self._lookup

    def count(self, step: int) -> int:
        return bisect.bisect_left(self.steps, step)

    def last(self) -> int | None:
        return self.steps[-1]

    def next_update(self, step: int) -> int | None:
        i = bisect.bisect_left(self.steps, step)
        return self.steps[i] if i < len(self.steps) else None


class NeverSchedule(UpdateSchedule):
    """No update step at all (``Static``)."""

    def __call__(self, step: int) -> bool:
        return False

    def count(self, step: int) -> int:
        return 0

    def last(self) -> int | None:
        return 0

    def next_update(self, step: int) -> int | None:
        return None


class CallableSchedule(StepFunction, UpdateSchedule):
    """``update(t) = bool(fn(t))``; ``fn`` should return a Python bool (a tensor would sync)."""

    cast = bool


_UPDATE_FORMS = (
    "None (every step), an int n (every n steps), {'freq': n, 'start': a, 'stop': b}, "
    "{'steps': [...]}, a list of ints, a callable step -> bool, or an UpdateSchedule"
)


def make_update_schedule(update: Any) -> UpdateSchedule:
    """Build an update cadence from any of its accepted forms.

    Args:
        update: an ``UpdateSchedule`` (returned as is); ``None`` (every step); an int ``n``
            (``FreqSchedule(n)``, the 2.0/2.1 ``schedule:`` form); a dict with ``freq`` and
            optional ``start``/``stop`` (``FreqSchedule``); a dict with ``steps`` or a list/tuple
            of ints (``ListSchedule``); or a callable ``step -> bool`` (``CallableSchedule``).

    Returns:
        The update schedule.

    Raises:
        ValueError: for an unsupported form, an unknown dict key or an out-of-range argument.
        TypeError: for a non-integer step argument.
    """
    if isinstance(update, UpdateSchedule):
        return update
    if update is None:
        return FreqSchedule(1)
    if validate.is_integer(update):
        return FreqSchedule(update)
    if isinstance(update, dict):
        accepted = {"steps"} if "steps" in update else {"freq", "start", "stop"}
        for key in update:
            if key not in accepted:
                raise ValueError(
                    f"unknown update key {key!r} in {update!r}; a dict takes "
                    f"{sorted(accepted)} (accepted forms: {_UPDATE_FORMS})"
                )
        if "steps" in update:
            return ListSchedule(update["steps"])
        if "freq" not in update:
            raise ValueError(
                f"update dict {update!r} needs 'freq' or 'steps'; "
                f"write e.g. {{'freq': 100, 'stop': 3584}}"
            )
        return FreqSchedule(**update)
    if isinstance(update, (list, tuple)):
        return ListSchedule(update)
    if callable(update) and not isinstance(update, type):
        return CallableSchedule(update)
    raise ValueError(
        f"cannot build an update schedule from {update!r} ({type(update).__name__}); "
        f"accepted forms: {_UPDATE_FORMS}"
    )

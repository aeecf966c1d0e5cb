"""Tests for lightning_sparse.core.schedules: hand-computed values, dict forms, state and errors."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.core.schedules import (
    SCHEDULES,
    CallableSchedule,
    Constant,
    Cosine,
    Cubic,
    Cycling,
    Exp,
    FreqSchedule,
    HyperParameterSchedule,
    Lambda,
    Linear,
    ListSchedule,
    Polynomial,
    Power,
    make_hyperparam_schedule,
    make_update_schedule,
)

fractions = st.floats(0.0, 1.0, allow_nan=False)

# ---------------------------------------------------------------- hyper-parameter golden values


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (Constant(0.5), {0: 0.5, 7: 0.5, 10**6: 0.5}),
        (Linear(0.1, 0.01), {0: 0.1, 10: 0.2, 100: 1.1}),  # not clamped
        # gamma = -ln 2 / 10 halves the gap to `final` every 10 steps: 0.8 -> 0.4 -> 0.2.
        (Exp(0.2, -math.log(2) / 10), {0: 0.2, 10: 0.6, 20: 0.8}),
        (Exp(0.5, -math.log(2), final=0.0), {0: 0.5, 1: 0.25, 2: 0.125}),
        (Power(0.8, 0.5), {0: 0.8, 1: 0.4, 3: 0.1}),
        (Cosine(0.3, 100), {0: 0.3, 50: 0.15, 100: 0.0, 150: 0.15, 200: 0.3}),
        # o = 0.3, a = 0.2: minimum at half_period, halfway at a quarter period.
        (Cosine(0.5, 10, minimum=0.1), {0: 0.5, 5: 0.3, 10: 0.1, 20: 0.5}),
        (Lambda(lambda t: t / 10), {0: 0.0, 5: 0.5, 30: 3.0}),
        # (1 - 1/2)^3 = 1/8 and (1 - 1/4)^3 = 27/64 of the 0.9 gap remain at mid and quarter.
        (Cubic(0.0, 0.9, 100, 200), {0: 0.0, 100: 0.0, 125: 0.9 - 0.9 * 27 / 64, 150: 0.7875}),
        (Cubic(0.0, 0.9, 100, 200), {200: 0.9, 10**5: 0.9}),
        (Polynomial(0.2, 0.8, 0, 10, power=1.0), {0: 0.2, 5: 0.5, 10: 0.8}),
        (Polynomial(0.2, 0.8, 0, 10, power=2.0), {5: 0.65, 20: 0.8}),
    ],
    ids=repr,
)
def test_golden_values(schedule: HyperParameterSchedule, expected: dict[int, float]) -> None:
    for step, value in expected.items():
        assert schedule(step) == pytest.approx(value, abs=1e-12), step
        assert type(schedule(step)) is float


def gmp_sparsity(t: int, s_i: float, s_f: float, t0: int, n: int, dt: int) -> float:
    """Zhu & Gupta (arXiv:1710.01878) eq. 1, written out as in the paper."""
    if t < t0:
        return s_i
    if t > t0 + n * dt:
        return s_f
    return s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3


@given(s_i=fractions, s_f=fractions, t0=st.integers(0, 1000), n=st.integers(1, 50))
@settings(max_examples=50, deadline=None)
def test_cubic_matches_gmp_formula(s_i: float, s_f: float, t0: int, n: int) -> None:
    dt = 10
    cubic = Cubic(s_i, s_f, t0, t0 + n * dt)
    for t in range(max(t0 - 20, 0), t0 + n * dt + 20, 7):
        assert cubic(t) == pytest.approx(gmp_sparsity(t, s_i, s_f, t0, n, dt), abs=1e-12)


@given(
    init=fractions,
    final=fractions,
    begin=st.integers(0, 100),
    length=st.integers(1, 100),
    power=st.floats(0.1, 5.0),
)
@settings(max_examples=50, deadline=None)
def test_polynomial_moves_monotonically_from_init_to_final(
    init: float, final: float, begin: int, length: int, power: float
) -> None:
    schedule = Polynomial(init, final, begin, begin + length, power=power)
    values = [schedule(t) for t in range(begin + length + 3)]
    assert values[begin] == init and values[-1] == final
    step_sign = [
        math.copysign(1.0, final - init) * (b - a)
        for a, b in zip(values[:-1], values[1:], strict=True)
    ]
    assert all(d >= -1e-12 for d in step_sign)


@given(
    init=fractions,
    minimum=fractions,
    half_period=st.integers(1, 5000),
    step=st.integers(0, 10**5),
)
@settings(max_examples=50, deadline=None)
def test_cosine_bounded_and_periodic(init: float, minimum: float, half_period: int, step: int):
    schedule = Cosine(init, half_period, minimum)
    assert min(init, minimum) - 1e-12 <= schedule(step) <= max(init, minimum) + 1e-12
    assert schedule(step + 2 * half_period) == pytest.approx(schedule(step), abs=1e-9)


def test_cubic_is_polynomial_power_3() -> None:
    cubic, poly = Cubic(0.1, 0.8, 5, 55), Polynomial(0.1, 0.8, 5, 55, power=3.0)
    assert [cubic(t) for t in range(70)] == [poly(t) for t in range(70)]
    assert repr(cubic) == "Cubic(init=0.1, final=0.8, begin=5, end=55)"


def test_repr_names_arguments() -> None:
    assert repr(Cosine(0.3, 100, minimum=0.1)) == "Cosine(init=0.3, half_period=100.0, minimum=0.1)"
    assert repr(FreqSchedule(100, stop=3584)) == "FreqSchedule(freq=100, start=0, stop=3584)"
    assert repr(ListSchedule([8, 0, 6])) == "ListSchedule(steps=(0, 6, 8))"


# ---------------------------------------------------------------- Cycling: pure, bound to a cadence


def test_cycling_counts_the_update_steps_before_the_step_and_wraps() -> None:
    cadence = ListSchedule([0, 2, 3, 5])
    schedule = Cycling([0.1, 0.3, 0.5]).bind(cadence)
    # updates before step t: t=0 -> 0, t=1..2 -> 1, t=3 -> 2, t=4..5 -> 3 (wraps to 0.1), t=6 -> 4
    assert [schedule(t) for t in range(7)] == [0.1, 0.3, 0.3, 0.5, 0.1, 0.1, 0.3]
    not_zero = Cycling([0.1, 0.3, 0.5]).bind(cadence, count_zero=False)
    assert [not_zero(t) for t in (0, 2, 3, 5)] == [0.1, 0.1, 0.3, 0.5]


@given(
    freq=st.integers(1, 5),
    start=st.integers(0, 6),
    n_values=st.integers(1, 5),
    step=st.integers(0, 60),
)
@settings(max_examples=60, deadline=None)
def test_cycling_is_a_pure_function_of_the_step(
    freq: int, start: int, n_values: int, step: int
) -> None:
    """Same value whatever was evaluated before (a resumed run needs no schedule state); equal
    to a walk that counts the update steps one by one."""
    cadence = FreqSchedule(freq, start=start)
    values = [i / 10 for i in range(n_values)]
    schedule = Cycling(values).bind(cadence)
    walked = sum(1 for s in range(step) if cadence(s))
    assert schedule(step) == values[walked % n_values]
    assert cadence.count(step) == walked


def test_schedules_hold_no_state() -> None:
    schedule = Cosine(0.3, 100)
    assert not hasattr(schedule, "state_dict") and not hasattr(schedule, "update")
    assert schedule(50) == pytest.approx(0.15)


# ---------------------------------------------------------------- make_hyperparam_schedule


def test_cerebras_dict_form() -> None:
    schedule = make_hyperparam_schedule({"type": "cosine", "init": 0.3, "half_period": 3584})
    assert isinstance(schedule, Cosine)
    assert (schedule.init, schedule.half_period, schedule.minimum) == (0.3, 3584, 0.0)
    assert schedule(3584) == pytest.approx(0.0, abs=1e-12)
    assert isinstance(
        make_hyperparam_schedule({"type": "Cubic", "init": 0, "final": 0.9, "begin": 0, "end": 10}),
        Cubic,
    )
    assert make_hyperparam_schedule({"type": "constant", "value": 0.75})(10) == 0.75


def test_make_hyperparam_schedule_forms() -> None:
    cosine = Cosine(0.3, 100)
    assert make_hyperparam_schedule(cosine) is cosine
    assert isinstance(make_hyperparam_schedule(1), Constant)
    assert make_hyperparam_schedule(0.9)(123) == 0.9
    cycling = make_hyperparam_schedule((0.1, 0.3))
    assert isinstance(cycling, Cycling) and cycling.values == [0.1, 0.3]
    lam = make_hyperparam_schedule(lambda t: 0.5 * t)
    assert isinstance(lam, Lambda) and lam(4) == 2.0


def test_registry_and_user_subclasses(monkeypatch: pytest.MonkeyPatch) -> None:
    class Halving(HyperParameterSchedule):
        def __init__(self, init: float) -> None:
            self.init = init

        def __call__(self, step: int) -> float:
            return self.init / 2**step

    with pytest.raises(ValueError, match="unknown schedule type 'halving'"):
        make_hyperparam_schedule({"type": "halving", "init": 0.8})  # explicit registry only
    monkeypatch.setitem(SCHEDULES, "half", Halving)
    assert isinstance(make_hyperparam_schedule({"type": "half", "init": 0.8}), Halving)
    assert set(SCHEDULES) >= {
        "constant",
        "linear",
        "exp",
        "power",
        "cosine",
        "cycling",
        "lambda",
        "cubic",
        "polynomial",
    }


# ---------------------------------------------------------------- errors name the bad value


@pytest.mark.parametrize(
    ("build", "error", "needles"),
    [
        (
            lambda: make_hyperparam_schedule({"type": "cosin"}),
            ValueError,
            ["'cosin'", "valid types", "constant, cosine"],
        ),
        (lambda: make_hyperparam_schedule({"init": 0.3}), ValueError, ["'type'", "{'init': 0.3}"]),
        (
            lambda: make_hyperparam_schedule({"type": "cosine", "init": 0.3}),
            TypeError,
            ["'cosine'", "half_period", "accepted keys: init, half_period, minimum"],
        ),
        (
            lambda: make_hyperparam_schedule({"type": "constant", "value": 1, "vale": 2}),
            TypeError,
            ["'constant'", "'vale'", "accepted keys: value"],
        ),
        (
            lambda: make_hyperparam_schedule({"type": "constant", "value": "0.5"}),
            TypeError,
            ["Constant value", "'0.5'"],
        ),
        (lambda: make_hyperparam_schedule(True), ValueError, ["True", "a number"]),
        (lambda: make_hyperparam_schedule("cosine"), ValueError, ["'cosine'", "dict with 'type'"]),
        (lambda: make_hyperparam_schedule(Cosine), ValueError, ["Cosine", "instance"]),
        (lambda: make_hyperparam_schedule([]), ValueError, ["Cycling values", "[]"]),
        (lambda: Cycling([0.1, "x"]), TypeError, ["values[1]", "'x'"]),
        (lambda: Cosine(0.3, 0), ValueError, ["half_period", "0"]),
        (lambda: Cosine(0.3, -5), ValueError, ["half_period", "-5"]),
        (lambda: Constant(float("nan")), ValueError, ["Constant value", "nan"]),
        (lambda: Cubic(0.0, 0.9, 100, 100), ValueError, ["Cubic", "begin=100", "end=100"]),
        (lambda: Polynomial(0.0, 0.9, 0, 10, power=0), ValueError, ["power", "0"]),
        (lambda: Polynomial(0.0, 0.9, 1.5, 10), TypeError, ["begin", "1.5"]),
        (lambda: Lambda(3), TypeError, ["Lambda fn", "3"]),
        (lambda: FreqSchedule(0), ValueError, ["freq", "got 0"]),
        (lambda: FreqSchedule(1, start=-1), ValueError, ["start", "-1"]),
        (lambda: FreqSchedule(1, start=10, stop=10), ValueError, ["start=10", "stop=10"]),
        (lambda: FreqSchedule(2.5), TypeError, ["freq", "2.5"]),
        (lambda: ListSchedule([]), ValueError, ["ListSchedule steps", "[]"]),
        (lambda: ListSchedule([3, -2]), ValueError, ["steps[1]", "-2"]),
        (lambda: ListSchedule([1, 2.0]), TypeError, ["steps[1]", "2.0"]),
        (lambda: CallableSchedule("every"), TypeError, ["'every'"]),
        (lambda: make_update_schedule({"freq": 10, "strat": 5}), ValueError, ["'strat'"]),
        (lambda: make_update_schedule({"steps": [1], "freq": 2}), ValueError, ["'freq'"]),
        (lambda: make_update_schedule({"start": 5}), ValueError, ["{'start': 5}", "'freq'"]),
        (lambda: make_update_schedule("often"), ValueError, ["'often'", "None (every step)"]),
        (lambda: make_update_schedule(True), ValueError, ["True"]),
        (lambda: make_update_schedule(0), ValueError, ["freq", "got 0"]),
    ],
)
def test_errors_name_the_bad_value(build, error: type[Exception], needles: list[str]) -> None:
    with pytest.raises(error) as info:
        build()
    for needle in needles:
        assert needle in str(info.value)


# ---------------------------------------------------------------- update cadences


def test_freq_schedule_start_offset_and_exclusive_stop() -> None:
    schedule = FreqSchedule(freq=100, start=50, stop=350)
    assert [t for t in range(1000) if schedule(t)] == [50, 150, 250]
    assert [t for t in range(12) if FreqSchedule(3)(t)] == [0, 3, 6, 9]
    assert not FreqSchedule(100, stop=3584)(3584) and FreqSchedule(100, stop=3584)(3500)


@given(
    freq=st.integers(1, 20),
    start=st.integers(0, 50),
    length=st.none() | st.integers(1, 100),
)
@settings(max_examples=50, deadline=None)
def test_freq_schedule_matches_range(freq: int, start: int, length: int | None) -> None:
    stop = None if length is None else start + length
    schedule = FreqSchedule(freq, start, stop)
    expected = set(range(start, 200 if stop is None else stop, freq))
    assert {t for t in range(200) if schedule(t)} == expected


def test_list_schedule() -> None:
    schedule = ListSchedule([8, 0, 6, 6])
    assert [t for t in range(20) if schedule(t)] == [0, 6, 8]
    assert schedule.steps == (0, 6, 8)


def test_make_update_schedule_forms() -> None:
    every = make_update_schedule(None)
    assert all(every(t) for t in range(50))
    assert [t for t in range(10) if make_update_schedule(4)(t)] == [0, 4, 8]
    freq = make_update_schedule({"freq": 100, "stop": 3584})
    assert isinstance(freq, FreqSchedule) and (freq.freq, freq.start, freq.stop) == (100, 0, 3584)
    listed = make_update_schedule({"steps": [0, 6, 8]})
    assert isinstance(listed, ListSchedule) and listed.steps == (0, 6, 8)
    assert make_update_schedule((2, 4)).steps == (2, 4)
    called = make_update_schedule(lambda t: int(t % 7 == 3))  # truthy int -> bool
    assert isinstance(called, CallableSchedule)
    assert [t for t in range(20) if called(t)] == [3, 10, 17]
    assert called(3) is True
    assert make_update_schedule(freq) is freq


def test_piecewise_schedule_from_cycling_and_list() -> None:
    """The 2.2+ GMP piecewise form: schedule [0.1, 0.3, 0.5] with update {steps: [0, 6, 8]}."""
    sparsity = make_hyperparam_schedule([0.1, 0.3, 0.5])
    update = make_update_schedule({"steps": [0, 6, 8]})
    bound = sparsity.bind(update)
    assert {step: bound(step) for step in range(10) if update(step)} == {0: 0.1, 6: 0.3, 8: 0.5}

"""One validator per kind of argument (`core/validate.py`): the same rule and message wherever a
value is met, numpy and 0-d tensor numbers accepted where a float or an int is, and schedules
that overflow at an update step refused when the algorithm is built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_sparse import configure
from lightning_sparse.core import GMP, SET, GraNet, RigL, Static, validate
from lightning_sparse.core.distributions import erk, uniform
from lightning_sparse.core.flops import transformer_flops
from lightning_sparse.core.init_methods import INIT_METHODS
from lightning_sparse.core.schedules import Exp, FreqSchedule, ListSchedule, Power
from lightning_sparse.core.shapers import NM, Blocks, OutputGroups

NAN = float("nan")
SPARSITY_RULE = "must be in [0, 1): it is the fraction of zeros"


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# ---------------------------------------------------------------- the validators


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (1.0, ValueError),
        (-0.1, ValueError),
        (NAN, ValueError),
        (True, TypeError),
        ("0.5", TypeError),
        (None, TypeError),
        (torch.ones(2), TypeError),
    ],
    ids=["1.0", "-0.1", "nan", "bool", "str", "none", "1-d tensor"],
)
def test_sparsity_names_value_rule_and_fix(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        validate.sparsity(bad, where="fc1.weight")
    message = str(info.value)
    assert f"sparsity={bad!r} for 'fc1.weight'" in message and "[0, 1)" in message
    assert "e.g. 0.8" in message or "0.8 keeps 20%" in message


@pytest.mark.parametrize(
    "good",
    [
        0,
        0.9,
        np.float32(0.8),
        np.float64(0.5),
        np.int64(0),
        torch.tensor(0.25),
        torch.tensor(0.5, dtype=torch.float64),
    ],
)
def test_numbers_numpy_users_pass_are_accepted_as_plain_floats(good: object) -> None:
    value = validate.sparsity(good)
    assert type(value) is float and value == float(good)  # type: ignore[arg-type]
    assert type(validate.drop_fraction(good)) is float


def test_integers_accept_numpy_and_refuse_fractions_and_bools() -> None:
    assert validate.integer(np.int64(100), "freq", 1) == 100
    assert type(validate.integer(torch.tensor(7), "freq", 1)) is int
    for bad in (2.0, 2.5, True, "3", np.float32(3)):
        with pytest.raises(TypeError, match=r"freq must be an int"):
            validate.integer(bad, "freq", 1)
    with pytest.raises(ValueError, match=r"FreqSchedule freq must be >= 1, got 0"):
        validate.integer(0, "freq", 1, owner="FreqSchedule")


def test_seed_accepts_numpy_ints_and_none() -> None:
    assert validate.seed(np.int64(3)) == 3 and validate.seed(None) is None
    with pytest.raises(TypeError, match=r"seed=1\.5 must be an int, or None"):
        validate.seed(1.5)


def test_every_place_that_takes_a_sparsity_states_the_same_rule() -> None:
    """Algorithms, distributions, init methods, FLOP counts and configure: one message."""
    shapes = {"a": (4, 4)}
    calls = [
        lambda: Static(1.2),
        lambda: RigL(1.2),
        lambda: SET(1.2),
        lambda: configure({"algorithm": "static", "sparsity": 1.2}),
        lambda: uniform(shapes, 1.2),
        lambda: erk(shapes, 1.2),
        lambda: INIT_METHODS["random"](torch.empty(4, 4), 1.2),
        lambda: transformer_flops(2, 8, 2, 4, 16, sparsity=1.2),
    ]
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        assert "=1.2" in str(info.value) and SPARSITY_RULE in str(info.value), str(info.value)


# ---------------------------------------------------------------- numpy values in algorithms


def test_static_accepts_a_numpy_float() -> None:
    """Refused before with "must be a float in [0, 1)" although it is in range."""
    model = mlp()
    sparsity = Static(np.float32(0.75), seed=np.int64(0))
    model.apply(sparsity)
    assert sparsity.seed == 0 and type(sparsity.seed) is int
    for name, sp in sparsity.sparse_params.items():
        assert int(sp.mask.sum()) == int(0.25 * sp.mask.numel()), name


@pytest.mark.parametrize("cls", [SET, RigL, GraNet])
def test_dynamic_algorithms_accept_numpy_and_tensor_arguments(cls: type) -> None:
    algorithm = cls(np.float32(0.5), drop_fraction=torch.tensor(0.25), update=np.int64(10))
    assert algorithm.update_schedule(20) and not algorithm.update_schedule(25)
    assert algorithm.drop_fraction_at(10) == 0.25
    assert algorithm.target_sparsity("x", 10) == pytest.approx(0.5)


def test_schedules_and_shapers_accept_numpy_ints() -> None:
    assert FreqSchedule(np.int64(5), start=np.int64(1)).next_update(2) == 6
    assert NM(np.int64(2), np.int64(4)) == NM(2, 4)
    assert OutputGroups(np.int64(2)).groups == 2 and type(OutputGroups(np.int64(2)).groups) is int
    with pytest.raises(ValueError, match=r"Blocks w must be >= 1, got -1"):
        Blocks(2, -1)


# ---------------------------------------------------------------- drop_fraction


@pytest.mark.parametrize("cls", [SET, RigL, GraNet])
@pytest.mark.parametrize("bad", [NAN, 1.5, -0.2])
def test_drop_fraction_errors_name_the_argument_and_its_range(cls: type, bad: float) -> None:
    """`SET(drop_fraction=nan)` said "Constant value must be finite": no name, no range."""
    with pytest.raises(ValueError) as info:
        cls(0.5, drop_fraction=bad)
    message = str(info.value)
    assert f"drop_fraction={bad!r}" in message and "[0, 1]" in message
    assert "share of active weights" in message


def test_drop_fraction_list_names_the_bad_entry() -> None:
    with pytest.raises(ValueError, match=r"drop_fraction=nan must be in \[0, 1\]"):
        SET(0.5, drop_fraction=[0.3, NAN])
    with pytest.raises(TypeError, match=r"drop_fraction='0.3' must be a number: a float in \[0, 1"):
        RigL(0.5, drop_fraction="0.3")


# ---------------------------------------------------------------- overflowing schedules


def test_exp_that_overflows_at_an_update_step_is_refused_when_built() -> None:
    """Constant 0.5 until exp(0.9 * t) overflows at t = 789: the first update after that is
    step 800, which used to raise mid-training; now the constructor names it."""
    schedule = {"type": "exp", "init": 0.5, "gamma": 0.9, "final": 0.5}
    assert Exp(0.5, 0.9, 0.5).defined_until() == 788
    with pytest.raises(ValueError) as info:
        SET(schedule, update={"freq": 100})
    message = str(info.value)
    assert "sparsity schedule Exp(init=0.5, gamma=0.9, final=0.5) fails at step 800" in message
    assert "OverflowError" in message and "gamma < 0" in message


def test_drop_fraction_exp_that_overflows_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"drop_fraction schedule Exp\(.*\) fails at step 790"):
        RigL(0.5, drop_fraction={"type": "exp", "init": 1.0, "gamma": 0.9}, update={"freq": 10})


def test_power_that_overflows_is_refused_at_its_first_update_past_the_limit() -> None:
    assert Power(0.0, 2.0).defined_until() == 1023
    with pytest.raises(ValueError, match=r"fails at step 1100"):
        SET({"type": "power", "init": 0.0, "beta": 2.0}, update={"steps": [10, 1100]})


@pytest.mark.parametrize(
    "update", [{"freq": 100, "stop": 700}, {"steps": [100, 700]}], ids=["stops", "list"]
)
def test_schedules_that_never_overflow_where_used_are_accepted(update: object) -> None:
    """Only an update step past the overflow is refused: not a cadence that ends before it."""
    schedule = {"type": "exp", "init": 0.5, "gamma": 0.9, "final": 0.5}
    assert SET(schedule, update=update).target_sparsity("x", 700) == 0.5


def test_an_open_ended_cadence_reaches_the_overflow_however_rare_its_updates() -> None:
    schedule = {"type": "exp", "init": 0.5, "gamma": 0.9, "final": 0.5}
    with pytest.raises(ValueError, match="fails at step 1000000000 "):
        SET(schedule, update=10**9)


def test_decaying_exp_and_gmp_ramps_are_accepted() -> None:
    assert Exp(0.3, -0.01, 0.9).defined_until() is None
    SET({"type": "exp", "init": 0.3, "gamma": -0.01, "final": 0.9}, update={"freq": 100})
    GMP({"type": "cubic", "init": 0.0, "final": 0.8, "begin": 0, "end": 100}, update=10)
    assert ListSchedule([3, 9]).next_update(4) == 9 and ListSchedule([3]).next_update(4) is None

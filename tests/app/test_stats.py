"""`lightning_sparse.app.stats`: the Student t quantile against published table values and
closed forms, and intervals computed by hand."""

from __future__ import annotations

import math

import pytest

from lightning_sparse.app.stats import (
    mean_interval,
    paired_difference,
    student_t_cdf,
    student_t_quantile,
)

# t(p, df) from the standard table (e.g. NIST/SEMATECH e-Handbook, Table 1.3.6.7.2), 6 digits.
TABLE = [
    (0.975, 1, 12.706205),
    (0.975, 2, 4.302653),
    (0.975, 3, 3.182446),
    (0.975, 4, 2.776445),
    (0.975, 5, 2.570582),
    (0.975, 9, 2.262157),
    (0.975, 10, 2.228139),
    (0.975, 30, 2.042272),
    (0.975, 100, 1.983972),
    (0.95, 2, 2.919986),
    (0.995, 2, 9.924843),
    (0.995, 5, 4.032143),
    (0.9, 1, 3.077684),
]


@pytest.mark.parametrize(("p", "df", "expected"), TABLE)
def test_t_quantile_matches_the_table(p: float, df: int, expected: float) -> None:
    assert student_t_quantile(p, df) == pytest.approx(expected, abs=2e-6)
    assert student_t_quantile(1 - p, df) == pytest.approx(-expected, abs=2e-6)


def test_t_cdf_matches_closed_forms() -> None:
    for t in (-7.0, -1.0, 0.0, 0.3, 1.0, 2.5, 40.0):
        cauchy = 0.5 + math.atan(t) / math.pi  # df = 1
        assert student_t_cdf(t, 1) == pytest.approx(cauchy, abs=1e-12)
        two = 0.5 + t / (2 * math.sqrt(2 + t * t))  # df = 2
        assert student_t_cdf(t, 2) == pytest.approx(two, abs=1e-12)
    # Large df: the normal distribution (97.5% quantile 1.959964).
    assert student_t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)


def test_t_quantile_inverts_the_cdf_for_non_integer_df() -> None:
    for df in (1.5, 2.7, 7.25):
        for p in (0.6, 0.9, 0.975, 0.999):
            assert student_t_cdf(student_t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)


def test_bad_arguments_name_the_value_and_the_rule() -> None:
    with pytest.raises(ValueError, match=r"df=0 must be a number > 0"):
        student_t_quantile(0.975, 0)
    with pytest.raises(ValueError, match=r"p=1\.0 must be in \(0, 1\)"):
        student_t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="at least one value"):
        mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        mean_interval([1.0, math.nan])
    with pytest.raises(ValueError, match="no seed in common"):
        paired_difference({0: 1.0}, {1: 1.0})


def test_mean_interval_by_hand() -> None:
    i = mean_interval([1.0, 2.0, 3.0])
    # mean 2, sd sqrt(((-1)^2 + 0 + 1^2) / 2) = 1, half width t(0.975, 2) * 1 / sqrt(3).
    half = 4.302653 / math.sqrt(3)
    assert (i.n, i.mean, i.sd) == (3, 2.0, 1.0)
    assert i.low == pytest.approx(2.0 - half, abs=1e-6)
    assert i.high == pytest.approx(2.0 + half, abs=1e-6)
    assert i.half_width == pytest.approx(2.484138, abs=1e-6)
    one = mean_interval([1.5])
    assert (one.mean, one.sd, one.low, one.high, one.half_width) == (1.5, None, None, None, None)


def test_paired_difference_by_hand() -> None:
    method = {0: 1.30, 1: 1.32, 2: 1.31}
    static = {0: 1.34, 1: 1.35, 2: 1.36, 3: 9.0}  # seed 3 has no partner: left out
    d = paired_difference(method, static)
    # d = [-0.04, -0.03, -0.05]: mean -0.04, sd 0.01, half width 4.302653 * 0.01 / sqrt(3).
    assert d.seeds == (0, 1, 2)
    assert d.interval.mean == pytest.approx(-0.04, abs=1e-12)
    assert d.interval.sd == pytest.approx(0.01, abs=1e-12)
    assert d.interval.half_width == pytest.approx(0.0248414, abs=1e-7)
    assert d.excludes_zero
    # d = [-0.04, +0.01, -0.05]: mean -0.0267, sd 0.0321, half width 0.0798: includes 0.
    noisy = paired_difference({0: 1.30, 1: 1.36, 2: 1.31}, static)
    assert not noisy.excludes_zero

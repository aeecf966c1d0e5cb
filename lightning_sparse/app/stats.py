"""Means, standard deviations and 95% intervals over seeds, in pure Python (no scipy).

`lightning-sparse compare --seeds N` trains every method N times (seeds 0..N-1) and reports, per
method, the mean of the final validation loss, its sample standard deviation and a Student t
interval for the mean (N - 1 degrees of freedom), and the difference to a baseline with a
*paired* t interval: seed ``s`` of every method starts from the same initial weights, the same
data order and (for methods with the same initial sparsity) the same initial random mask, so the
per-seed differences cancel what the seed contributes to both (common random numbers). The
interval of the mean difference is ``mean(d) +- t(0.975, N - 1) * sd(d) / sqrt(N)`` over
``d_s = x_s - baseline_s`` (e.g. Montgomery, *Design and Analysis of Experiments*, the paired
t-test).

The t quantile is the inverse of the Student t CDF, computed from the regularized incomplete
beta function (the continued fraction of Numerical Recipes, section 6.4, written from the
formula) and inverted by bisection, so any degrees of freedom (also non-integer) work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Difference",
    "Interval",
    "mean_interval",
    "paired_difference",
    "student_t_cdf",
    "student_t_quantile",
]

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """Mean, sample standard deviation and a two-sided t interval of ``n`` values.

    ``sd``, ``low`` and ``high`` are ``None`` for a single value (no spread to estimate).
    """

    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None
    confidence: float = CONFIDENCE

    @property
    def half_width(self) -> float | None:
        """``high - mean``, or ``None``."""
        return None if self.high is None else self.high - self.mean


@dataclass(frozen=True)
class Difference:
    """``mean(x - baseline)`` over paired seeds, with its t interval (`Interval` of the
    differences) and the seeds it paired."""

    interval: Interval
    seeds: tuple[int, ...]

    @property
    def excludes_zero(self) -> bool:
        """The interval lies entirely on one side of 0 (the difference is resolved)."""
        i = self.interval
        return i.low is not None and i.high is not None and (i.high < 0 or i.low > 0)


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function, by the modified Lentz method."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _regularized_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)`` for ``0 <= x <= 1``, ``a, b > 0``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # The fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def _check_df(df: float) -> None:
    if isinstance(df, bool) or not isinstance(df, int | float) or not df > 0:
        raise ValueError(f"degrees of freedom df={df!r} must be a number > 0 (n - 1 for n values)")


def student_t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df`` degrees of freedom.

    Raises:
        ValueError: ``df <= 0``.
    """
    _check_df(df)
    tail = 0.5 * _regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The ``t`` with ``student_t_cdf(t, df) == p`` (e.g. ``p=0.975, df=2`` -> 4.3027).

    Raises:
        ValueError: ``p`` outside (0, 1) or ``df <= 0``.
    """
    _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"probability p={p!r} must be in (0, 1), e.g. 0.975 for a 95% interval")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:  # bracket the quantile (df=1, p=0.9995: 636.6)
        low, high = high, high * 2.0
    for _ in range(200):  # bisection to machine precision
        middle = 0.5 * (low + high)
        if student_t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-13 * max(1.0, high):
            break
    return 0.5 * (low + high)


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean, sample standard deviation (``n - 1`` in the denominator) and the two-sided Student
    t interval ``mean +- t((1 + confidence) / 2, n - 1) * sd / sqrt(n)``.

    Raises:
        ValueError: no values, a value that is not finite, or ``confidence`` outside (0, 1).
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval needs at least one value")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"mean_interval: every value must be finite, got {values}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1), e.g. 0.95")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(1, mean, None, None, None, confidence)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = student_t_quantile((1.0 + confidence) / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(n, mean, sd, mean - half, mean + half, confidence)


def paired_difference(
    values: dict[int, float], baseline: dict[int, float], confidence: float = CONFIDENCE
) -> Difference:
    """``values - baseline`` paired by seed: the `mean_interval` of the per-seed differences.

    Args:
        values: ``{seed: value}`` of one method.
        baseline: ``{seed: value}`` of the baseline (e.g. static sparsity).

    Raises:
        ValueError: the two share no seed.
    """
    seeds = tuple(sorted(set(values) & set(baseline)))
    if not seeds:
        raise ValueError(
            f"paired_difference: no seed in common (method seeds {sorted(values)}, baseline "
            f"seeds {sorted(baseline)}); run both with the same --seeds"
        )
    differences = [values[s] - baseline[s] for s in seeds]
    return Difference(mean_interval(differences, confidence), seeds)

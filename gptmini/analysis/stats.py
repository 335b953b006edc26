"""Statistics a reader can trust for speed runs: each recipe's mean and spread over seeds,
and a one-sided Welch t-test against the baseline (modded-nanogpt accepts a record at
p < 0.01 over its seeds).

The t distribution's CDF is computed here (the regularized incomplete beta function by its
continued fraction, Numerical Recipes' `betacf` with Lentz's method), so no SciPy is
needed; with SciPy installed, `welch_t_test` uses `scipy.stats.ttest_ind` instead, and a
test checks that the two agree.
"""

import math
import statistics
from dataclasses import dataclass

__all__ = ["Comparison", "incomplete_beta", "student_t_cdf", "welch_t_test"]


def incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for 0 <= x <= 1, a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta: x={x} must be in [0, 1]")
    if x in (0.0, 1.0):
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); else use the
    # symmetry I_x(a, b) = 1 - I_{1-x}(b, a).
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(x, a, b) / a
    return 1.0 - front * _beta_fraction(1.0 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float, iterations: int = 300) -> float:
    """The continued fraction of I_x(a, b) by Lentz's method (Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, iterations + 1):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even step
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    return h


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t distribution with `df` (> 0, not necessarily whole)
    degrees of freedom."""
    if df <= 0:
        raise ValueError(f"student_t_cdf: df={df} must be positive")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * incomplete_beta(df / (df + t * t), df / 2, 0.5)  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


@dataclass(frozen=True)
class Comparison:
    """A recipe's runs against the baseline's: `p` is the one-sided p-value that the
    recipe's mean is lower (better bits per byte) than the baseline's."""

    mean: float
    stdev: float
    baseline_mean: float
    t: float
    df: float
    p: float


def welch_t_test(values: list[float], baseline: list[float]) -> Comparison:
    """One-sided Welch t-test of "mean(values) < mean(baseline)" (unequal variances).

    Args:
        values: the recipe's result per seed (at least 2).
        baseline: the baseline's result per seed (at least 2).
    """
    if len(values) < 2 or len(baseline) < 2:
        raise ValueError(f"welch_t_test needs at least 2 seeds a side, got {len(values)} and "
                         f"{len(baseline)}: run more --seeds")
    m1, m2 = statistics.fmean(values), statistics.fmean(baseline)
    v1, v2 = statistics.variance(values), statistics.variance(baseline)
    n1, n2 = len(values), len(baseline)
    se2 = v1 / n1 + v2 / n2
    if se2 == 0.0:  # identical runs: the sign of the difference is certain
        t, df = (-math.inf if m1 < m2 else math.inf if m1 > m2 else 0.0), float(n1 + n2 - 2)
        p = 0.0 if m1 < m2 else 1.0 if m1 > m2 else 0.5
        return Comparison(m1, math.sqrt(v1), m2, t, df, p)
    t = (m1 - m2) / math.sqrt(se2)
    df = se2 ** 2 / ((v1 / n1) ** 2 / (n1 - 1) + (v2 / n2) ** 2 / (n2 - 1))  # Welch-Satterthwaite
    try:
        from scipy import stats
    except ImportError:
        p = student_t_cdf(t, df)
    else:
        p = float(stats.ttest_ind(values, baseline, equal_var=False, alternative="less").pvalue)
    return Comparison(m1, math.sqrt(v1), m2, t, df, p)

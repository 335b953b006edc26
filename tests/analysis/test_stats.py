"""The speed run's statistics: the t distribution's CDF against closed forms and printed
tables, and Welch's one-sided test against its formulas."""

import math
import statistics

import pytest

from gptmini.analysis.stats import incomplete_beta, student_t_cdf, welch_t_test


@pytest.mark.parametrize("t", [-30.0, -2.5, -1.0, -0.1, 0.0, 0.3, 1.0, 4.0, 50.0])
def test_t_cdf_with_one_and_two_degrees_has_its_closed_forms(t):
    # df 1 is the Cauchy distribution; df 2 has a closed form too
    assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)),
                                                abs=1e-12)


@pytest.mark.parametrize(("quantile", "df", "t"), [
    # Student's t table (two-sided 5% and 2%, one-sided 5% and 1%), six digits
    (0.975, 10, 2.228139), (0.99, 4, 3.746947), (0.95, 30, 1.697261),
    (0.99, 8, 2.896459), (0.975, 4, 2.776445), (0.995, 120, 2.617421),
])
def test_t_cdf_matches_the_printed_table(quantile, df, t):
    assert student_t_cdf(t, df) == pytest.approx(quantile, abs=2e-6)
    assert student_t_cdf(-t, df) == pytest.approx(1 - quantile, abs=2e-6)


def test_many_degrees_approach_the_normal():
    normal = 0.5 * (1 + math.erf(1.959964 / math.sqrt(2)))
    assert student_t_cdf(1.959964, 1e7) == pytest.approx(normal, abs=1e-6)


def test_incomplete_beta_edges_and_symmetry():
    assert incomplete_beta(0.0, 2, 3) == 0.0 and incomplete_beta(1.0, 2, 3) == 1.0
    assert incomplete_beta(0.3, 1, 1) == pytest.approx(0.3)  # uniform
    assert incomplete_beta(0.3, 2.5, 4) == pytest.approx(1 - incomplete_beta(0.7, 4, 2.5))
    with pytest.raises(ValueError, match="x=1.5 must be in"):
        incomplete_beta(1.5, 1, 1)


def test_welch_follows_its_formulas():
    better, base = [2.01, 2.03, 2.00, 2.02, 2.04], [2.08, 2.05, 2.09, 2.07, 2.10]
    result = welch_t_test(better, base)
    v1, v2 = statistics.variance(better) / 5, statistics.variance(base) / 5
    assert result.t == pytest.approx((statistics.mean(better) - statistics.mean(base))
                                     / math.sqrt(v1 + v2))
    assert result.df == pytest.approx((v1 + v2) ** 2 / (v1 ** 2 / 4 + v2 ** 2 / 4))
    assert result.p == pytest.approx(student_t_cdf(result.t, result.df), rel=1e-6)
    assert result.p < 0.01  # clearly better: a record
    assert welch_t_test(base, better).p > 0.99  # clearly worse
    same = welch_t_test([2.0, 2.1, 2.05], [2.0, 2.1, 2.05])
    assert same.p == pytest.approx(0.5)


def test_welch_needs_two_seeds_a_side():
    with pytest.raises(ValueError, match="at least 2 seeds a side.*--seeds"):
        welch_t_test([2.0], [2.1, 2.2])


def test_scipy_agrees_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for t, df in ((1.3, 3.7), (-2.2, 11.4), (0.4, 40.0)):
        assert student_t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-10)

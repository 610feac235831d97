"""Power-law fit with bootstrap CI: recovers known exponents from synthetic hitting times."""

import numpy as np
import pytest

from sims.experiments.fit import censored_median, fit_power_law


@pytest.mark.parametrize("true_slope", [1.0, 2.0])
def test_fit_recovers_slope_and_ci_covers_it(true_slope):
    rng = np.random.default_rng(1)
    d = np.array([100, 300, 1000, 3000, 10000])
    times = [5.0 * dd**true_slope * rng.lognormal(0, 0.2, size=32) for dd in d]
    fit = fit_power_law(d, times, n_boot=500, seed=0)
    assert abs(fit.slope - true_slope) < 0.05
    assert fit.slope_ci[0] < true_slope < fit.slope_ci[1]
    assert fit.slope_ci[1] - fit.slope_ci[0] < 0.2
    np.testing.assert_allclose(fit.predict(d), np.exp(fit.intercept) * d**fit.slope)


def test_censored_runs_count_as_infinite_and_are_reported():
    t = np.array([1.0, 2.0, np.nan, np.nan, np.nan])
    assert censored_median(t) == np.inf
    assert censored_median(np.array([1.0, 2.0, np.nan])) == 2.0
    d = [10, 100, 1000]
    times = [np.array([10.0, 11, 12]), np.array([100.0, 110, np.nan]), np.array([np.nan] * 3)]
    fit = fit_power_law(d, times, n_boot=50)
    np.testing.assert_allclose(fit.reached, [1.0, 2 / 3, 0.0])
    assert np.isinf(fit.median_T[2])
    assert abs(fit.slope - 1.0) < 0.05


def test_fit_refuses_when_nothing_reached():
    with pytest.raises(ValueError, match="fewer than two"):
        fit_power_law([10, 100], [np.array([np.nan]), np.array([1.0])])

"""Dual kernels K, K′: quadrature vs Hermite series and vs closed forms; the cached interpolant."""

import numpy as np
import pytest

from dynamics.activations import Activation, activation_from_callable
from hermite import dual_kernel, dual_kernel_derivative, hermite_coefficients, kernel_interpolant

RHO = np.concatenate([[-1.0, -1 + 1e-12, -0.999999], np.linspace(-0.99, 0.99, 23),
                      [0.999999, 1 - 1e-12, 1.0]])


def _series(name, rho, pmax=600, derivative=True):
    mu = hermite_coefficients(name, pmax)
    p = np.arange(pmax + 1)
    if derivative:
        return np.polynomial.polynomial.polyval(rho, (p * mu**2)[1:])
    return np.polynomial.polynomial.polyval(rho, mu**2)


@pytest.mark.parametrize("name", ["sigmoid", "tanh"])
def test_quadrature_matches_hermite_series(name):
    # μ_p of sigmoid/tanh decay like exp(−c√p): the p ≤ 600 series is exact to ~1e-15 on [−1, 1]
    rho = RHO[::3]
    np.testing.assert_allclose(dual_kernel_derivative(name, rho, method="quadrature"),
                               _series(name, rho), rtol=0, atol=1e-8)
    np.testing.assert_allclose(dual_kernel(name, rho, method="quadrature"),
                               _series(name, rho, derivative=False), rtol=0, atol=1e-8)


@pytest.mark.parametrize("name", ["sigmoid", "tanh"])
def test_interpolant_matches_series_everywhere(name):
    rho = np.concatenate([RHO, np.random.default_rng(0).uniform(-1, 1, 500)])
    interp = kernel_interpolant(name, "kprime")
    assert interp.converged and interp.error_bound < 1e-12
    np.testing.assert_allclose(dual_kernel_derivative(name, rho), _series(name, rho),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", ["relu", "abs", "erf"])
def test_closed_forms_match_quadrature(name):
    rho = RHO[::2]
    np.testing.assert_allclose(dual_kernel_derivative(name, rho, method="quadrature"),
                               dual_kernel_derivative(name, rho, method="closed"),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(dual_kernel(name, rho, method="quadrature"),
                               dual_kernel(name, rho, method="closed"), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["relu", "abs", "erf", "quadratic", "he4"])
def test_closed_forms_match_series_inside(name):
    rho = np.linspace(-0.8, 0.8, 17)  # the series converges slowly near |ρ| = 1 for ReLU/abs
    pmax = 300 if name == "erf" else 4000  # erf: quadrature μ_p, exponentially decaying
    np.testing.assert_allclose(dual_kernel_derivative(name, rho), _series(name, rho, pmax),
                               rtol=0, atol=1e-9)
    np.testing.assert_allclose(dual_kernel(name, rho), _series(name, rho, pmax, False),
                               rtol=0, atol=1e-9)


def test_kinked_activation_without_closed_form():
    # leaky ReLU = αx + β|x| (α = (1+a)/2, β = (1−a)/2): K′ = α² + β² (2/π) arcsin ρ,
    # K = α² ρ + β² (2/π)(√(1−ρ²) + ρ arcsin ρ); computed here by piecewise quadrature + cache
    a = 0.1
    al, be = (1 + a) / 2, (1 - a) / 2
    act = activation_from_callable(lambda x: np.maximum(x, a * x),
                                   lambda x: np.where(x > 0, 1.0, a), "leaky", (0.0,))
    rho = np.concatenate([RHO, np.random.default_rng(1).uniform(-1, 1, 200)])
    kp = al**2 + be**2 * (2 / np.pi) * np.arcsin(rho)
    k = al**2 * rho + be**2 * (2 / np.pi) * (np.sqrt(1 - rho**2) + rho * np.arcsin(rho))
    np.testing.assert_allclose(dual_kernel_derivative(act, rho), kp, rtol=0, atol=1e-12)
    np.testing.assert_allclose(dual_kernel(act, rho), k, rtol=0, atol=1e-12)
    assert kernel_interpolant(act, "kernel").converged


def test_smooth_callable_without_closed_form_via_interpolant():
    # erf(x) passed as a plain function (σ′ by finite differences, error ~1e-10)
    from scipy.special import erf

    rho = np.linspace(-1, 1, 41)
    np.testing.assert_allclose(dual_kernel(erf, rho), dual_kernel("erf", rho), atol=1e-12)
    np.testing.assert_allclose(dual_kernel_derivative(erf, rho),
                               dual_kernel_derivative("erf", rho), atol=1e-8)
    interp = kernel_interpolant(erf, "kprime")
    assert interp.error_bound < 1e-8


def test_interpolant_on_closed_form_activation_and_shapes():
    rho = np.random.default_rng(2).uniform(-1, 1, (3, 4))
    out = dual_kernel_derivative("relu", rho, method="interpolant")
    assert out.shape == (3, 4)
    np.testing.assert_allclose(out, dual_kernel_derivative("relu", rho), atol=1e-13)
    assert np.shape(dual_kernel("relu", 0.3)) == ()


def test_kernel_errors():
    with pytest.raises(ValueError, match="method"):
        dual_kernel("relu", 0.1, method="bogus")
    with pytest.raises(ValueError, match="closed-form"):
        dual_kernel("tanh", 0.1, method="closed")
    with pytest.raises(ValueError, match="NaN"):
        dual_kernel_derivative("relu", np.nan)
    with pytest.raises(ValueError, match="valid names"):
        dual_kernel("bogus", 0.1)
    with pytest.raises(ValueError, match="which"):
        kernel_interpolant("relu", "both")
    assert isinstance(Activation, type)

"""μ_p(σ): quadrature vs closed forms and vs mpmath high-precision quadrature; Parseval."""

import math

import mpmath as mp
import numpy as np
import pytest

from dynamics.activations import activation_from_callable, get_activation
from hermite import (
    derivative_second_moment,
    gaussian_second_moment,
    hermite_coefficients,
    parseval_residual,
)


@pytest.mark.parametrize("name", ["relu", "abs", "quadratic", "linear", "he0", "he3", "he7",
                                  "he40"])
@pytest.mark.parametrize("pmax", [10, 60])
def test_quadrature_matches_closed_form(name, pmax):
    closed = hermite_coefficients(name, pmax, method="closed")
    quad = hermite_coefficients(name, pmax, method="quadrature")
    assert closed.shape == quad.shape == (pmax + 1,)
    np.testing.assert_allclose(quad, closed, rtol=0, atol=1e-10)


def test_relu_high_degree_matches_closed_form():
    np.testing.assert_allclose(hermite_coefficients("relu", 200, method="quadrature"),
                               hermite_coefficients("relu", 200), rtol=0, atol=1e-12)


def _mp_coefficient(f, p: int) -> float:
    """μ_p by mpmath at 20 digits: Gauss–Legendre on unit panels of [−14, 14]."""
    mp.mp.dps = 20

    def integrand(x):
        h_prev, h = mp.mpf(1), x
        if p == 0:
            h = h_prev
        for n in range(1, p):
            h_prev, h = h, (x * h - mp.sqrt(n) * h_prev) / mp.sqrt(n + 1)
        return f(x) * h * mp.exp(-x * x / 2)

    val = mp.quad(integrand, mp.linspace(-14, 14, 15), method="gauss-legendre")
    return float(val / mp.sqrt(2 * mp.pi))


MP_FUNCS = {"sigmoid": lambda x: 1 / (1 + mp.exp(-x)), "tanh": mp.tanh, "erf": mp.erf}


@pytest.mark.parametrize("name", sorted(MP_FUNCS))
def test_quadrature_matches_mpmath(name):
    mu = hermite_coefficients(name, 31)
    for p in (0, 1, 3, 10, 31):
        assert abs(mu[p] - _mp_coefficient(MP_FUNCS[name], p)) <= 1e-10, (name, p)


def test_plain_callable_and_symmetries():
    mu = hermite_coefficients(np.tanh, 20)
    np.testing.assert_allclose(mu, hermite_coefficients("tanh", 20), atol=1e-15)
    assert np.all(np.abs(mu[0::2]) < 1e-14)  # odd function
    sig = hermite_coefficients("sigmoid", 20)
    assert sig[0] == pytest.approx(0.5, abs=1e-14)
    assert np.all(np.abs(sig[2::2]) < 1e-14)  # sigmoid − 1/2 is odd


def test_shifted_relu_with_breakpoint():
    # σ(x) = relu(x − b): μ_p = φ(b) He_{p−2}(b)/√p! (p ≥ 2), μ_1 = 1 − Φ(b)
    b = 0.7
    act = activation_from_callable(lambda x: np.maximum(x - b, 0.0), name="srelu",
                                   breakpoints=(b,))
    mu = hermite_coefficients(act, 30)
    phi = math.exp(-b * b / 2) / math.sqrt(2 * math.pi)
    he = [1.0, b]
    for n in range(1, 30):
        he.append(b * he[n] - n * he[n - 1])
    expect = [phi - b * (1 - 0.5 * math.erfc(-b / math.sqrt(2))), 0.5 * math.erfc(b / math.sqrt(2))]
    expect += [phi * he[p - 2] / math.sqrt(math.factorial(p)) for p in range(2, 31)]
    np.testing.assert_allclose(mu, expect, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "erf", "he5", "quadratic"])
def test_parseval_smooth(name):
    assert abs(parseval_residual(name, 200)) < 1e-12


def test_parseval_relu_tail():
    # residual = −Σ_{p>pmax} μ_p²: negative, shrinking, equal to the closed-form tail
    res = [parseval_residual("relu", p) for p in (10, 40, 160)]
    assert res[0] < res[1] < res[2] < 0
    tail = -np.sum(hermite_coefficients("relu", 20000)[41:] ** 2)
    assert res[1] == pytest.approx(tail, rel=1e-3)


def test_second_moments_quadrature():
    assert gaussian_second_moment("tanh") == pytest.approx(
        np.sum(hermite_coefficients("tanh", 300) ** 2), abs=1e-14)
    mu = hermite_coefficients("sigmoid", 300)
    assert derivative_second_moment("sigmoid") == pytest.approx(
        np.sum(np.arange(301) * mu**2), abs=1e-14)
    assert derivative_second_moment("relu") == 0.5


def test_bad_arguments():
    with pytest.raises(ValueError, match="pmax"):
        hermite_coefficients("relu", -1)
    with pytest.raises(ValueError, match="valid names"):
        hermite_coefficients("nope", 3)
    with pytest.raises(ValueError, match="closed-form"):
        hermite_coefficients("tanh", 3, method="closed")
    with pytest.raises(ValueError, match="method"):
        hermite_coefficients("relu", 3, method="magic")
    assert get_activation("relu").coefficients is not None

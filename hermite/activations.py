"""Activations σ: the registry of the theory (numpy only: importing it loads no torch).

Each :class:`Activation` carries σ and σ′ on numpy arrays, and,
where one exists, the closed-form dual kernel K(ρ) = E[σ(z₁)σ(z₂)] and its derivative
K′(ρ) = E[σ′(z₁)σ′(z₂)] (Price's theorem) for standard Gaussians of correlation ρ, plus the
closed-form orthonormal Hermite coefficients μ_p (basis hₚ = Heₚ/√(p!)).

Names: ``relu, abs, sigmoid, tanh, erf, quadratic, linear`` and ``he<p>`` (normalized hₚ),
and any of them with an input scale a > 0, σ_a(x) = σ(a·x): ``erf(x/sqrt2)`` (Saad & Solla's
and nn2pp's g), ``tanh(x*0.5)``, ``relu(x*2)`` (:func:`scaled_activation`; the scale is
``sqrt<n>``, ``sqrt(<number>)`` or a number). The engine adds tensor versions of σ and σ′ on
top (:mod:`dynamics.activations`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import scipy.special as sp

__all__ = [
    "Activation",
    "ACTIVATION_NAMES",
    "get_activation",
    "activation_from_callable",
    "hermite_normalized",
    "scaled_activation",
]

ACTIVATION_NAMES = ("relu", "abs", "sigmoid", "tanh", "erf", "quadratic", "linear", "he<p>",
                    "<name>(x*a)", "<name>(x/a)")


@dataclass(frozen=True)
class Activation:
    """An activation σ with its derivative and (optional) closed-form Gaussian kernels.

    Fields
    ------
    name : registry name (``he3``, ``relu``...) or the user's label.
    fn, deriv : σ and σ′ on numpy arrays (numpy out).
    kernel : ρ ↦ E[σ(z₁)σ(z₂)] in closed form (numpy), or ``None``.
    kprime : ρ ↦ E[σ′(z₁)σ′(z₂)] in closed form (numpy), or ``None``.
    coefficients : pmax ↦ closed-form μ_0..μ_pmax, or ``None`` (then quadrature).
    breakpoints : points where σ is not smooth (for piecewise quadrature).
    deriv_second_moment : E[σ′(g)²] = Σ_p p μ_p² in closed form, or ``None``.
    polynomial_degree : degree when σ is a polynomial, else ``None``.
    """

    name: str
    fn: Callable
    deriv: Callable
    kernel: Callable | None = None
    kprime: Callable | None = None
    coefficients: Callable | None = None
    breakpoints: tuple[float, ...] = ()
    deriv_second_moment: float | None = None
    polynomial_degree: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def base_and_scale(self) -> tuple[str, float]:
        """(registry name of σ, input scale a) of σ(a·x); (name, 1.0) when unscaled."""
        return self.extra.get("base", self.name), float(self.extra.get("scale", 1.0))

    def __call__(self, x):
        return self.fn(x)


def _clip_rho(rho):
    return np.clip(np.asarray(rho, dtype=float), -1.0, 1.0)


# ---------------------------------------------------------------- ReLU and abs
def _relu(x):
    return np.maximum(x, 0.0)


def _relu_deriv(x):
    return (np.asarray(x) > 0).astype(float)


def _relu_kernel(rho):
    # arc-cosine kernel of degree 1 (Cho & Saul): (√(1-ρ²) + (π - arccos ρ) ρ) / (2π)
    r = _clip_rho(rho)
    return (np.sqrt(1.0 - r * r) + (np.pi - np.arccos(r)) * r) / (2.0 * np.pi)


def _relu_kprime(rho):
    # E[1{z1>0}1{z2>0}] = (π - arccos ρ) / (2π)
    return (np.pi - np.arccos(_clip_rho(rho))) / (2.0 * np.pi)


def _even_hermite_at_zero_over_sqrt_fact(p: np.ndarray) -> np.ndarray:
    """He_{p-2}(0)/√(p!) for p ≥ 2, computed in log space (p up to thousands)."""
    n = p - 2
    out = np.zeros(p.shape)
    even = n % 2 == 0
    ne = n[even]
    # He_n(0) = (-1)^{n/2} (n-1)!! = (-1)^{n/2} n! / (2^{n/2} (n/2)!)
    log_abs = sp.gammaln(ne + 1) - (ne / 2) * np.log(2.0) - sp.gammaln(ne / 2 + 1)
    log_val = log_abs - 0.5 * sp.gammaln(p[even] + 1)
    out[even] = np.where((ne // 2) % 2 == 0, 1.0, -1.0) * np.exp(log_val)
    return out


def _relu_coefficients(pmax: int) -> np.ndarray:
    # μ_0 = φ(0), μ_1 = 1/2, μ_p = φ(0) He_{p-2}(0)/√(p!) for p ≥ 2 (σ'' = δ₀)
    mu = np.zeros(pmax + 1)
    phi0 = 1.0 / math.sqrt(2.0 * math.pi)
    mu[0] = phi0
    if pmax >= 1:
        mu[1] = 0.5
    if pmax >= 2:
        p = np.arange(2, pmax + 1)
        mu[2:] = phi0 * _even_hermite_at_zero_over_sqrt_fact(p)
    return mu


def _abs_fn(x):
    return np.abs(x)


def _abs_deriv(x):
    return np.sign(x).astype(float)


def _abs_kernel(rho):
    r = _clip_rho(rho)
    return (2.0 / np.pi) * (np.sqrt(1.0 - r * r) + r * np.arcsin(r))


def _abs_kprime(rho):
    return (2.0 / np.pi) * np.arcsin(_clip_rho(rho))


def _abs_coefficients(pmax: int) -> np.ndarray:
    # |x| = relu(x) + relu(-x): odd coefficients cancel, even ones double
    mu = 2.0 * _relu_coefficients(pmax)
    mu[1::2] = 0.0
    return mu


# ---------------------------------------------------------------- smooth ones
def _sigmoid(x):
    return sp.expit(x)


def _sigmoid_deriv(x):
    s = _sigmoid(x)
    return s * (1 - s)


def _tanh(x):
    return np.tanh(x)


def _tanh_deriv(x):
    t = _tanh(x)
    return 1 - t * t


def _erf(x):
    return sp.erf(x)


def _erf_deriv(x):
    e = np.exp(-np.asarray(x) ** 2)
    return (2.0 / math.sqrt(math.pi)) * e


def _erf_kernel(rho):
    # E[erf(z1) erf(z2)] = (2/π) arcsin(2ρ/3)
    return (2.0 / np.pi) * np.arcsin(2.0 * _clip_rho(rho) / 3.0)


def _erf_kprime(rho):
    # (4/π) E[exp(-z1² - z2²)] = (4/π) / √det(I + 2Σ) = 4 / (π √(9 - 4ρ²))
    r = _clip_rho(rho)
    return 4.0 / (np.pi * np.sqrt(9.0 - 4.0 * r * r))


# ---------------------------------------------------------------- polynomials
def _quadratic_coefficients(pmax: int) -> np.ndarray:
    mu = np.zeros(pmax + 1)
    mu[0] = 1.0  # x² = He_0 + He_2 = h_0 + √2 h_2
    if pmax >= 2:
        mu[2] = math.sqrt(2.0)
    return mu


def _linear_coefficients(pmax: int) -> np.ndarray:
    mu = np.zeros(pmax + 1)
    if pmax >= 1:
        mu[1] = 1.0
    return mu


def hermite_normalized(p: int, x):
    """hₚ(x) = Heₚ(x)/√(p!) by the stable three-term recurrence (any array type)."""
    h_prev, h = x * 0 + 1, x
    if p == 0:
        return h_prev
    for n in range(1, p):
        h_prev, h = h, (x * h - math.sqrt(n) * h_prev) / math.sqrt(n + 1)
    return h


def _hermite_activation(p: int) -> Activation:
    def fn(x):
        return hermite_normalized(p, x)

    def deriv(x):
        return math.sqrt(p) * hermite_normalized(p - 1, x) if p > 0 else x * 0

    def coefficients(pmax):
        mu = np.zeros(pmax + 1)
        if p <= pmax:
            mu[p] = 1.0
        return mu

    return Activation(
        name=f"he{p}",
        fn=fn,
        deriv=deriv,
        kernel=lambda rho: _clip_rho(rho) ** p,
        kprime=lambda rho: p * _clip_rho(rho) ** (p - 1) if p > 0 else 0.0 * _clip_rho(rho),
        coefficients=coefficients,
        deriv_second_moment=float(p),
        polynomial_degree=p,
    )


_REGISTRY: dict[str, Activation] = {
    "relu": Activation(
        "relu", _relu, _relu_deriv, _relu_kernel, _relu_kprime, _relu_coefficients,
        breakpoints=(0.0,), deriv_second_moment=0.5,
    ),
    "abs": Activation(
        "abs", _abs_fn, _abs_deriv, _abs_kernel, _abs_kprime, _abs_coefficients,
        breakpoints=(0.0,), deriv_second_moment=1.0,
    ),
    "sigmoid": Activation("sigmoid", _sigmoid, _sigmoid_deriv),
    "tanh": Activation("tanh", _tanh, _tanh_deriv),
    "erf": Activation(
        "erf", _erf, _erf_deriv, _erf_kernel, _erf_kprime,
        deriv_second_moment=4.0 / (math.pi * math.sqrt(5.0)),
    ),
    "quadratic": Activation(
        "quadratic", lambda x: x * x, lambda x: 2 * x,
        kernel=lambda rho: 1.0 + 2.0 * _clip_rho(rho) ** 2,
        kprime=lambda rho: 4.0 * _clip_rho(rho),
        coefficients=_quadratic_coefficients, deriv_second_moment=4.0, polynomial_degree=2,
    ),
    "linear": Activation(
        "linear", lambda x: x, lambda x: x * 0 + 1,
        kernel=lambda rho: _clip_rho(rho), kprime=lambda rho: 0.0 * _clip_rho(rho) + 1.0,
        coefficients=_linear_coefficients, deriv_second_moment=1.0, polynomial_degree=1,
    ),
}

_HE_PATTERN = re.compile(r"^he(\d+)$")
_SCALED_PATTERN = re.compile(r"^(\w+)\(\s*x\s*([*/])\s*([^()\s]+|sqrt\([^()]+\))\s*\)$")
_NUMBER = r"[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?"
# positively homogeneous σ (σ(a x) = a^h σ(x) for a > 0): their scaled kernels are closed forms
_HOMOGENEOUS = {"relu": 1, "abs": 1, "linear": 1, "quadratic": 2}


def _base_activation(key: str) -> Activation | None:
    if key in _REGISTRY:
        return _REGISTRY[key]
    match = _HE_PATTERN.match(key)
    return _hermite_activation(int(match.group(1))) if match else None


def _parse_scale(text: str) -> float | None:
    """a from ``2``, ``0.5``, ``sqrt2``, ``sqrt(2)``, ``sqrt(0.5)``; None if malformed."""
    m = re.fullmatch(rf"sqrt\(?({_NUMBER})\)?", text)
    if m:
        return math.sqrt(float(m.group(1)))
    return float(text) if re.fullmatch(_NUMBER, text) else None


def get_activation(name) -> Activation:
    """Look an activation up by name (``relu``, ``he3``, ``erf(x/sqrt2)``...); pass an
    Activation through.

    Raises ``ValueError`` naming the valid names for an unknown one.
    """
    if isinstance(name, Activation):
        return name
    key = str(name).strip().lower()
    act = _base_activation(key)
    if act is not None:
        return act
    match = _SCALED_PATTERN.match(key)
    if match:
        base, op, text = match.groups()
        scale = _parse_scale(text)
        if _base_activation(base) is None or scale is None or not math.isfinite(scale) \
                or scale <= 0:
            raise ValueError(f"activation {name!r}: a scaled activation is <name>(x*a) or "
                             f"<name>(x/a) with a registry name and a number a > 0 (or "
                             f"sqrt<n>), e.g. erf(x/sqrt2)")
        return scaled_activation(base, 1.0 / scale if op == "/" else scale)
    raise ValueError(
        f"unknown activation {name!r}; valid names: {', '.join(ACTIVATION_NAMES)}"
    )


def _canonical_scale(a: float) -> tuple[str, float]:
    """(text, a′) of a scale: ``*n``, ``/n``, ``*sqrtn``, ``/sqrtn`` for integers n ≥ 2
    (a′ recomputed from n, so 1/√2 written either way is one float), else ``*repr(a)``."""
    forms = (("*", a, lambda n: float(n)), ("/", 1.0 / a, lambda n: 1.0 / n),
             ("*sqrt", a * a, math.sqrt), ("/sqrt", 1.0 / (a * a), lambda n: 1.0 / math.sqrt(n)))
    for op, v, back in forms:
        n = round(v)
        if n >= 2 and abs(v - n) <= 1e-12 * n:
            return f"{op}{n}", back(n)
    return f"*{a!r}", a


def scaled_activation(base: str, scale: float) -> Activation:
    """σ_a(x) = σ(a·x) for a registry σ and a > 0, σ_a′(x) = a σ′(a·x); one object per
    canonical (σ, a), so equal names are the same activation (:func:`_scaled`)."""
    a = float(scale)
    if not math.isfinite(a) or a <= 0.0:
        raise ValueError(f"activation scale must be a finite number > 0, got {scale!r}")
    act = _base_activation(str(base).strip().lower())
    if act is None:
        raise ValueError(f"unknown activation {base!r}; valid names: "
                         f"{', '.join(ACTIVATION_NAMES)}")
    if a == 1.0:
        return act
    text, a = _canonical_scale(a)
    return _scaled(act.name, text, a)


@cache
def _scaled(base: str, text: str, a: float) -> Activation:
    """The :class:`Activation` ``base(x{text})`` = σ(a·x).

    Closed-form kernels where they exist: erf (K_a(ρ) = (2/π) arcsin(2a²ρ/(1 + 2a²)),
    K_a′(ρ) = (4a²/π)/√((1 + 2a²)² − 4a⁴ρ²), Saad & Solla's g at a = 1/√2) and the positively
    homogeneous relu, abs, linear, quadratic (σ(ax) = a^h σ(x): K_a = a^{2h} K, μ scaled by
    a^h); otherwise quadrature (as for a user's σ). Breakpoints scale by 1/a.
    """
    act = _base_activation(base)
    name = f"{base}(x{text})"
    extra = {"base": act.name, "scale": a}
    f0, d0 = act.fn, act.deriv

    def fn(x):
        return f0(a * x)

    def deriv(x):
        return a * d0(a * x)

    kernel = kprime = coefficients = None
    dsm = None
    if act.name == "erf":
        t2 = 2.0 * a * a

        def kernel(rho):
            return (2.0 / np.pi) * np.arcsin(t2 * _clip_rho(rho) / (1.0 + t2))

        def kprime(rho):
            r = _clip_rho(rho)
            return t2 * (2.0 / np.pi) / np.sqrt((1.0 + t2) ** 2 - t2 * t2 * r * r)

        dsm = float(kprime(1.0))
    elif act.name in _HOMOGENEOUS:
        g = a ** _HOMOGENEOUS[act.name]
        k0, kp0, c0 = act.kernel, act.kprime, act.coefficients

        def kernel(rho):
            return g * g * k0(rho)

        def kprime(rho):
            return g * g * kp0(rho)

        def coefficients(pmax):
            return g * c0(pmax)

        dsm = g * g * act.deriv_second_moment
    return Activation(name, fn, deriv, kernel, kprime, coefficients,
                      breakpoints=tuple(b / a for b in act.breakpoints),
                      deriv_second_moment=dsm, polynomial_degree=act.polynomial_degree,
                      extra=extra)


def activation_from_callable(
    fn: Callable, deriv: Callable | None = None, name: str = "custom",
    breakpoints: tuple[float, ...] = (),
) -> Activation:
    """Wrap a user function σ (numpy in, numpy out) as an Activation.

    Without ``deriv``, σ′ is a central finite difference (step 1e-5, error ~1e-10 for
    smooth σ). Kernels and coefficients then come from quadrature in ``hermite``.
    """
    if deriv is None:
        def deriv(x, _f=fn, _h=1e-5):
            return (_f(x + _h) - _f(x - _h)) / (2 * _h)
    return Activation(name=name, fn=fn, deriv=deriv, breakpoints=tuple(breakpoints))

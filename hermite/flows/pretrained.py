"""Fine-tuning from a pre-trained base (issue 39, first case; docs/theory/pretraining-hurts.md).

Teacher y = σ(⟨u, x⟩), student ŷ = σ(⟨μu + a·v, x⟩) with a fixed base w₀ = μu (0 < μ < 1), a
scalar a and a unit v, both trained by online SGD. With m = ⟨v, u⟩, ν, z independent N(0, 1),
s = mν + √(1−m²)z, λ = μν + a·s and δ = (σ(λ) − σ(ν))σ′(λ), the population flow in t = steps·η is

    da/dt = −E[δs],   dm/dt = −a(E[δν] − m E[δs]) − (η/2)·a²·m·E[δ²]·(d−2)/B,

the last term (v's renormalisation at finite η·d/B) only when η, d and B are given. Its fixed
point (a, m) = (0, 0) has the Jacobian [[−c, −b], [−b, 0]] with

    b = E[(σ(μν) − σ(ν))σ′(μν)ν],   c = (E[σ′(μν)σ′(ν)] + b)/μ   (Stein's lemma: no σ″),

so the search phase escapes at λ₊ = (−c + √(c² + 4b²))/2, in time τ = 1/λ₊.

Expectations, vectorised over a batch of states: closed forms for ReLU (sector integrals of
the pair (ν, λ)) and erf (Gaussian tilts, Stein, the arcsine kernel), the exact tensor
Gauss–Hermite rule for polynomial σ, and for tanh and sigmoid (kink-free, analytic in a strip)
the smooth rule: one fixed tensor trapezoid rule in the principal axes w₁ = λ/√Var λ, w₂ ⊥,
|w| ≤ 9, spacing 0.3 in w₂ and per tier of √Var λ in w₁ (tanh 0.18/0.09/0.06 up to 1.5/3/4.5,
sigmoid 0.18/0.09 up to 3/4.5; beyond 4.5, i.e. |a| ≳ 3.5, the reference), 6161, 12261 or
18361 nodes, every moment one sum over w₁ of σ(λ), σ′(λ) and three inner sums of σ(ν) over
w₂ (within 1e-9 of the reference, ≲ 1e-10 of a finer one, spacings 0.03 and 0.15; `loradyn
bench theory`). Any other σ (kinked, scaled, user-given) takes the adaptive reference state
by state: b and c are 1-D composite Gauss–Legendre with σ(ν)'s and σ(μν)'s kinks as panel edges; the
drift a 2-D composite Gauss–Legendre rule over (ν, z) on panels scaled to σ(λ) with the kink
lines ν = k and λ = k as panel edges (graded like :mod:`hermite.expansion._pair_quadrature`),
good to ≲ 1e-11 (E[δ²] to ~3e-10 at |a| ~ 2).

The general setting (:class:`Pretraining`; issue 39's options ``base``, ``teacher_activation``
and ``labels``): the mixed base w₀ = μu + (1 − μ)ζ with ⟨ζ, u⟩ = ρ (the run's own, kept exact),
a teacher σ* and labels y(ν) = σ*(ν) or σ*(ν)². The state is (a, m) or, mixed, (a, m, q) with
q = ⟨v, ζ⟩; with ℓ ∈ {s = ⟨v, x⟩, ν = ⟨u, x⟩, ⟨ζ, x⟩} and δ = (σ(λ) − y(ν))σ′(λ),

    da/dt = −E[δs],   dm/dt = −a(E[δν] − mE[δs]) − ½R a²m E[δ²],
    dq/dt = −a(E[δ⟨ζ, x⟩] − qE[δs]) − ½R a²q E[δ²],   R = η(d − 3)/B (aligned: d − 2).

δ depends on x only through the pair (ν, λ), λ = αν + βz (z ⊥ ν standard; α = Cov(ν, λ),
β² = Var λ − α²: :func:`_geometry`), so E[δℓ] = Cov(ℓ, ν)E[δν] + k_ℓE[δz] with k_ℓ the
z-coefficient of the regression of ℓ on (ν, z): every expectation is one of the four pair
moments (E[δν], E[δz], E[δ²], E[(σ(λ) − y)²]) at (α, β) — closed forms for ReLU and erf with
y = σ(ν), the exact rule for polynomial σ and y, the smooth rule where σ and σ* are kink-free
registry ones, else the adaptive plane rule with y's kinks as ν edges. Escape
(:func:`general_escape_coefficients`): at a = 0, m = q = 0 the Jacobian has the eigenvalues
0 and the roots of λ² + cλ − b², with b² = E[δ₀ν]² + E[δ₀z]² and c = E[δ₀z]/β₀ for the
mixed base (λ₀ = α₀ν + β₀z, α₀ = μ + (1 − μ)ρ, β₀ = (1 − μ)√(1 − ρ²)), and b, c as above
with y for σ(ν) for the aligned one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.integrate import solve_ivp

from hermite._activation import resolve_activation
from hermite._quadrature import gauss_hermite, gauss_panels, legendre
from hermite.activations import Activation, get_activation
from hermite.expansion._pair_quadrature import _outer_edges

__all__ = [
    "LABELS",
    "PretrainedFlow",
    "Pretraining",
    "escape_coefficients",
    "escape_rate",
    "escape_time",
    "flow_crossing_time",
    "general_drift",
    "general_escape_coefficients",
    "general_escape_time",
    "general_flow",
    "general_loss",
    "pretrained_drift",
    "pretrained_flow",
    "pretrained_loss",
]

_ORDER = 8  # Gauss–Legendre nodes per panel of the plane rule (drift error ≲ 1e-11)
_TAIL = 10.0  # the plane rule's window: φ(10) ≈ 8e-23
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check_mu(mu) -> float:
    mu = float(mu)
    if not 0.0 < mu < 1.0:
        raise ValueError(f"mu must be in (0, 1): the base w0 = mu·u needs it, got {mu!r}")
    return mu


def _renorm_rate(eta, d, batch, inside: int = 2) -> float:
    """η(d − inside)/B of the renormalisation term (``inside``: the dimension of the span the
    flow follows, 2 for (u, v), 3 for (u, ζ, v)), 0 when none of η, d, B is given."""
    given = [x is not None for x in (eta, d, batch)]
    if not any(given):
        return 0.0
    if not all(given):
        raise ValueError("eta, d and batch go together: give all three or none")
    if not (eta > 0 and d >= inside and batch >= 1):
        raise ValueError(f"need eta > 0, d ≥ {inside}, batch ≥ 1, got {eta!r}, {d!r}, "
                         f"{batch!r}")
    return float(eta) * (float(d) - float(inside)) / float(batch)


# ---------------------------------------------------------------- escape of the search phase
def escape_coefficients(activation, mu) -> tuple[float, float]:
    """(b, c) of the Jacobian [[−c, −b], [−b, 0]] at (a, m) = (0, 0), by 1-D quadrature.

    b = E[(σ(μν) − σ(ν))σ′(μν)ν], c = (E[σ′(μν)σ′(ν)] + b)/μ; composite Gauss–Legendre with
    the kinks k and k/μ of σ(ν), σ(μν) as panel edges (exact for piecewise σ).
    """
    act = resolve_activation(activation)
    return _aligned_coefficients(act, act.fn, act.deriv, act.breakpoints, _check_mu(mu))


def _aligned_coefficients(act: Activation, label, label_deriv, label_kinks, mu: float):
    """(b, c) of :func:`escape_coefficients` with labels y(ν) = ``label``: b = E[(σ(μν) −
    y(ν))σ′(μν)ν], c = (E[σ′(μν)y′(ν)] + b)/μ (Stein's lemma on ν removes σ″); the kinks of
    y(ν) and of σ(μν) as panel edges."""
    kinks = tuple(label_kinks) + tuple(k / mu for k in act.breakpoints)
    x, w = gauss_panels(width=0.5, order=24, breakpoints=kinks)
    dmu = np.asarray(act.deriv(mu * x), dtype=np.float64)
    b = float(np.dot(w, (act.fn(mu * x) - label(x)) * dmu * x))
    c = (float(np.dot(w, dmu * label_deriv(x))) + b) / mu
    return b, c


def _rate(b: float, c: float) -> float:
    """Largest root of λ² + cλ − b² = 0 (cancellation-free for c > 0)."""
    root = math.sqrt(c * c + 4.0 * b * b)
    return 2.0 * b * b / (c + root) if c > 0 else 0.5 * (root - c)


def escape_rate(activation, mu):
    """λ₊ = (−c + √(c² + 4b²))/2 per unit t = steps·η; a float, or an array for array μ."""
    act = resolve_activation(activation)
    mus = np.asarray(mu, dtype=np.float64)
    out = np.array([_rate(*escape_coefficients(act, x)) for x in mus.ravel()])
    return float(out[0]) if mus.ndim == 0 else out.reshape(mus.shape)


def escape_time(activation, mu):
    """τ = 1/λ₊ (``math.inf`` where λ₊ ≤ 0: b = 0 is a trap); float or array like μ."""
    lam = np.asarray(escape_rate(activation, mu), dtype=np.float64)
    with np.errstate(divide="ignore"):
        tau = np.where(lam > 0, 1.0 / np.where(lam > 0, lam, 1.0), math.inf)
    return float(tau) if tau.ndim == 0 else tau


# ---------------------------------------------------------------- population expectations
def _row_panels(edges: np.ndarray):
    """Composite Gauss–Legendre against φ on the panels between each row's sorted ``edges``."""
    t, wt = legendre(_ORDER)
    mid = 0.5 * (edges[:, 1:] + edges[:, :-1])
    half = 0.5 * (edges[:, 1:] - edges[:, :-1])
    x = (mid[..., None] + half[..., None] * t).reshape(edges.shape[0], -1)
    w = (half[..., None] * wt).reshape(edges.shape[0], -1)
    return x, w * _INV_SQRT_2PI * np.exp(-0.5 * x * x)


def _plane_rule(act: Activation, alpha: float, beta: float, label=None):
    """Nodes (ν, z) and weights w with Σ w F(ν, z) ≈ E[F] for F = G(ν, z, y(ν), σ(λ), σ′(λ)),
    λ = αν + βz, labels y = σ (``label`` None) or a :class:`_Labels`. Polynomial σ and y:
    exact tensor Gauss–Hermite. Otherwise composite Gauss–Legendre with panels ≤ 1/|α| in ν
    and ≤ 1/|β| in z (σ(λ)'s scale) and, for kinked σ or y, the kink lines ν = k (y's) and
    λ = k (σ's) as panel edges: graded in ν around k/α (the edges of
    :mod:`hermite.expansion._pair_quadrature`), cut at z = (k − αν)/β for each ν node."""
    deg = act.polynomial_degree if label is None else label.rule_degree(act)
    if deg is not None:
        x, w = gauss_hermite(2 * deg + 2)
        return x[:, None], x[None, :], w[:, None] * w[None, :]
    kinks = np.asarray(act.breakpoints, dtype=np.float64)
    nu_kinks = kinks if label is None else np.asarray(label.kinks, dtype=np.float64)
    graded = _outer_edges(alpha, abs(beta), nu_kinks, kinks) \
        if kinks.size or nu_kinks.size else ()
    nu, w_nu = gauss_panels(width=1.0 / max(1.0, abs(alpha)), order=_ORDER,
                            breakpoints=tuple(graded), tail=_TAIL)
    base = np.linspace(-_TAIL, _TAIL, int(np.ceil(2 * _TAIL * max(1.0, abs(beta)))) + 1)
    edges = np.broadcast_to(base, (nu.size, base.size))
    if beta != 0.0 and kinks.size:
        cuts = np.clip((kinks[None, :] - alpha * nu[:, None]) / beta, -_TAIL, _TAIL)
        edges = np.sort(np.concatenate([edges, cuts], axis=1), axis=1)
    z, w_z = _row_panels(edges)
    return nu[:, None], z, w_nu[:, None] * w_z


def _moments(act: Activation, mu: float, a: float, m: float):
    """(E[δs], E[δν], E[δ²], E[(σ(λ) − σ(ν))²]) at the state (a, m)."""
    root = math.sqrt(max(0.0, 1.0 - m * m))
    nu, z, w = _plane_rule(act, mu + a * m, a * root)
    s = m * nu + root * z
    lam = mu * nu + a * s
    diff = act.fn(lam) - act.fn(nu)
    delta = diff * act.deriv(lam)
    return (float(np.sum(w * delta * s)), float(np.sum(w * delta * nu)),
            float(np.sum(w * delta * delta)), float(np.sum(w * diff * diff)))


def _reference_moments(act: Activation, mu: float, a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(4, N) moments of :func:`_moments` state by state: the adaptive reference."""
    return np.array([_moments(act, mu, float(x), float(y)) for x, y in zip(a, m, strict=True)]
                    ).reshape(-1, 4).T


def _pair(mu: float, a: np.ndarray, m: np.ndarray):
    """(√(1−m²), α, β, q) of λ = αν + βz = μν + a(mν + √(1−m²)z), q = Var λ = α² + β²."""
    root = np.sqrt(np.maximum(0.0, 1.0 - m * m))
    alpha, beta = mu + a * m, a * root
    return root, alpha, beta, alpha * alpha + beta * beta


def _relu_moments(mu: float, a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Closed form for ReLU: δ = λ1{λ>0} − ν1{ν>0, λ>0}. The one-indicator terms are
    E[λU1{λ>0}] = E[λU]/2 (symmetry); the two-indicator ones are sector integrals in polar
    coordinates of (ν, z): ν > 0, λ > 0 is θ ∈ (lo, hi), E[R²] = 2, so
    E[ν²1] = ∫cos²θ dθ/π and E[νz1] = ∫cosθ sinθ dθ/π (empty sector when λ ≡ 0)."""
    root, alpha, beta, q = _pair(mu, a, m)
    j_nn, j_nz, cross = _relu_sector(alpha, beta, q)
    return np.array([0.5 * (mu * m + a) - (m * j_nn + root * j_nz), 0.5 * alpha - j_nn,
                     0.5 * q - 2.0 * cross + j_nn, 0.5 * (q + 1.0) - 2.0 * cross])


def _relu_sector(alpha, beta, q):
    """(E[ν²1], E[νz1], E[relu(λ)relu(ν)]) over the sector 1 = 1{ν > 0, λ > 0}, λ = αν + βz,
    q = Var λ (:func:`_relu_moments`)."""
    phi = np.arctan2(beta, alpha)
    lo = np.maximum(-0.5 * math.pi, phi - 0.5 * math.pi)
    hi = np.where(q > 0, np.minimum(0.5 * math.pi, phi + 0.5 * math.pi), lo)
    j_nn = (0.5 * (hi - lo) + 0.25 * (np.sin(2 * hi) - np.sin(2 * lo))) / math.pi
    j_nz = (np.sin(hi) ** 2 - np.sin(lo) ** 2) / (2.0 * math.pi)
    return j_nn, j_nz, alpha * j_nn + beta * j_nz  # E[relu(λ)relu(ν)] = E[λν1{ν>0, λ>0}]


def _relu_pair(alpha, beta):
    """(E[δν], E[δz], E[δ²], E[(σ(λ) − σ(ν))²]) for ReLU at λ = αν + βz (as
    :func:`_relu_moments`, E[λz1{λ>0}] = β/2)."""
    q = alpha * alpha + beta * beta
    j_nn, j_nz, cross = _relu_sector(alpha, beta, q)
    return np.array([0.5 * alpha - j_nn, 0.5 * beta - j_nz, 0.5 * q - 2.0 * cross + j_nn,
                     0.5 * (q + 1.0) - 2.0 * cross])


def _erf_moments(mu: float, a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Closed form for erf, σ′(λ) = (2/√π)e^{−λ²}. The weight e^{−cλ²} tilts (ν, z) ~ N(0, I)
    to N(0, I − k eeᵀ), e = (α, β), k = 2c/(1 + 2cq), with mass 1/√(1 + 2cq); then
    E[U erf(X)] = Cov(U, X)(2/√π)/√(1 + 2Var X) (Stein) and :func:`_erf_pair`."""
    root, alpha, beta, q = _pair(mu, a, m)
    e_s = mu * m + a  # ⟨s, e⟩ = Cov(s, λ)
    tilt = _erf_tilt(alpha, q)
    ds = _erf_linear(tilt, e_s, m)
    dnu = _erf_linear(tilt, alpha, None)
    return np.array([ds, dnu, *_erf_squares(alpha, q)])


def _erf_tilt(alpha, q):
    """(α, g, k, Var λ, Var ν, mass) of (ν, z) tilted by e^{−λ²}: g = 1 + 2q, k = 2/g."""
    g1 = 1.0 + 2.0 * q
    k1 = 2.0 / g1
    weight = (2.0 / math.sqrt(math.pi)) / np.sqrt(g1)
    return alpha, g1, k1, q / g1, 1.0 - k1 * alpha * alpha, weight


def _erf_stein(cov_ux, var_x):
    return cov_ux * (2.0 / math.sqrt(math.pi)) / np.sqrt(1.0 + 2.0 * var_x)


def _erf_linear(tilt, cov_lam, cov_nu):
    """E[δU] for erf, U Gaussian with Cov(U, λ) = ``cov_lam`` and Cov(U, ν) = ``cov_nu``
    (None: U = ν), from the tilt of :func:`_erf_tilt` (Stein under the tilted law)."""
    alpha, g1, k1, v_lam, v_nu, weight = tilt
    tilted = v_nu if cov_nu is None else cov_nu - k1 * cov_lam * alpha
    return weight * (_erf_stein(cov_lam / g1, v_lam) - _erf_stein(tilted, v_nu))


def _erf_pair(var_x, var_y, cov):
    """E[erf(X)erf(Y)] = (2/π)arcsin(2C/√((1+2Vx)(1+2Vy))) for a centred Gaussian pair."""
    return (2.0 / math.pi) * np.arcsin(2.0 * cov / np.sqrt((1 + 2 * var_x) * (1 + 2 * var_y)))


def _erf_squares(alpha, q):
    """(E[δ²], E[(σ(λ) − σ(ν))²]) for erf at Cov(ν, λ) = α, Var λ = q."""
    g2 = 1.0 + 4.0 * q
    v_lam2, v_nu2, c_2 = q / g2, 1.0 - (4.0 / g2) * alpha * alpha, alpha / g2
    d2 = (4.0 / math.pi) / np.sqrt(g2) * (_erf_pair(v_lam2, v_lam2, v_lam2)
                                          + _erf_pair(v_nu2, v_nu2, v_nu2)
                                          - 2.0 * _erf_pair(v_lam2, v_nu2, c_2))
    gap = _erf_pair(q, q, q) + _erf_pair(1.0, 1.0, 1.0) - 2.0 * _erf_pair(q, 1.0, alpha)
    return d2, gap


def _erf_pair_moments(alpha, beta):
    """(E[δν], E[δz], E[δ²], E[(σ(λ) − σ(ν))²]) for erf at λ = αν + βz."""
    q = alpha * alpha + beta * beta
    tilt = _erf_tilt(alpha, q)
    return np.array([_erf_linear(tilt, alpha, None), _erf_linear(tilt, beta, 0.0),
                     *_erf_squares(alpha, q)])


_CHUNK = 1 << 20  # states × nodes per block of the polynomial rule


def _polynomial_moments(act: Activation, mu: float, a: np.ndarray, m: np.ndarray):
    """Polynomial σ: the exact tensor Gauss–Hermite rule of :func:`_plane_rule`, one array of
    states × nodes per block."""
    nu, z, w = (x.ravel() for x in np.broadcast_arrays(*_plane_rule(act, 0.0, 0.0)))
    out = np.empty((4, a.size))
    step = max(1, _CHUNK // w.size)
    for lo in range(0, a.size, step):
        ab, mb = a[lo:lo + step, None], m[lo:lo + step, None]
        s = mb * nu + np.sqrt(np.maximum(0.0, 1.0 - mb * mb)) * z
        lam = mu * nu + ab * s
        diff = act.fn(lam) - act.fn(nu)
        delta = diff * act.deriv(lam)
        out[:, lo:lo + step] = [(delta * s) @ w, (delta * nu) @ w, (delta * delta) @ w,
                                (diff * diff) @ w]
    return out


_CLOSED_FORMS = {"relu": _relu_moments, "erf": _erf_moments}

# the smooth rule: trapezoid in the principal axes (w₁ = λ/√q, w₂ ⊥), |w| ≤ _SMOOTH_TAIL
_SMOOTH_NAMES = ("sigmoid", "tanh", "erf")  # registry σ that are analytic near the real line
# (largest √q = √Var λ, spacing in w₁) per tier: σ(λ) = σ(√q w₁) sets it (sigmoid's poles,
# ±iπ, lie twice as far as tanh's); beyond the last tier (√q > 4.5): the reference
_SMOOTH_TIERS = {"tanh": ((1.5, 0.18), (3.0, 0.09), (4.5, 0.06)),
                 "sigmoid": ((3.0, 0.18), (4.5, 0.09))}
_SMOOTH_STEP_W2 = 0.3  # spacing in w₂ (only y(ν), unit scale, there)
_SMOOTH_TAIL = 9.0  # φ(9) ≈ 1e-18


def _smooth(act: Activation) -> bool:
    """Whether the smooth rule serves σ: a registry σ without kinks, analytic in a strip
    (:data:`_SMOOTH_NAMES`, or a polynomial)."""
    if act.breakpoints:
        return False
    return act.polynomial_degree is not None or (act.name in _SMOOTH_NAMES
                                                 and act is get_activation(act.name))


def _trapezoid(step: float) -> tuple[np.ndarray, np.ndarray]:
    """Nodes kh, |kh| ≤ _SMOOTH_TAIL, and weights ∝ hφ(kh) summing to 1 (E[1] = 1 exactly):
    the trapezoid rule, error ~ e^{−2πd/h} for an integrand analytic in the strip |Im| < d."""
    x = step * np.arange(-int(_SMOOTH_TAIL / step), int(_SMOOTH_TAIL / step) + 1)
    w = np.exp(-0.5 * x * x)
    return x, w / w.sum()


def _smooth_pair(act: Activation, label, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """(4, N) pair moments (E[δν], E[δz], E[δ²], E[(σ(λ) − y(ν))²]) at λ = αν + βz for σ and
    y = ``label`` (a :class:`_Labels`) analytic near the real line: one fixed tensor trapezoid
    rule in the principal axes w₁ = λ/√q, w₂ = (αz − βν)/√q (q = α² + β²), so ν = cw₁ − sw₂,
    z = sw₁ + cw₂ (c, s = α, β over √q). σ(λ), σ′(λ) depend on w₁ alone; with the inner sums
    Uₖ(w₁) = E_{w₂}[y(ν)·(1, w₂, y(ν))] every moment is one sum over w₁, e.g.
    E[δν] = E[σ′(λ)(σ(λ)cw₁ − cw₁U₀ + sU₁)]. The w₁ spacing is fixed per tier of √q and σ
    (:data:`_SMOOTH_TIERS`; tanh's for erf and polynomials); vectorised over states in
    blocks; states with √q above the last tier take the adaptive reference
    :func:`_pair_reference`."""
    tiers = _SMOOTH_TIERS.get(act.name, _SMOOTH_TIERS["tanh"])
    root = np.hypot(alpha, beta)
    tier = np.searchsorted([t[0] for t in tiers], root)
    out = np.empty((4, alpha.size))
    beyond = tier == len(tiers)
    if beyond.any():
        out[:, beyond] = _pair_reference(act, label, alpha[beyond], beta[beyond])
    safe = np.where(root > 0, root, 1.0)
    cos, sin = np.where(root > 0, alpha / safe, 1.0), np.where(root > 0, beta / safe, 0.0)
    x2, w2 = _trapezoid(_SMOOTH_STEP_W2)
    for i, (_, h1) in enumerate(tiers):
        _smooth_block(act, label, (root, cos, sin), np.flatnonzero(tier == i),
                      (*_trapezoid(h1), x2, w2), out)
    return out


def _smooth_block(act: Activation, label, geometry, idx: np.ndarray, rule, out: np.ndarray):
    """:func:`_smooth_pair`'s sums for the states ``idx`` on one tensor ``rule`` (x₁, w₁, x₂,
    w₂), written into ``out``; ``geometry`` = (√q, c, s) of all states."""
    root, cos, sin = geometry
    x1, w1, x2, w2 = rule
    step = max(1, _CHUNK // (x1.size * x2.size))
    for lo in range(0, idx.size, step):
        k = idx[lo:lo + step]
        c, s = cos[k, None], sin[k, None]
        lam = root[k, None] * x1
        sig, der = act.fn(lam), act.deriv(lam)
        y = label.fn(c[..., None] * x1[:, None] - s[..., None] * x2)
        u0, u1, u2 = y @ w2, y @ (w2 * x2), (y * y) @ w2
        cw = c * x1
        gap2 = sig * sig - 2.0 * sig * u0 + u2  # E_{w₂}[(σ(λ) − y)²]
        out[:, k] = [(der * (sig * cw - cw * u0 + s * u1)) @ w1,
                     (der * (sig * s * x1 - s * x1 * u0 - c * u1)) @ w1,
                     (der * der * gap2) @ w1, gap2 @ w1]


def _smooth_moments(act: Activation, mu: float, a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(4, N) aligned moments from :func:`_smooth_pair` with y = σ(ν): E[δs] = mE[δν] +
    √(1−m²)E[δz]."""
    root, alpha, beta, _ = _pair(mu, a, m)
    d_nu, d_z, d2, gap = _smooth_pair(act, _Labels(act, False), alpha, beta)
    return np.array([m * d_nu + root * d_z, d_nu, d2, gap])


def _fast_moments(act: Activation):
    """(mu, a, m) ↦ (4, N) moments (E[δs], E[δν], E[δ²], E[(σ(λ) − σ(ν))²]) of flat states,
    vectorised over states: closed forms for the registry's ReLU and erf, the exact rule for
    polynomial σ, the smooth rule (:func:`_smooth_moments`) for tanh and sigmoid; ``None`` for
    any other σ (kinked or user-given)."""
    closed = _CLOSED_FORMS.get(act.name)
    if closed is not None and act is get_activation(act.name):
        return closed
    if act.polynomial_degree is not None:
        return lambda mu, a, m: _polynomial_moments(act, mu, a, m)
    if _smooth(act):
        return lambda mu, a, m: _smooth_moments(act, mu, a, m)
    return None


def _batch_moments(act: Activation):
    """The fast moments of σ where there are some, else the adaptive reference."""
    return _fast_moments(act) or (lambda mu, a, m: _reference_moments(act, mu, a, m))


def _check_state(a, m) -> tuple[np.ndarray, np.ndarray]:
    a, m = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(m, dtype=np.float64))
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(m))):
        raise ValueError("a and m must be finite")
    if np.any(np.abs(m) > 1.0):
        raise ValueError(f"|m| must be ≤ 1 (m = ⟨v, u⟩ with v, u unit), got {m[np.abs(m) > 1]}")
    return a, m


def _drift(moments, mu: float, a: np.ndarray, m: np.ndarray, renorm: float) -> np.ndarray:
    """(2, N) drift at flat states from a :func:`_batch_moments` function."""
    ds, dnu, d2, _ = moments(mu, a, np.clip(m, -1.0, 1.0))
    return np.array([-ds, -a * (dnu - m * ds) - 0.5 * renorm * a * a * m * d2])


def pretrained_drift(activation, mu, a, m, *, eta=None, d=None, batch=None):
    """(da/dt, dm/dt) of the population flow at (a, m) (scalars or broadcastable arrays);
    with η, d and B, dm/dt carries the renormalisation term −(η/2)a²m E[δ²](d−2)/B."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    renorm = _renorm_rate(eta, d, batch)
    a, m = _check_state(a, m)
    out = _drift(_batch_moments(act), mu, a.ravel(), m.ravel(), renorm).reshape(2, *a.shape)
    return (float(out[0]), float(out[1])) if a.ndim == 0 else (out[0], out[1])


def pretrained_loss(activation, mu, a, m):
    """Population loss ½E[(σ(ν) − σ(λ))²], λ = μν + a(mν + √(1−m²)z); float or array."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    a, m = _check_state(a, m)
    out = 0.5 * _batch_moments(act)(mu, a.ravel(), m.ravel())[3].reshape(a.shape)
    return float(out) if out.ndim == 0 else out


# ---------------------------------------------------------------- the flow
@dataclass(frozen=True)
class PretrainedFlow:
    """Solution of the population flow: ``a``, ``m`` of shape (runs, times) at ``times``
    (t = steps·η); ``overlap`` = |m| is what the learner records."""

    activation: str
    mu: float
    times: np.ndarray
    a: np.ndarray
    m: np.ndarray
    q: np.ndarray | None = None  # ⟨v, ζ⟩ of the mixed base (:func:`general_flow`)

    @property
    def overlap(self) -> np.ndarray:
        return np.abs(self.m)


def pretrained_flow(activation, mu, a0, m0, times, *, eta=None, d=None, batch=None
                    ) -> PretrainedFlow:
    """Integrate the flow from each start (a0[r], m0[r]) (a0 scalar or (R,), m0 (R,)) to the
    sorted ``times`` ≥ 0 (DOP853, rtol 1e-9, atol 1e-15: the drift's roundoff, so a₀ ≳ 1e-6
    keeps ≲ 1e-9 relative accuracy); η, d and B add the renormalisation term. With a fast
    drift (:func:`_fast_moments`) all runs are one system, else each run is solved alone."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    renorm = _renorm_rate(eta, d, batch)
    a0, m0 = _check_state(a0, np.atleast_1d(np.asarray(m0, dtype=np.float64)))
    a0, m0 = np.atleast_1d(a0), np.atleast_1d(m0)
    times = np.atleast_1d(np.asarray(times, dtype=np.float64))
    if times.ndim != 1 or not np.all(np.isfinite(times)) or np.any(times < 0) \
            or np.any(np.diff(times) < 0):
        raise ValueError("times must be a 1-D sorted array of finite t ≥ 0")
    fast = _fast_moments(act)
    moments = fast or (lambda mu, a, m: _reference_moments(act, mu, a, m))
    a, m = _integrate(moments, mu, np.stack([a0, m0]), times, renorm, joint=fast is not None)
    return PretrainedFlow(act.name, mu, times, a, m)


def _integrate(moments, mu: float, starts: np.ndarray, times: np.ndarray, renorm: float, *,
               joint: bool) -> tuple[np.ndarray, np.ndarray]:
    """(a, m) of shape (runs, times) from ``starts`` (2, runs), all runs in one DOP853 system
    when ``joint`` (a vectorised drift), else run by run (rtol 1e-9, atol 1e-15 either way)."""
    a_out, m_out = _solve(lambda y: _drift(moments, mu, y[0], y[1], renorm), starts, times,
                          joint=joint)
    return a_out, np.clip(m_out, -1.0, 1.0)  # m = ±1 invariant


def _solve(drift, starts: np.ndarray, times: np.ndarray, *, joint: bool) -> np.ndarray:
    """(c, runs, times) of dy/dt = drift(y) (y (c, k) ↦ (c, k)) from ``starts`` (c, runs), all
    runs in one DOP853 system when ``joint``, else run by run (rtol 1e-9, atol 1e-15)."""
    comps, runs = starts.shape
    groups = [np.arange(runs)] if joint else [np.array([r]) for r in range(runs)]
    out = np.empty((comps, runs, times.size))
    for idx in groups:
        k = idx.size

        def rhs(_t, y, k=k):
            return drift(y.reshape(comps, k)).ravel()

        sol = solve_ivp(rhs, (0.0, float(times[-1])), starts[:, idx].ravel(), method="DOP853",
                        t_eval=times, rtol=1e-9, atol=1e-15)
        if not sol.success:
            raise RuntimeError(f"pretrained_flow: the solver failed from {starts[:, idx].T}: "
                               f"{sol.message}")
        out[:, idx] = sol.y.reshape(comps, k, times.size)
    return out


def flow_crossing_time(activation, mu, a0, m0, level, t_max, *, eta=None, d=None,
                       batch=None) -> float:
    """First t ∈ (0, t_max] with |m(t)| = ``level`` on the population flow from (a0, m0) (an
    event of the DOP853 solve, rtol 1e-9, atol 1e-15; η, d and B add the renormalisation
    term); 0 if |m0| ≥ level already, ``math.inf`` if not by t_max."""
    act = resolve_activation(activation)
    mu = _check_mu(mu)
    renorm = _renorm_rate(eta, d, batch)
    a0, m0 = (float(x) for x in _check_state(a0, m0))
    if not (0.0 < level <= 1.0 and t_max > 0):
        raise ValueError(f"need 0 < level ≤ 1 and t_max > 0, got {level!r}, {t_max!r}")
    if abs(m0) >= level:
        return 0.0
    moments = _batch_moments(act)

    def rhs(_t, y):
        return _drift(moments, mu, y[:1], y[1:], renorm).ravel()

    def hit(_t, y):
        return abs(y[1]) - level

    hit.terminal, hit.direction = True, 1
    sol = solve_ivp(rhs, (0.0, float(t_max)), [a0, m0], method="DOP853", events=hit,
                    rtol=1e-9, atol=1e-15)
    if not sol.success:
        raise RuntimeError(f"flow_crossing_time: the solver failed from ({a0}, {m0}): "
                           f"{sol.message}")
    return float(sol.t_events[0][0]) if sol.t_events[0].size else math.inf


# ---------------------------------------------------------------- the general setting
LABELS = ("y", "y2")


@dataclass(frozen=True)
class _Labels:
    """Labels y(ν) = σ*(ν) (``squared`` False) or σ*(ν)², their derivative, kinks and degree."""

    teacher: Activation
    squared: bool

    def fn(self, nu):
        y = self.teacher.fn(nu)
        return y * y if self.squared else y

    def deriv(self, nu):
        d = self.teacher.deriv(nu)
        return 2.0 * self.teacher.fn(nu) * d if self.squared else d

    @property
    def kinks(self) -> tuple:
        return tuple(self.teacher.breakpoints)

    @property
    def degree(self) -> int | None:
        deg = self.teacher.polynomial_degree
        return None if deg is None else deg * (2 if self.squared else 1)

    def rule_degree(self, act: Activation) -> int | None:
        """D with the 2D + 2 node Gauss–Hermite rule exact for δ², δν, (σ(λ) − y)² (degrees
        ≤ 2(max(deg σ, deg y) + deg σ − 1)); None unless σ and y are polynomials."""
        if act.polynomial_degree is None or self.degree is None:
            return None
        return max(act.polynomial_degree, self.degree)


@dataclass(frozen=True)
class Pretraining:
    """The setting beyond :func:`pretrained_flow`'s: student σ, base w₀ = μu (``rho`` None)
    or μu + (1 − μ)ζ with ζ unit and ⟨ζ, u⟩ = ``rho`` (the mixed base), teacher σ*
    (``teacher``; None: σ) and labels y = σ*(ν) (``labels`` "y") or σ*(ν)² ("y2"). Built
    from names or activations; ValueError (one line) for a bad one."""

    activation: Activation
    mu: float
    rho: float | None = None
    teacher: Activation | None = None
    labels: str = "y"

    def __post_init__(self):
        object.__setattr__(self, "activation", resolve_activation(self.activation))
        object.__setattr__(self, "mu", _check_mu(self.mu))
        if self.teacher is not None:
            object.__setattr__(self, "teacher", resolve_activation(self.teacher))
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        if self.rho is not None:
            rho = float(self.rho)
            if not abs(rho) < 1.0:
                raise ValueError(f"rho = ⟨ζ, u⟩ must be in (−1, 1), got {self.rho!r}")
            object.__setattr__(self, "rho", rho)

    @property
    def mixed(self) -> bool:
        return self.rho is not None

    @property
    def label(self) -> _Labels:
        return _Labels(self.teacher or self.activation, self.labels == "y2")

    @property
    def same_teacher(self) -> bool:
        """Whether y = σ(ν): the teacher is the student's σ and the labels are not squared."""
        teacher = self.teacher
        return self.labels == "y" and (teacher is None or teacher is self.activation or (
            teacher.name == self.activation.name and teacher.fn is self.activation.fn))


def _pair_reference(act: Activation, label: _Labels, alpha: np.ndarray, beta: np.ndarray):
    """(4, N) pair moments (E[δν], E[δz], E[δ²], E[(σ(λ) − y(ν))²]) at λ = αν + βz, state by
    state on the adaptive :func:`_plane_rule`: the reference for any (σ, y)."""
    out = np.empty((4, alpha.size))
    for i, (al, be) in enumerate(zip(alpha.ravel(), beta.ravel(), strict=True)):
        nu, z, w = _plane_rule(act, float(al), float(be), label)
        lam = al * nu + be * z
        gap = act.fn(lam) - label.fn(nu)
        delta = gap * act.deriv(lam)
        out[:, i] = [np.sum(w * delta * nu), np.sum(w * delta * z), np.sum(w * delta * delta),
                     np.sum(w * gap * gap)]
    return out


def _pair_polynomial(act: Activation, label: _Labels, alpha: np.ndarray, beta: np.ndarray):
    """The pair moments for polynomial σ and y: the exact tensor Gauss–Hermite rule of
    :func:`_plane_rule`, vectorised over states in blocks."""
    nu, z, w = (x.ravel() for x in np.broadcast_arrays(*_plane_rule(act, 0.0, 0.0, label)))
    y = label.fn(nu)
    out = np.empty((4, alpha.size))
    step = max(1, _CHUNK // w.size)
    for lo in range(0, alpha.size, step):
        lam = alpha[lo:lo + step, None] * nu + beta[lo:lo + step, None] * z
        gap = act.fn(lam) - y
        delta = gap * act.deriv(lam)
        out[:, lo:lo + step] = [(delta * nu) @ w, (delta * z) @ w, (delta * delta) @ w,
                                (gap * gap) @ w]
    return out


_PAIR_CLOSED = {"relu": _relu_pair, "erf": _erf_pair_moments}


def _pair_moments(setting: Pretraining):
    """(α, β) ↦ (4, N) pair moments of ``setting`` for flat arrays and whether they are
    vectorised: the closed forms (ReLU, erf with y = σ(ν)), the exact rule (polynomial σ and
    y), the smooth rule (:func:`_smooth_pair`: σ and σ* kink-free registry ones), else the
    adaptive reference state by state."""
    act, label = setting.activation, setting.label
    closed = _PAIR_CLOSED.get(act.name)
    if closed is not None and act is get_activation(act.name) and setting.same_teacher:
        return closed, True
    if label.rule_degree(act) is not None:
        return (lambda al, be: _pair_polynomial(act, label, al, be)), True
    if _smooth(act) and _smooth(label.teacher):
        return (lambda al, be: _smooth_pair(act, label, al, be)), True
    return (lambda al, be: _pair_reference(act, label, al, be)), False


def _geometry(setting: Pretraining, a, m, q, rho=None):
    """(α, β, k_s, k_ζ) at the state: λ = αν + βz with ν = ⟨u, x⟩ and z ⊥ ν standard, and
    the z-coefficients of E[s | ν, z] and E[⟨ζ, x⟩ | ν, z] (s = ⟨v, x⟩).

    Aligned: λ = (μ + am)ν + a√(1−m²)z, s = mν + √(1−m²)z. Mixed: in the orthonormal frame
    (u, e, w) with ζ = ρu + ρ̄e, ρ̄ = √(1−ρ²), v = mu + pe + rw (p = (q − ρm)/ρ̄,
    r = √(1 − m² − p²)): λ = αν + b_e x_e + b_w x_w with α = μ + (1−μ)ρ + am,
    b_e = (1−μ)ρ̄ + ap, b_w = ar, so β = ‖(b_e, b_w)‖, z = (b_e x_e + b_w x_w)/β,
    k_s = (p b_e + r b_w)/β and k_ζ = ρ̄ b_e/β (0 where β = 0). ``rho``: ρ per state
    (broadcast with a), else the setting's."""
    mu = setting.mu
    if not setting.mixed:
        root = np.sqrt(np.maximum(0.0, 1.0 - m * m))
        return mu + a * m, a * root, root, None
    rho = setting.rho if rho is None else rho
    rho_bar = np.sqrt(1.0 - rho * rho)
    p = (q - rho * m) / rho_bar
    r = np.sqrt(np.maximum(0.0, 1.0 - m * m - p * p))
    b_e, b_w = (1.0 - mu) * rho_bar + a * p, a * r
    beta = np.hypot(b_e, b_w)
    inv = np.divide(1.0, beta, out=np.zeros_like(beta), where=beta > 0)
    return mu + (1.0 - mu) * rho + a * m, beta, (p * b_e + r * b_w) * inv, rho_bar * b_e * inv


def _general_drift(pair, setting: Pretraining, y: np.ndarray, renorm: float,
                   rho=None) -> np.ndarray:
    """(c, N) drift at flat states y = (a, m) or (a, m, q) (mixed):
    ȧ = −E[δs], ṁ = −a(E[δν] − mE[δs]) − ½R a²m E[δ²], q̇ = −a(E[δ⟨ζ,x⟩] − qE[δs]) − ½R a²q E[δ²]
    with E[δℓ] = Cov(ℓ, ν)E[δν] + k_ℓ E[δz] (Gaussian regression of ℓ on (ν, z)); ``rho``
    per state or None (the setting's)."""
    a, m = y[0], np.clip(y[1], -1.0, 1.0)
    q = np.clip(y[2], -1.0, 1.0) if setting.mixed else None
    rho = setting.rho if rho is None else rho
    alpha, beta, k_s, k_z = _geometry(setting, a, m, q, rho)
    d_nu, d_z, d2, _ = pair(alpha, beta)
    ds = m * d_nu + k_s * d_z
    out = [-ds, -a * (d_nu - m * ds) - 0.5 * renorm * a * a * m * d2]
    if setting.mixed:
        d_zeta = rho * d_nu + k_z * d_z
        out.append(-a * (d_zeta - q * ds) - 0.5 * renorm * a * a * q * d2)
    return np.array(out)


def _general_state(setting: Pretraining, a, m, q, rho=None):
    """Broadcast, checked state arrays (a, m, q, ρ); q and ρ (``rho`` per state, else the
    setting's) only for the mixed base."""
    a, m = _check_state(a, m)
    if not setting.mixed:
        if q is not None:
            raise ValueError("q = ⟨v, ζ⟩ is the mixed base's: give it only with rho")
        return a, m, None, None
    if q is None:
        raise ValueError("the mixed base's state needs q = ⟨v, ζ⟩")
    rho = setting.rho if rho is None else rho
    a, m, q, rho = np.broadcast_arrays(a, m, np.asarray(q, dtype=np.float64),
                                       np.asarray(rho, dtype=np.float64))
    if not (np.all(np.isfinite(q)) and np.all(np.abs(rho) < 1.0)):
        raise ValueError("q must be finite and |rho| < 1")
    if np.any(m * m + ((q - rho * m) ** 2) / (1 - rho * rho) > 1.0 + 1e-9):
        raise ValueError("(m, q) must be the overlaps of a unit v with u and ζ")
    return a, m, q, rho


def _inside(setting: Pretraining) -> int:
    return 3 if setting.mixed else 2


def general_drift(setting: Pretraining, a, m, q=None, *, eta=None, d=None, batch=None):
    """(ȧ, ṁ) or, for the mixed base, (ȧ, ṁ, q̇) of the population flow of ``setting`` at the
    state(s) (:func:`_general_drift`); η, d and B add the renormalisation term with
    R = η(d − 2)/B (aligned) or η(d − 3)/B (mixed: the rest of x is ⊥ span(u, ζ, v))."""
    renorm = _renorm_rate(eta, d, batch, _inside(setting))
    a, m, q, _ = _general_state(setting, a, m, q)
    y = np.stack([x.ravel() for x in (a, m, q) if x is not None])
    out = _general_drift(_pair_moments(setting)[0], setting, y, renorm).reshape(-1, *a.shape)
    return tuple(float(x) for x in out) if a.ndim == 0 else tuple(out)


def general_loss(setting: Pretraining, a, m, q=None, rho=None):
    """Population loss ½E[(y(ν) − σ(λ))²] of ``setting`` at the state(s) (no label noise);
    ``rho``: ⟨ζ, u⟩ per state (mixed base), else the setting's."""
    a, m, q, rho = _general_state(setting, a, m, q, rho)
    alpha, beta, _, _ = _geometry(setting, a.ravel(), np.clip(m.ravel(), -1.0, 1.0),
                                  None if q is None else np.clip(q.ravel(), -1.0, 1.0),
                                  None if rho is None else rho.ravel())
    out = 0.5 * _pair_moments(setting)[0](alpha, beta)[3].reshape(a.shape)
    return float(out) if out.ndim == 0 else out


def general_flow(setting: Pretraining, a0, m0, times, q0=None, *, rho=None, eta=None, d=None,
                 batch=None) -> PretrainedFlow:
    """The flow of ``setting`` from each start (``a0[r]``, ``m0[r]``, and ``q0[r]`` for the
    mixed base) to the sorted ``times``
    (DOP853 as :func:`pretrained_flow`; one system when the pair moments are vectorised);
    ``q`` of the result is set for the mixed base, ``rho`` (R,) gives each run its own
    ⟨ζ, u⟩ (else the setting's)."""
    renorm = _renorm_rate(eta, d, batch, _inside(setting))
    m0 = np.atleast_1d(np.asarray(m0, dtype=np.float64))
    a0, m0, q0, rho = _general_state(setting, np.broadcast_to(np.asarray(a0, float), m0.shape),
                                     m0, q0, rho)
    times = np.atleast_1d(np.asarray(times, dtype=np.float64))
    if times.ndim != 1 or not np.all(np.isfinite(times)) or np.any(times < 0) \
            or np.any(np.diff(times) < 0):
        raise ValueError("times must be a 1-D sorted array of finite t ≥ 0")
    pair, joint = _pair_moments(setting)
    starts = np.stack([np.atleast_1d(x) for x in (a0, m0, q0) if x is not None])
    if setting.mixed and not joint:  # run by run, each with its own ρ
        out = np.concatenate([_solve(lambda y, r=r: _general_drift(pair, setting, y, renorm,
                                                                   rho[r]),
                                     starts[:, r:r + 1], times, joint=False)
                              for r in range(starts.shape[1])], axis=1)
    else:
        out = _solve(lambda y: _general_drift(pair, setting, y, renorm, rho), starts, times,
                     joint=joint)
    q = np.clip(out[2], -1.0, 1.0) if setting.mixed else None
    return PretrainedFlow(setting.activation.name, setting.mu, times, out[0],
                          np.clip(out[1], -1.0, 1.0), q)


def general_escape_coefficients(setting: Pretraining) -> tuple[float, float]:
    """(b, c) of the linearisation at a = 0, m = q = 0: λ₊ is the positive root of
    λ² + cλ − b² (the other eigenvalue of the mixed base's 3×3 Jacobian is 0).

    Aligned: :func:`escape_coefficients` with y for σ(ν), c = (E[σ′(μν)y′(ν)] + b)/μ.
    Mixed: λ₀ = α₀ν + β₀z, α₀ = μ + (1−μ)ρ, β₀ = (1−μ)ρ̄, δ₀ = (σ(λ₀) − y(ν))σ′(λ₀); the
    Jacobian is [[−c, −hᵀΣ⁻¹], [−h, 0]] with h = (E[δ₀ν], E[δ₀⟨ζ,x⟩]) and Σ the Gram matrix of
    (u, ζ), so b² = hᵀΣ⁻¹h = E[δ₀ν]² + E[δ₀z]², and Stein's lemma on z gives
    c = E[σ′(λ₀)² + (σ(λ₀) − y)σ″(λ₀)] = E[δ₀z]/β₀ (no σ″). b ≥ 0 here (its sign is lost)."""
    act, label, mu = setting.activation, setting.label, setting.mu
    if not setting.mixed:
        return _aligned_coefficients(act, label.fn, label.deriv, label.kinks, mu)
    rho = setting.rho
    beta0 = (1.0 - mu) * math.sqrt(1.0 - rho * rho)
    d_nu, d_z, _, _ = _pair_moments(setting)[0](np.array([mu + (1.0 - mu) * rho]),
                                                np.array([beta0]))[:, 0]
    return float(math.hypot(d_nu, d_z)), float(d_z / beta0)


def general_escape_time(setting: Pretraining) -> float:
    """τ = 1/λ₊ of :func:`general_escape_coefficients` (``math.inf`` where λ₊ ≤ 0)."""
    lam = _rate(*general_escape_coefficients(setting))
    return 1.0 / lam if lam > 0 else math.inf

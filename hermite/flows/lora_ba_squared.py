"""Squared labels y = f*² for ``lora-ba``'s population flow (normalised rows; issue 39).

Teacher f* = Σᵢλᵢσ*(zᵢ), zᵢ = ⟨vᵢ, x⟩ (unit rows), student f̂ = Σⱼλⱼσ(aⱼ), aⱼ = ⟨ĥⱼ, x⟩ (unit
rows), x ~ N(0, I). The population loss (no 1/2, without the label noise's constant) is

    F = E[f*⁴] − 2 Σⱼ λⱼ C(ĥⱼ) + λᵀK(ĤĤᵀ)λ,   C(ĥ) = E[f*² σ(⟨ĥ, x⟩)] = Σᵢᵢ′ λᵢλᵢ′ Tᵢᵢ′(ĥ),   (Y)

Tᵢᵢ′(ĥ) = T(ρ*ᵢᵢ′, κᵢ, κᵢ′) = E[σ*(z₁)σ*(z₂)σ(z₃)] with corr(z₁, z₂) = ρ*ᵢᵢ′ = ⟨vᵢ, vᵢ′⟩,
corr(z₁, z₃) = κᵢ = ⟨vᵢ, ĥ⟩, corr(z₂, z₃) = κᵢ′. By Price's theorem ∂T/∂κᵢ =
E[σ*′(z₁)σ*(z₂)σ′(z₃)], so the teacher's sum in ∂F/∂ĥⱼ (``lora_ba.row_gradient``, which takes
it through the unit rows) is −2λⱼ Σᵢᵢ′ λᵢλᵢ′ (∂T/∂κᵢ vᵢ + ∂T/∂κᵢ′ vᵢ′). The escape's rest
Hessian (``hermite.flows.lora_ba_escape``, eq. (M2)) needs only ⟨that sum, ŵⱼ⟩ at the base
rows (:func:`squared_rest_teacher`): out of the span κ moves at second order.

A pair i ≠ i′ (ρ*ᵢᵢ′ = cos θ*, |ρ*| < 1). In the plane of vᵢ, vᵢ′ (orthonormal e₁ = vᵢ, e₂;
vᵢ at angle 0, vᵢ′ at θ*) write ĥ's projection p = cos θ e_φ, φ ∈ [0, π), θ ∈ [0, π] (θ > π/2:
p points to φ + π), and x's plane coordinates as s = ⟨e_φ, x⟩, t = ⟨e_φ⊥, x⟩. Then z₃ =
s cos θ + ξ sin θ (ξ ⊥ the plane) and

    T(φ, θ) = E_s[Ψ_φ(s) G_θ(s)],   Ψ_φ(s) = E_t[σ*(⟨v̄ᵢ, u⟩)σ*(⟨v̄ᵢ′, u⟩)],
    G_θ(s) = E_ξ[σ(s cos θ + ξ sin θ)],   u = s e_φ + t e_φ⊥,                              (P)

the pair expectation of Ψ_φ and σ at correlation cos θ (smooth in θ, as ``ChebyshevInTheta``
uses). (P) is a composite Gauss–Legendre sum on one s-grid for all (φ, θ) (edges at 0 and
graded towards 0 down to 2^−``GRADE``: the kinks of Ψ_φ and G_θ for breakpoints at 0), Ψ_φ and
G_θ inner composite Gauss–Legendre sums split at the kinks; the Price forms likewise with σ*′
in the first (second) factor and σ′. Tabulated at Chebyshev–Lobatto nodes in (φ, 1 − 2θ/π) on
two φ-panels, [0, θ*] and [θ*, π] (the corners φ ∈ {0, θ*}, θ ∈ {0, π}, ĥ = ±vᵢ, are where
ReLU's kinks align): a 2-D Chebyshev interpolant of degrees (``PHI_DEGREE``, ``THETA_DEGREE``)
per table, cached per (σ*, σ, ρ*). Parallel rows (vᵢ′ = ±vᵢ, and the diagonal i = i′): 1-D,
E[σ*(z)σ*(±z)σ(z₃)] at correlation κᵢ, a ``ChebyshevInTheta`` of ``pair_expectation`` (its
κ-derivative E[(σ*(z)σ*(±z))′σ′(z₃)]). Activations with breakpoints other than 0 are refused.
Accuracy and cost, measured: docs/learners.md (lora-ba, squared labels).

E[f*⁴] (a constant: the loss's value only), a k-dim Gaussian integral over span(V): for smooth
σ* a tensor Gauss–Hermite rule where it has at most ``FOURTH_SAMPLES`` points (exact for a
polynomial σ*), else (σ* with a kink, or k too large) a quasi-Monte Carlo average over one
scrambled Sobol′ set of ``FOURTH_SAMPLES`` points (seed ``FOURTH_SEED``); cached per teacher.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.fft
import scipy.special
import scipy.stats

from hermite._activation import resolve_activation
from hermite._quadrature import gauss_hermite, sobol_normals
from hermite.expansion._chebyshev import ChebyshevInTheta
from hermite.expansion._pair_quadrature import _gl_nodes, pair_expectation
from hermite.expansion.kernels import dual_kernel

__all__ = ["PairTable", "pair_table", "squared_cross", "squared_teacher_gradient",
           "squared_rest_teacher", "squared_loss", "fourth_moment", "PHI_DEGREE",
           "THETA_DEGREE", "FOURTH_SAMPLES"]

PHI_DEGREE, THETA_DEGREE = 64, 64  # Chebyshev degrees of a pair's table (per φ-panel)
TAIL, PANELS, GRADE = 10.0, 10, 14  # quadrature window [−TAIL, TAIL], its panels, 2^−GRADE
TRIM = 1e-13  # trailing Chebyshev coefficients below TRIM × the largest are dropped
PARALLEL = 1e-12  # |ρ*| > 1 − PARALLEL: the pair is treated as parallel rows (1-D)
FOURTH_SAMPLES, FOURTH_SEED = 2**20, 39  # E[f*⁴]: at most this many points; Sobol′ seed
FOURTH_NODES = 48  # Gauss–Hermite nodes a side of E[f*⁴]'s tensor rule (smooth σ*)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _zero_breaks(*acts) -> None:
    """ValueError unless every activation's breakpoints are at 0 (the grids' kinks)."""
    for act in acts:
        if any(b != 0.0 for b in act.breakpoints):
            raise ValueError(f"labels y2 need activations smooth away from 0, {act.name} has "
                             f"breakpoints {act.breakpoints}")


def _lobatto(n: int) -> np.ndarray:
    """Chebyshev–Lobatto points cos(πj/n), j = 0..n (descending from 1)."""
    return np.cos(np.pi * np.arange(n + 1) / n)


def _outer() -> tuple[np.ndarray, np.ndarray]:
    """The s-grid of (P): nodes and weights (the N(0, 1) density folded in)."""
    grade = 2.0 ** -np.arange(GRADE + 1)
    edges = np.unique(np.concatenate([np.linspace(-TAIL, TAIL, PANELS + 1), grade, -grade,
                                      [0.0]]))
    s, w = _gl_nodes(edges)
    return s, w * _INV_SQRT_2PI * np.exp(-0.5 * s * s)


def _inner(cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights (…, n) of E over a standard normal, split at ``cuts`` (…, c)."""
    base = np.broadcast_to(np.linspace(-TAIL, TAIL, PANELS + 1), cuts.shape[:-1] + (PANELS + 1,))
    edges = np.sort(np.concatenate([base, np.clip(cuts, -TAIL, TAIL)], -1), -1)
    t, w = _gl_nodes(edges)
    return t, w * _INV_SQRT_2PI * np.exp(-0.5 * t * t)


def _student(act, s: np.ndarray, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """(G_θ(s), G′_θ(s)) of (P): E_ξ[σ(s cos θ + ξ sin θ)] and the same with σ′."""
    c, sn = math.cos(theta), math.sin(theta)
    if sn < 1e-300:
        return act.fn(c * s), act.deriv(c * s)
    xi, w = _inner((-c * s / sn)[:, None])
    arg = c * s[:, None] + sn * xi
    return (w * act.fn(arg)).sum(-1), (w * act.deriv(arg)).sum(-1)


_STUDENTS: dict = {}


def _students(act, degree: int) -> np.ndarray:
    """(G_θ, G′_θ) (S, Θ, 2) on the s-grid at the Lobatto θ-nodes, times the s-weights
    (cached per σ)."""
    key = (act, degree)
    if key not in _STUDENTS:
        s, w = _outer()
        thetas = 0.5 * np.pi * (1.0 - _lobatto(degree))
        gs = np.stack([np.stack(_student(act, s, th), -1) for th in thetas], 1)
        _STUDENTS[key] = gs * w[:, None, None]
    return _STUDENTS[key]


def _teacher(star, s: np.ndarray, phi: float, angle: float) -> np.ndarray:
    """(Ψ_φ, Ψ¹_φ, Ψ²_φ)(s) (3, S) of (P): E_t of σ*σ*, σ*′σ*, σ*σ*′ at ⟨v̄ᵢ, u⟩, ⟨v̄ᵢ′, u⟩
    (v̄ᵢ at angle 0, v̄ᵢ′ at ``angle``)."""
    coef = [(math.cos(a - phi), math.sin(a - phi)) for a in (0.0, angle)]
    cuts = [-ca * s / sa for ca, sa in coef if abs(sa) > 1e-15]
    t, w = _inner(np.stack(cuts, -1) if cuts else s[:, None][:, :0])
    z1, z2 = (ca * s[:, None] + sa * t for ca, sa in coef)
    f1, f2, d1, d2 = star.fn(z1), star.fn(z2), star.deriv(z1), star.deriv(z2)
    return np.stack([(w * f1 * f2).sum(-1), (w * d1 * f2).sum(-1), (w * f1 * d2).sum(-1)])


def _coefficients(values: np.ndarray) -> np.ndarray:
    """2-D Chebyshev coefficients (last two axes) of values at Lobatto × Lobatto points."""
    out = values
    for axis in (-2, -1):
        n = out.shape[axis] - 1
        out = scipy.fft.dct(out, type=1, axis=axis) / n
        idx = [slice(None)] * out.ndim
        for j in (0, -1):
            idx[axis] = j
            out[tuple(idx)] *= 0.5
    return out


class PairTable:
    """(T, ∂T/∂κᵢ, ∂T/∂κᵢ′) of one non-parallel teacher pair (module docstring, (P)):
    2-D Chebyshev interpolants in (φ, 1 − 2θ/π) on the φ-panels [0, θ*], [θ*, π]."""

    def __init__(self, teacher, act, rho: float, phi_degree: int = PHI_DEGREE,
                 theta_degree: int = THETA_DEGREE):
        star, act = resolve_activation(teacher), resolve_activation(act)
        _zero_breaks(star, act)
        if not abs(rho) < 1.0 - PARALLEL:
            raise ValueError(f"a pair table needs |ρ*| < 1, got {rho}")
        self.angle = math.acos(rho)
        s, w = _outer()
        gs = _students(act, theta_degree)  # (S, Θ, 2), weights folded in
        coef = []
        for lo, hi in ((0.0, self.angle), (self.angle, np.pi)):
            phis = lo + 0.5 * (hi - lo) * (1.0 + _lobatto(phi_degree))
            psi = np.stack([_teacher(star, s, ph, self.angle) for ph in phis], 1)  # (3, Φ, S)
            vals = np.stack([psi[0] @ gs[..., 0], psi[1] @ gs[..., 1], psi[2] @ gs[..., 1]])
            coef.append(_coefficients(vals))  # (3, Φ, Θ)
        coef = np.stack(coef)  # (panel, 3, Φ, Θ)
        # |T| ≤ (E σ*⁴ E σ²)^{1/2}: the scale of the dropped coefficients
        bound = math.sqrt((w * star.fn(s) ** 4).sum() * (w * act.fn(s) ** 2).sum())
        big = np.abs(coef) > TRIM * max(np.abs(coef).max(), bound)
        last = [int(np.nonzero(big.any(axis))[0].max(initial=0)) + 1
                for axis in ((0, 1, 3), (0, 1, 2))]
        self.coef = np.ascontiguousarray(coef[..., : last[0], : last[1]])
        self.tail = float(max(np.abs(coef[..., -4:, :]).max(), np.abs(coef[..., -4:]).max()))

    def __call__(self, p1, p2, gamma) -> np.ndarray:
        """(3, …) (T, ∂T/∂κᵢ, ∂T/∂κᵢ′) at ĥ with plane coordinates (p1, p2) (e₁ = vᵢ) and
        normal part of norm ``gamma``."""
        p1, p2, gamma = np.broadcast_arrays(*(np.asarray(v, float) for v in (p1, p2, gamma)))
        phi = np.arctan2(p2, p1)
        rho = np.hypot(p1, p2)
        flip = (phi < 0.0) | (phi >= np.pi)
        phi = np.where(flip, np.where(phi < 0.0, phi + np.pi, 0.0), phi)
        theta = np.arctan2(gamma, np.where(flip, -rho, rho))
        x = 1.0 - 2.0 * theta / np.pi
        second = phi > self.angle
        lo = np.where(second, self.angle, 0.0)
        hi = np.where(second, np.pi, self.angle)
        y = 2.0 * (phi - lo) / (hi - lo) - 1.0
        nphi, nth = self.coef.shape[-2:]
        by = np.cos(np.arange(nphi) * np.arccos(np.clip(y, -1, 1)).ravel()[:, None])  # (Q, Φ)
        bx = np.cos(np.arange(nth) * np.arccos(np.clip(x, -1, 1)).ravel()[:, None])  # (Q, Θ)
        out = np.empty((y.size, 3))
        flat = second.ravel()
        for panel in (0, 1):
            m = flat == bool(panel)
            if m.any():
                c = np.moveaxis(self.coef[panel], 0, 1).reshape(nphi, 3 * nth)
                out[m] = np.einsum("qpt,qt->qp", (by[m] @ c).reshape(-1, 3, nth), bx[m])
        return out.T.reshape((3,) + y.shape)


_TABLES: dict = {}


def pair_table(teacher, act, rho: float) -> PairTable:
    """The cached :class:`PairTable` of (σ*, σ, ρ*)."""
    key = (resolve_activation(teacher), resolve_activation(act), float(rho))
    if key not in _TABLES:
        _TABLES[key] = PairTable(*key)
    return _TABLES[key]


def _line(teacher, act, sign: float, which: str) -> np.ndarray:
    """The 1-D pair of parallel rows (sign ±1) as a cached ``ChebyshevInTheta``: κ ↦
    E[σ*(z)σ*(±z)σ(z₃)] (``which = "kernel"``) or its κ-derivative (``"kprime"``)."""
    star, act = resolve_activation(teacher), resolve_activation(act)
    key = (star, act, sign, which)
    if key not in _TABLES:
        _zero_breaks(star, act)
        if which == "kernel":
            def f(z):
                return star.fn(z) * star.fn(sign * z)
            g = act.fn
        else:
            def f(z):
                return star.deriv(z) * star.fn(sign * z) + sign * star.fn(z) * \
                    star.deriv(sign * z)
            g = act.deriv
        _TABLES[key] = ChebyshevInTheta(lambda r: pair_expectation(
            f, g, r, star.breakpoints, act.breakpoints))
    return _TABLES[key]


def _pair_terms(geo, hh: np.ndarray):
    """Yield (weight, T (…, k), ∂T along the teacher rows (…, k, D)) for each unordered pair
    i ≤ i′ of (Y) at the unit student rows hh (…, k, D); weight = λᵢλᵢ′ (×2 for i ≠ i′)."""
    k, width = geo.lam.size, hh.shape[-1]
    v = np.zeros((k, width))
    v[:, : geo.v.shape[-1]] = geo.v / np.linalg.norm(geo.v, axis=-1, keepdims=True)
    star = geo.act if geo.teacher is None else geo.teacher
    for i in range(k):
        for i2 in range(i, k):
            rho = float(np.clip(v[i] @ v[i2], -1.0, 1.0))
            weight = geo.lam[i] * geo.lam[i2] * (1.0 if i == i2 else 2.0)
            if abs(rho) > 1.0 - PARALLEL:
                sign = 1.0 if rho > 0 else -1.0
                kap = np.clip(hh @ v[i], -1.0, 1.0)
                val = _line(star, geo.act, sign, "kernel")(kap)
                grad = _line(star, geo.act, sign, "kprime")(kap)[..., None] * v[i]
            else:
                e2 = (v[i2] - rho * v[i]) / math.sqrt(1.0 - rho * rho)
                p1, p2 = hh @ v[i], hh @ e2
                rest = hh - p1[..., None] * v[i] - p2[..., None] * e2
                val, d1, d2 = pair_table(star, geo.act, rho)(p1, p2, np.linalg.norm(rest, axis=-1))
                grad = d1[..., None] * v[i] + d2[..., None] * v[i2]
            yield weight, val, grad


def squared_cross(geo, hh: np.ndarray) -> np.ndarray:
    """Σⱼ λⱼ C(ĥⱼ) (…) of (Y) at the unit student rows hh (…, k, D) of a ``BARowsGeometry``."""
    out = 0.0
    for weight, val, _ in _pair_terms(geo, hh):
        out = out + weight * (val @ geo.lam)
    return np.asarray(out)


def squared_teacher_gradient(geo, hh: np.ndarray) -> np.ndarray:
    """λⱼ ∂C/∂ĥⱼ (…, k, D) (Price, module docstring): the teacher's sum of ∂F/∂ĥⱼ is −2×it."""
    out = np.zeros(hh.shape)
    for weight, _, grad in _pair_terms(geo, hh):
        out += weight * grad
    return geo.lam[:, None] * out


def squared_rest_teacher(geo, wh: np.ndarray) -> np.ndarray:
    """(k,) the teacher's sum in the rest Hessian's diagonal M̃ⱼⱼ/2 for labels y²
    (``hermite.flows.lora_ba_escape``, eq. (M)) at the unit base rows wh (k, t): out of the span
    κᵢⱼ = κ⁰ᵢⱼ(1 − ε̃ⱼ²/2) to second order, so −2λⱼC(ĥⱼ) moves by first derivatives of T only,
    λⱼ ε̃ⱼ² Σᵢᵢ′ λᵢλᵢ′(∂T/∂κᵢ κ⁰ᵢⱼ + ∂T/∂κᵢ′ κ⁰ᵢ′ⱼ) = ε̃ⱼ² ⟨λⱼ∂C/∂ĥⱼ, ŵⱼ⟩: this ⟨·, ŵⱼ⟩ (the
    labels-y analogue is Σᵢ λᵢλⱼK′(κ⁰ᵢⱼ)κ⁰ᵢⱼ)."""
    return (squared_teacher_gradient(geo, wh) * wh).sum(-1)


_FOURTH: dict = {}


def _normals(star, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(points (n, dim), weights (n,)) for E over g ~ N(0, I_dim): a tensor Gauss–Hermite rule
    for smooth σ* where it has ≤ FOURTH_SAMPLES points (2·deg + 1 nodes a side for a
    polynomial of degree deg: exact; else ``FOURTH_NODES``), else the Sobol′ set."""
    side = FOURTH_NODES if star.polynomial_degree is None else 2 * star.polynomial_degree + 1
    if not star.breakpoints and side**dim <= FOURTH_SAMPLES:
        x, w = gauss_hermite(side)
        grid = np.stack(np.meshgrid(*[x] * dim, indexing="ij"), -1).reshape(-1, dim)
        weight = np.prod(np.stack(np.meshgrid(*[w] * dim, indexing="ij"), -1), -1).ravel()
        return grid, weight
    g = sobol_normals(dim, FOURTH_SAMPLES, FOURTH_SEED)
    return g, np.full(len(g), 1.0 / len(g))


def fourth_moment(geo) -> float:
    """E[f*⁴] (module docstring) over g ~ N(0, I) in span(V) (cached per teacher)."""
    star = geo.act if geo.teacher is None else geo.teacher
    v = geo.v / np.linalg.norm(geo.v, axis=-1, keepdims=True)
    key = (star, v.tobytes(), np.asarray(geo.lam, float).tobytes())
    if key not in _FOURTH:
        _, r = np.linalg.qr(v.T)  # V = Rᵀ Qᵀ: Vx ~ Rᵀ g, g ~ N(0, I)
        g, w = _normals(star, r.shape[0])
        _FOURTH[key] = float(w @ (star.fn(g @ r) @ geo.lam) ** 4)
    return _FOURTH[key]


def squared_loss(geo, hh: np.ndarray) -> np.ndarray:
    """F (…) of (Y) at the unit student rows hh (…, k, D): E[f*⁴] − 2Σⱼλⱼ C(ĥⱼ) + λᵀK(ĤĤᵀ)λ."""
    gram = np.clip(hh @ np.swapaxes(hh, -1, -2), -1.0, 1.0)
    student = np.einsum("i,...ij,j->...", geo.lam, dual_kernel(geo.act, gram), geo.lam)
    return fourth_moment(geo) - 2.0 * squared_cross(geo, hh) + student

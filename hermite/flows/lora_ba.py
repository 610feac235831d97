"""Population flow of the ``lora-ba`` learner (LoRA as practised: W + s·B·A, plain SGD).

Model (``dynamics/learners/lora_ba.py``): student rows ĥⱼ = hⱼ/‖hⱼ‖, H = W + sBA, second
layer λ, the paper's teacher f* = Σᵢλᵢσ(⟨vᵢ, x⟩). Its population loss (no 1/2, without the
label noise's constant) is, with K the dual kernel (``network_loss``'s expansion),

    F(B, A) = λᵀK(VVᵀ)λ + λᵀK(ĤĤᵀ)λ − 2λᵀK(VĤᵀ)λ,

and its gradient, by the chain rule through the unit rows (K′ = dK/dρ = E[σ′σ′]):

    ∂F/∂ĥⱼ = 2λⱼ(Σᵢ λᵢK′(⟨ĥᵢ, ĥⱼ⟩) ĥᵢ − Σᵢ λᵢK′(⟨vᵢ, ĥⱼ⟩) vᵢ),
    ∂F/∂hⱼ = (I − ĥⱼĥⱼᵀ) ∂F/∂ĥⱼ / ‖hⱼ‖,   ∂F/∂B = s (∂F/∂H) Aᵀ,   ∂F/∂A = s Bᵀ(∂F/∂H).

The flow (d → ∞, first order in η: the SGD step's mean, no noise), in τ = η·steps, is
dB/dτ = −lr_ratio·∂F/∂B, dA/dτ = −∂F/∂A (0 when A is frozen). F depends on A only through
its order parameters — Z = A's coordinates in span(W, u) (r × (k+1)) and its Gram Q = AAᵀ
(r × r) — and ∂F/∂A's rows lie in span(W, u) ⊕ rows(A), so A stays in the (k + 1 + r)-dim
span of W, u and its initial rows: the flow is integrated on (B, A_red), A_red = [Z, R]
the coordinates of A in that span (``reduce_rows``: Q = ZZᵀ + RRᵀ), which is the flow of
(B, Z, Q) written through a square root of Q − ZZᵀ. Exact at any d for the mean of the
gradient; the SGD noise (O(η d) in Q per unit τ) is what it leaves out.

The finite-η·d flow (:func:`corrected_flow`, given η, d, batch b: :class:`BANoise`)
---------------------------------------------------------------------------------
One step of the exact chain (``dynamics.reduced.lora_ba_chain``, (BA4)) sets A's rest Gram to

    S′ = C_E′C_E′ᵀ + (ηs/b)² (MΛ)(MΛ)ᵀ,   C_E′ = C − (η/b)∂C_E,   M = [B ᵀg₁ … Bᵀg_b],

with ΛΛᵀ ~ Wishart_b(n, I), n = d − k − 1 − r, independent of M. So E[(MΛ)(MΛ)ᵀ | M] = n MMᵀ
and, per unit τ = η·steps, the noise adds to the flow of S the exact mean

    dS/dτ ⊃ η s² n/b · Bᵀ E[g gᵀ] B,                                                   (N)

E[ggᵀ] the one-example moment of gⱼ = δⱼ/Nⱼ (:func:`gradient_covariance`). At fixed η·d
this is O(1): the order kept. Dropped, all O(η) per unit τ: the square of the mean step
((η/b)²∂C_E∂C_Eᵀ's mean part and the like: η² per step), the noise of C_E′ along A's own r
rest directions (the sum over r, not n, directions: O(η r)), Z's noise (t = k + 1 directions:
O(η t)), B's noise (k·r entries: O(η)), and S's own fluctuation about its mean (variance
O(η³d) per unit τ). B's noise is O(η) in B's units, but B starts at 0 and the escape from it
(``hermite.flows.lora_ba_escape``) amplifies it from the scale d^{−1/2} of Z₀, where it is
O(η·d): the escape's kick, handled there. The corrected flow is

    dB/dτ = −ρ_B ∂F/∂B,   dZ/dτ = −∂F/∂Z,   dS/dτ = RṘᵀ + ṘRᵀ + (N),               (C)

R = S^{1/2} (any square root: Ṙ = −(∂F/∂A)'s rest block is linear in R from the right, so
RṘᵀ + ṘRᵀ depends on S only), integrated in (B, Z, S) (S may become singular at rank > 1).
As η·d → 0 (N) vanishes and (C) is the population flow above. E[ggᵀ]'s label-noise part is
exact (Price, σ_ε²λᵢλⱼK′(⟨ĥᵢ, ĥⱼ⟩)); its E[(f* − f̂)²σ′(aᵢ)σ′(aⱼ)] (a four-field Gaussian
moment with no closed form for ReLU) is a quasi-Monte Carlo average over one scrambled Sobol′
set of ``NOISE_SAMPLES`` points in the reduced basis (common to every state, so the flow is
deterministic; at 2^10 points its error moves the escape's steps to overlap 0.9 by ≤ 0.4 %:
two Sobol′ seeds against 2^16 points, ReLU, k = 4, d = 10³, η·d = 0.5). RK45 at rtol
``CORRECTED_RTOL`` (the QMC average is only piecewise smooth in the state, which DOP853's error
control pays for in rejected steps).

Given base and target rows (:class:`BARowsGeometry`, ``dynamics.learners.lora_ba_rows``)
-------------------------------------------------------------------------------------
W (k×t) and the teacher rows W* (k×t) in a t-dim frame (t = dim span(W, W*)). Normalised
rows: the same F and ∂F/∂H as above with V = W*'s rows divided by their norms. Rows as they
are (f = Σλⱼσ(⟨hⱼ, x⟩), f* = Σλᵢσ(⟨w*ᵢ, x⟩)): F = E(f* − f̂)² = λᵀI₂(W*W*ᵀ)λ + λᵀI₂(HHᵀ)λ −
2λᵀI₂(W*Hᵀ)λ (I₂ the Gaussian pair integral E σ(a)σ(b) of the pair's covariance) and, by
Stein's lemma on the pair (⟨hⱼ, x⟩, ⟨g, x⟩),

    E[σ′(⟨h, x⟩)σ(⟨g, x⟩) x] = h (P₂ − ⟨h, g⟩J₂)/‖h‖² + g J₂,                        (S)

P₂ = E[aσ′(a)σ(b)], J₂ = E[σ′(a)σ′(b)] (``hermite.committee.CommitteeIntegrals``), so

    ∂F/∂hⱼ = −2λⱼ (Σᵢ λᵢ m(hⱼ, w*ᵢ) − Σᵢ λᵢ m(hⱼ, hᵢ)),   m = (S).

Z (A's coordinates in span(W, W*)) and A's Gram are again the order parameters: ∂F/∂H's rows
lie in span(W, W*) ⊕ rows(A). The finite-η·d flow carries over to normalised rows (any σ*,
labels y or y²): their chain is (BA4) with t = dim span(W, W*) for k + 1, so n = d − t − r
and E[ggᵀ] of their rows (``hermite.flows.lora_ba_escape`` for the escape, labels y or y²);
rows as they are have none (g = δ: neither (N)'s moment nor the escape's M is written
for them).

A separate teacher σ* (``teacher_activation``, :attr:`BARowsGeometry.teacher`; normalised
rows, labels y): f* = Σᵢλᵢσ*(⟨vᵢ, x⟩), so with the cross kernel K×(ρ) = E[σ*(z₁)σ(z₂)] and
K×′(ρ) = E[σ*′(z₁)σ′(z₂)] (Price; :func:`cross_kernel`, a Chebyshev interpolant in θ of the
2-D pair quadrature)

    F = λᵀK*(VVᵀ)λ + λᵀK(ĤĤᵀ)λ − 2λᵀK×(VĤᵀ)λ,   ∂F/∂ĥⱼ as above with K×′ for K′ in the
    teacher's sum;

the paper's instance enters through :func:`teacher_geometry`. Squared labels (y = f*²,
normalised rows, σ* = σ or not; :attr:`BARowsGeometry.squared`): F and the teacher's sum of
∂F/∂ĥⱼ from ``hermite.flows.lora_ba_squared`` (three-field Gaussian integrals E[σ*σ*σ],
tabulated per teacher pair, and E[f*⁴]). Squared labels on rows as they are have no flow here
(the learner records why).

A teacher σ* ≠ σ on rows as they are (labels y): f* = Σᵢλᵢσ*(⟨w*ᵢ, x⟩), F = λᵀI₂*(W*W*ᵀ)λ +
λᵀI₂(HHᵀ)λ − 2λᵀI₂×(HW*ᵀ)λ with the cross pair integral I₂× = E[σ(a)σ*(b)] (a = ⟨hⱼ, x⟩ the
student's field, b = ⟨w*ᵢ, x⟩ the teacher's; ``hermite.committee.cross``), and the teacher's
sum of ∂F/∂hⱼ by Stein's lemma with σ* in the second factor,

    E[σ′(⟨h, x⟩)σ*(⟨g, x⟩) x] = h (P₂× − ⟨h, g⟩J₂×)/‖h‖² + g J₂×,                     (S×)

P₂× = E[aσ′(a)σ*(b)], J₂× = E[σ′(a)σ*′(b)]; the student's sum stays (S).

Torch-free; instances duck-typed as ``hermite.flows.linearized``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import scipy.integrate
import scipy.special
import scipy.stats

from hermite._activation import resolve_activation
from hermite._quadrature import sobol_normals
from hermite.expansion._chebyshev import ChebyshevInTheta
from hermite.expansion._pair_quadrature import pair_expectation
from hermite.expansion.kernels import dual_kernel, dual_kernel_derivative
from hermite.flows.linearized import _geometry, true_network_loss

__all__ = ["BAFlow", "BANoise", "BARowsGeometry", "lora_ba_gradient", "row_gradient",
           "lora_ba_flow", "gradient_covariance", "rest_noise", "corrected_flow", "rows_loss",
           "cross_kernel", "teacher_geometry"]

FLOW_RTOL, FLOW_ATOL = 1e-8, 1e-11  # solve_ivp tolerances (a curve beside SGD)


@dataclass(frozen=True)
class BARowsGeometry:
    """Given rows (module docstring): σ ``act`` (a name or activation), λ (k), base W (k×t),
    teacher rows ``v`` (k×t; divided by their norms where ``normalize``), the teacher's σ*
    (``teacher``; None: σ), labels y = f*² (``squared``; normalised rows). Accepted wherever
    an instance is (its first t coordinates play the canonical ones' part)."""

    act: object
    lam: np.ndarray
    w: np.ndarray
    v: np.ndarray
    normalize: bool = True
    teacher: object = None
    squared: bool = False

    def __post_init__(self):
        if self.squared and not self.normalize:
            raise ValueError("labels y2 have a flow for normalised rows only")
        object.__setattr__(self, "act", resolve_activation(self.act))
        if self.teacher is not None:
            teacher = resolve_activation(self.teacher)
            object.__setattr__(self, "teacher", None if teacher == self.act else teacher)


def teacher_geometry(instance, teacher, squared: bool = False) -> BARowsGeometry:
    """The paper's rows of an instance (``linearized._geometry``) with the teacher σ* (None:
    σ) and labels f*² where ``squared``."""
    geo = _geometry(instance)
    return BARowsGeometry(geo.act, geo.lam, geo.w, geo.v, True, teacher, squared)


_CROSS: dict = {}


def cross_kernel(teacher, act, rho, which: str = "kernel") -> np.ndarray:
    """K×(ρ) = E[σ*(z₁)σ(z₂)] (``which = "kernel"``) or K×′(ρ) = E[σ*′(z₁)σ′(z₂)]
    (``"kprime"``), standard Gaussians of correlation ρ: a cached Chebyshev interpolant in θ
    of the 2-D pair quadrature (``hermite.expansion._pair_quadrature``)."""
    teacher, act = resolve_activation(teacher), resolve_activation(act)
    key = (teacher, act, which)
    if key not in _CROSS:
        f, g = (teacher.fn, act.fn) if which == "kernel" else (teacher.deriv, act.deriv)
        _CROSS[key] = ChebyshevInTheta(lambda r: pair_expectation(
            f, g, r, teacher.breakpoints, act.breakpoints))
    return _CROSS[key](np.clip(np.asarray(rho, float), -1.0, 1.0))


def _teacher_kernel(geo, rho, which: str = "kprime") -> np.ndarray:
    """K′ (or K) of the teacher–student pairs: the dual kernel, or K× with a σ*."""
    teacher = getattr(geo, "teacher", None)
    if teacher is None:
        fn = dual_kernel_derivative if which == "kprime" else dual_kernel
        return fn(geo.act, rho)
    return cross_kernel(teacher, geo.act, rho, which)


def _geo(instance):
    """The rows of an instance (``linearized._geometry``) or a :class:`BARowsGeometry`."""
    return instance if isinstance(instance, BARowsGeometry) else _geometry(instance)


def _padded(rows: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros(rows.shape[:-1] + (width,))
    out[..., : rows.shape[-1]] = rows
    return out


def lora_ba_gradient(instance, b, a, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(∂F/∂B (…, k, r), ∂F/∂A (…, r, D)) of the population loss at B (…, k, r) and A
    (…, r, D) in a basis whose first k + 1 coordinates are the canonical ones (module
    docstring; given rows: the frame's first t)."""
    b, a = np.asarray(b, float), np.asarray(a, float)
    g_h = row_gradient(instance, _padded(_geo(instance).w, a.shape[-1]) + scale * b @ a)
    return scale * g_h @ np.swapaxes(a, -1, -2), scale * np.swapaxes(b, -1, -2) @ g_h


def _pairs(h, g) -> np.ndarray:
    """Covariances (…, i, j, 2, 2) of the pairs (⟨hⱼ, x⟩, ⟨gᵢ, x⟩): h (…, k, D), g (k′, D) or
    (…, k′, D)."""
    qh = (h * h).sum(-1)
    qg = (g * g).sum(-1)
    cross = np.einsum("...id,...jd->...ij", np.broadcast_to(g, h.shape[:-2] + g.shape[-2:]), h)
    out = np.empty(cross.shape + (2, 2))
    out[..., 0, 0] = qh[..., None, :]
    out[..., 1, 1] = np.broadcast_to(qg, cross.shape[:-1])[..., :, None]
    out[..., 0, 1] = out[..., 1, 0] = cross
    return out


def _stein_sum(ci, h, g, lam) -> np.ndarray:
    """Σᵢ λᵢ m(hⱼ, gᵢ) (…, k, D), m = (S) of the module docstring."""
    pairs = _pairs(h, g)  # (…, i, j, 2, 2)
    p2, j2 = ci.p2(pairs), ci.j2(pairs)
    qh, cross = pairs[..., 0, 0], pairs[..., 0, 1]
    along_h = (lam[:, None] * (p2 - cross * j2) / qh).sum(-2)  # (…, j)
    gb = np.broadcast_to(g, h.shape[:-2] + g.shape[-2:])
    return along_h[..., None] * h + np.einsum("i,...ij,...id->...jd", lam, j2, gb)


def _raw_row_gradient(geo: BARowsGeometry, h) -> np.ndarray:
    """∂F/∂H of rows as they are (module docstring): −2λⱼ(Σᵢλᵢm(hⱼ, w*ᵢ) − Σᵢλᵢm(hⱼ, hᵢ)),
    the teacher's m with the cross integrals P2×, J2× (a = ⟨hⱼ, x⟩, b = ⟨w*ᵢ, x⟩) of a σ*."""
    from hermite.committee import CommitteeIntegrals
    from hermite.committee.cross import CrossIntegrals

    ci = CommitteeIntegrals(geo.act)
    cross = ci if getattr(geo, "teacher", None) is None else CrossIntegrals(geo.act, geo.teacher)
    v = _padded(geo.v, h.shape[-1])
    diff = _stein_sum(cross, h, v, geo.lam) - _stein_sum(ci, h, h, geo.lam)
    return -2.0 * geo.lam[:, None] * diff


def rows_loss(geo: BARowsGeometry, delta) -> np.ndarray:
    """F (…) at H = W + Δ (Δ (…, k, D), the frame's first t coordinates): rows divided by
    their norms where ``geo.normalize``, else as they are (module docstring)."""
    from hermite.committee import CommitteeIntegrals

    delta = np.asarray(delta, float)
    h = _padded(geo.w, delta.shape[-1]) + delta
    if geo.normalize:
        h = h / np.linalg.norm(h, axis=-1, keepdims=True)
    if geo.squared:  # unit rows, labels f*² (lora_ba_squared)
        from hermite.flows.lora_ba_squared import squared_loss

        return squared_loss(geo, h)
    v = _padded(geo.v, delta.shape[-1])
    if geo.teacher is not None and geo.normalize:  # unit rows, σ* ≠ σ: F with K*, K and K×
        def form(kern):
            return np.einsum("i,...ij,j->...", geo.lam, kern, geo.lam)

        def gram(a, b):
            return np.clip(np.einsum("...ia,...ja->...ij", a, b), -1.0, 1.0)

        return form(dual_kernel(geo.teacher, gram(v, v))) + \
            form(dual_kernel(geo.act, gram(h, h))) - \
            2.0 * form(cross_kernel(geo.teacher, geo.act, gram(v, h)))
    i2 = CommitteeIntegrals(geo.act).i2
    i2_star, i2_cross = i2, i2
    if geo.teacher is not None:  # rows as they are, σ* ≠ σ: I₂* and I₂× (a = hⱼ, b = w*ᵢ)
        from hermite.committee.cross import CrossIntegrals

        i2_star = CommitteeIntegrals(geo.teacher).i2
        i2_cross = CrossIntegrals(geo.act, geo.teacher).i2
    lam = geo.lam

    def quad(a, b, integral=i2):
        return np.einsum("i,...ij,j->...", lam, integral(_pairs(a, b)), lam)

    return quad(v[None], v[None], i2_star)[0] + quad(h, h) - 2.0 * quad(h, v, i2_cross)


def row_gradient(instance, h) -> np.ndarray:
    """∂F/∂H (…, k, D) at the rows H (…, k, D) (module docstring; first k + 1 coordinates
    the canonical ones; given rows: the frame's first t)."""
    geo = _geo(instance)
    h = np.asarray(h, float)
    if not getattr(geo, "normalize", True):
        return _raw_row_gradient(geo, h)
    v = _padded(geo.v, h.shape[-1])
    n = np.linalg.norm(h, axis=-1)
    hh = h / n[..., None]
    lam2 = geo.lam[:, None] * geo.lam[None, :]
    rho = np.clip(hh @ np.swapaxes(hh, -1, -2), -1.0, 1.0)  # ⟨ĥᵢ, ĥⱼ⟩
    ks = lam2 * dual_kernel_derivative(geo.act, rho)
    if getattr(geo, "squared", False):  # labels f*²: λⱼ∂C/∂ĥⱼ (lora_ba_squared)
        from hermite.flows.lora_ba_squared import squared_teacher_gradient

        teach = squared_teacher_gradient(geo, hh)
    else:
        kap = np.clip(np.einsum("ia,...ja->...ij", v, hh), -1.0, 1.0)  # ⟨vᵢ, ĥⱼ⟩
        teach = np.swapaxes(lam2 * _teacher_kernel(geo, kap), -1, -2) @ v
    g_hat = 2.0 * (np.swapaxes(ks, -1, -2) @ hh - teach)
    return (g_hat - hh * (hh * g_hat).sum(-1, keepdims=True)) / n[..., None]


# ---------------------------------------------------------------- the SGD noise (finite η·d)
NOISE_SAMPLES = 2**10  # quasi-Monte Carlo points of E[g gᵀ] (one scrambled Sobol′ set)
NOISE_SEED = 39
CORRECTED_RTOL, CORRECTED_ATOL = 1e-5, 1e-10  # solve_ivp tolerances of the corrected flow


@dataclass(frozen=True)
class BANoise:
    """The SGD of a run, as the corrected flow needs it: step η, dimension d, batch b, label-
    noise variance, and the quasi-Monte Carlo points of E[g gᵀ] (``samples``, ``seed``)."""

    eta: float
    d: int
    batch: int = 1
    label_noise: float = 0.0
    samples: int = NOISE_SAMPLES
    seed: int = NOISE_SEED

    def __post_init__(self):
        if not (self.eta > 0 and self.d >= 1 and self.batch >= 1 and self.label_noise >= 0):
            raise ValueError(f"BANoise needs η > 0, d ≥ 1, b ≥ 1, label noise ≥ 0, got {self}")


@lru_cache(maxsize=8)
def _normals(dim: int, samples: int, seed: int) -> np.ndarray:
    """:func:`hermite._quadrature.sobol_normals`, cached and read-only (E[g gᵀ]'s points,
    shared by every state)."""
    x = sobol_normals(dim, samples, seed)
    x.setflags(write=False)
    return x


def _noise_geometry(instance):
    """The rows of an instance or a :class:`BARowsGeometry` (:func:`_geo`) for the SGD noise:
    ValueError for rows as they are (the finite-η·d theory is written for unit rows)."""
    geo = _geo(instance)
    if not getattr(geo, "normalize", True):
        raise ValueError("the finite-η·d theory needs normalised rows (normalize_rows on)")
    return geo


def gradient_covariance(instance, b, a, scale: float, noise: BANoise) -> np.ndarray:
    """E[g gᵀ] (…, k, k) of one example at B (…, k, r), A (…, r, D) (reduced basis): gⱼ =
    δⱼ/Nⱼ, δⱼ = −2(y − f̂)λⱼσ′(aⱼ) (learner's module docstring), so

        E[gᵢgⱼ] = 4λᵢλⱼ/(NᵢNⱼ) (E[(f* − f̂)² σ′(aᵢ)σ′(aⱼ)] + σ_ε² K′(⟨ĥᵢ, ĥⱼ⟩)),

    the first a quasi-Monte Carlo average over ``noise.samples`` points x ~ N(0, I_D), the
    label noise's part exact (Price). Given rows (:class:`BARowsGeometry`, normalised): the
    same with their W, V, f* = Σλᵢσ*(⟨vᵢ, x⟩) (σ* enters y only), y = f*² where squared."""
    geo = _noise_geometry(instance)
    a = np.asarray(a, float)
    width = a.shape[-1]
    h = _padded(geo.w, width) + scale * np.asarray(b, float) @ a
    n = np.linalg.norm(h, axis=-1)
    hh = h / n[..., None]
    x = _normals(width, noise.samples, noise.seed)
    v = _padded(geo.v, width)
    act = geo.act
    star = act if getattr(geo, "teacher", None) is None else geo.teacher
    y = star.fn(x @ v.T) @ geo.lam  # (S,)
    if getattr(geo, "squared", False):
        y = y * y
    pre = np.swapaxes(hh @ x.T, -1, -2)  # (…, S, k): ⟨ĥₖ, xₛ⟩ (BLAS; einsum was 15× slower)
    err = y - act.fn(pre) @ geo.lam  # (…, S)
    dl = act.deriv(pre) * geo.lam * err[..., None]  # (…, S, k)
    mom = np.swapaxes(dl, -1, -2) @ dl / noise.samples
    if noise.label_noise > 0:
        rho = np.clip(hh @ np.swapaxes(hh, -1, -2), -1.0, 1.0)
        mom = mom + noise.label_noise * geo.lam[:, None] * geo.lam[None, :] * \
            dual_kernel_derivative(act, rho)
    return 4.0 * mom / (n[..., :, None] * n[..., None, :])


def rest_noise(instance, b, a, scale: float, noise: BANoise) -> np.ndarray:
    """The SGD noise's drift of A's rest Gram S per unit τ (…, r, r) (module docstring, (N)):
    η s² (d − t − r)/b · Bᵀ E[g gᵀ] B, t = k + 1 (given rows: dim span(W, W*), the chain's
    Wishart degree d − t − r)."""
    b = np.asarray(b, float)
    dof = noise.d - _noise_geometry(instance).w.shape[-1] - b.shape[-1]
    cov = gradient_covariance(instance, b, a, scale, noise)
    return noise.eta * scale**2 * dof / noise.batch * (np.swapaxes(b, -1, -2) @ cov @ b)


@dataclass(frozen=True)
class BAFlow:
    """The flow at the requested times: B (…, T, k, r), A (…, T, r, D) and the exact loss
    F (…, T) of the rows (wⱼ + s(BA)ⱼ)/‖·‖."""

    b: np.ndarray
    a: np.ndarray
    loss: np.ndarray


def lora_ba_flow(instance, b0, a0, times, *, scale: float = 1.0, lr_ratio: float = 1.0,
                 train_a: bool = True) -> BAFlow:
    """Integrate dB/dτ = −lr_ratio ∂F/∂B, dA/dτ = −∂F/∂A (module docstring) from B₀
    (n, k, r), A₀ (n, r, D) (n starts of one instance, integrated together) to the times τ
    (T,) ≥ 0 (τ = η·steps); scipy's DOP853 at rtol ``FLOW_RTOL``."""
    b0, a0 = np.asarray(b0, float), np.asarray(a0, float)
    times = np.asarray(times, float)
    nb = b0.size

    def rhs(_t, y):
        b, a = y[:nb].reshape(b0.shape), y[nb:].reshape(a0.shape)
        gb, ga = lora_ba_gradient(instance, b, a, scale)
        return np.concatenate([-lr_ratio * gb.ravel(), (-ga if train_a else 0.0 * ga).ravel()])

    y0 = np.concatenate([b0.ravel(), a0.ravel()])
    ys = _solve(rhs, y0, times, FLOW_RTOL, FLOW_ATOL)
    b = np.moveaxis(ys[:nb].reshape(*b0.shape, times.size), -1, 1)
    a = np.moveaxis(ys[nb:].reshape(*a0.shape, times.size), -1, 1)
    return _flow_result(instance, b, a, scale)


def _solve(rhs, y0, times, rtol: float, atol: float, method: str = "DOP853") -> np.ndarray:
    """solve_ivp (``method``) of y′ = rhs(τ, y) at the times: (y0.size, T), NaN where it failed
    or beyond where it stopped early."""
    sol = scipy.integrate.solve_ivp(rhs, (0.0, float(times.max(initial=0.0))), y0,
                                    method=method, t_eval=times, rtol=rtol, atol=atol)
    ys = sol.y if sol.success else np.full((y0.size, times.size), np.nan)
    if ys.shape[1] != times.size:  # stopped early: NaN beyond
        ys = np.concatenate([ys, np.full((y0.size, times.size - ys.shape[1]), np.nan)], 1)
    return ys


def _flow_result(instance, b, a, scale: float) -> BAFlow:
    """:class:`BAFlow` of B (n, T, k, r), A (n, T, r, D), with the exact loss where finite."""
    ok = np.isfinite(b).all((-2, -1)) & np.isfinite(a).all((-2, -1))
    delta = scale * np.where(ok[..., None, None], b, 0.0) @ np.where(ok[..., None, None], a, 0.0)
    loss = rows_loss(instance, delta) if isinstance(instance, BARowsGeometry) else \
        true_network_loss(instance, delta)
    return BAFlow(b, a, np.where(ok, loss, np.nan))


def _sqrt_psd(s: np.ndarray) -> np.ndarray:
    """The symmetric square root of S (…, r, r) (negative round-off eigenvalues set to 0)."""
    val, vec = np.linalg.eigh(0.5 * (s + np.swapaxes(s, -1, -2)))
    return (vec * np.sqrt(np.clip(val, 0.0, None))[..., None, :]) @ np.swapaxes(vec, -1, -2)


def corrected_flow(instance, b0, a0, times, noise: BANoise, *, scale: float = 1.0,
                   lr_ratio: float = 1.0, train_a: bool = True) -> BAFlow:
    """The finite-η·d flow (module docstring, (C)) in (B, Z, S) from B₀ (n, k, r), A₀
    (n, r, t + r) to the times τ (T,): dB/dτ and dZ/dτ as :func:`lora_ba_flow`, dS/dτ =
    R Ṙᵀ + Ṙ Rᵀ + η s² (d − t − r)/b · Bᵀ E[ggᵀ] B (R = S^{1/2}, Ṙ = −(∂F/∂A)'s rest
    block); A returned as [Z, S^{1/2}]. t = k + 1, or dim span(W, W*) of a
    :class:`BARowsGeometry` (normalised rows). RK45 at rtol ``CORRECTED_RTOL``."""
    b0, a0 = np.asarray(b0, float), np.asarray(a0, float)
    n, k, r = b0.shape
    t = _noise_geometry(instance).w.shape[-1]
    if a0.shape[-1] != t + r or noise.d <= t + r:
        raise ValueError(f"the corrected flow needs A's rest of full rank r = {r} and "
                         f"d > t + r = {t + r}, got width {a0.shape[-1]}, d = {noise.d}")
    times = np.asarray(times, float)
    rest0 = a0[..., t:]
    y0 = np.concatenate([b0.ravel(), a0[..., :t].ravel(), (rest0 @ np.swapaxes(rest0, -1, -2))
                         .ravel()])
    nb, nz = b0.size, n * r * t

    def unpack(y):
        b = y[:nb].reshape(b0.shape)
        z = y[nb:nb + nz].reshape(n, r, t)
        s = y[nb + nz:].reshape(n, r, r)
        return b, np.concatenate([z, _sqrt_psd(s)], -1)

    def rhs(_t, y):
        b, a = unpack(y)
        gb, ga = lora_ba_gradient(instance, b, a, scale)
        if not train_a:
            return np.concatenate([-lr_ratio * gb.ravel(), np.zeros(y.size - nb)])
        rest, drest = a[..., t:], -ga[..., t:]
        ds = rest @ np.swapaxes(drest, -1, -2)
        ds = ds + np.swapaxes(ds, -1, -2) + rest_noise(instance, b, a, scale, noise)
        return np.concatenate([-lr_ratio * gb.ravel(), -ga[..., :t].ravel(), ds.ravel()])

    ys = _solve(rhs, y0, times, CORRECTED_RTOL, CORRECTED_ATOL, "RK45")
    b = np.moveaxis(ys[:nb].reshape(*b0.shape, times.size), -1, 1)
    z = np.moveaxis(ys[nb:nb + nz].reshape(n, r, t, times.size), -1, 1)
    s = np.moveaxis(ys[nb + nz:].reshape(n, r, r, times.size), -1, 1)
    rest = np.where(np.isfinite(s), s, 0.0)
    rest = np.where(np.isfinite(s).all((-2, -1))[..., None, None], _sqrt_psd(rest), np.nan)
    return _flow_result(instance, b, np.concatenate([z, rest], -1), scale)

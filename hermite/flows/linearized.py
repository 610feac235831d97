"""Exact population theory of the linearized (NTK) learner: quadratic loss, ODEs, floor.

Model (``dynamics/learners/linearized.py``; derivation in docs/theory/linearized.md). With
unit rows wⱼ, z = Wx, βⱼ = λⱼσ′(zⱼ) and Pⱼ = I − wⱼwⱼᵀ,

    f_lin(x) = f₀(x) + Σⱼ βⱼ ⟨PⱼΔⱼ, x⟩,   f* = Σᵢ λᵢσ(⟨vᵢ, x⟩),   x ~ N(0, I_d),

so L(Δ) = E(f* − f_lin)² (no 1/2, no label noise) is an exact quadratic form in Δ:

    L(Δ) = L₀ − 2 Σⱼ ⟨bⱼ, Δⱼ⟩ + Σⱼₗ ⟨Δⱼ, Aⱼₗ Δₗ⟩,

    Aⱼₗ = λⱼλₗ [K′(Gⱼₗ) PⱼPₗ + K″(Gⱼₗ) (Pⱼwₗ)(Pₗwⱼ)ᵀ]   (the K″ term for j ≠ l only),
    bⱼ  = λⱼ Pⱼ [Σᵢ λᵢ K′(⟨vᵢ, wⱼ⟩) vᵢ − Σᵢ λᵢ K′(Gᵢⱼ) wᵢ],
    L₀  = λᵀK(VVᵀ)λ + λᵀK(G)λ − 2 λᵀK(VWᵀ)λ = E(f* − f₀)²,

with K, K′ = E[σ′σ′], K″ = E[σ″σ″] the dual kernel and its derivatives (Stein's lemma
E[F x xᵀ] = E[F] I + E[∇²F], E[F x] = E[∇F], then Price's theorem). Every wᵢ, vᵢ lies in
S = span(W, u) (the canonical frame's first k + 1 coordinates), so A is block diagonal:
A restricted to S (a k(k+1)-square matrix) plus B ⊗ I on the complement S^⊥, with
B = diag(λ) K′(G) diag(λ) (k × k), and b lives in S:

    L(Δ) = L₀ − 2⟨b, Δ_S⟩ + ⟨Δ_S, A Δ_S⟩ + tr(B Δ_⊥Δ_⊥ᵀ).

Δ is given as (…, k, D), D ≥ k + 1: the first k + 1 columns are its rows' coordinates in S
(canonical frame: span W, then e = Π^⊥u/‖Π^⊥u‖), the remaining ones any orthonormal
coordinates of the rest (the full d-dimensional canonical frame, the learner's reduced
(k, 2k+1) basis, or one ⊥ coordinate as in finetune's (k+2)-coordinates: L depends on Δ_⊥
only through Δ_⊥Δ_⊥ᵀ).

Functions:

* :func:`linear_model_quadratic` → :class:`LinearQuadratic` (A, b, L₀, B; loss, gradient);
* :func:`linear_model_loss` — L(Δ);
* :func:`linear_model_ode` — the mean of the full-rank learner's SGD, exactly (the
  learner's sample gradient is affine in Δ and the example is independent of Δ, so
  E Δₜ₊₁ = E Δₜ − η Π(∇L(E Δₜ)) − 2η·prox·E Δₜ with no approximation), or its gradient flow;
* :func:`linear_model_rank1_gradient`, :func:`linear_model_rank1_ode` — rank 1 Δ = ξĉûᵀ:
  the mean drift of the learner's spherical step and its integration (scipy), first order in
  η (its finite-η corrected line, projected û: ``hermite.finite_d.linearized_corrected``);
* :func:`linear_model_floor` → :class:`Floor` — min L over full-rank or rank-1 Δ (the
  learner's constraints), and the true network loss at the minimiser;
* :func:`linear_model_sgd_excess` — leading-order stationary excess E L(Δ_∞) − L* of SGD;
* :func:`true_network_loss` — the exact loss of the network with rows (wⱼ + Δⱼ)/‖wⱼ + Δⱼ‖;
* :func:`dual_kernel_second_derivative` — K″ (closed forms, else the derivative of the
  certified Chebyshev interpolant of K′).

Torch-free; instances are duck-typed (``dynamics.instances.instance.Instance``: ``activation, k, xi,
w_factor, u_w, u_perp, lam, c, c_hat, teacher_norms(), teacher_gram()``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import scipy.integrate
import scipy.optimize
import scipy.special
from numpy.polynomial import chebyshev

from hermite._activation import resolve_activation
from hermite.expansion.kernels import dual_kernel, dual_kernel_derivative, kernel_interpolant
from hermite.flows.regime import LEARNER, FinetuneRegime, from_keywords

__all__ = ["dual_kernel_second_derivative", "LinearQuadratic", "linear_model_quadratic",
           "linear_model_loss", "LinearODE", "linear_model_ode", "linear_model_rank1_gradient",
           "Rank1ODE", "linear_model_rank1_ode", "Floor", "linear_model_floor",
           "linear_model_sgd_excess", "true_network_loss", "update_mask"]

_HE = re.compile(r"^he(\d+)$")
_PINV_RTOL = 1e-12  # eigenvalues below this × the largest are treated as null directions


# ---------------------------------------------------------------- K″
def _closed_kpp(act):
    """ρ ↦ K″(ρ) = E[σ″(z₁)σ″(z₂)] in closed form, or None."""
    if act.kprime is None:  # a user's callable, sigmoid, tanh: no closed form
        return None
    base, a = act.base_and_scale

    def inv_sqrt(r):
        return 1.0 / np.sqrt(np.maximum(1.0 - r * r, 0.0))

    scale = 1.0
    if base == "erf":
        t2 = 2.0 * a * a  # K′ = t2(2/π)((1 + t2)² − t2²ρ²)^{−1/2}
        return lambda r: t2 ** 3 * (2.0 / np.pi) * r * ((1.0 + t2) ** 2 - t2 * t2 * r * r) ** -1.5
    if a != 1.0:
        homogeneous = {"relu": 1, "abs": 1, "linear": 1, "quadratic": 2}
        if base not in homogeneous:
            return None
        scale = a ** (2 * homogeneous[base])  # σ(ax) = a^h σ(x)
    if base == "relu":
        return lambda r: scale * inv_sqrt(r) / (2.0 * np.pi)
    if base == "abs":
        return lambda r: scale * (2.0 / np.pi) * inv_sqrt(r)
    if base == "quadratic":
        return lambda r: scale * 4.0 + 0.0 * r
    if base == "linear":
        return lambda r: 0.0 * r
    match = _HE.match(base)
    if match and a == 1.0:
        p = int(match.group(1))
        return lambda r: p * (p - 1) * r ** (p - 2) if p >= 2 else 0.0 * r
    return None


def dual_kernel_second_derivative(activation, rho, method: str = "auto") -> np.ndarray:
    """K″(ρ) = d²K/dρ² = E[σ″(z₁)σ″(z₂)] (Price) for standard Gaussians of correlation ρ.

    ``auto``: closed form (relu (2π√(1−ρ²))⁻¹, abs, erf and erf(a·x), polynomials, hₚ:
    p(p−1)ρ^{p−2}, scaled relu/abs/linear/quadratic); otherwise (``interpolant``) the
    derivative of the certified Chebyshev interpolant of K′ in x = 1 − 2 arccos(ρ)/π,
    K″ = (dK′/dx)·(2/π)/√(1 − ρ²) (relative error ~1e-12 for |ρ| ≤ 0.99). Singular at
    |ρ| = 1 for kinked σ; the quadratic form only needs it at off-diagonal Gram entries.
    """
    if method not in ("auto", "closed", "interpolant"):
        raise ValueError(f"method must be auto, closed or interpolant, got {method!r}")
    act = resolve_activation(activation)
    rho = np.clip(np.asarray(rho, dtype=np.float64), -1.0, 1.0)
    closed = _closed_kpp(act) if method != "interpolant" else None
    if closed is not None:
        return np.asarray(closed(rho), dtype=np.float64) + np.zeros(rho.shape)
    if method == "closed":
        raise ValueError(f"activation {act.name!r} has no closed-form K″")
    interp = kernel_interpolant(act, "kprime")
    dcoef = chebyshev.chebder(interp.coef)
    x = 1.0 - 2.0 * np.arccos(rho) / np.pi
    with np.errstate(divide="ignore"):
        return chebyshev.chebval(x, dcoef) * (2.0 / np.pi) / np.sqrt(1.0 - rho * rho)


# ---------------------------------------------------------------- geometry
@dataclass(frozen=True)
class _Geometry:
    act: object
    k: int
    lam: np.ndarray  # (k,)
    w: np.ndarray  # (k, k+1) base rows in S
    v: np.ndarray  # (k, k+1) teacher rows in S
    u: np.ndarray  # (k+1,) u in S
    gram: np.ndarray  # (k, k) ⟨wⱼ, wₗ⟩
    teacher_gram: np.ndarray  # (k, k) ⟨vᵢ, vⱼ⟩
    cross: np.ndarray  # (k, k) ⟨vᵢ, wⱼ⟩


def _geometry(instance) -> _Geometry:
    if getattr(instance, "committee", False) or not getattr(instance, "unit_rows", True):
        raise ValueError("the linearized-model theory needs a fine-tuning instance with unit "
                         "rows (teacher 'finetune', convention 'unit')")
    k = int(instance.k)
    w = np.zeros((k, k + 1))
    w[:, :k] = instance.w_factor
    u = np.zeros(k + 1)
    u[:k] = instance.u_w
    u[k] = instance.u_perp
    c = np.asarray(instance.c, dtype=float)
    v = (w + instance.xi * c[:, None] * u[None, :]) / np.asarray(instance.teacher_norms())[:, None]
    return _Geometry(resolve_activation(instance.activation), k, np.asarray(instance.lam, float),
                     w, v, u, np.clip(w @ w.T, -1, 1), np.clip(v @ v.T, -1, 1),
                     np.clip(v @ w.T, -1, 1))


def _u_vector(geo: _Geometry, width: int) -> np.ndarray:
    u = np.zeros(width)
    u[: geo.k + 1] = geo.u
    return u


# ---------------------------------------------------------------- the quadratic form
@dataclass(frozen=True)
class LinearQuadratic:
    """L(Δ) = const − 2⟨b, Δ_S⟩ + ⟨Δ_S, A Δ_S⟩ + tr(B Δ_⊥Δ_⊥ᵀ) (module docstring).

    Fields: ``A`` (k, k+1, k, k+1) (A[j, :, l, :] = Aⱼₗ restricted to S, symmetric as a
    k(k+1)-square matrix, positive semi-definite), ``b`` (k, k+1), ``const`` = L(0) =
    E(f* − f₀)², ``B`` (k, k) = λλᵀ∘K′(G), the isotropic block on S^⊥, ``k``.
    """

    A: np.ndarray
    b: np.ndarray
    const: float
    B: np.ndarray
    k: int

    @property
    def matrix(self) -> np.ndarray:
        """A as a (k(k+1), k(k+1)) matrix acting on Δ_S.ravel()."""
        n = self.k * (self.k + 1)
        return self.A.reshape(n, n)

    def _split(self, delta):
        delta = np.asarray(delta, dtype=float)
        if delta.shape[-2] != self.k or delta.shape[-1] < self.k + 1:
            raise ValueError(f"delta must be (..., k={self.k}, D ≥ {self.k + 1}), got "
                             f"{delta.shape}")
        return delta[..., : self.k + 1], delta[..., self.k + 1:]

    def loss(self, delta) -> np.ndarray:
        """L(Δ) for Δ (..., k, D) (batch shape out)."""
        ds, dp = self._split(delta)
        quad = np.einsum("...ja,jalb,...lb->...", ds, self.A, ds)
        perp = np.einsum("...ja,jl,...la->...", dp, self.B, dp)
        return self.const - 2.0 * np.einsum("ja,...ja->...", self.b, ds) + quad + perp

    def gradient(self, delta) -> np.ndarray:
        """∇_Δ L = 2(AΔ_S − b) on S, 2BΔ_⊥ on S^⊥, shape of Δ (no projection)."""
        ds, dp = self._split(delta)
        gs = 2.0 * (np.einsum("jalb,...lb->...ja", self.A, ds) - self.b)
        gp = 2.0 * np.einsum("jl,...la->...ja", self.B, dp)
        return np.concatenate([gs, gp], axis=-1)

    def dense(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """(A (k, d, k, d), b (k, d)) in the d-dimensional canonical frame (tests)."""
        k, s = self.k, self.k + 1
        a = np.zeros((k, d, k, d))
        a[:, :s, :, :s] = self.A
        eye = np.eye(d - s)
        a[:, s:, :, s:] = self.B[:, None, :, None] * eye[None, :, None, :]
        b = np.zeros((k, d))
        b[:, :s] = self.b
        return a, b


def linear_model_quadratic(instance, method: str = "auto") -> LinearQuadratic:
    """The exact quadratic form of L(Δ) = E(f* − f_lin)² (module docstring).

    Aⱼₗ = λⱼλₗ[K′(Gⱼₗ)PⱼPₗ + K″(Gⱼₗ)(wₗ − Gⱼₗwⱼ)(wⱼ − Gⱼₗwₗ)ᵀ] (j ≠ l), Aⱼⱼ = λⱼ²K′(1)Pⱼ;
    bⱼ = λⱼPⱼ[Σᵢλᵢ K′(⟨vᵢ,wⱼ⟩)vᵢ − Σᵢλᵢ K′(Gᵢⱼ)wᵢ]; B = λλᵀ∘K′(G); const = E(f* − f₀)².
    ``method`` is the kernels' (``hermite.dual_kernel``): auto, closed, interpolant, quadrature
    (K″: auto/closed/interpolant, quadrature → interpolant).
    """
    geo = _geometry(instance)
    act, k, lam, w = geo.act, geo.k, geo.lam, geo.w
    kp = dual_kernel_derivative(act, geo.gram, method=method)  # (k, k)
    off = ~np.eye(k, dtype=bool) & (np.abs(geo.gram) < 1.0)
    kpp = np.zeros((k, k))
    if off.any():
        kpp[off] = dual_kernel_second_derivative(
            act, geo.gram[off], method="interpolant" if method in ("interpolant", "quadrature")
            else method)
    lam2 = np.outer(lam, lam)
    proj = np.eye(k + 1)[None] - w[:, :, None] * w[:, None, :]  # (k, k+1, k+1) Pⱼ
    pp = np.einsum("jab,lbc->jalc", proj, proj)  # PⱼPₗ
    pw = np.einsum("jab,lb->jla", proj, w)  # [j, l] = Pⱼwₗ
    rank1 = np.einsum("jla,ljb->jalb", pw, pw)  # (Pⱼwₗ)(Pₗwⱼ)ᵀ
    A = (lam2 * kp)[:, None, :, None] * pp + (lam2 * kpp)[:, None, :, None] * rank1
    n = k * (k + 1)
    A = 0.5 * (A + A.reshape(n, n).T.reshape(A.shape))  # exact symmetry
    kp_vw = dual_kernel_derivative(act, geo.cross, method=method)  # [i, j] K′(⟨vᵢ, wⱼ⟩)
    vec = np.einsum("i,ij,ia->ja", lam, kp_vw, geo.v) - np.einsum("i,ij,ia->ja", lam, kp, w)
    b = lam[:, None] * np.einsum("jab,jb->ja", proj, vec)
    kern = lambda g: float(lam @ dual_kernel(act, g, method=method) @ lam)  # noqa: E731
    const = kern(geo.teacher_gram) + kern(geo.gram) - 2.0 * kern(geo.cross)
    return LinearQuadratic(A, b, const, lam2 * kp, k)


def linear_model_loss(instance, delta, quad: LinearQuadratic | None = None) -> np.ndarray:
    """L(Δ) = E(f* − f_lin)² exactly, Δ (..., k, D) as in the module docstring."""
    return (quad or linear_model_quadratic(instance)).loss(delta)


# ---------------------------------------------------------------- the true network
def true_network_loss(instance, delta) -> np.ndarray:
    """E(f* − f̂)² of the network with rows (wⱼ + Δⱼ)/‖wⱼ + Δⱼ‖ and second layer λ.

    Δ (..., k, D), first k + 1 columns in S (canonical frame). The dual-kernel expansion
    λᵀK(VVᵀ)λ + λᵀK(ŴŴᵀ)λ − 2λᵀK(VŴᵀ)λ: the same rows and formula as
    ``dynamics.learners.linearized.true_loss`` (``dynamics.measures.network_loss``), without torch.
    """
    geo = _geometry(instance)
    delta = np.asarray(delta, dtype=float)
    width = delta.shape[-1]
    base = np.zeros((geo.k, width))
    base[:, : geo.k + 1] = geo.w
    rows = base + delta
    rows = rows / np.linalg.norm(rows, axis=-1, keepdims=True)
    v = np.zeros((geo.k, width))
    v[:, : geo.k + 1] = geo.v
    lam = geo.lam
    clip = lambda g: np.clip(g, -1.0, 1.0)  # noqa: E731
    k_t = lam @ dual_kernel(geo.act, geo.teacher_gram) @ lam
    k_s = np.einsum("i,...ij,j->...", lam,
                    dual_kernel(geo.act, clip(np.einsum("...ia,...ja->...ij", rows, rows))), lam)
    k_c = np.einsum("i,...ij,j->...", lam,
                    dual_kernel(geo.act, clip(np.einsum("ia,...ja->...ij", v, rows))), lam)
    return k_t + k_s - 2.0 * k_c


def _top_overlap(geo: _Geometry, delta: np.ndarray) -> np.ndarray:
    """|⟨v₁, u⟩|, v₁ the top right singular vector of Δ (NaN where Δ = 0), (...)."""
    _, sv, vt = np.linalg.svd(delta, full_matrices=False)
    ov = np.abs(vt[..., 0, :] @ _u_vector(geo, delta.shape[-1]))
    return np.where(sv[..., 0] > 0, ov, np.nan)


# ---------------------------------------------------------------- full-rank ODE
def update_mask(k: int, width: int, project: bool) -> np.ndarray:
    """(k, width) bool: the coordinates of Δ the learner's update moves. Projected (Π onto
    span(W)^⊥ on every row): the columns ≥ k; unprojected: all (the data gradient of row j
    is ⊥ wⱼ by itself; Aⱼₗ has wⱼ in its null space, so that direction just stays put)."""
    mask = np.ones((k, width), dtype=bool)
    if project:
        mask[:, :k] = False
    return mask


def _log_mult(a, eta: float, flow: bool):
    """(ℓ(a), ℓ(a)/a): per-step log multiplier of a mode of curvature a (ℓ/a → −2η)."""
    a = np.asarray(a, dtype=float)
    if flow:
        return -2.0 * eta * a, np.full(a.shape, -2.0 * eta)
    x = -2.0 * eta * a
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(x == 0, 1.0, np.log1p(x) / np.where(x == 0, 1.0, x))
    return np.log1p(x), -2.0 * eta * ratio


def _modes(lam, prox: float, eta: float, t: np.ndarray, flow: bool):
    """For modes λ (n,) with curvature a = λ + prox and times t (C,), the three (C, n)
    factors of y(t) = S·y₀ + F·f + H·g (see :func:`linear_model_ode`):
    S = s^t, F = (1 − s^t)/a, H = (s^t − r^t)/λ, s = 1 − 2ηa, r = 1 − 2η·prox (flow:
    s^t → e^{−2ηat}); evaluated stably for λ → 0, a → 0."""
    lam = np.asarray(lam, dtype=float)
    a = lam + prox
    t = np.asarray(t, dtype=float)[:, None]
    if not flow and (np.any(2.0 * eta * a >= 1.0) or 2.0 * eta * prox >= 1.0):
        s, r = 1.0 - 2.0 * eta * a, 1.0 - 2.0 * eta * prox  # oscillating or divergent
        st, rt = np.power(s, t), np.power(r, t)
        with np.errstate(divide="ignore", invalid="ignore"):
            F = np.where(a == 0, 2.0 * eta * t, (1.0 - st) / np.where(a == 0, 1.0, a))
            H = np.where(lam == 0, -2.0 * eta * t * np.power(r, t - 1),
                         (st - rt) / np.where(lam == 0, 1.0, lam))
        return st, F, H
    la, ka = _log_mult(a, eta, flow)
    lp, _ = _log_mult(np.array(prox), eta, flow)
    S = np.exp(t * la)
    F = -t * ka * scipy.special.exprel(t * la)
    # ℓ(a) − ℓ(prox) = λ·κ, κ → −2η/(1 − 2η·prox) (flow: −2η) as λ → 0
    if flow:
        kap = np.full(lam.shape, -2.0 * eta)
    else:
        r = 1.0 - 2.0 * eta * prox
        _, kr = _log_mult(lam / r, eta, False)
        kap = kr / r
    H = np.exp(t * lp) * t * kap * scipy.special.exprel(t * lam * kap)
    return S, F, H


def _eigh_psd(mat: np.ndarray):
    vals, vecs = np.linalg.eigh(0.5 * (mat + mat.T))
    top = max(float(np.max(np.abs(vals))) if vals.size else 0.0, 1e-300)
    vals = np.where(np.abs(vals) < _PINV_RTOL * top, 0.0, vals)
    return vals, vecs


@dataclass(frozen=True)
class LinearODE:
    """Mean trajectory of the full-rank linearized learner at ``steps`` (C,).

    ``delta`` (C, k, D) E Δₜ; ``loss_linear`` (C,) L(E Δₜ) (a lower bound of E L(Δₜ): the
    gap is tr(A Cov Δₜ), the SGD noise, see :func:`linear_model_sgd_excess`);
    ``loss_true`` (C,) the true network's loss at E Δₜ; ``overlap`` (C,) |⟨v₁, u⟩| of E Δₜ's
    top right singular vector (the learner's full-rank overlap; NaN at Δ = 0).
    """

    steps: np.ndarray
    delta: np.ndarray
    loss_linear: np.ndarray
    loss_true: np.ndarray
    overlap: np.ndarray


def linear_model_ode(instance, delta0, eta: float, steps, *, project: bool = True,
                     prox: float = 0.0, flow: bool = False,
                     quad: LinearQuadratic | None = None) -> LinearODE:
    """E Δₜ of the full-rank learner, exactly, at the checkpoints ``steps``.

    The learner's step (``LinearizedFullRank``, any batch size) is
    Δ ← (1 − 2η·prox)Δ − η Π(∇ℓ(Δ; x)) with E ∇ℓ = ∇L(Δ) = 2(AΔ − b) affine and x independent
    of Δ, so m = E Δ obeys, with no approximation,

        mₜ₊₁ = mₜ − 2η [Π(A mₜ − b) + prox·mₜ]        (``flow=False``, the default)

    (Π: the rows' projection onto span(W)^⊥ when ``project``, else none). ``flow=True``
    solves the gradient flow dm/dt = −2η[Π(Am − b) + prox·m] (t in steps) instead. Both are
    solved in closed form: split the coordinates of Δ_S into the update's range R
    (:func:`update_mask`) and the rest N; N only decays, m_N(t) = rᵗ m_N(0), r = 1 − 2η·prox;
    on R, with A_RR = QΛQᵀ, the modes y = Qᵀm_R obey yₜ₊₁ = sᵢyₜ + 2η(fᵢ − gᵢrᵗ),
    sᵢ = 1 − 2η(Λᵢ + prox), f = Qᵀb_R, g = QᵀA_RN m_N(0), hence

        y(t) = sᵗ y(0) + f (1 − sᵗ)/(Λ + prox) + g (sᵗ − rᵗ)/Λ

    (flow: sᵗ → e^{−2η(Λ+prox)t}); the S^⊥ part Δ_⊥ decays by the same formula with B for
    A_RR and no forcing. ``delta0`` (k, D) (None: Δ₀ = 0, D = k + 2), ``steps`` (C,) ≥ 0.
    """
    quad = quad or linear_model_quadratic(instance)
    geo = _geometry(instance)
    k, s = quad.k, quad.k + 1
    if delta0 is None:
        delta0 = np.zeros((k, k + 2))
    delta0 = np.asarray(delta0, dtype=float)
    if delta0.ndim != 2 or delta0.shape[0] != k or delta0.shape[1] < s:
        raise ValueError(f"delta0 must be (k={k}, D ≥ {s}), got {delta0.shape}")
    t = np.atleast_1d(np.asarray(steps, dtype=float))
    if np.any(t < 0) or not np.all(np.isfinite(t)):
        raise ValueError("steps must be finite and ≥ 0")
    if not (eta > 0 and prox >= 0):
        raise ValueError("eta must be > 0 and prox ≥ 0")
    width = delta0.shape[1]
    out = np.empty((t.size, k, width))
    # S part
    on = update_mask(k, s, project).ravel()
    m0 = delta0[:, :s].ravel()
    amat, bvec = quad.matrix, quad.b.ravel()
    lam_r, q = _eigh_psd(amat[np.ix_(on, on)])
    y0, f = q.T @ m0[on], q.T @ bvec[on]
    g = q.T @ (amat[np.ix_(on, ~on)] @ m0[~on])
    S, F, H = _modes(lam_r, prox, eta, t, flow)
    m_on = (S * y0 + F * f + H * g) @ q.T  # (C, |R|)
    r_t = _modes(np.zeros(1), prox, eta, t, flow)[0][:, 0]  # rᵗ: s^t of curvature prox
    flat = np.empty((t.size, k * s))
    flat[:, on] = m_on
    flat[:, ~on] = r_t[:, None] * m0[~on][None, :]
    out[:, :, :s] = flat.reshape(t.size, k, s)
    # S^⊥ part: Δ_⊥(t) = Q_B diag(s^t) Q_Bᵀ Δ_⊥(0)
    if width > s:
        lam_b, qb = _eigh_psd(quad.B)
        sb = _modes(lam_b, prox, eta, t, flow)[0]  # (C, k)
        out[:, :, s:] = np.einsum("jm,cm,lm,la->cja", qb, sb, qb, delta0[:, s:])
    return LinearODE(t, out, quad.loss(out), true_network_loss(instance, out),
                     _top_overlap(geo, out))


# ---------------------------------------------------------------- rank 1
def linear_model_rank1_gradient(instance, u_hat, c_hat=None, *, project: bool = True,
                                prox: float = 0.0, quad: LinearQuadratic | None = None):
    """Mean sample gradients of the rank-1 learner at (û, ĉ), Δ = ξĉûᵀ:

        tangent = (I − ûûᵀ) Π ∇_û L = (I − ûûᵀ) Π (ξ Gᵀĉ),
        ∂L/∂ĉ + 2·prox·ξ²ĉ = ξ G û + 2·prox·ξ²ĉ,

    G = ∇_Δ L(ξĉûᵀ) (Π zeroes the span-W coordinates when ``project``). These are the
    expectations of ``Linearized.sample_gradients``' outputs; the learner's mean step is
    û ← û − η·tangent (+ O(η²) from the retraction), ĉ ← ĉ − η_c·(∂L/∂ĉ) (joint ĉ).
    u_hat (..., D), D ≥ k + 1 (canonical S coordinates first); c_hat (..., k) (default: the
    instance's). Returns (tangent (..., D), grad_c (..., k)).
    """
    quad = quad or linear_model_quadratic(instance)
    u = np.asarray(u_hat, dtype=float)
    ch = np.asarray(instance.c_hat if c_hat is None else c_hat, dtype=float)
    xi = float(instance.xi)
    grad = quad.gradient(xi * ch[..., :, None] * u[..., None, :])
    gu = xi * np.einsum("...j,...ja->...a", ch, grad)
    if project:
        gu[..., : quad.k] = 0.0
    tangent = gu - np.sum(u * gu, axis=-1, keepdims=True) * u
    grad_c = xi * np.einsum("...ja,...a->...j", grad, u) + 2.0 * prox * xi * xi * ch
    return tangent, grad_c


@dataclass(frozen=True)
class Rank1ODE:
    """Mean-drift trajectory of the rank-1 learner at ``steps`` (C,): ``u_hat`` (..., C, D),
    ``c_hat`` (..., C, k), ``overlap`` ⟨û, u⟩, ``loss_linear`` L(ξĉûᵀ), ``loss_true``
    (..., C); the leading axes are u0's (a run axis, or none)."""

    steps: np.ndarray
    u_hat: np.ndarray
    c_hat: np.ndarray
    overlap: np.ndarray
    loss_linear: np.ndarray
    loss_true: np.ndarray


def linear_model_rank1_ode(instance, u0, regime: FinetuneRegime | float, steps, *, c0=None,
                           rtol: float = 1e-10, quad: LinearQuadratic | None = None,
                           **keywords) -> Rank1ODE:
    """Integrate the rank-1 learner's mean drift (:func:`linear_model_rank1_gradient`):

        dû/dt = −η (I − ûûᵀ) Π ∇_û L(ξĉûᵀ),   dĉ/dt = −η_c (∇_ĉ L + 2·prox·ξ²ĉ) (joint ĉ),

    t in steps (scipy DOP853 in τ = ηt). It is the O(η) drift of the learner's step: the
    retraction's O(η²) term (the finite-d noise drift −(η²/2)E‖tangent‖² û per step, of
    relative size ~ηd) is left out. Projected frozen ĉ has the closed form
    ⟨û, e⟩(t) = tanh(2ηξ ĉᵀb_e t + artanh⟨û₀, e⟩) (û₀ ⊥ span W, e the coordinate k).
    u0 (D,) or (R, D) unit (R runs integrated together, e.g. the learner's
    ``records["coords"][:, 0]``), D ≥ k + 2 recommended (S, then ⊥ coordinates);
    c0 (k,) or (R, k) (default: the instance's ĉ). ``regime``: the learner's
    :class:`~hermite.flows.regime.FinetuneRegime` (η, η_c default η, project, joint_c, prox),
    or η with those as keywords.
    """
    regime = from_keywords("linear_model_rank1_ode", regime, keywords, accepted=LEARNER)
    eta, eta_c, project, joint_c = regime.eta, regime.eta_c, regime.project, regime.joint_c
    quad = quad or linear_model_quadratic(instance)
    geo = _geometry(instance)
    k = quad.k
    u0 = np.asarray(u0, dtype=float)
    width, batch = u0.shape[-1], u0.shape[:-1]
    if width < k + 1:
        raise ValueError(f"u0 must have D ≥ k + 1 = {k + 1} coordinates")
    c0 = np.broadcast_to(np.asarray(instance.c_hat if c0 is None else c0, dtype=float),
                         batch + (k,))
    ratio = 1.0 if eta_c is None else eta_c / eta
    t = np.atleast_1d(np.asarray(steps, dtype=float))
    xi = float(instance.xi)
    n_u = int(np.prod(batch, dtype=int)) * width

    def rhs(_, z):
        u = z[:n_u].reshape(batch + (width,))
        # the drift at u/‖u‖ is tangent to it, so ‖u‖ stays 1 without the radial instability
        # of (I − ûûᵀ)∇ off the sphere (where uᵀ∇ < 0, a norm error would grow)
        u = u / np.linalg.norm(u, axis=-1, keepdims=True)
        ch = z[n_u:].reshape(batch + (k,)) if joint_c else c0
        tan, gc = linear_model_rank1_gradient(instance, u, ch, project=project,
                                              prox=regime.prox, quad=quad)
        if joint_c:
            return np.concatenate([-tan.ravel(), -ratio * gc.ravel()])
        return -tan.ravel()

    z0 = np.concatenate([u0.ravel(), c0.ravel()]) if joint_c else u0.ravel()
    sol = scipy.integrate.solve_ivp(rhs, (0.0, eta * float(t.max(initial=0.0))), z0,
                                    method="DOP853", t_eval=eta * t, rtol=rtol,
                                    atol=rtol * 1e-2)
    if not sol.success:
        raise RuntimeError(f"rank-1 ODE integration failed: {sol.message}")
    zs = sol.y.T  # (C, n)
    u = np.moveaxis(zs[:, :n_u].reshape((t.size,) + batch + (width,)), 0, -2)
    u = u / np.linalg.norm(u, axis=-1, keepdims=True)
    if joint_c:
        ch = np.moveaxis(zs[:, n_u:].reshape((t.size,) + batch + (k,)), 0, -2)
    else:
        ch = np.broadcast_to(c0[..., None, :], batch + (t.size, k)).copy()
    delta = xi * ch[..., :, None] * u[..., None, :]
    return Rank1ODE(t, u, ch, u @ _u_vector(geo, width), quad.loss(delta),
                    true_network_loss(instance, delta))


# ---------------------------------------------------------------- the floor
@dataclass(frozen=True)
class Floor:
    """The linear model's least population loss under the learner's constraints.

    ``loss_linear`` = L(Δ*) (without the prox term); ``delta`` (k, k+2) the minimiser Δ*
    (S coordinates, then one ⊥ coordinate); ``loss_true`` the true network's loss at Δ*
    (rows (wⱼ + Δ*ⱼ)/‖·‖); ``overlap`` |⟨v₁, u⟩| of Δ*'s top right singular vector (rank 1:
    ⟨û*, u⟩ up to sign); ``u_hat`` (k+2,), ``c_hat`` (k,) for rank 1 (else None).
    """

    loss_linear: float
    delta: np.ndarray
    loss_true: float
    overlap: float
    rank: str
    project: bool
    joint_c: bool
    u_hat: np.ndarray | None = None
    c_hat: np.ndarray | None = None


def _trust_region(h: np.ndarray, g: np.ndarray) -> np.ndarray:
    """argmin xᵀHx − 2gᵀx over ‖x‖ = 1 (H symmetric): x = (H − μI)⁻¹g, μ ≤ λ_min, with the
    'hard case' (g ⊥ the bottom eigenspace) handled."""
    vals, vecs = np.linalg.eigh(0.5 * (h + h.T))
    gam = vecs.T @ g
    scale = max(float(np.max(np.abs(vals))), float(np.linalg.norm(g)), 1e-300)
    bottom = vals <= vals[0] + 1e-12 * scale
    gn = float(np.linalg.norm(g))

    def norm_at(mu, idx):
        return float(np.sqrt(np.sum((gam[idx] / (vals[idx] - mu)) ** 2)))

    rest = ~bottom
    hard = np.linalg.norm(gam[bottom]) <= 1e-13 * max(gn, 1e-300)
    if hard and (not rest.any() or norm_at(vals[0], rest) <= 1.0):
        x = np.zeros_like(g)
        if rest.any():
            x += vecs[:, rest] @ (gam[rest] / (vals[rest] - vals[0]))
        tau = math.sqrt(max(0.0, 1.0 - float(x @ x)))
        return x + tau * vecs[:, np.nonzero(bottom)[0][0]]
    idx = rest if hard else np.ones(vals.size, dtype=bool)
    # 1/‖x(μ)‖ − 1 is > 0 at lo (every |γᵢ|/(λᵢ − lo) < |γᵢ|/‖g‖) and < 0 at top
    # (‖x(top)‖ ≥ ‖γ_bottom‖/(λ₁ − top) = 2, or > 1 on the rest in the hard case)
    lo = vals[0] - gn - 1.0
    top = vals[0] if hard else vals[0] - 0.5 * float(np.linalg.norm(gam[bottom]))
    fun = lambda mu: 1.0 / norm_at(mu, idx) - 1.0  # noqa: E731
    mu = scipy.optimize.brentq(fun, lo, top, xtol=1e-15 * (top - lo), rtol=1e-15,
                               maxiter=500)
    x = vecs[:, idx] @ (gam[idx] / (vals[idx] - mu))
    return x / np.linalg.norm(x)


def _solve_psd(mat, rhs):
    vals, vecs = _eigh_psd(mat)
    inv = np.where(vals > 0, 1.0 / np.where(vals > 0, vals, 1.0), 0.0)
    return vecs @ (inv * (vecs.T @ rhs))


def _rank1_blocks(quad: LinearQuadratic, s: np.ndarray):
    """(β (k,), M (k, k)) with L(a sᵀ) = const − 2aᵀβ + aᵀMa for unit s ∈ S."""
    beta = quad.b @ s
    mmat = np.einsum("a,jalb,b->jl", s, quad.A, s)
    return beta, 0.5 * (mmat + mmat.T)


def linear_model_floor(instance, *, rank: str | int = "full", project: bool = True,
                       joint_c: bool = False, prox: float = 0.0, starts: int = 16,
                       seed: int = 0, quad: LinearQuadratic | None = None) -> Floor:
    """min L(Δ) over the learner's Δ, its minimiser, and the true network loss there.

    * ``rank="full"``: Δ with rows in the update's range (:func:`update_mask`; projected:
      rows ⊥ span W). Δ* = (A_RR + prox)⁺ b_R on S, Δ*_⊥ = 0 (b has no S^⊥ part and B ⪰ 0):
      the limit of the mean ODE from Δ₀ = 0. Projected, A_RR = B on the e-column, so
      Δ* = (B + prox)⁺ b_e eᵀ is rank 1 along e = Π^⊥u/‖Π^⊥u‖ and L* = L₀ − b_eᵀB⁺b_e.
    * ``rank=1``, frozen ĉ (``joint_c=False``, the instance's ĉ): Δ = ξĉûᵀ, û unit (⊥ span W
      when projected): min xᵀHx − 2gᵀx on the unit sphere of û's (k+2) coordinates with
      H = ξ²(ΣⱼₗĉⱼĉₗAⱼₗ ⊕ ĉᵀBĉ), g = ξ(bᵀĉ ⊕ 0) (a trust-region subproblem, solved exactly).
      Projected: û* = sign(ĉᵀb_e)·e, L* = L₀ − 2ξ|ĉᵀb_e| + ξ²ĉᵀBĉ.
    * ``rank=1``, joint ĉ: Δ = a sᵀ with a = ξĉ free; for fixed s the optimal a =
      (M(s) + prox)⁺β(s), M(s)ⱼₗ = sᵀAⱼₗs, β(s)ⱼ = ⟨bⱼ, s⟩, and a ⊥ component of s never
      helps (B ⪰ 0), so s ranges over the unit sphere of S (projected: s = e, the same floor
      as full rank); the unprojected case is minimised numerically (BFGS from e, the
      full-rank minimiser's top direction and ``starts`` seeded random points).

    ``prox`` > 0 minimises L + prox·‖Δ‖²_F (the learner's objective); ``loss_linear`` is L.
    """
    quad = quad or linear_model_quadratic(instance)
    geo = _geometry(instance)
    k, s = quad.k, quad.k + 1
    xi = float(instance.xi)
    delta = np.zeros((k, k + 2))
    u_hat = c_hat = None
    if rank == "full":
        on = update_mask(k, s, project).ravel()
        flat = np.zeros(k * s)
        amat = quad.matrix[np.ix_(on, on)] + prox * np.eye(int(on.sum()))
        flat[on] = _solve_psd(amat, quad.b.ravel()[on])
        delta[:, :s] = flat.reshape(k, s)
    elif rank == 1 and not joint_c:
        ch = np.asarray(instance.c_hat, dtype=float)
        idx = np.arange(k + 2) if not project else np.array([k, k + 1])
        h = np.zeros((k + 2, k + 2))
        h[:s, :s] = np.einsum("j,jalb,l->ab", ch, quad.A, ch)
        h[s, s] = ch @ quad.B @ ch
        g = np.zeros(k + 2)
        g[:s] = ch @ quad.b
        x = np.zeros(k + 2)
        x[idx] = _trust_region(xi * xi * h[np.ix_(idx, idx)], xi * g[idx])
        u_hat, c_hat = x, ch
        delta = xi * ch[:, None] * x[None, :]
    elif rank == 1:
        def best_a(sv):
            beta, mmat = _rank1_blocks(quad, sv)
            a = _solve_psd(mmat + prox * np.eye(k), beta)
            return a, float(-2.0 * a @ beta + a @ mmat @ a + prox * a @ a)

        e = np.zeros(s)
        e[k] = 1.0
        if project:
            sv = e
        else:
            full = linear_model_floor(instance, rank="full", project=False, prox=prox,
                                      quad=quad)
            cands = [e]
            _, _, vt = np.linalg.svd(full.delta[:, :s])
            cands.append(vt[0])
            rng = np.random.default_rng(seed)
            cands += list(rng.standard_normal((starts, s)))

            def obj(y):  # J(s) and its gradient in y (envelope theorem: a is optimal)
                ny = float(np.linalg.norm(y))
                sv = y / ny
                a, val = best_a(sv)
                grad_s = -2.0 * a @ quad.b + 2.0 * np.einsum("j,jalb,l,b->a", a, quad.A, a, sv)
                return val, (grad_s - (sv @ grad_s) * sv) / ny

            best = None
            for y0 in cands:
                res = scipy.optimize.minimize(obj, y0 / np.linalg.norm(y0), jac=True,
                                              method="BFGS", options={"gtol": 1e-13})
                if best is None or res.fun < best.fun:
                    best = res
            sv = best.x / np.linalg.norm(best.x)
        a, _ = best_a(sv)
        u_hat = np.zeros(k + 2)
        u_hat[:s] = sv
        c_hat = a / xi if xi > 0 else np.full(k, np.nan)
        delta = a[:, None] * u_hat[None, :]
    else:
        raise ValueError(f"rank must be 'full' or 1, got {rank!r}")
    return Floor(float(quad.loss(delta)), delta, float(true_network_loss(instance, delta)),
                 float(_top_overlap(geo, delta)), str(rank), bool(project), bool(joint_c),
                 u_hat, c_hat)


# ---------------------------------------------------------------- SGD noise
def linear_model_sgd_excess(instance, eta: float, *, d: int, batch: int = 1,
                            project: bool = True, prox: float = 0.0, label_noise: float = 0.0,
                            samples: int = 2**20, seed: int = 0,
                            floor: Floor | None = None) -> float:
    """Leading-order stationary excess E L(Δ_∞) − L* of the full-rank learner's SGD.

    With θ = Δ − Δ*, features φ = (βⱼ Π Pⱼ x)ⱼ, r* = y − f_lin(Δ*) and N = E[r*² φφᵀ], the
    second moment Σ = E θθᵀ of the stationary SGD obeys 2η(AΣ + ΣA) = 4η² N/b + O(η²·AΣ·tr A),
    so tr(AΣ) = η tr(N)/b: the excess, to relative accuracy O(η tr A) ≈ O(η d Σλ²K′(1)).
    tr N = E[r*² Σⱼβⱼ² (‖ΠPⱼx_S‖² + d − k − 1)] (x_⊥ is independent of r*, which only
    sees S); a seeded Monte Carlo over x_S ∈ R^{k+1} (``samples``, relative error
    ≈ 1/√samples). ``label_noise`` (variance) adds to r*².
    """
    geo = _geometry(instance)
    k, s = geo.k, geo.k + 1
    floor = floor or linear_model_floor(instance, rank="full", project=project, prox=prox)
    dstar = floor.delta[:, :s]
    proj_rows = np.eye(s)[None] - geo.w[:, :, None] * geo.w[:, None, :]
    eff = np.einsum("jab,jb->ja", proj_rows, dstar)  # PⱼΔ*ⱼ
    act, lam = geo.act, geo.lam
    rng = np.random.default_rng(seed)
    total, done, chunk = 0.0, 0, max(1, min(samples, 2**16))
    while done < samples:
        n = min(chunk, samples - done)
        x = rng.standard_normal((n, s))
        z, t = x @ geo.w.T, x @ geo.v.T
        beta = act.deriv(z) * lam
        resid = act.fn(t) @ lam - act.fn(z) @ lam - np.sum(beta * (x @ eff.T), axis=1)
        if project:
            sq = np.broadcast_to((x[:, k] ** 2)[:, None], z.shape)
        else:
            sq = np.sum(x * x, axis=1)[:, None] - z * z
        total += float(np.sum((resid ** 2 + label_noise)
                              * np.sum(beta ** 2 * (sq + (d - k - 1)), axis=1)))
        done += n
    return eta * total / samples / batch

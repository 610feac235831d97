"""Population theory of rank-r fine-tuning: the r×r overlap M = UᵀÛ and its matrix ODE.

Model (``dynamics.instances.lora_instance``): teacher rows vᵢ = (wᵢ + ξUcᵢ)/Nᵢ, student rows
v̂ⱼ = (wⱼ + ξÛĉⱼ)/N̂ⱼ, Û ⊥ span W with ÛᵀÛ = I (so N̂ⱼ = √(1 + ξ²‖ĉⱼ‖²) does not depend on Û).

Derivation. ⟨vᵢ, v̂ⱼ⟩ = (Gᵢⱼ + ξ⟨wⱼ, Ucᵢ⟩ + ξ²cᵢᵀUᵀÛĉⱼ)/(NᵢN̂ⱼ) (⟨wᵢ, Ûĉⱼ⟩ = 0), i.e.

    ρᵢⱼ(M) = Pᵢⱼ + ξ² cᵢᵀ M ĉⱼ/(NᵢN̂ⱼ),   M = UᵀÛ (r×r),

and the student–student correlations do not depend on Û. With the dual kernel K, the
population loss (App. D.1, no factor 1/2) is

    Φ(M) = Σᵢⱼ λᵢλⱼ [K(⟨vᵢ,vⱼ⟩) + K(⟨v̂ᵢ,v̂ⱼ⟩) − 2K(ρᵢⱼ(M))],

so dΦ/dM = −A(M) with A(M) = 2ξ² Σᵢⱼ λᵢλⱼ K′(ρᵢⱼ(M)) cᵢĉⱼᵀ/(NᵢN̂ⱼ) (r×r), and the Euclidean
gradient of Φ(UᵀÛ) is ∂Φ/∂Û = −U A(M) (any Û-dependence of N̂ or of the student Gram adds
Û·(symmetric) and W-terms, which the tangent projection and Π remove). The Riemannian
gradient for the embedded metric, after Π onto span(W)^⊥, is
grad = −ΠUA + Û sym(ÛᵀΠUA) = −ΠUA + Û sym(MᵀA) (ÛᵀΠU = ÛᵀU = Mᵀ), and the gradient flow
dÛ/dt = −η grad gives, with UᵀΠU = U_⊥ᵀU_⊥ (= I for U ⊥ span W),

    dM/dt = η [UᵀΠU A(M) − M sym(MᵀA(M))].

At r = 1: A = h(m) (``hermite.h``) and dm/dt = η h(m)(u⊥² − m²) (Prop. 4). The population map
iterated by :func:`matrix_ode` is M_{t+1} = M_t + η[UᵀΠU A(M_t) − M_t sym(M_tᵀA(M_t))].
Both are invariant under the gauges (C, U) ↦ (CQ, UQ) (M ↦ QᵀM, A ↦ QᵀA) and
(Ĉ, Û) ↦ (ĈQ, ÛQ) (M ↦ MQ, A ↦ AQ), so the singular values of M (cosines of the principal
angles between span U and span Û) are gauge-invariant.

Accuracy: K and K′ are ``hermite.dual_kernel``/``dual_kernel_derivative`` (closed form or the
certified interpolant, no truncation), the same standard as ``hermite.h``.
"""

from __future__ import annotations

import numpy as np

from hermite.expansion.kernels import dual_kernel, dual_kernel_derivative
from hermite.flows.ode import check_steps

__all__ = ["A_matrix", "overlap_drift", "population_loss_rank", "matrix_ode",
           "singular_values", "signed_smallest", "rank_correlations", "RankConstants"]

_TOL = 1e-12


class RankConstants:
    """The M-independent arrays of one or several rank-r instances (leading axis n, or none).

    lam2 (…, k, k) λᵢλⱼ; p, q (…, k, k) with ρ = P + Q∘(C M Ĉᵀ); c, c_hat (…, k, r);
    perp (…, r, r) = UᵀΠU. Build with :meth:`of` (one instance) or :meth:`stack` (per run).
    """

    def __init__(self, activation, lam2, p, q, c, c_hat, perp):
        self.activation, self.lam2, self.p, self.q = activation, lam2, p, q
        self.c, self.c_hat, self.perp = c, c_hat, perp

    @classmethod
    def of(cls, inst_r, C_hat=None) -> RankConstants:
        ch = inst_r.C_hat if C_hat is None else np.asarray(C_hat, dtype=float)
        p, q = inst_r.correlation_parts(ch)
        return cls(inst_r.activation, np.outer(inst_r.lam, inst_r.lam), p, q, inst_r.C, ch,
                   inst_r.perp_gram)

    @classmethod
    def stack(cls, instances) -> RankConstants:
        """Per-run constants (leading axis = run) of instances sharing σ, k and r."""
        parts = [cls.of(i) for i in instances]
        names = {i.activation.name for i in instances}
        if len(names) != 1:
            raise ValueError("instances must share the activation")
        return cls(instances[0].activation, *(np.stack([getattr(p, f) for p in parts])
                                              for f in ("lam2", "p", "q", "c", "c_hat", "perp")))

    def rho(self, m: np.ndarray) -> np.ndarray:
        """ρᵢⱼ(M) = Pᵢⱼ + Qᵢⱼ (C M Ĉᵀ)ᵢⱼ, clipped to [−1, 1]; m (…, r, r) → (…, k, k)."""
        cmc = self.c @ m @ np.swapaxes(self.c_hat, -1, -2)
        return np.clip(self.p + self.q * cmc, -1.0, 1.0)

    def a(self, m: np.ndarray) -> np.ndarray:
        """A(M) = 2 Cᵀ [λλᵀ ∘ Q ∘ K′(ρ(M))] Ĉ (= 2ξ² Σᵢⱼ λᵢλⱼ K′(ρᵢⱼ) cᵢĉⱼᵀ/(NᵢN̂ⱼ))."""
        weights = self.lam2 * self.q * dual_kernel_derivative(self.activation, self.rho(m))
        return 2.0 * np.swapaxes(self.c, -1, -2) @ weights @ self.c_hat

    def drift(self, m: np.ndarray) -> np.ndarray:
        """UᵀΠU A(M) − M sym(MᵀA(M))."""
        a = self.a(m)
        mta = np.swapaxes(m, -1, -2) @ a
        return self.perp @ a - m @ (0.5 * (mta + np.swapaxes(mta, -1, -2)))


def _check_m(inst_r, m, name: str = "M", projected: bool = True) -> np.ndarray:
    m = np.asarray(m, dtype=float)
    r = inst_r.rank
    if m.ndim < 2 or m.shape[-2:] != (r, r):
        raise ValueError(f"{name} must have shape (..., {r}, {r}) (rank r = {r}), got {m.shape}")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"{name} must be finite")
    bound = float(np.sqrt(np.linalg.eigvalsh(inst_r.perp_gram)[-1])) if projected else 1.0
    if m.size:
        top = singular_values(m)[..., 0].max()
        if top > bound + _TOL:
            raise ValueError(f"{name}'s singular values must be ≤ {bound:.6g} (M = UᵀÛ with "
                             f"ÛᵀÛ = I{', Û ⊥ span W' if projected else ''}), got {top:.6g}")
    return m


def rank_correlations(inst_r, M, C_hat=None) -> np.ndarray:
    """ρᵢⱼ(M) = ⟨vᵢ, v̂ⱼ⟩ for Û ⊥ span W; M (…, r, r) → (…, k, k)."""
    return RankConstants.of(inst_r, C_hat).rho(_check_m(inst_r, M))


def A_matrix(inst_r, M, C_hat=None) -> np.ndarray:
    """A(M) = 2ξ² Σᵢⱼ λᵢλⱼ K′(ρᵢⱼ(M)) cᵢĉⱼᵀ/(NᵢN̂ⱼ) = −dΦ/dM, (…, r, r) (exact K′)."""
    return RankConstants.of(inst_r, C_hat).a(_check_m(inst_r, M))


def overlap_drift(inst_r, M, C_hat=None) -> np.ndarray:
    """dM/dt / η = UᵀΠU A(M) − M sym(MᵀA(M)) (= A − M sym(MᵀA) for U ⊥ span W)."""
    return RankConstants.of(inst_r, C_hat).drift(_check_m(inst_r, M))


def population_loss_rank(inst_r, M, C_hat=None, omega=None) -> np.ndarray:
    """Φ = E(f* − f̂)² (exact, dual kernels) at overlap M = UᵀÛ (…, r, r) → (…).

    ``C_hat``: the student's Ĉ, (k, r) or (…, k, r) (default the instance's). ``omega``:
    W Û (…, k, r) for a Û not ⊥ span W (unprojected learner; default 0). Then
    N̂ⱼ² = 1 + 2ξ⟨ωⱼ, ĉⱼ⟩ + ξ²‖ĉⱼ‖², ⟨vᵢ, v̂ⱼ⟩ = (Gᵢⱼ + ξ⟨ωᵢ, ĉⱼ⟩ + ξ⟨cᵢ, (WU)ⱼ⟩ +
    ξ²cᵢᵀMĉⱼ)/(NᵢN̂ⱼ), ⟨v̂ᵢ, v̂ⱼ⟩ = (Gᵢⱼ + ξ⟨ωᵢ, ĉⱼ⟩ + ξ⟨ĉᵢ, ωⱼ⟩ + ξ²⟨ĉᵢ, ĉⱼ⟩)/(N̂ᵢN̂ⱼ).
    """
    m = _check_m(inst_r, M, projected=omega is None)
    act, xi, g = inst_r.activation, inst_r.xi, inst_r.gram
    lam2 = np.outer(inst_r.lam, inst_r.lam)
    ch = inst_r.C_hat if C_hat is None else np.asarray(C_hat, dtype=float)
    om = np.zeros(inst_r.C.shape) if omega is None else np.asarray(omega, dtype=float)
    cht = np.swapaxes(ch, -1, -2)
    wc = om @ cht  # (…, k, k): ⟨ωᵢ, ĉⱼ⟩ = wᵢᵀ Û ĉⱼ
    nh = np.sqrt(1.0 + 2.0 * xi * np.diagonal(wc, axis1=-2, axis2=-1)
                 + xi**2 * (ch * ch).sum(-1))
    nt = inst_r.teacher_norms()
    student = (g + xi * (wc + np.swapaxes(wc, -1, -2)) + xi**2 * (ch @ cht)) / (
        nh[..., :, None] * nh[..., None, :])
    cross = (g + xi * wc + xi * inst_r.C @ inst_r.w_dot_U.T + xi**2 * (inst_r.C @ m @ cht)) / (
        nt[:, None] * nh[..., None, :])
    k_t = float(np.sum(lam2 * dual_kernel(act, np.clip(inst_r.teacher_gram(), -1.0, 1.0))))
    k_s = (lam2 * dual_kernel(act, np.clip(student, -1.0, 1.0))).sum((-1, -2))
    k_c = (lam2 * dual_kernel(act, np.clip(cross, -1.0, 1.0))).sum((-1, -2))
    return k_t + k_s - 2.0 * k_c


MAP_MAX_STEPS = 200_000  # method "auto": the discrete map up to this horizon, else the flow


def matrix_ode(inst_r, eta, M0, steps, C_hat=None, method: str = "auto") -> np.ndarray:
    """Iterate M_{t+1} = M_t + η[UᵀΠU A(M_t) − M_t sym(M_tᵀA(M_t))] from M0 (…, r, r),
    vectorised over the leading axes; the iterates at ``steps`` → (…, C, r, r).

    ``method``: ``map`` (the discrete map, one numpy step per SGD step), ``continuous`` (the
    flow dM/dt = η[…] by an adaptive Runge–Kutta solve evaluated at ``steps``; it differs from
    the map by O(η), like the map from SGD's mean) or ``auto`` (map up to ``MAP_MAX_STEPS``
    steps). ``inst_r`` may also be a :class:`RankConstants` (e.g. ``RankConstants.stack`` of
    per-run instances, leading axis = run, aligned with M0's).
    """
    eta = float(eta)
    if not np.isfinite(eta) or eta <= 0:
        raise ValueError(f"eta must be a finite number > 0, got {eta!r}")
    if method not in ("auto", "map", "continuous"):
        raise ValueError(f"method must be auto, map or continuous, got {method!r}")
    if isinstance(inst_r, RankConstants):
        consts, m = inst_r, np.array(M0, dtype=float)
    else:
        consts, m = RankConstants.of(inst_r, C_hat), _check_m(inst_r, M0, "M0").copy()
    ckpts = check_steps(steps)
    if method == "continuous" or (method == "auto" and ckpts[-1] > MAP_MAX_STEPS):
        return _matrix_flow(consts, eta, m, ckpts)
    out = np.empty(m.shape[:-2] + (ckpts.size,) + m.shape[-2:])
    t, j = 0, 0
    while j < ckpts.size:
        while j < ckpts.size and ckpts[j] == t:
            out[..., j, :, :] = m
            j += 1
        if j == ckpts.size:
            break
        m = m + eta * consts.drift(m)
        t += 1
    return out


def _matrix_flow(consts: RankConstants, eta: float, m0: np.ndarray, ckpts) -> np.ndarray:
    """dM/dt = η·drift(M) from m0 (…, r, r), solved at the checkpoints (DOP853, rtol 1e-10)."""
    from scipy.integrate import solve_ivp

    shape = m0.shape

    def rhs(_t, y):
        return (eta * consts.drift(y.reshape(shape))).ravel()

    sol = solve_ivp(rhs, (0.0, float(ckpts[-1])), m0.ravel(), method="DOP853",
                    t_eval=np.asarray(ckpts, dtype=float), rtol=1e-10, atol=1e-12)
    if not sol.success:
        raise RuntimeError(f"matrix ODE flow failed: {sol.message}")
    out = sol.y.T.reshape((len(ckpts),) + shape)  # (C, …, r, r)
    return np.moveaxis(out, 0, -3)


def singular_values(M) -> np.ndarray:
    """Singular values of M (…, r, r), descending: cosines of the principal angles."""
    return np.linalg.svd(np.asarray(M, dtype=float), compute_uv=False)


def signed_smallest(M) -> np.ndarray:
    """sign(det M)·σ_min(M) (…): equals m = ⟨u, û⟩ at r = 1 (the ``overlap`` curve)."""
    m = np.asarray(M, dtype=float)
    s = singular_values(m)[..., -1]
    sign = np.where(np.linalg.det(m) < 0, -1.0, 1.0)
    return sign * s

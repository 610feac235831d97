r"""The finite-η (noise-corrected) flow of the rank-1 linearized learner, projected û
(docs/theory/linearized.md, "Rank 1 at finite η").

The learner (``dynamics/learners/linearized.py``, rank 1, projected) runs finetune's spherical
step on the linear model's loss. Its state reduces to y = (μ, ĉ), μ = ⟨û, e⟩ (m = u⊥μ): the
loss sees û only through μ (docs/theory/linearized.md, "Projected, frozen ĉ"). With b_e the
e-column of the form's b and B = diag(λ)K′(G)diag(λ), the mean drift per SGD step is

    D_μ = 2ηξ (ĉᵀb_e)(1 − μ²) − (η²/2) μ E‖Ḡ_T‖²,                               (L1)
    D_ĉ = −η_c (2ξ²Bĉ − 2ξμ b_e + 2·prox·ξ²ĉ)                      (exact, no O(η²) part),

the first line to O(η²): the O(η) part is
:func:`hermite.flows.linearized.linear_model_rank1_gradient` in closed form, the second the
spherical step's renormalisation. E‖G_T‖² = E[g²(t² + ρ²)] of the example's sample gradient
G_T = g(Πx − sû), g = −2rb, r = y − f₀ − bs, b = ξΣⱼβⱼĉⱼ, s = ⟨û, x⟩, t = ⟨(e − μû)/ν, x⟩,
ν = √(1 − μ²), ρ² ~ χ²_{d−k−2} the rest (independent, its mean d − k − 2 exact); with a
mini-batch of B examples E‖Ḡ_T‖² = (E‖G_T‖² − (E gt)²)/B + (E gt)². The expectation over
the (k + 3) Gaussians (x_W, a = ⟨e, x⟩, w = ⟨f, x⟩, the label noise) is a randomised QMC
average on fixed points (``hermite.finite_d.noise``'s common random numbers).

The learner starts at |μ₀| ~ d^{−1/2}, where the escape from μ = 0 is unstable and the
step noise of μ (variance η²ν²Var(gt) per step, large while ĉ is still near ĉ₀) is as large
as the renormalisation pull; ĉ's step noise (2η_cξ r s β) raises the loss by tr(H Cov ĉ).
Both are carried by the linear-noise approximation (LNA) about the mean path, taken in
φ = artanh μ, where the O(η) drift of μ is linear (dφ/dt = 2ηξĉᵀb_e, the tanh law of the
frozen case): by Itô, with M₂ = E[(ḡt)²] the second moment of μ's O(η) increment over η²ν²,

    D_φ = 2ηξ ĉᵀb_e − (η²/2)(μ/ν²)(E‖Ḡ_T‖² − 2ν²M₂),                                  (L3)
    dȳ/dt = E[D(y)],   dΣ/dt = JΣ + ΣJᵀ + Q,   y = (φ, ĉ) ~ N(ȳ, Σ),                    (L2)

E[D_ĉ] with E tanh φ by Gauss–Hermite (exact for a Gaussian φ), J the Jacobian (the
O(η²) part of D_φ differentiated with E‖Ḡ_T‖², M₂ held), Q the covariance of one step's O(η)
increments (−ηgt/ν, 2η_cξ r s β; QMC). A run whose mean path crosses μ = 0 while its
spread is wide then ends at ±μ, and |μ| < 1. Lines: E|m| = u⊥E|tanh φ| (Gauss–Hermite),
E L_lin = L₀ − 2ξ b_eᵀE[μĉ] + ξ²(ĉ̄ᵀBĉ̄ + tr BΣ_ĉĉ) with E[μĉ] = ĉ̄ E tanh φ + Σ_ĉφ E sech²φ
(Stein; exact for the Gaussian law), E L_true by the symmetric sigma points of N(ȳ, Σ)
(exact for a quadratic in (φ, ĉ)). Integration: RK4 in SGD steps, E‖Ḡ_T‖², M₂ held over a
step and Q over :data:`Q_EVERY` steps (:data:`RATE_STEP`, :data:`ETA_STEP`, :data:`RAMP`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hermite.finite_d.noise import _gaussians
from hermite.flows.linearized import linear_model_quadratic, true_network_loss
from hermite.flows.regime import LEARNER, FinetuneRegime, from_keywords

__all__ = ["ProjectedRank1", "StepNoise", "LinearCorrected", "linear_rank1_corrected",
           "SAMPLES", "RATE_STEP", "ETA_STEP", "RAMP", "Q_EVERY",
           "rk4_steps"]

SAMPLES = 2**13  # QMC points of E‖G_T‖² and Q (8 scrambled Sobol′ sets of 2^10)
RATE_STEP = 1.0  # RK4 step h: h × the largest decay rate per SGD step ≤ this (RK4 at hλ = 1:
# amplification 0.375 against e^{−1} = 0.368)
ETA_STEP = 0.05  # and η_max·h ≤ this (the slow drift's resolution)
RAMP = 0.5  # and h ≤ max(1, RAMP·t): S and Q are held over a step, ĉ relaxes fast at first
Q_EVERY = 8  # the step covariance Q is refreshed every this many RK4 steps


@dataclass(frozen=True)
class ProjectedRank1:
    """The projected rank-1 linear model in y = (μ, ĉ): L_lin = L₀ − 2ξμĉᵀb_e + ξ²ĉᵀBĉ and
    the O(η) drift (L1) in closed form (``b_e`` (k,), ``B`` (k, k) of
    :func:`~hermite.flows.linearized.linear_model_quadratic`)."""

    k: int
    xi: float
    u_perp: float
    b_e: np.ndarray
    B: np.ndarray
    L0: float

    @classmethod
    def of(cls, instance, quad=None) -> ProjectedRank1:
        quad = quad or linear_model_quadratic(instance)
        k = quad.k
        return cls(k, float(instance.xi), float(instance.u_perp), quad.b[:, k].copy(),
                   np.asarray(quad.B, dtype=float), float(quad.const))

    def delta(self, mu, ch) -> np.ndarray:
        """Δ = ξĉûᵀ (..., k, k+2) with û = (0, μ, √(1 − μ²)) in (span W, e, ⊥)."""
        mu = np.clip(np.asarray(mu, dtype=float), -1.0, 1.0)
        u = np.zeros(mu.shape + (self.k + 2,))
        u[..., self.k], u[..., self.k + 1] = mu, np.sqrt(1.0 - mu * mu)
        return self.xi * np.asarray(ch)[..., :, None] * u[..., None, :]

    def loss_linear(self, mu, ch) -> np.ndarray:
        """L_lin(μ, ĉ) = L₀ − 2ξμĉᵀb_e + ξ²ĉᵀBĉ."""
        ch = np.asarray(ch, dtype=float)
        return (self.L0 - 2.0 * self.xi * np.asarray(mu) * (ch @ self.b_e)
                + self.xi**2 * np.einsum("...j,jl,...l->...", ch, self.B, ch))

    def mean_loss_linear(self, cross, ch, cov_c) -> np.ndarray:
        """E L_lin = L₀ − 2ξ b_eᵀE[μĉ] + ξ²(ĉ̄ᵀBĉ̄ + tr BΣ_ĉĉ) from E[μĉ] (..., k), the mean
        ĉ̄ (..., k) and the covariance Σ_ĉĉ (..., k, k) of ĉ, exactly."""
        quad = np.einsum("...j,jl,...l->...", ch, self.B, ch)
        return (self.L0 - 2.0 * self.xi * cross @ self.b_e
                + self.xi**2 * (quad + np.einsum("jl,...lj->...", self.B, cov_c)))

    def drift(self, mu, ch, eta: float, eta_c: float, prox: float = 0.0):
        """The O(η) mean step (D_μ (R,), D_ĉ (R, k)) of (L1) without the renormalisation."""
        be = ch @ self.b_e
        d_mu = 2.0 * eta * self.xi * be * (1.0 - mu * mu)
        d_c = -eta_c * (2.0 * self.xi**2 * (ch @ self.B + prox * ch)
                        - 2.0 * self.xi * mu[:, None] * self.b_e)
        return d_mu, d_c

    def jacobian(self, mu, ch, eta: float, eta_c: float, prox: float = 0.0) -> np.ndarray:
        """∂(D_μ, D_ĉ)/∂(μ, ĉ) of :meth:`drift`, (R, k+1, k+1)."""
        k, xi = self.k, self.xi
        jac = np.zeros((mu.size, k + 1, k + 1))
        jac[:, 0, 0] = -4.0 * eta * xi * (ch @ self.b_e) * mu
        jac[:, 0, 1:] = 2.0 * eta * xi * (1.0 - mu * mu)[:, None] * self.b_e
        jac[:, 1:, 0] = 2.0 * eta_c * xi * self.b_e
        jac[:, 1:, 1:] = -2.0 * eta_c * xi**2 * (self.B + prox * np.eye(k))
        return jac


class StepNoise:
    """The O(η²) moments of one step on fixed QMC points: :meth:`renorm` E‖Ḡ_T‖² and
    :meth:`covariance` Q (module docstring). ``d`` the runs' dimension; label noise of
    variance ``label_noise``; ``batch`` examples per step."""

    def __init__(self, instance, d: int, *, label_noise: float = 0.0, batch: int = 1,
                 samples: int = SAMPLES, seed: int = 0):
        k = int(instance.k)
        if d < k + 2:
            raise ValueError(f"d must be ≥ k + 2 = {k + 2}, got {d}")
        z, a, w, eps = _gaussians(k, samples, seed)
        act, lam = instance.activation, np.asarray(instance.lam, dtype=float)
        zw = z @ np.asarray(instance.w_factor).T  # zⱼ = ⟨wⱼ, x⟩
        ux = z @ np.asarray(instance.u_w) + instance.u_perp * a  # ⟨u, x⟩
        pre = (zw + instance.xi * np.asarray(instance.c) * ux[:, None]) / np.asarray(
            instance.teacher_norms())
        self.y0 = act.fn(pre) @ lam - act.fn(zw) @ lam + math.sqrt(label_noise) * eps
        self.beta = act.deriv(zw) * lam  # βⱼ = λⱼσ′(zⱼ)
        self.a, self.w = a, w
        self.rest = d - k - 2  # E ρ²
        self.xi, self.batch, self.d = float(instance.xi), int(batch), int(d)

    def _fields(self, mu, ch):
        """(b, s, t, r, g, ν) per point and run, (N, R)."""
        mu = np.clip(np.asarray(mu, dtype=float), -1.0, 1.0)
        nu = np.sqrt(1.0 - mu * mu)
        b = self.xi * (self.beta @ np.asarray(ch, dtype=float).T)
        a, w = self.a[:, None], self.w[:, None]
        s, t = mu * a + nu * w, nu * a - mu * w
        r = self.y0[:, None] - b * s
        return b, s, t, r, -2.0 * r * b, nu

    def renorm(self, mu, ch) -> np.ndarray:
        """E‖Ḡ_T‖² (R,) at (μ (R,), ĉ (R, k)): (E‖G_T‖² − (E gt)²)/B + (E gt)², E‖G_T‖² =
        E[g²t²] + (d − k − 2)E[g²]."""
        return self.moments(mu, ch)[0]

    def moments(self, mu, ch) -> tuple[np.ndarray, np.ndarray]:
        """(E‖Ḡ_T‖², E[(ḡt)²]) (R,) each: :meth:`renorm` and the second moment of the
        O(η) increment of μ over η²ν², (E[g²t²] − (E gt)²)/B + (E gt)²."""
        _, _, t, _, g, _ = self._fields(mu, ch)
        gt = g * t
        g2t2 = (gt * gt).mean(0)
        full = g2t2 + self.rest * (g * g).mean(0)
        mean2 = gt.mean(0) ** 2
        return (full - mean2) / self.batch + mean2, (g2t2 - mean2) / self.batch + mean2

    def covariance(self, mu, ch, eta: float, eta_c: float) -> np.ndarray:
        """Q (R, k+1, k+1): the covariance of one step's O(η) increments of (μ, ĉ),
        −ηνgt and 2η_cξ r s β, over the batch."""
        _, s, t, r, g, nu = self._fields(mu, ch)
        runs, n = g.shape[1], self.beta.shape[0]
        inc = np.empty((runs, self.beta.shape[1] + 1, n))  # (R, k+1, N)
        inc[:, 0] = (-eta * nu * g * t).T
        inc[:, 1:] = (2.0 * eta_c * self.xi) * (r * s).T[:, None, :] * self.beta.T[None]
        inc -= inc.mean(-1, keepdims=True)
        return inc @ inc.transpose(0, 2, 1) / (n * self.batch)


@dataclass(frozen=True)
class LinearCorrected:
    """(L2) at ``steps`` (C,), per run (R, …): mean ``mu`` (R, C), ``c_hat`` (R, C, k),
    covariance ``cov`` (R, C, k+1, k+1) of (μ, ĉ); lines ``overlap`` (E|m| signed by μ̄),
    ``loss_linear`` and ``loss_true`` (E over the Gaussian law)."""

    steps: np.ndarray
    mu: np.ndarray
    c_hat: np.ndarray
    cov: np.ndarray
    overlap: np.ndarray
    loss_linear: np.ndarray
    loss_true: np.ndarray


def _steps_of(regime: FinetuneRegime):
    """(η, η_c, prox) of the flow: η_c = prox = 0 with ĉ frozen."""
    eta_c = (regime.eta if regime.eta_c is None else regime.eta_c) if regime.joint_c else 0.0
    return regime.eta, eta_c, regime.prox if regime.joint_c else 0.0


def _rk4_size(model: ProjectedRank1, regime: FinetuneRegime) -> float:
    """RK4 step in SGD steps: RATE_STEP over the largest decay rate of ĉ's drift,
    2η_cξ²(λ_max(B) + prox), and over the μ row's largest coupling, ETA_STEP/η at most."""
    eta, eta_c, prox = _steps_of(regime)
    top = float(np.linalg.eigvalsh(model.B)[-1])
    rate = max(2.0 * eta_c * model.xi**2 * (top + prox),
               2.0 * eta * model.xi * float(np.abs(model.b_e).sum()), 1e-300)
    return min(RATE_STEP / rate, ETA_STEP / max(eta, eta_c))


def rk4_steps(instance, regime: FinetuneRegime, steps, quad=None) -> int:
    """RK4 steps :func:`linear_rank1_corrected` takes to max(steps) (its cost; the ramp from
    step 0 and the landings on ``steps`` add at most a few per cent)."""
    h = _rk4_size(ProjectedRank1.of(instance, quad), regime)
    return math.ceil(float(np.max(steps, initial=0.0)) / h)


def _hermite(n: int = 16):
    """Probabilists' Gauss–Hermite nodes and weights summing to 1 (E over N(0, 1))."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    return x, w / w.sum()


def linear_rank1_corrected(instance, mu0, c0, regime: FinetuneRegime | float, steps, *,
                           samples: int = SAMPLES, seed: int = 0, quad=None,
                           **keywords) -> LinearCorrected:
    """Integrate (L2) from the starts μ₀ (R,), ĉ₀ (R, k) (Σ(0) = 0) to ``steps``.

    The Gaussian law is taken in φ = artanh μ (eq. L3 of the docs), in which the O(η) drift
    of μ is linear (dφ/dt = 2ηξĉᵀb_e): a run whose mean crosses μ = 0 with a wide spread
    then ends at ±μ, and |μ| stays below 1. ``regime``: the learner's
    :class:`~hermite.flows.regime.FinetuneRegime` (η, η_c, joint_c, prox, and ``d``,
    ``batch``, ``label_noise`` of the runs; ``project`` must be True), or η with those as
    keywords."""
    regime = from_keywords("linear_rank1_corrected", regime, keywords,
                           accepted=LEARNER + ("d", "batch", "label_noise"))
    if not regime.project:
        raise ValueError("linear_rank1_corrected: projected û only (the regime of Fig. 3)")
    if regime.d is None:
        raise ValueError("linear_rank1_corrected needs the runs' dimension d (regime.d)")
    model = ProjectedRank1.of(instance, quad)
    noise = StepNoise(instance, regime.d, label_noise=regime.label_noise, batch=regime.batch,
                      samples=samples, seed=seed)
    eta, eta_c, prox = _steps_of(regime)
    mu = np.clip(np.atleast_1d(np.asarray(mu0, dtype=float)), -1.0 + 1e-12, 1.0 - 1e-12)
    runs, k = mu.size, model.k
    ch = np.broadcast_to(np.asarray(c0, dtype=float), (runs, k)).copy()
    t_out = np.atleast_1d(np.asarray(steps, dtype=float))
    h = _rk4_size(model, regime)
    y = np.concatenate([np.arctanh(mu)[:, None], ch], axis=1)  # (φ, ĉ)
    cov = np.zeros((runs, k + 1, k + 1))
    out_y, out_cov = np.empty((runs, t_out.size, k + 1)), np.empty((runs, t_out.size, k + 1,
                                                                      k + 1))
    nodes, weights = _hermite()
    held = {}

    def rhs(yv, cv):
        phi, c = yv[:, 0], yv[:, 1:]
        m, nu2 = np.tanh(phi), 1.0 / np.cosh(phi) ** 2
        pts = phi[:, None] + np.sqrt(np.maximum(cv[:, 0, 0], 0.0))[:, None] * nodes
        e_tanh, e_sech2 = np.tanh(pts) @ weights, (1.0 / np.cosh(pts) ** 2) @ weights
        d_phi = (2.0 * eta * model.xi * (c @ model.b_e)
                 - 0.5 * eta * eta * m / nu2 * (held["S"] - 2.0 * held["M2"]))  # L3
        d_c = model.drift(e_tanh, c, 0.0, eta_c, prox)[1]  # E tanh φ: exact for Gaussian φ
        jac = model.jacobian(m, c, eta, eta_c, prox)
        jac[:, 0, 0] = -0.5 * eta * eta * (1.0 + m * m) / nu2 * (held["S"] - 2.0 * held["M2"])
        jac[:, 0, 1:] = 2.0 * eta * model.xi * model.b_e
        jac[:, 1:, 0] *= e_sech2[:, None]
        dcov = jac @ cv
        return (np.concatenate([d_phi[:, None], d_c], axis=1),
                dcov + dcov.transpose(0, 2, 1) + held["Q"])

    now, count = 0.0, 0
    for i, target in enumerate(t_out):
        while now < target - 1e-9:
            dt = min(h, target - now, max(1.0, RAMP * now))  # ĉ's fast start resolved
            m, c = np.tanh(y[:, 0]), y[:, 1:]
            nu2 = np.maximum(1.0 - m * m, 1e-300)
            if count % Q_EVERY == 0:
                q = noise.covariance(m, c, eta, eta_c)
                q[:, 0, :] /= nu2[:, None]  # Δφ = Δμ/ν² to first order
                q[:, :, 0] /= nu2[:, None]
                held["Q"] = q
            count += 1
            held["S"], held["M2"] = noise.moments(m, c)
            held["M2"] = held["M2"] * nu2  # E[(Δμ)²]/η² = ν²E[(ḡt)²]
            k1 = rhs(y, cov)
            k2 = rhs(y + 0.5 * dt * k1[0], cov + 0.5 * dt * k1[1])
            k3 = rhs(y + 0.5 * dt * k2[0], cov + 0.5 * dt * k2[1])
            k4 = rhs(y + dt * k3[0], cov + dt * k3[1])
            y = y + dt / 6.0 * (k1[0] + 2.0 * k2[0] + 2.0 * k3[0] + k4[0])
            cov = cov + dt / 6.0 * (k1[1] + 2.0 * k2[1] + 2.0 * k3[1] + k4[1])
            cov = 0.5 * (cov + cov.transpose(0, 2, 1))
            if not (np.isfinite(y).all() and np.isfinite(cov).all()):
                raise FloatingPointError("linear_rank1_corrected: the flow left the finite "
                                         f"numbers at step {now + dt:.0f}")
            now += dt
        out_y[:, i], out_cov[:, i] = y, cov
    return _lines(instance, model, t_out, out_y, out_cov)


def _lines(instance, model: ProjectedRank1, t_out, y, cov) -> LinearCorrected:
    """The lines of a Gaussian law of (φ, ĉ), mean y (R, C, k+1), covariance cov: E|m| and
    E tanh φ by Gauss–Hermite, E L_lin exactly (Stein: E[tanh(φ)ĉ] = ĉ̄ E tanh φ +
    Σ_ĉφ E sech²φ), E L_true by sigma points; ``mu``, ``c_hat`` the means E tanh φ, ĉ̄."""
    nodes, weights = _hermite()
    sd = np.sqrt(np.maximum(cov[..., 0, 0], 0.0))
    pts = y[..., 0, None] + sd[..., None] * nodes
    e_tanh = np.tanh(pts) @ weights
    e_abs = np.abs(np.tanh(pts)) @ weights
    e_sech2 = (1.0 / np.cosh(pts) ** 2) @ weights
    ch = y[..., 1:]
    cross = e_tanh[..., None] * ch + cov[..., 1:, 0] * e_sech2[..., None]  # E[μĉ]
    loss_lin = model.mean_loss_linear(cross, ch, cov[..., 1:, 1:])
    sign = np.where(e_tanh < 0.0, -1.0, 1.0)
    return LinearCorrected(t_out, e_tanh, ch, cov, sign * model.u_perp * e_abs, loss_lin,
                           _sigma_point_loss(instance, model, y, cov))


def _sigma_point_loss(instance, model: ProjectedRank1, y, cov) -> np.ndarray:
    """E L_true under N(y, cov) of (φ, ĉ) by the 2n symmetric sigma points y ± √n·(columns
    of a square root of cov), n = k + 1 (exact for a quadratic in (φ, ĉ)); y (R, C, n), cov
    (R, C, n, n)."""
    n = y.shape[-1]
    vals, vecs = np.linalg.eigh(cov)
    root = vecs * np.sqrt(np.maximum(vals, 0.0))[..., None, :] * math.sqrt(n)  # columns
    pts = np.concatenate([y[..., None, :] + np.swapaxes(root, -1, -2),
                          y[..., None, :] - np.swapaxes(root, -1, -2)], axis=-2)
    loss = true_network_loss(instance, model.delta(np.tanh(pts[..., 0]), pts[..., 1:]))
    return loss.mean(-1)

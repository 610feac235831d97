r"""Theory band of fine-tuning with ĉ trained jointly: the linear-noise approximation (LNA)
around the finite-d corrected ODE (projected û, unit rows, b = 1, no proximal term).

State and step. Projected, the exact chain's state is y = (μ, ĉ) ∈ R^{1+k} (p = 0,
ν = √(1 − μ²); docs/theory/exact-reductions.md (R0)–(R6)). One step from y, for an example
with fields z = Wx (k), a = ⟨e, x⟩, b = ⟨ê, x⟩, label noise ε and the rest's squared norm
ρ² ~ χ²_{d−k−2} (independent of the rest):

    s = μa + νb,   N̂ⱼ = √(1 + ξ²ĉⱼ²),   âⱼ = (zⱼ + ξĉⱼs)/N̂ⱼ,
    δⱼ = −2(y − Σλⱼσ(âⱼ))λⱼσ′(âⱼ),   g = Σⱼ δⱼξĉⱼ/N̂ⱼ,   τ = g s,
    μ⁺ = (μ − η(ga − τμ))/n,   n² = (μ − η(ga − τμ))² + (ν − η(gb − τν))² + η²g²ρ²,
    ĉⱼ⁺ = ĉⱼ − η_c δⱼ (ξ/N̂ⱼ)(s − âⱼ ξĉⱼ/N̂ⱼ)                    (both from the pre-step state).

``StepMoments`` averages these exact increments Δy = y⁺ − y over randomised QMC points of
(z, a, b, ε, ρ²) (the points of :class:`hermite.finetune.population.SecondMoment` plus one
coordinate for ρ²): their mean is the chain's one-step drift, their covariance V(y) the
step noise. The mean agrees with the corrected drift (O(η) drift plus −(η²/2)μE‖G_T‖²) up to
O(η²); the covariance contains, besides η²Cov(g(a − sμ), ∂ℓ/∂ĉ), the normalisation's
fluctuation η⁴Var(g²ρ²)μ²/4 and its cross terms, which are of the same order when η·d = O(1).

LNA (as :mod:`hermite.finite_d.lna` does for μ alone). Along the corrected ODE's path ȳ(t) (its RK4,
:class:`hermite.finetune.population.CorrectedFlow`: η·Δt ≤ ``FLOW_STEP``, Δt·ρ ≤
``FLOW_RATE``) the covariance obeys
dΣ/dt = JΣ + ΣJᵀ + V(ȳ) per SGD step, J the Jacobian of the corrected drift (central
differences of width ``JACOBIAN_STEP``; the QMC average is piecewise smooth in the state for a
kinked σ, so the width is kept well above the points' spacing). Over an RK4 step of h SGD
steps: Σ ← AΣAᵀ + h·A½ V(ȳ½) A½ᵀ with A = exp(hJ), A½ = exp(hJ/2) and ȳ½ the step's
predicted midpoint.

Band (``method="mixture"`` of :mod:`hermite.finite_d.lna`). Each start node yⱼ (the runs' own
starts, or equal-probability quantile nodes of them) is carried with its own Σⱼ(0) = 0; the
predicted
law of a readout r(y) is the equal-weight mixture of N(r(ȳⱼ), ∇rᵀΣⱼ∇r): m = u⊥μ and the
cosine ⟨ĉ, c⟩/(‖ĉ‖‖c‖) (delta method). Its known limits are those of :mod:`hermite.finite_d.lna`: a
path keeps the sign of its m₀, so an escape from m ≈ 0 that SGD noise re-mixes is not
described; it is built for the aligned or informative starts that fine-tuning uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.stats

from hermite._activation import resolve_activation
from hermite.finetune.population import CorrectedFlow, FinetuneModel, SecondMoment, _rhs
from hermite.finite_d.lna import _mixture_quantile
from hermite.flows.regime import FinetuneRegime, FinetuneStart

__all__ = ["StepMoments", "JointBand", "joint_band", "joint_band_applies", "STEP_POINTS",
           "JACOBIAN_STEP", "BAND_NODES"]

STEP_POINTS = 2**12  # scrambled Sobol′ points of the step's mean and covariance
JACOBIAN_STEP = 1e-3  # central-difference width of J (state coordinates are O(1))
JACOBIAN_EVERY = 4  # RK4 steps between refreshes of J (η·Δt ≤ 0.16: J varies on η·Δt ~ 1)
BAND_NODES = 16  # start nodes of the mixture when there are more runs


def joint_band_applies(model: FinetuneModel, batch: int = 1) -> str | None:
    """None where :func:`joint_band` is derived, else why not (one line)."""
    if not model.joint_c:
        return "the joint band is for ĉ trained jointly (frozen ĉ: hermite.theory_band)"
    if not model.project:
        return "the joint band is derived for projected û only"
    if not model.unit:
        return "the joint band is derived for unit rows only (the exact chain's convention)"
    if batch != 1:
        return "the joint band is derived for b = 1 only"
    if model.prox != 0.0:
        return "the joint band is derived without the proximal term"
    return None


class StepMoments:
    """Mean (R, 1 + k) and covariance (R, 1 + k, 1 + k) of the exact chain's one-step
    increment of y = (μ, ĉ) at states (module docstring), by randomised QMC."""

    def __init__(self, model: FinetuneModel, d: int, label_noise: float = 0.0,
                 points: int = STEP_POINTS, seed: int = 1):
        why = joint_band_applies(model)
        if why:
            raise ValueError(why)
        self.model, self.d = model, int(d)
        self.qmc = SecondMoment(model, d, 1, label_noise, points, seed, extra_dims=1)
        self.rho2 = scipy.stats.chi2.ppf(self.qmc.extra[:, 0], self.d - model.k - 2)
        act = resolve_activation(model.instance.activation)
        self.fn, self.deriv = act.fn, act.deriv
        self.code = self.qmc.code  # compiled moments where σ has a numba code

    def increments(self, mu, ch) -> np.ndarray:
        """(R, N, 1 + k) exact increments Δy at states μ (R,), ĉ (R, k), one row per QMC
        point."""
        m, q = self.model, self.qmc
        mu = np.atleast_1d(np.asarray(mu, dtype=float))[:, None]
        ch = np.atleast_2d(np.asarray(ch, dtype=float))
        nu = np.sqrt(np.maximum(0.0, 1.0 - mu * mu))
        s = mu * q.a + nu * q.b  # (R, N)
        xc = m.xi * ch[:, None, :]
        scale = 1.0 / np.sqrt(1.0 + xc * xc)
        pre = (q.lz + xc * s[..., None]) * scale
        resid = q.y - self.fn(pre) @ m.lam
        delta = (-2.0 * resid)[..., None] * m.lam * self.deriv(pre)
        g = np.sum(delta * (xc * scale), axis=-1)
        tau = g * s
        ne = mu - m.eta * (g * q.a - tau * mu)
        nt = nu - m.eta * (g * q.b - tau * nu)
        norm = np.sqrt(ne * ne + nt * nt + (m.eta * g) ** 2 * self.rho2)
        gc = delta * (m.xi * scale) * (s[..., None] - pre * (xc * scale))
        return np.concatenate([(ne / norm - mu)[..., None], -m.eta_c * gc], axis=-1)

    def __call__(self, mu, ch):
        if self.code is not None:
            from hermite.finetune._second_moment_numba import step_moments_block

            m, q = self.model, self.qmc
            return step_moments_block(
                np.atleast_1d(np.asarray(mu, dtype=float)),
                np.ascontiguousarray(np.atleast_2d(ch), dtype=float), q.a, q.b, q.lz, q.y,
                self.rho2, m.lam, m.xi, m.eta, m.eta_c, *self.code)
        inc = self.increments(mu, ch)
        mean = inc.mean(axis=1)
        dev = inc - mean[:, None, :]
        return mean, np.einsum("rni,rnj->rij", dev, dev) / (inc.shape[1] - 1)


def _expm(x):
    """exp of a stack of small matrices (..., D, D): scaling and squaring of a degree-10
    Taylor polynomial (the RK4 step keeps ‖hJ‖ moderate; error < 1e-14 relative)."""
    norm = float(np.max(np.abs(x).sum(axis=-1))) if x.size else 0.0
    sq = max(0, math.ceil(math.log2(norm / 0.5))) if norm > 0.5 else 0
    x = x / 2.0**sq
    eye = np.broadcast_to(np.eye(x.shape[-1]), x.shape)
    out, term = eye.copy(), eye.copy()
    for n in range(1, 11):
        term = term @ x / n
        out = out + term
    for _ in range(sq):
        out = out @ out
    return out


@dataclass(frozen=True)
class JointBand:
    """Quantile band of ⟨û, u⟩ (``lower``/``upper``, (C,)) and of the cosine ⟨ĉ, c⟩/‖ĉ‖‖c‖
    (``c_lower``/``c_upper``) at ``steps``; ``means`` (J, C, 1 + k) and ``covs``
    (J, C, 1 + k, 1 + k): each node's corrected path and LNA covariance."""

    steps: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    c_lower: np.ndarray
    c_upper: np.ndarray
    means: np.ndarray
    covs: np.ndarray
    quantiles: tuple


def _jacobian(fun, y, width=JACOBIAN_STEP):
    """(J, D, D) central-difference Jacobians of ``fun`` (packed states of J nodes)."""
    nodes, dim = y.shape
    jac = np.empty((nodes, dim, dim))
    for i in range(dim):
        e = np.zeros(dim)
        e[i] = width
        jac[:, :, i] = (fun(0.0, (y + e).ravel()).reshape(nodes, dim)
                        - fun(0.0, (y - e).ravel()).reshape(nodes, dim)) / (2.0 * width)
    return jac


def start_nodes(mu0, c0, nodes: int = BAND_NODES):
    """(μ₀, ĉ₀) of at most ``nodes`` runs at equal-probability quantiles of μ₀."""
    mu0, c0 = np.asarray(mu0, dtype=float), np.atleast_2d(np.asarray(c0, dtype=float))
    if c0.shape[0] == 1:
        c0 = np.repeat(c0, mu0.size, axis=0)
    if mu0.size <= nodes:
        return mu0, c0
    order = np.argsort(mu0, kind="stable")
    pick = order[((np.arange(nodes) + 0.5) * mu0.size / nodes).astype(int)]
    return mu0[pick], c0[pick]


def joint_band(instance, regime: FinetuneRegime, steps, start: FinetuneStart, *,
               quantiles=(0.1, 0.9), nodes: int = BAND_NODES,
               model: FinetuneModel | None = None) -> JointBand:
    """The LNA band of ⟨û, u⟩ and of ĉ's cosine to c (module docstring) under ``regime``
    (joint ĉ, projected, with its d and label noise) from the starts (``start.mu0`` (R,),
    ``start.c_hat0`` (k,) or (R, k), default the instance's ĉ); a mixture over at most
    ``nodes`` of them."""
    from hermite.flows.ode import check_steps

    if model is None:
        model = FinetuneModel.of(instance, regime)
    why = joint_band_applies(model, regime.batch)
    if why:
        raise ValueError(why)
    if regime.d is None:
        raise ValueError("the joint band needs the regime's dimension d")
    ck = check_steps(steps, integer=False)
    c_hat0 = instance.c_hat if start.c_hat0 is None else start.c_hat0
    mu, ch = start_nodes(start.mu0, c_hat0, nodes)
    second = SecondMoment(model, regime.d, 1, regime.label_noise)
    moments = StepMoments(model, regime.d, regime.label_noise)
    flow = CorrectedFlow(model, ch, second)
    full = _rhs(model, ch, second)  # the coefficient recomputed at every state (for J)
    y = model.pack(np.zeros((mu.size, model.k)), mu, ch)
    nodes_n, dim = y.shape
    cov = np.zeros((nodes_n, dim, dim))
    means, covs = np.empty((nodes_n, ck.size, dim)), np.empty((nodes_n, ck.size, dim, dim))
    t, n_step, jac = 0.0, 0, None
    for j, target in enumerate(ck):
        while t < target:
            new, dt, mid = flow.step(t, y.ravel(), target - t)
            mid = mid.reshape(nodes_n, dim)
            if n_step % JACOBIAN_EVERY == 0:
                jac = _jacobian(full, mid)
            n_step += 1
            _, pm, cm = model.unpack(mid, ch)
            _, v = moments(pm, cm)
            ah = _expm(0.5 * dt * jac)
            a = ah @ ah
            cov = a @ cov @ a.transpose(0, 2, 1) + dt * (ah @ v @ ah.transpose(0, 2, 1))
            y = new.reshape(nodes_n, dim)
            t = float(target) if dt >= target - t else t + dt
        means[:, j], covs[:, j] = y, cov
    lower, upper, c_lower, c_upper = _readout_bands(model, means, covs, quantiles)
    return JointBand(ck, lower, upper, c_lower, c_upper, means, covs, tuple(quantiles))


def _readout_bands(model, means, covs, quantiles):
    """Mixture quantiles of m = u⊥μ and of the cosine ⟨ĉ, c⟩/‖ĉ‖‖c‖ (delta method)."""
    m_mean = model.u_perp * means[..., 0]
    m_sd = model.u_perp * np.sqrt(np.maximum(covs[..., 0, 0], 0.0))
    c = model.c / np.linalg.norm(model.c)
    ch = means[..., 1:]
    norm = np.linalg.norm(ch, axis=-1)
    cos = (ch @ c) / norm
    grad = c / norm[..., None] - cos[..., None] * ch / norm[..., None] ** 2
    c_var = np.einsum("...i,...ij,...j->...", grad, covs[..., 1:, 1:], grad)
    c_sd = np.sqrt(np.maximum(c_var, 0.0))
    return (_mixture_quantile(m_mean, m_sd, quantiles[0]),
            _mixture_quantile(m_mean, m_sd, quantiles[1]),
            _mixture_quantile(cos, c_sd, quantiles[0]),
            _mixture_quantile(cos, c_sd, quantiles[1]))

r"""Fluctuation-corrected flows of fine-tuning at finite ξ/√d (docs/theory/finite-xi.md):
(S), the diffusion approximation, is the line drawn beside runs with ĉ joint and ξ²/d ≥ 0.25
(``dynamics.overlays.finetune.finite_xi_lines``); (F), the moment closure, is kept for the
measurement that rules it out.

State y = (p, μ, ĉ) ∈ R^D of the exact chain (D = k + 1 + k unprojected and joint; p or ĉ
dropped where projected or frozen, as :meth:`FinetuneModel.pack` does). One SGD step is
y⁺ = y + D(y) + ζ with D the corrected drift (O(η) drift plus the O(η²d) renormalisation
drift −(η²/2)X E‖Ḡ_T‖², :func:`hermite.finetune.population._rhs`) and ζ the step noise,
E ζ = 0, Cov ζ = V(y) (:class:`StepNoise`, O(η²)).

(F) :func:`finite_xi_flow`, Gaussian second-order moment closure for a run's mean ȳ and
covariance Σ, per SGD step from ȳ(0) = the run's start, Σ(0) = 0:

    (F1)  dȳ/dt = D(ȳ) + ½ Σ_ab ∂²D/∂y_a∂y_b Σ_ab,
    (F2)  dΣ/dt = JΣ + ΣJᵀ + V(ȳ),            J = ∂D/∂y at ȳ.

(F1)'s correction by sigma points: with Σ = Σ_a λ_a v_a v_aᵀ and h_a = √λ_a, ½ Σ_a [D(ȳ + h_a
v_a) + D(ȳ − h_a v_a) − 2D(ȳ)] equals ½ D″:Σ for a quadratic D; the same points give J v_a =
[D(ȳ + h_a v_a) − D(ȳ − h_a v_a)]/(2h_a) (h_a ≥ ``MIN_WIDTH``: there the central difference).
Exponential Rosenbrock–Euler for ȳ, ȳ ← ȳ + h φ₁(hJ) F(ȳ) (F the right side of (F1)), and
Σ ← AΣAᵀ + h A½ V A½ᵀ (A = exp(hJ), A½ = exp(hJ/2)), in steps η·h ≤ ``FLOW_STEP``.
Measured (finite-xi.md): with the closure off and no renormalisation it is the plain ODE
(tests/test_finite_xi.py); with the closure on it moves the mean the wrong way in the He₃
cells of Figs 1b/6.

(S) :func:`finite_xi_ensemble`, the diffusion approximation dy = D dt + V^{1/2} dB by
Euler–Maruyama, a few paths per run: **the line to draw** (finite-xi.md: with V on 2¹⁴ points it
follows the exact chain where the plain ODE is 0.1 off) and, with ``noise_blocks``, the causal
diagnostic of which block's noise matters. V is a QMC average of a heavy-tailed integrand
(He₃ at ξ ~ √d: 2¹⁰ points underestimate it 2–4×), hence ``NOISE_POINTS`` = 2¹⁴.

Readouts: m = ⟨p, u_w⟩ + u⊥μ; ``m`` its mean, ``abs_m`` E|m| (Gaussian under (F), the paths'
average under (S)), ``c_overlap`` the cosine of ĉ to c.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.linalg

from hermite.finetune.escape import folded_mean
from hermite.finetune.population import FinetuneModel, SecondMoment, _as_state, _nu, _start
from hermite.flows.regime import FinetuneRegime, FinetuneStart

__all__ = ["StepNoise", "FiniteXiFlow", "FiniteXi", "EnsembleScheme", "finite_xi_flow",
           "finite_xi_ensemble", "FLOW_STEP", "NOISE_POINTS", "MIN_WIDTH", "NOISE_EVERY"]

FLOW_STEP = 5e-4  # largest η·h of one step of the flow (2e-3 was off by 0.25 in ⟨û,u⟩, He₃)
NOISE_EVERY = 16  # steps between refreshes of V and E‖Ḡ_T‖² (η·t = 0.008 at FLOW_STEP)
NOISE_POINTS = 2**14  # scrambled Sobol′ points of V(y): its integrand is heavy-tailed (He₃ at
# ξ ~ √d: 2¹⁰ points underestimate Var of p and ĉ by 2–4×, with rare 10× overshoots)
MIN_WIDTH = 1e-4  # smallest sigma-point width (the central-difference width of J)
_BLOCK = 2_000_000  # elements (runs × points × k) per vectorised block of V


def _covariance(inc) -> np.ndarray:
    """(R, D, D) sample covariance over the points of increments (R, N, D)."""
    dev = inc - inc.mean(axis=1, keepdims=True)
    return np.swapaxes(dev, 1, 2) @ dev / (inc.shape[1] - 1)


class StepNoise:
    """Covariance V(y) (R, D, D) of the O(η) step increment of the packed state y at states
    (R, ·): η² Cov of the tangent sample gradient's (p, μ) coordinates and η_c² Cov of ∂ℓ/∂ĉ
    (model.md's closed-form sample gradient), divided by the batch b; randomised QMC over
    (z, a, b, ε) (the points of :class:`SecondMoment`). Unit rows only."""

    def __init__(self, model: FinetuneModel, d: int, batch: int = 1, label_noise: float = 0.0,
                 points: int = NOISE_POINTS, seed: int = 2):
        if not model.unit:
            raise ValueError("the finite-ξ flow is derived for unit rows only")
        self.model, self.batch = model, int(batch)
        self.qmc = SecondMoment(model, d, 1, label_noise, points, seed)

    def __call__(self, p, mu, ch) -> np.ndarray:
        m = self.model
        p, mu, ch = _as_state(p, mu, ch, m.k)
        out = np.empty((mu.size, m.dim, m.dim))
        step = max(1, _BLOCK // (self.qmc.a.size * m.k))
        for r0 in range(0, mu.size, step):
            sl = slice(r0, min(mu.size, r0 + step))
            out[sl] = (self._block(p[sl], mu[sl], ch[sl]) if self.qmc.code is None
                       else self._compiled(p[sl], mu[sl], ch[sl]))
        return out / self.batch

    def _block(self, p, mu, ch):
        """(R, D, D) covariance of the increments of a block of runs (numpy increments: the
        reference of the compiled ones, and σ without a numba code)."""
        return _covariance(self._increments(p, mu, ch))

    def _compiled(self, p, mu, ch):
        """:meth:`_block` with the increments of
        :func:`hermite.finetune._second_moment_numba.step_increments_block`."""
        from hermite.finetune._second_moment_numba import step_increments_block

        m, q = self.model, self.qmc
        return _covariance(step_increments_block(
            np.ascontiguousarray(p, dtype=float), np.ascontiguousarray(mu, dtype=float),
            np.ascontiguousarray(ch, dtype=float), q.z, q.a, q.b, q.lz, q.y, m.L, m.lam, m.xi,
            m.project, m.joint_c, m.eta, m.eta_c, *q.code))

    def _increments(self, p, mu, ch):
        """(R, N, D) O(η) increments −η G_T (p, μ) and −η_c ∂ℓ/∂ĉ at each QMC point."""
        m, q = self.model, self.qmc
        nu = _nu(p, mu)
        s = p @ q.z.T + mu[:, None] * q.a + nu[:, None] * q.b  # ⟨û, x⟩
        xc = m.xi * ch
        omega = p @ m.L.T
        scale = 1.0 / np.sqrt(1.0 + 2.0 * xc * omega + xc * xc)  # 1/N̂ⱼ
        pre = (q.lz[None] + xc[:, None, :] * s[:, :, None]) * scale[:, None, :]
        resid = q.y[None] - q.fn(pre) @ m.lam
        delta = (-2.0 * resid)[:, :, None] * m.lam * q.deriv(pre)
        g = np.einsum("rnk,rk->rn", delta, xc * scale)
        parts = []
        if not m.project:
            gamma = delta * pre * (xc * scale * scale)[:, None, :]
            gw = g[:, :, None] * q.z[None] - gamma @ m.L  # basis coordinates of G
            ge = g * q.a
            sdot = (np.einsum("rnk,rk->rn", gw, p) + mu[:, None] * ge
                    + nu[:, None] * g * q.b)
            parts += [-m.eta * (gw - sdot[:, :, None] * p[:, None, :]),
                      (-m.eta * (ge - sdot * mu[:, None]))[:, :, None]]
        else:
            ge = g * q.a
            sdot = mu[:, None] * ge + nu[:, None] * g * q.b
            parts.append((-m.eta * (ge - sdot * mu[:, None]))[:, :, None])
        if m.joint_c:
            norm_part = (m.xi * omega + m.xi * xc) * scale  # (ξωⱼ + ξ²ĉⱼ)/N̂ⱼ
            gc = delta * (m.xi * scale)[:, None, :] * (
                s[:, :, None] - pre * norm_part[:, None, :] / m.xi)
            parts.append(-m.eta_c * gc)
        return np.concatenate(parts, axis=2)


class FiniteXiFlow:
    """(F1)–(F2) of the module docstring for the runs of one instance, step by step."""

    def __init__(self, model: FinetuneModel, d: int, ch0, *, batch: int = 1,
                 label_noise: float = 0.0, closure: bool = True, renormalise: bool = True,
                 noise_points: int = NOISE_POINTS, flow_step: float = FLOW_STEP):
        self.model, self.ch0 = model, np.asarray(ch0, dtype=float)
        self.noise = StepNoise(model, d, batch, label_noise, noise_points)
        self.second = SecondMoment(model, d, batch, label_noise) if renormalise else None
        self.closure = closure
        self.h_max = flow_step / model.rate
        self.v, self.taken = None, 0

    def drift(self, y):
        """Corrected drift D at packed states y (..., D); the renormalisation coefficient
        E‖Ḡ_T‖² is taken at the means (``self.coef``, one per run, broadcast over points)."""
        model = self.model
        shape = y.shape
        runs = shape[0]
        flat = y.reshape(-1, model.dim)
        reps = flat.shape[0] // runs
        ch0 = np.repeat(self.ch0, reps, axis=0)
        p, mu, ch = model.unpack(flat, ch0)
        dp, dmu, dc = model.drift(p, mu, ch)
        if self.second is not None:
            f = np.repeat(-0.5 * model.eta**2 * self.coef, reps)
            dp, dmu = dp + f[:, None] * p, dmu + f * mu
        return model.pack(dp, dmu, dc).reshape(shape)

    def _moments(self, y, cov):
        """(F (R, D), J (R, D, D)): the right side of (F1) and the (statistical) Jacobian."""
        runs, dim = y.shape
        lam, vec = np.linalg.eigh(cov)
        width = np.sqrt(np.maximum(lam, 0.0))
        width = np.maximum(width, MIN_WIDTH) if self.closure else np.full_like(width, MIN_WIDTH)
        dirs = np.swapaxes(vec, 1, 2) * width[:, :, None]  # (R, D, D): row a = h_a v_a
        pts = np.concatenate([y[:, None, :], y[:, None, :] + dirs, y[:, None, :] - dirs], 1)
        val = self.drift(pts)
        d0, dp, dm = val[:, 0], val[:, 1:dim + 1], val[:, dim + 1:]
        jv = (dp - dm) / (2.0 * width[:, :, None])  # (R, a, D): J v_a
        jac = np.einsum("rai,rja->rij", jv, vec)  # J = Σ_a (J v_a) v_aᵀ
        f = d0
        if self.closure:
            curv = 0.5 * (dp + dm - 2.0 * d0[:, None, :])  # ½ D″[h_a v_a, h_a v_a]
            real = (lam > MIN_WIDTH**2)[:, :, None]  # directions Σ actually has
            f = d0 + np.sum(np.where(real, curv, 0.0), axis=1)
        return f, jac

    def step(self, y, cov, h):
        """One step of h SGD steps: (ȳ, Σ) after it."""
        model = self.model
        p, mu, ch = model.unpack(y, self.ch0)
        if self.second is not None:
            self.coef = self.second(p, mu, ch)
        f, jac = self._moments(y, cov)
        runs, dim = y.shape
        aug = np.zeros((runs, dim + 1, dim + 1))
        aug[:, :dim, :dim] = h * jac
        aug[:, :dim, dim] = h * f
        half = scipy.linalg.expm(0.5 * aug)
        full = half @ half
        y_new = y + full[:, :dim, dim]  # ȳ + h φ₁(hJ) F
        a_half, a = half[:, :dim, :dim], full[:, :dim, :dim]
        if self.taken % NOISE_EVERY == 0:  # V at the predicted midpoint
            self.v = self.noise(*model.unpack(y + half[:, :dim, dim], self.ch0))
        self.taken += 1
        v = self.v
        cov = a @ cov @ np.swapaxes(a, 1, 2) + h * (a_half @ v @ np.swapaxes(a_half, 1, 2))
        return y_new, 0.5 * (cov + np.swapaxes(cov, 1, 2))

    def solve(self, y0, steps):
        """(ȳ (R, C, D), Σ (R, C, D, D)) at the checkpoints ``steps``."""
        runs, dim = y0.shape
        means, covs = np.empty((runs, len(steps), dim)), np.empty((runs, len(steps), dim, dim))
        y, cov, t = y0.copy(), np.zeros((runs, dim, dim)), 0.0
        for j, target in enumerate(steps):
            while t < target:
                h = min(self.h_max, target - t)
                y, cov = self.step(y, cov, h)
                t = float(target) if h >= target - t else t + h
                if not np.all(np.isfinite(y)):
                    raise ArithmeticError(f"the finite-ξ flow left the finite numbers at η·t = "
                                          f"{self.model.eta * t:.3g}")
            means[:, j], covs[:, j] = y, cov
        return means, covs


@dataclass(frozen=True)
class FiniteXi:
    """The finite-ξ flow at ``steps`` (C,) for R runs: ``m`` (R, C) the mean of ⟨û, u⟩,
    ``abs_m`` (R, C) E|⟨û, u⟩|, ``m_sd`` (R, C) its standard deviation, ``c_overlap`` (R, C)
    ⟨ĉ̄, c⟩/(‖ĉ̄‖‖c‖) (the start's when ĉ is frozen), ``means`` (R, C, D)
    and ``covs`` (R, C, D, D) the packed state's mean and covariance."""

    steps: np.ndarray
    m: np.ndarray
    abs_m: np.ndarray
    m_sd: np.ndarray
    c_overlap: np.ndarray
    means: np.ndarray
    covs: np.ndarray


@dataclass(frozen=True)
class EnsembleScheme:
    """The Euler–Maruyama scheme of :func:`finite_xi_ensemble`: ``particles`` paths per run
    from the generator ``seed``, steps η·h ≤ ``flow_step``, the step noise V on
    ``noise_points`` QMC points refreshed every ``noise_every`` steps."""

    particles: int = 32
    seed: int = 0
    flow_step: float = FLOW_STEP
    noise_points: int = NOISE_POINTS
    noise_every: int = NOISE_EVERY

    def __post_init__(self):
        for name in ("particles", "noise_points", "noise_every"):
            val = getattr(self, name)
            if int(val) != val or val < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, got {val!r}")
        if not (math.isfinite(self.flow_step) and self.flow_step > 0.0):
            raise ValueError(f"flow_step must be a finite number > 0, got {self.flow_step!r}")


def _finite_d(regime: FinetuneRegime) -> int:
    """The regime's dimension d (one-line ValueError where it has none)."""
    if regime.d is None:
        raise ValueError("the finite-ξ flows need the regime's dimension d")
    return regime.d


def finite_xi_flow(instance, regime: FinetuneRegime, steps, start: FinetuneStart, *,
                   closure=True, renormalise=True, flow_step=FLOW_STEP,
                   model: FinetuneModel | None = None) -> FiniteXi:
    """The closure flow (F1)–(F2) of every run from its ``start`` (mu0 (R,), p0 (R, k)
    (zeros when projected), c_hat0 (R, k) or (k,)) under ``regime`` (its d, batch and label
    noise enter V and the O(η²d) drift); ``steps`` (C,) sorted checkpoint steps.
    ``closure=False`` drops (F1)'s curvature term (the corrected ODE, with its LNA
    covariance); ``renormalise=False`` drops the O(η²d) drift."""
    from hermite.flows.ode import check_steps

    ck = check_steps(steps, integer=False)
    d = _finite_d(regime)
    if model is None:
        model = FinetuneModel.of(instance, regime)
    p0, mu0, ch0 = _start(model, start)
    flow = FiniteXiFlow(model, d, ch0, batch=regime.batch, label_noise=regime.label_noise,
                        closure=closure, renormalise=renormalise, flow_step=flow_step)
    means, covs = flow.solve(model.pack(p0, mu0, ch0), ck)
    runs, cps, dim = means.shape
    grad = np.zeros(dim)
    if not model.project:
        grad[:model.k] = model.u_w
    grad[0 if model.project else model.k] = model.u_perp
    m = means @ grad
    sd = np.sqrt(np.maximum(np.einsum("i,rcij,j->rc", grad, covs, grad), 0.0))
    p, mu, ch = model.unpack(means.reshape(-1, dim), np.repeat(ch0, cps, axis=0))
    ch = ch.reshape(runs, cps, model.k)
    c_ov = ch @ model.c / (np.linalg.norm(ch, axis=-1) * np.linalg.norm(model.c))
    return FiniteXi(ck, m, folded_mean(m, sd), sd, c_ov, means, covs)


def finite_xi_ensemble(instance, regime: FinetuneRegime, steps, start: FinetuneStart, *,
                       scheme: EnsembleScheme = EnsembleScheme(), noise_blocks=None,
                       model: FinetuneModel | None = None) -> FiniteXi:
    """The diffusion approximation of the chain (docs/theory/finite-xi.md, (S)) under
    ``regime`` (with its d): dy = D(y) dt + V^{1/2} dB per SGD step, D the corrected drift
    and V the step noise (:class:`StepNoise` on ``scheme.noise_points`` QMC points, taken at
    each run's ensemble mean every ``scheme.noise_every`` steps), by Euler–Maruyama in steps
    η·h ≤ ``scheme.flow_step`` for ``scheme.particles`` paths per run from its ``start``
    (as :func:`finite_xi_flow`'s). ``abs_m`` is the paths' mean |⟨û, u⟩|, ``m`` their
    mean, ``m_sd`` their sd, ``c_overlap`` the mean cosine of ĉ to c; ``means``/``covs`` the
    paths' moments.
    ``noise_blocks`` (diagnosis): a subset of {"p", "mu", "c"} whose noise is kept. (V at
    each path's own state instead of the mean was measured worse: finite-xi.md.)"""
    from hermite.flows.ode import check_steps

    ck = check_steps(steps, integer=False)
    d = _finite_d(regime)
    if model is None:
        model = FinetuneModel.of(instance, regime)
    p0, mu0, ch0 = _start(model, start)
    runs, dim, k = mu0.size, model.dim, model.k
    particles = scheme.particles
    flow = FiniteXiFlow(model, d, np.repeat(ch0, particles, axis=0), batch=regime.batch,
                        label_noise=regime.label_noise, closure=False,
                        flow_step=scheme.flow_step, noise_points=scheme.noise_points)
    noise = flow.noise
    second = SecondMoment(model, d, regime.batch, regime.label_noise)
    mask = np.ones((dim, dim), dtype=bool)
    if noise_blocks is not None:
        idx = {"p": range(0, 0 if model.project else k)}
        i = 0 if model.project else k
        idx["mu"], idx["c"] = range(i, i + 1), range(i + 1, dim)
        keep = np.zeros(dim, dtype=bool)
        for b in noise_blocks:
            keep[list(idx[b])] = True
        mask = keep[:, None] & keep[None, :]
    rng = np.random.default_rng(scheme.seed)
    y = np.repeat(model.pack(p0, mu0, ch0)[:, None, :], particles, axis=1)
    grad = np.zeros(dim)
    if not model.project:
        grad[:k] = model.u_w
    grad[0 if model.project else k] = model.u_perp
    cps = ck.size
    out = {key: np.empty((runs, cps)) for key in ("m", "abs_m", "m_sd", "c_ov")}
    means, covs = np.empty((runs, cps, dim)), np.empty((runs, cps, dim, dim))
    chol, t, taken = None, 0.0, 0
    cn = model.c / np.linalg.norm(model.c)
    for j, target in enumerate(ck):
        while t < target:
            h = min(flow.h_max, target - t)
            ybar = y.mean(axis=1)
            pm, mm, cm = model.unpack(ybar, ch0)
            if taken % scheme.noise_every == 0:  # V and E‖Ḡ_T‖² at the runs' path means
                v = np.where(mask, noise(pm, mm, cm), 0.0)
                lam, vec = np.linalg.eigh(v)
                chol = vec * np.sqrt(np.maximum(lam, 0.0))[:, None, :]
                flow.coef = np.repeat(second(pm, mm, cm), particles)
            taken += 1
            drift = flow.drift(y.reshape(runs * particles, dim)).reshape(y.shape)
            kick = rng.standard_normal(y.shape)
            y = y + h * drift + math.sqrt(h) * np.einsum("rij,rnj->rni", chol, kick)
            t = float(target) if h >= target - t else t + h
            if not np.all(np.isfinite(y)):
                raise ArithmeticError(f"the finite-ξ ensemble left the finite numbers at "
                                      f"η·t = {model.eta * t:.3g}")
        m = y @ grad
        out["m"][:, j], out["abs_m"][:, j], out["m_sd"][:, j] = (
            m.mean(1), np.abs(m).mean(1), m.std(1))
        if model.joint_c:
            ch = y[..., -k:]
            out["c_ov"][:, j] = np.mean(ch @ cn / np.linalg.norm(ch, axis=-1), axis=1)
        else:
            out["c_ov"][:, j] = ch0 @ cn / np.linalg.norm(ch0, axis=-1)
        means[:, j] = y.mean(1)
        dev = y - means[:, j][:, None, :]
        covs[:, j] = np.swapaxes(dev, 1, 2) @ dev / max(1, particles - 1)
    return FiniteXi(ck, out["m"], out["abs_m"], out["m_sd"], out["c_ov"], means, covs)

r"""Finite-d noise moments of the projected online-SGD overlap chain (issue 8).

Setting and scope
-----------------
Projected fine-tuning (eq. 4 with Π), ĉ frozen (or any given ĉ — "joint ĉ at a given ĉ"),
optional additive label noise y = f*(x) + ε, ε ~ N(0, ``label_noise``). The unprojected
variant is *not* covered (its state also carries û's span(W) part). u may have a part in
span(W) (u_alpha > 0): the derivation is done in μ = m/u_perp units, where
u = (u_w, u_perp·e, 0, …) and a projected û can only reach m = ⟨u, û⟩ = u_perp·μ.

Derivation (canonical frame of ``dynamics.instances.instance``)
-----------------------------------------------------
Write x = (z, a, x_rest) with z ∈ R^k the coordinates of span(W), a = ⟨e, x⟩, and
μ = ⟨e, û⟩. The sample loss L = (y − f̂)² has gradient ∇_û L = g·x with the scalar

    g = −2 (y − f̂) ψ,    ψ = Σ_j λ_j σ′(ν̂_j) ξ ĉ_j / N̂_j,    ν̂_j = ((Lz)_j + ξ ĉ_j s)/N̂_j,

s = ⟨û, x⟩ (the derivative of N̂_j lies in span(W) ⊕ û and is killed by (I − ûûᵀ)Π). The
projected spherical gradient is g·Px with Px = (I − ûûᵀ)Πx. In the plane span(e, û) use the
orthonormal pair (û, f), f = (e − μû)/√(1 − μ²), and put s = ⟨û, x⟩, t = ⟨f, x⟩, so that

    a = μ s + √(1 − μ²) t,    ‖Px‖² = t² + ‖r‖²,    ⟨e, Px⟩ = √(1 − μ²) t,

with r the part of Πx orthogonal to span(e, û): ‖r‖² ~ χ²_n, n = d − k − 2. In the notation
of docs/theory/exact-reductions.md (a, b with s = μa + √(1−μ²)b) this is a² + b² − s² = t²:
the (k+2)-dimensional Gaussian (z, s, t) is standard, the student (f̂, ψ) depends on (z, s)
only and the teacher y = Σ_i λ_i σ(((Lz)_i + ξ c_i ⟨u, x⟩)/N_i), ⟨u, x⟩ = ⟨u_w, z⟩ + u_perp a,
on (z, a). One step of eq. 4 is therefore exactly

    μ′ = (μ − η g √(1 − μ²) t) / √(1 + η² g² (t² + ‖r‖²)).                       (★)

First moment (Stein in t, since g depends on t only through a):
E[g t] = √(1−μ²) E[∂_a g] = −√(1−μ²) h̃(μ), h̃(μ) = 2 u_perp Σ_ij λ_iλ_j Q_ij K′(P_ij + Q_ij m)
= u_perp·h(m) (Price), the h of Prop. 4 with (P, Q) = ``Instance.correlation_affine``. So the
first-order drift of μ is η h̃(μ)(1 − μ²), i.e. m′ − m = η h(m)(u_perp² − m²).

Second moments: E[S²‖Px‖²] = n·E[g²] + E[g² t²] (S = g), and the martingale increment
⟨u, ∇̂L⟩ = u_perp √(1−μ²) g t has Var(⟨u, ∇̂L⟩) = u_perp² (1 − μ²) (E[g² t²] − (1−μ²) h̃²).

Label noise adds −2ε ψ to g, independent of everything else with mean 0:
E[g²] += 4 σ_ε² E[ψ²], E[g² t²] += 4 σ_ε² E[ψ²] (t ⊥ ψ, E t² = 1), E[g t] unchanged, with
E[ψ²] = Σ_jj′ λ_jλ_j′ ξ² ĉ_jĉ_j′/(N̂_jN̂_j′) K′(⟨v̂_j, v̂_j′⟩) exact by Price (student Gram).

How they are computed, and the error
------------------------------------
g² moments are fourth-order Gaussian moments of non-polynomial functions with no closed form
in general, so they are randomised quasi-Monte Carlo averages over ``samples`` points
(z, s, t, ε): 8 independently scrambled Sobol′ sets mapped by Φ⁻¹, the same points for every
m (common random numbers: the estimates are smooth in m and their errors strongly correlated
across m). Each replicate is unbiased; the standard error returned with every estimate is the
spread of the 8 replicate means /√8. For ReLU at 2^18 points the relative SE of E[S²] is
≈ 0.1–0.2% (plain Monte Carlo: 0.7–0.9%), which matters: on the d = 200 test instance a 0.7%
error of the noise term moves the predicted late-time mean by several SE of a 16384-run average.
h̃ and E[ψ²] are exact (Price: K′ from ``hermite.expansion.kernels``, closed form or certified
quadrature). The sample loop is compiled (numba, σ from ``dynamics.activations_numba``) for the
registry activations and runs in numpy otherwise.

The exact one-step law (★): :func:`one_step_moments` gives E[μ′ − μ] and Var(μ′ − μ) with
‖r‖² integrated by an 8-node Gauss rule for the χ²_n law (exact for polynomials of degree 15 in
‖r‖²; the integrand is analytic there, the rule error is far below the sampling error), and
the first-order part E[−η g √(1−μ²) t] = η h̃ (1−μ²) taken exactly (control variate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numba
import numpy as np
import scipy.special
import scipy.stats

from hermite.activations_numba import compiled_activation, sigma
from hermite.expansion.gradient import h as _h_exact
from hermite.expansion.kernels import dual_kernel_derivative

__all__ = [
    "NoiseMoments",
    "OneStepMoments",
    "noise_moments",
    "one_step_moments",
    "h_tilde",
    "chi2_rule",
    "DEFAULT_SAMPLES",
]

DEFAULT_SAMPLES = 2**18
REPLICATES = 8


# ---------------------------------------------------------------- small helpers
def _c_hat(instance, c_hat):
    return np.asarray(instance.c_hat if c_hat is None else c_hat, dtype=float)


def _key(instance, c_hat) -> tuple:
    """Hashable identity of everything the chain's law depends on (besides d, η)."""
    act = instance.activation
    return (act.name, id(act), float(instance.xi), instance.w_factor.tobytes(),
            instance.u_w.tobytes(), instance.lam.tobytes(), instance.c.tobytes(),
            np.ascontiguousarray(c_hat).tobytes())


def _mu_of(instance, m):
    up = instance.u_perp
    if up <= 0:
        raise ValueError("u_perp = 0: u lies in span(W) and a projected û cannot learn it")
    mu = np.asarray(m, dtype=float) / up
    if np.any(np.abs(mu) > 1 + 1e-12):
        raise ValueError(f"overlap m must satisfy |m| ≤ u_perp = {up:.6g}")
    return np.clip(mu, -1.0, 1.0)


@lru_cache(maxsize=64)
def chi2_rule(n: int, nodes: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Gauss rule (values R_q, weights ω_q) with Σ ω_q f(R_q) ≈ E f(R), R ~ χ²_n.

    Golub–Welsch on the generalised Laguerre weight x^{n/2−1}e^{−x} (R = 2x); stable for any n.
    Exact for polynomials of degree < 2·nodes. n = 0 gives the point mass at 0.
    """
    if n <= 0:
        return np.zeros(1), np.ones(1)
    alpha = n / 2.0 - 1.0
    j = np.arange(nodes, dtype=float)
    off = np.sqrt(j[1:] * (j[1:] + alpha))
    jac = np.diag(2 * j + alpha + 1) + np.diag(off, 1) + np.diag(off, -1)
    x, v = np.linalg.eigh(jac)
    w = v[0] ** 2
    return 2.0 * x, w / w.sum()


@lru_cache(maxsize=8)
def _gaussians(k: int, samples: int, seed: int):
    """Common random numbers: z (N, k), s, t, ε (N,), N(0, 1) marginals, read-only.

    Randomised quasi-Monte Carlo: ``REPLICATES`` independently scrambled Sobol′ sets of
    N/REPLICATES points each in dimension k + 3, mapped by Φ⁻¹. Each replicate is an unbiased
    estimator; their spread gives the standard error (see :func:`_est`).
    """
    per = samples // REPLICATES
    m = int(round(math.log2(per))) if per >= 1 else -1
    if m < 4 or 2**m * REPLICATES != samples:
        raise ValueError(f"samples must be {REPLICATES}·2^m with m ≥ 4, got {samples}")
    u = np.empty((samples, k + 3))
    for r in range(REPLICATES):
        sob = scipy.stats.qmc.Sobol(d=k + 3, scramble=True,
                                    seed=np.random.default_rng([int(seed), 0x5EED, k, r]))
        u[r * per:(r + 1) * per] = sob.random_base2(m)
    x = scipy.special.ndtri(np.clip(u, 1e-300, 1.0 - 2.0**-53))
    z = np.ascontiguousarray(x[:, :k])
    s, t, eps = (np.ascontiguousarray(x[:, k + i]) for i in range(3))
    for arr in (z, s, t, eps):
        arr.setflags(write=False)
    return z, s, t, eps


class _Chain:
    """Per (instance, ĉ, samples, seed): the μ-independent student side, cached."""

    _cache: dict = {}

    def __init__(self, instance, c_hat, samples, seed):
        self.inst = instance
        self.c_hat = c_hat
        act = instance.activation
        z, s, t, eps = _gaussians(instance.k, samples, seed)
        self.z, self.s, self.t, self.eps = z, s, t, eps
        self.zw = z @ instance.w_factor.T          # ⟨w_i, x⟩
        self.zu = z @ instance.u_w                  # ⟨u_w, z⟩
        nh = instance.student_norms(c_hat)
        pre_hat = (self.zw + instance.xi * c_hat * s[:, None]) / nh
        self.fhat = act.fn(pre_hat) @ instance.lam
        self.psi = act.deriv(pre_hat) @ (instance.lam * instance.xi * c_hat / nh)
        self.n_teacher = instance.teacher_norms()
        self.samples = samples

    @classmethod
    def get(cls, instance, c_hat, samples, seed) -> _Chain:
        key = _key(instance, c_hat) + (samples, seed)
        ch = cls._cache.get(key)
        if ch is None:
            if len(cls._cache) > 6:
                cls._cache.pop(next(iter(cls._cache)))
            ch = cls._cache[key] = _Chain(instance, c_hat, samples, seed)
        return ch

    def teacher(self, mu: float):
        """(y, ∂y/∂a) at overlap μ for every sample."""
        inst = self.inst
        a = mu * self.s + math.sqrt(max(0.0, 1.0 - mu * mu)) * self.t
        ux = self.zu + inst.u_perp * a
        pre = (self.zw + inst.xi * inst.c * ux[:, None]) / self.n_teacher
        y = inst.activation.fn(pre) @ inst.lam
        dyda = inst.activation.deriv(pre) @ (inst.lam * inst.xi * inst.c * inst.u_perp
                                             / self.n_teacher)
        return y, dyda


def h_tilde(instance, mu, c_hat=None):
    """h̃(μ) = u_perp·h(u_perp μ) (exact, ``hermite.expansion.gradient.h``): the first-order drift
    of μ divided by η(1 − μ²)."""
    ch = _c_hat(instance, c_hat)
    mu = np.atleast_1d(np.asarray(mu, dtype=float))
    up = instance.u_perp
    return up * _h_exact(instance, np.clip(up * mu, -1.0, 1.0), c_hat=ch)


def _psi_second_moment(instance, ch) -> float:
    """E[ψ²] = Σ_jj′ λ_jλ_j′ ξ²ĉ_jĉ_j′/(N̂_jN̂_j′) K′(⟨v̂_j, v̂_j′⟩), exact (Price)."""
    nh = instance.student_norms(ch)
    coef = instance.lam * instance.xi * ch / nh
    rho = np.clip(instance.student_gram(ch), -1.0, 1.0)
    return float(coef @ dual_kernel_derivative(instance.activation, rho) @ coef)


# ---------------------------------------------------------------- the sample loop
# per-replicate sums, one row per μ: g², g²t², (μ + A)(E_R w − 1), E_R Δ, E_R Δ²  (Δ = μ′ − μ)
_Q = 5


@numba.njit(cache=True, parallel=True)
def _sums_kernel(mus, eta, r_nodes, r_w, zw, zu, s, t, extra, fhat, psi, tcoef, lam,
                 n_teacher, u_perp, code, p, reps, exact):  # pragma: no cover - compiled
    n_mu = mus.size
    n_s, k = zw.shape
    per = n_s // reps
    out = np.zeros((n_mu, reps, _Q))
    for im in numba.prange(n_mu):
        mu = mus[im]
        sin = math.sqrt(max(0.0, 1.0 - mu * mu))
        for rep in range(reps):
            acc = np.zeros(_Q)
            for i in range(rep * per, (rep + 1) * per):
                ux = zu[i] + u_perp * (mu * s[i] + sin * t[i])
                y = 0.0
                for j in range(k):
                    y += lam[j] * sigma((zw[i, j] + tcoef[j] * ux) / n_teacher[j], code, p)
                g = -2.0 * (y - fhat[i]) * psi[i] + extra[i]
                g2 = g * g
                t2 = t[i] * t[i]
                acc[0] += g2
                acc[1] += g2 * t2
                if exact:
                    a_step = -eta * sin * g * t[i]
                    c = eta * eta * g2
                    ew = 0.0
                    ed = 0.0
                    ed2 = 0.0
                    for q in range(r_nodes.size):
                        cq = c * (t2 + r_nodes[q])
                        root = math.sqrt(1.0 + cq)
                        wm1 = -cq / (root * (1.0 + root))
                        delta = a_step * (1.0 + wm1) + mu * wm1
                        ew += r_w[q] * wm1
                        ed += r_w[q] * delta
                        ed2 += r_w[q] * delta * delta
                    acc[2] += (mu + a_step) * ew
                    acc[3] += ed
                    acc[4] += ed2
            for q in range(_Q):
                out[im, rep, q] = acc[q] / per
    return out


def _sums_numpy(chain, mus, eta, r_nodes, r_w, extra, exact):
    """Same per-replicate means as :func:`_sums_kernel`, numpy (activations without a
    compiled σ)."""
    out = np.zeros((mus.size, REPLICATES, _Q))
    t, t2 = chain.t, chain.t**2
    for im, mu in enumerate(mus):
        y, _ = chain.teacher(float(mu))
        g = -2.0 * (y - chain.fhat) * chain.psi + extra
        g2 = g * g
        cols = [g2, g2 * t2]
        if exact:
            sin = math.sqrt(max(0.0, 1.0 - mu * mu))
            a_step = -eta * sin * g * t
            c = eta**2 * g2
            ew, ed, ed2 = (np.zeros_like(g) for _ in range(3))
            for rq, wq in zip(r_nodes, r_w, strict=True):
                cq = c * (t2 + rq)
                root = np.sqrt(1.0 + cq)
                wm1 = -cq / (root * (1.0 + root))          # w − 1, without cancellation
                delta = a_step * (1.0 + wm1) + mu * wm1    # μ′ − μ = (μ + A) w − μ
                ew += wq * wm1
                ed += wq * delta
                ed2 += wq * delta * delta
            cols += [(mu + a_step) * ew, ed, ed2]
        for q, col in enumerate(cols):
            out[im, :, q] = col.reshape(REPLICATES, -1).mean(axis=1)
    return out


def _compiled_code(act):
    """(code, p) of the numba σ of ``dynamics.reduced`` when ``act`` is that registry entry
    (unscaled)."""
    code = compiled_activation(act)
    return code[:2] if code is not None and code[2] == 1.0 else None


def _replicate_sums(chain, mus, eta, n, extra, exact):
    """(n_μ, REPLICATES, 5) replicate means of g², g²t², and the exact-step quantities."""
    r_nodes, r_w = chi2_rule(n)
    inst = chain.inst
    code = _compiled_code(inst.activation)
    if code is None:
        return _sums_numpy(chain, mus, eta, r_nodes, r_w, extra, exact)
    extra = np.zeros(chain.t.size) if np.isscalar(extra) else extra
    return _sums_kernel(np.ascontiguousarray(mus, dtype=np.float64), float(eta), r_nodes, r_w,
                        chain.zw, chain.zu, chain.s, chain.t, extra, chain.fhat, chain.psi,
                        inst.xi * inst.c, inst.lam.astype(np.float64), chain.n_teacher,
                        float(inst.u_perp), code[0], code[1], REPLICATES, bool(exact))


def _est(rep_values):
    """(estimate, SE) over the replicate axis (axis 1)."""
    return rep_values.mean(axis=1), rep_values.std(axis=1, ddof=1) / math.sqrt(REPLICATES)


# ---------------------------------------------------------------- public moments
@dataclass(frozen=True)
class NoiseMoments:
    """Noise moments on a grid of overlaps (all arrays have the shape of ``m``).

    m : overlaps ⟨u, û⟩; mu = m/u_perp. h : h(m) of Prop. 4 (so h̃ = u_perp·h).
    e_s2 = E[S²]; e_s2_t2 = E[S² t²] = E[S²(a² + b² − s²)]; e_s2_px2 = E[S²‖Px‖²]
    = (d − k − 2)E[S²] + E[S²t²] (NaN when d is not given); var_u_grad = Var(⟨u, ∇̂L⟩),
    the variance of the martingale increment per unit η. ``se_*``: sampling standard errors
    (h and the label-noise parts are exact); they are sampling SEs, from the replicates.
    """

    m: np.ndarray
    mu: np.ndarray
    h: np.ndarray
    e_s2: np.ndarray
    e_s2_t2: np.ndarray
    e_s2_px2: np.ndarray
    var_u_grad: np.ndarray
    se_e_s2: np.ndarray
    se_e_s2_t2: np.ndarray
    se_e_s2_px2: np.ndarray
    se_var_u_grad: np.ndarray
    d: int | None
    label_noise: float
    samples: int


def noise_moments(instance, m, *, d=None, c_hat=None, label_noise=0.0,
                  samples=DEFAULT_SAMPLES, seed=0) -> NoiseMoments:
    """E[S²‖Px‖²] (split as (d−k−2)E[S²] + E[S²t²]) and Var(⟨u, ∇̂L⟩) as functions of m.

    ``d`` defaults to ``instance.d``; ``c_hat`` overrides the instance's ĉ (joint training
    evaluated at a given ĉ); ``label_noise`` is the variance σ_ε² of additive label noise.
    Randomised QMC with common random numbers (``samples``, ``seed``); see the module docstring.
    """
    ch = _c_hat(instance, c_hat)
    d = instance.d if d is None else int(d)
    m_arr = np.asarray(m, dtype=float)
    mu = _mu_of(instance, m_arr).ravel()
    chain = _Chain.get(instance, ch, samples, seed)
    ht = h_tilde(instance, mu, ch)
    psi2 = 4.0 * label_noise * _psi_second_moment(instance, ch) if label_noise else 0.0
    n = (d - instance.k - 2) if d is not None else 0
    sums = _replicate_sums(chain, mu, 0.0, max(n, 0), 0.0, False)
    out = {}
    out["s2"], out["se_s2"] = _est(sums[:, :, 0])
    out["s2t2"], out["se_s2t2"] = _est(sums[:, :, 1])
    out["px"], out["se_px"] = _est(n * sums[:, :, 0] + sums[:, :, 1])
    out["s2"] += psi2
    out["s2t2"] += psi2
    out["px"] += (n + 1) * psi2
    up2 = instance.u_perp**2
    one = 1.0 - mu**2
    var_u = up2 * one * (out["s2t2"] - one * ht**2)
    shape = m_arr.shape
    nan = np.full(mu.size, np.nan)
    return NoiseMoments(
        m=m_arr, mu=mu.reshape(shape), h=(ht / instance.u_perp).reshape(shape),
        e_s2=out["s2"].reshape(shape), e_s2_t2=out["s2t2"].reshape(shape),
        e_s2_px2=(out["px"] if d is not None else nan).reshape(shape),
        var_u_grad=var_u.reshape(shape),
        se_e_s2=out["se_s2"].reshape(shape), se_e_s2_t2=out["se_s2t2"].reshape(shape),
        se_e_s2_px2=(out["se_px"] if d is not None else nan).reshape(shape),
        se_var_u_grad=(up2 * one * out["se_s2t2"]).reshape(shape),
        d=d, label_noise=float(label_noise), samples=int(samples),
    )


@dataclass(frozen=True)
class OneStepMoments:
    """Exact conditional moments of one step of (★) in μ units, on a grid of μ.

    drift = E[μ′ − μ | μ]; var = Var(μ′ − μ | μ); drift2 = the second-order truncation
    η h̃(1−μ²) − (η²/2) μ E[g²(t² + ‖r‖²)]; var1 = η²(1−μ²)Var(g t), the first-order variance.
    ``se_*``: sampling standard errors. ``drift_reps``/``drift2_reps`` (n_μ, 8): the same
    drifts from each scrambled replicate alone (to propagate the sampling error).
    """

    mu: np.ndarray
    drift: np.ndarray
    var: np.ndarray
    drift2: np.ndarray
    var1: np.ndarray
    h_tilde: np.ndarray
    se_drift: np.ndarray
    se_var: np.ndarray
    se_drift2: np.ndarray
    eta: float
    d: int
    drift_reps: np.ndarray | None = None
    drift2_reps: np.ndarray | None = None


def one_step_moments(instance, mu, eta, d=None, *, c_hat=None, label_noise=0.0,
                     samples=DEFAULT_SAMPLES, seed=0, exact=True) -> OneStepMoments:
    """E and Var of μ′ − μ under the exact step (★), plus its second-order truncation.

    Drift: η h̃(μ)(1−μ²) [exact] + E[(μ − η g√(1−μ²) t)(E_R w − 1)], w = (1 + η²g²(t²+R))^{-1/2},
    R ~ χ²_{d−k−2} by :func:`chi2_rule`; label noise enters g through sampled ε. ``exact=False``
    skips the exact step (drift/var NaN) and returns only the truncation (cheaper).
    """
    ch = _c_hat(instance, c_hat)
    d = instance.d if d is None else int(d)
    if d is None:
        raise ValueError("d is required")
    mu = np.atleast_1d(np.asarray(mu, dtype=float))
    chain = _Chain.get(instance, ch, samples, seed)
    ht = h_tilde(instance, mu, ch)
    n = d - instance.k - 2
    extra = -2.0 * math.sqrt(label_noise) * chain.eps * chain.psi if label_noise else 0.0
    sums = _replicate_sums(chain, mu, eta, n, extra, exact)
    one = 1.0 - mu**2
    first = eta * ht * one
    reps2 = first[:, None] - 0.5 * eta**2 * mu[:, None] * (n * sums[:, :, 0] + sums[:, :, 1])
    drift2, se_drift2 = _est(reps2)
    var1 = eta**2 * one * (sums[:, :, 1].mean(axis=1) - one * ht**2)
    res = dict(drift2=drift2, se_drift2=se_drift2, var1=var1, reps=None)
    if exact:
        res["reps"] = first[:, None] + sums[:, :, 2]
        res["drift"], res["se_drift"] = _est(res["reps"])
        res["var"], res["se_var"] = _est(sums[:, :, 4] - sums[:, :, 3] ** 2)
    else:
        res.update({key: np.full(mu.size, np.nan) for key in ("drift", "var", "se_drift",
                                                               "se_var")})
    return OneStepMoments(mu=mu, drift=res["drift"], var=res["var"], drift2=res["drift2"],
                          var1=res["var1"], h_tilde=ht, se_drift=res["se_drift"],
                          se_var=res["se_var"], se_drift2=res["se_drift2"], eta=float(eta),
                          d=d, drift_reps=res["reps"], drift2_reps=reps2)

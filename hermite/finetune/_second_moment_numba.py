"""Compiled E‖G_T‖² of fine-tuning's tangent sample gradient (b = 1) at a block of states.

The same average over the same fixed quasi-Monte Carlo points as
:meth:`hermite.finetune.population.SecondMoment._block` (its docstring and the module's
"Finite-d correction" give the formula), as one loop per (run, point) instead of numpy
arrays of runs × points × k, whose temporaries took almost all of the corrected ODE's time
(profile: 20 of 30 s for 16 runs, k = 8). Activations with a numba code only
(:func:`hermite.activations_numba.act_code`); tests/test_finetune_ode.py checks it against
the numpy path.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from hermite.activations_numba import sigma_and_deriv

__all__ = ["second_moment_block", "overlap_moments_block", "step_moments_block",
           "step_increments_block"]


@njit(cache=True, nogil=True)
def _state(p, mu, ch, r, L, xi, unit, row_scale, xc, sc):
    """ν of run r's state, and its ξĉⱼ and row normalisations into ``xc``, ``sc`` (k,)."""
    k = ch.shape[1]
    nu2 = 1.0 - mu[r] * mu[r]
    for i in range(k):
        nu2 -= p[r, i] * p[r, i]
    for j in range(k):
        xc[j] = xi * ch[r, j]
        if unit:
            om = 0.0
            for i in range(k):
                om += L[j, i] * p[r, i]
            sc[j] = 1.0 / math.sqrt(1.0 + 2.0 * xc[j] * om + xc[j] * xc[j])
        else:
            sc[j] = row_scale
    return math.sqrt(max(nu2, 0.0))


@njit(cache=True, nogil=True)
def _point(p, mu, nu, r, t, z, a, b, lz, y, lam, out, xc, sc, code, deg, pre, delta):
    """The scalar g of run r's sample gradient along x at point t (its per-neuron δ and
    pre-activations into ``delta``, ``pre``)."""
    k = xc.shape[0]
    s = mu[r] * a[t] + nu * b[t]
    for i in range(k):
        s += p[r, i] * z[t, i]
    f = 0.0
    for j in range(k):
        pre[j] = (lz[t, j] + xc[j] * s) * sc[j]
        val, der = sigma_and_deriv(pre[j], code, deg)
        f += lam[j] * val
        delta[j] = lam[j] * der
    resid = (-2.0 * out) * (y[t] - out * f)
    g = 0.0
    for j in range(k):
        delta[j] *= resid
        g += delta[j] * xc[j] * sc[j]
    return g


@njit(cache=True, nogil=True)
def _span_w(g, t, z, L, unit, xc, sc, pre, delta, gw):
    """The gradient's part in span W at point t (unprojected û) into ``gw`` (k,)."""
    k = xc.shape[0]
    for i in range(k):
        gw[i] = g * z[t, i]
    if unit:
        for j in range(k):
            coef = delta[j] * pre[j] * xc[j] * sc[j] * sc[j]
            for i in range(k):
                gw[i] -= coef * L[j, i]


@njit(cache=True, nogil=True)
def second_moment_block(p, mu, ch, z, a, b, lz, y, L, lam, xi, unit, row_scale, out, project,
                        d, code, deg):
    """(R,) mean over the points of ‖G_T‖² (b = 1) at states p (R, k), μ (R,), ĉ (R, k).

    z (N, k), a, b, y (N,), lz = z Lᵀ (N, k): the points; L (k, k) W's factor, λ (k,); ``unit``
    rows (scale 1/‖r̂ⱼ‖) or App. B's fixed ``row_scale``; ``out`` the output factor;
    ``project``: û's gradient projected on span(W)^⊥; d the dimension.
    """
    runs, k = ch.shape
    n = a.shape[0]
    res = np.empty(runs)
    xc, sc, pre, delta, gw = np.empty(k), np.empty(k), np.empty(k), np.empty(k), np.empty(k)
    rest = float(d - k - 2)
    for r in range(runs):
        nu = _state(p, mu, ch, r, L, xi, unit, row_scale, xc, sc)
        acc = 0.0
        for t in range(n):
            g = _point(p, mu, nu, r, t, z, a, b, lz, y, lam, out, xc, sc, code, deg, pre,
                       delta)
            ge, gb = g * a[t], g * b[t]
            base = ge * ge + gb * gb + rest * g * g
            if project:
                sdot = mu[r] * ge + nu * gb
                acc += base - sdot * sdot
                continue
            _span_w(g, t, z, L, unit, xc, sc, pre, delta, gw)
            sdot = mu[r] * ge + nu * gb
            sq = 0.0
            for i in range(k):
                sdot += gw[i] * p[r, i]
                sq += gw[i] * gw[i]
            acc += sq + base - sdot * sdot
        res[r] = acc / n
    return res


@njit(cache=True, nogil=True)
def overlap_moments_block(p, mu, ch, z, a, b, lz, y, L, lam, xi, unit, row_scale, out, uw,
                          u_perp, code, deg):
    """(R, 2) mean over the points of x and x², x = ⟨G_T, u⟩ the tangent sample gradient's
    component along u (b = 1, unprojected û), at states p (R, k), μ (R,), ĉ (R, k).

    The same points and arguments as :func:`second_moment_block`; u = (u_w, u⊥, 0, …), so
    x = ⟨G_W, u_w⟩ + G_e u⊥ − S m with S = ⟨û, G⟩ and m = ⟨û, u⟩ (tangent projection).
    """
    runs, k = ch.shape
    n = a.shape[0]
    res = np.zeros((runs, 2))
    xc, sc, pre, delta, gw = np.empty(k), np.empty(k), np.empty(k), np.empty(k), np.empty(k)
    for r in range(runs):
        nu = _state(p, mu, ch, r, L, xi, unit, row_scale, xc, sc)
        m = mu[r] * u_perp
        for i in range(k):
            m += p[r, i] * uw[i]
        s1 = 0.0
        s2 = 0.0
        for t in range(n):
            g = _point(p, mu, nu, r, t, z, a, b, lz, y, lam, out, xc, sc, code, deg, pre,
                       delta)
            _span_w(g, t, z, L, unit, xc, sc, pre, delta, gw)
            ge = g * a[t]
            sdot = mu[r] * ge + nu * g * b[t]
            x = ge * u_perp
            for i in range(k):
                sdot += gw[i] * p[r, i]
                x += gw[i] * uw[i]
            x -= sdot * m
            s1 += x
            s2 += x * x
        res[r, 0] = s1 / n
        res[r, 1] = s2 / n
    return res


@njit(cache=True, nogil=True)
def step_moments_block(mu, ch, a, b, lz, y, rho2, lam, xi, eta, eta_c, code, deg):
    """Mean (R, 1 + k) and covariance (R, 1 + k, 1 + k) over the points of the exact chain's
    one-step increment of (μ, ĉ) (projected û, unit rows, b = 1; the formulas of
    :mod:`hermite.finetune.band`) at states μ (R,), ĉ (R, k); ρ² (N,) the rest's squared norm
    at each point. The compiled form of ``StepMoments.increments`` (numpy, its reference)."""
    runs, k = ch.shape
    n, dim = a.shape[0], 1 + ch.shape[1]
    mean = np.zeros((runs, dim))
    cov = np.zeros((runs, dim, dim))
    xc = np.empty(k)
    sc = np.empty(k)
    inc = np.empty(dim)
    for r in range(runs):
        m0 = mu[r]
        nu = math.sqrt(max(1.0 - m0 * m0, 0.0))
        for j in range(k):
            xc[j] = xi * ch[r, j]
            sc[j] = 1.0 / math.sqrt(1.0 + xc[j] * xc[j])
        s1 = np.zeros(dim)
        s2 = np.zeros((dim, dim))
        for t in range(n):
            s = m0 * a[t] + nu * b[t]
            f = 0.0
            gsum = 0.0  # Σⱼ λⱼσ′(âⱼ)ξĉⱼ/N̂ⱼ
            for j in range(k):
                pre = (lz[t, j] + xc[j] * s) * sc[j]
                val, der = sigma_and_deriv(pre, code, deg)
                f += lam[j] * val
                inc[1 + j] = lam[j] * der * xi * sc[j] * (s - pre * xc[j] * sc[j])
                gsum += lam[j] * der * xc[j] * sc[j]
            res = -2.0 * (y[t] - f)
            g = res * gsum
            tau = g * s
            ne = m0 - eta * (g * a[t] - tau * m0)
            nt = nu - eta * (g * b[t] - tau * nu)
            eg = eta * g
            inc[0] = ne / math.sqrt(ne * ne + nt * nt + eg * eg * rho2[t]) - m0
            for j in range(k):
                inc[1 + j] *= -eta_c * res
            for i in range(dim):
                s1[i] += inc[i]
                for j in range(i + 1):
                    s2[i, j] += inc[i] * inc[j]
        for i in range(dim):
            mean[r, i] = s1[i] / n
        for i in range(dim):
            for j in range(i + 1):
                c = (s2[i, j] - n * mean[r, i] * mean[r, j]) / (n - 1)
                cov[r, i, j] = c
                cov[r, j, i] = c
    return mean, cov


@njit(cache=True, nogil=True)
def step_increments_block(p, mu, ch, z, a, b, lz, y, L, lam, xi, project, joint_c, eta, eta_c,
                          code, deg):
    """(R, N, D) O(η) step increments of the packed state (p (k, unprojected), μ, ĉ (k,
    joint)) at every point, at states p (R, k), μ (R,), ĉ (R, k): −η G_T's coordinates and
    −η_c ∂ℓ/∂ĉ (unit rows, b = 1). The compiled form of
    ``hermite.finetune.finite_xi.StepNoise._increments`` (numpy, its reference); their
    covariance is left to BLAS."""
    runs, k = ch.shape
    n = a.shape[0]
    off = 0 if project else k
    dim = off + 1 + (k if joint_c else 0)
    inc = np.empty((runs, n, dim))
    xc, sc, pre, delta, gw = np.empty(k), np.empty(k), np.empty(k), np.empty(k), np.empty(k)
    om = np.empty(k)
    for r in range(runs):
        nu = _state(p, mu, ch, r, L, xi, True, 1.0, xc, sc)
        for j in range(k):
            acc = 0.0
            for i in range(k):
                acc += L[j, i] * p[r, i]
            om[j] = acc
        for t in range(n):
            g = _point(p, mu, nu, r, t, z, a, b, lz, y, lam, 1.0, xc, sc, code, deg, pre,
                       delta)
            ge = g * a[t]
            sdot = mu[r] * ge + nu * g * b[t]
            if not project:
                _span_w(g, t, z, L, True, xc, sc, pre, delta, gw)
                for i in range(k):
                    sdot += gw[i] * p[r, i]
                for i in range(k):
                    inc[r, t, i] = -eta * (gw[i] - sdot * p[r, i])
            inc[r, t, off] = -eta * (ge - sdot * mu[r])
            if joint_c:
                s = mu[r] * a[t] + nu * b[t]
                for i in range(k):
                    s += p[r, i] * z[t, i]
                for j in range(k):
                    norm_part = (xi * om[j] + xi * xc[j]) * sc[j]
                    inc[r, t, off + 1 + j] = -eta_c * delta[j] * xi * sc[j] * (
                        s - pre[j] * norm_part / xi)
    return inc

"""Compiled sample sums of :mod:`.diffusion` (one SGD example per point, per path): equal to
:func:`.diffusion.sample_sums_numpy` to rounding (tests/test_committee_diffusion.py)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from hermite.activations_numba import sigma_and_deriv


@njit(cache=True, parallel=True)
def sample_sums(L, z, w, v, v_eff, A, Q, R, unit, squared, s, gam, noise_sd, c2, code, p,
                scale, kicks, out_S, out_kQ, out_kR, out_kv):
    """σ(x) = σ_code(scale·x). For each path b and each of its n points: fields
    f = L[b] z[b, i, :P] (students, then teachers), label noise noise_sd·z[b, i, P], δ and
    ξ = ζ + c2·χ; out: S = mean δδᵀ and the kicks Σᵢ w[b, i] (ξᵢ − ξ̄)/√n of ξ_Q, ξ_R, ξ_v
    (:mod:`.diffusion`; ``kicks`` False: S only, the kicks left 0). Paths in parallel; each
    path's numbers are the same on any number of threads."""
    n = z.shape[1]
    B, K = v.shape
    M = A.shape[0]
    P = K + M
    u = 1.0 if unit else 0.0
    root = np.sqrt(float(n))
    for b in prange(B):
        f = np.empty(P)
        g = np.empty(K)
        gp = np.empty(K)
        dl = np.empty(K)
        mQ = np.zeros((K, K))
        mR = np.zeros((K, M))
        mv = np.zeros(K)
        wsum = 0.0
        for k in range(K):
            out_kv[b, k] = 0.0
            for m in range(M):
                out_kR[b, k, m] = 0.0
            for m in range(K):
                out_S[b, k, m] = 0.0
                out_kQ[b, k, m] = 0.0
        for i in range(n):
            wi = w[b, i]
            wsum += wi
            for a in range(P):
                acc = 0.0
                for c in range(P):
                    acc += L[b, a, c] * z[b, i, c]
                f[a] = acc
            y = noise_sd * z[b, i, P]
            for m in range(M):
                y += A[m] * sigma_and_deriv(scale * f[K + m], code, p)[0]
            yhat = 0.0
            for k in range(K):
                g[k], gp[k] = sigma_and_deriv(scale * f[k], code, p)
                gp[k] *= scale
                yhat += v[b, k] * g[k]
            e = y - yhat
            for k in range(K):
                if squared:
                    dl[k] = -gam * s * v_eff[b, k] * gp[k] * e
                else:
                    dl[k] = -s * v_eff[b, k] * gp[k] * y
            for k in range(K):
                for m in range(K):
                    out_S[b, k, m] += dl[k] * dl[m]
            if not kicks:
                continue
            for k in range(K):
                zv = 2.0 * s * e * g[k]
                mv[k] += zv
                out_kv[b, k] += wi * zv
                for m in range(M):
                    zr = -dl[k] * (f[K + m] - u * f[k] * R[b, k, m]
                                   + u * 0.5 * c2 * dl[k] * R[b, k, m])
                    mR[k, m] += zr
                    out_kR[b, k, m] += wi * zr
            for k in range(K):
                for m in range(K):
                    zq = (c2 * (dl[k] * dl[m] - u * 0.5 * (dl[k] * dl[k] + dl[m] * dl[m])
                                * Q[b, k, m])
                          - dl[k] * (f[m] - u * f[k] * Q[b, k, m])
                          - dl[m] * (f[k] - u * f[m] * Q[b, k, m]))
                    mQ[k, m] += zq
                    out_kQ[b, k, m] += wi * zq
        c = wsum / n  # Σ wᵢ(ζᵢ − ζ̄) = Σ wᵢζᵢ − (Σ wᵢ) Σ ζᵢ / n
        for k in range(K):
            out_kv[b, k] = (out_kv[b, k] - c * mv[k]) / root
            for m in range(M):
                out_kR[b, k, m] = (out_kR[b, k, m] - c * mR[k, m]) / root
            for m in range(K):
                out_S[b, k, m] /= n
                out_kQ[b, k, m] = (out_kQ[b, k, m] - c * mQ[k, m]) / root

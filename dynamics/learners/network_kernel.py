"""Compiled chunk steps of the O(k′d) learners: a whole chunk of SGD steps in one call.

The learners of rows (``scratch``, ``scratch-csq``, ``sparse``: :mod:`.network`) and the
full-rank ``linearized`` (:mod:`.linearized`) cost O(k′d) per step and run. Their torch step
(``step_prepared_``, kept as the reference) issues ~30 small ops per step, allocates the
(R, k′, d) gradient and reads it twice. Here one numba call advances every run through every
step of a chunk (runs over numba's threads: one run's steps are sequential, runs are independent),
on the same examples (the engine's streams, so the same numbers up to rounding) and with the
same update. At b = 1 a row's update and the next step's dot product take ONE pass over the
row, for four rows at a time (the example and the next one are loaded once per four rows),
with the arithmetic in the rows' dtype (float32 runs about twice as fast as float64); a row
of d numbers stays in L1 meanwhile. One compiled path (a block of runs, on numba's threads by
:func:`dynamics.runtime.run_threads.over_runs`) serves every number of threads, so a run's numbers
depend neither on R nor on the threads.

- rows (:func:`network_chunk`): with δ (b, k′) the per-example coefficients of the module
  docstring of :mod:`.network`, Gⱼ = Σ_b δ_bj x_b / b is never formed: ⟨ŵⱼ, Gⱼ⟩ =
  Σ_b δ_bj a_bj / b, ‖Gⱼ‖² = δⱼᵀ (XXᵀ) δⱼ / b² from the b×b Gram of the examples (δⱼ²‖x‖² at
  b = 1), and ŵⱼ ← αⱼ ŵⱼ − Σ_b cⱼ δ_bj x_b / b with αⱼ = (1 + ηⱼ⟨ŵⱼ,Gⱼ⟩)/nⱼ and
  cⱼ = ηⱼ/nⱼ; the next step's aⱼ = ⟨ŵⱼ, x′⟩ is taken while the new row is in L1. Rows with
  ηⱼ = 0 (frozen by the mask, or a diverged run) are never written; the aⱼ of rows frozen by
  the mask can come precomputed for the whole chunk (one batched GEMM, ``a_pre``).
- full-rank Δ (:func:`linear_chunk`): Δⱼ ← (1 − 2η·prox)Δⱼ + η Σ_b coef_bj Π(x_b − z_bj wⱼ).

The kernels release the GIL, so the engine's sampler threads draw the next chunk meanwhile.
Reductions are vectorised (fastmath reassociation only: NaN and ∞ keep their IEEE meaning, so
a diverged step still reads non-finite in the health value). Arrays are float64 or float32
(the same compiled code, one specialisation per dtype).
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numba import njit

from dynamics.runtime.numba_cache import SIGMA_SOURCE, drop_stale_cache
from dynamics.runtime.run_threads import over_runs
from hermite.activations_numba import sigma_and_deriv

__all__ = ["network_chunk", "linear_chunk", "RowRule", "examples_view", "RowArrays",
           "ChunkView", "RowFlags", "LinearArrays", "LinearFlags"]

# reassociation (vectorised reductions) and contraction (FMA); no nnan/ninf: NaN must survive
_FM = {"reassoc", "contract", "nsz"}


# σ lives in hermite/activations_numba.py: drop this module's cache whenever either changed
drop_stale_cache(Path(__file__).parent / "__pycache__", [Path(__file__), SIGMA_SOURCE],
                 prefix="network_kernel.")


# The compiled kernel's arguments, packed (numba takes named tuples of arrays and scalars):
# the run-axis arrays it reads and writes, where the chunk's examples lie, and the switches.
RowArrays = namedtuple("RowArrays", ["rows", "lam", "eta", "eta_c", "mask", "y", "a_pre",
                                     "norms"])
ChunkView = namedtuple("ChunkView", ["xf", "off", "s0", "s1", "s2", "n"])
RowFlags = namedtuple("RowFlags", ["code", "p", "scale", "correlation", "train", "has_pre",
                                   "free"])
# the full-rank Δ path's: Δ and the per-example arrays of the chunk, the same ChunkView, and
# its constants (prox, project)
LinearArrays = namedtuple("LinearArrays", ["delta", "z", "y", "f0", "beta", "lmat", "eta",
                                           "norms"])
LinearFlags = namedtuple("LinearFlags", ["prox", "project"])


@dataclass(frozen=True)
class RowRule:
    """The network learner's update rule of its rows: σ by ``activation`` (code, p, a) from
    :func:`hermite.activations_numba.compiled_activation`, the correlation loss (else the
    squared loss), a trained second layer λ̂, and free rows (plain SGD; else unit rows,
    spherical SGD)."""

    activation: tuple
    correlation: bool
    train: bool
    free: bool = False


def examples_view(x: torch.Tensor):
    """(flat 1-D numpy view of x's storage, offset, strides (R, n, b)) of a CPU tensor
    x (R, n, b, d) whose last axis is contiguous: example (r, i, β) is
    flat[off + r·s0 + i·s1 + β·s2 :][:d], a contiguous slice (vectorised loops)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    span = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride(), strict=True))
    flat = torch.as_strided(x, (span,), (1,))
    s0, s1, s2, _ = x.stride()
    return flat.numpy(), 0, s0, s1, s2


# ---------------------------------------------------------------------------- helpers
@njit(cache=True, fastmath=_FM, inline="always")
def _dot(u, v, d):
    s = 0.0
    for t in range(d):
        s += u[t] * v[t]
    return s


@njit(cache=True, fastmath=_FM, inline="always")
def _fused1(row, x0, x1, cf, u, d):
    """row ← cf[u]·row − cf[4+u]·x0 and ⟨new row, x1⟩ (arithmetic in the rows' dtype)."""
    al, c = cf[u], cf[4 + u]
    acc = cf[8]
    for t in range(d):
        v = al * row[t] - c * x0[t]
        row[t] = v
        acc += v * x1[t]
    return acc


@njit(cache=True, fastmath=_FM, inline="always")
def _fused2(r0, r1, x0, x1, cf, d):
    """:func:`_fused1` for two rows in one pass."""
    a0, a1, c0, c1 = cf[0], cf[1], cf[4], cf[5]
    s0 = s1 = cf[8]
    for t in range(d):
        xa = x0[t]
        xb = x1[t]
        v0 = a0 * r0[t] - c0 * xa
        v1 = a1 * r1[t] - c1 * xa
        r0[t] = v0
        r1[t] = v1
        s0 += v0 * xb
        s1 += v1 * xb
    return s0, s1


@njit(cache=True, fastmath=_FM, inline="always")
def _fused4(r0, r1, r2, r3, x0, x1, cf, d):
    """:func:`_fused1` for four rows in one pass (x0 and x1 are loaded once for all four)."""
    a0, a1, a2, a3 = cf[0], cf[1], cf[2], cf[3]
    c0, c1, c2, c3 = cf[4], cf[5], cf[6], cf[7]
    s0 = s1 = s2 = s3 = cf[8]
    for t in range(d):
        xa = x0[t]
        xb = x1[t]
        v0 = a0 * r0[t] - c0 * xa
        v1 = a1 * r1[t] - c1 * xa
        v2 = a2 * r2[t] - c2 * xa
        v3 = a3 * r3[t] - c3 * xa
        r0[t] = v0
        r1[t] = v1
        r2[t] = v2
        r3[t] = v3
        s0 += v0 * xb
        s1 += v1 * xb
        s2 += v2 * xb
        s3 += v3 * xb
    return s0, s1, s2, s3


# ---------------------------------------------------------------------------- rows
@njit(cache=True, inline="always")
def _act(x, fl):
    """(σ(a·x), a σ′(a·x)) of the flags' activation σ(a·x)."""
    s, ds = sigma_and_deriv(fl.scale * x, fl.code, fl.p)
    return s, fl.scale * ds


@njit(cache=True, fastmath=_FM)
def _network_run(r, ar, cv, fl):
    """All n steps of run r (see :func:`network_chunk`): arrays ``ar`` (:data:`RowArrays`),
    examples ``cv`` (:data:`ChunkView`), switches ``fl`` (:data:`RowFlags`)."""
    rows, lam, xf, y, mask, a_pre = ar.rows, ar.lam, cv.xf, ar.y, ar.mask, ar.a_pre
    s1, s2, n, has_pre = cv.s1, cv.s2, cv.n, fl.has_pre
    kp, d = rows.shape[1], rows.shape[2]
    b = y.shape[2]
    inv_b = 1.0 / b
    eta, eta_c = ar.eta[r], ar.eta_c[r]
    a = np.empty((b, kp))
    a_next = np.empty((b, kp))
    sa = np.empty((b, kp))
    delta = np.empty((b, kp))
    outer = np.empty(b)
    gram = np.empty((b, b))
    alpha = np.empty(kp)
    coef = np.empty(kp)
    fused = np.empty(kp, dtype=np.int64)
    cf = np.zeros(9, dtype=rows.dtype)  # the one-pass coefficients in the rows' dtype
    base = cv.off + r * cv.s0
    for beta in range(b):  # a of step 0
        o = base + beta * s2
        for j in range(kp):
            if has_pre and not mask[r, j]:
                a[beta, j] = a_pre[r, 0, beta, j]
            else:
                a[beta, j] = _dot(rows[r, j], xf[o: o + d], d)
    for i in range(n):
        oi = base + i * s1
        for beta in range(b):  # Gram of the step's examples
            xb = xf[oi + beta * s2: oi + beta * s2 + d]
            for g in range(beta + 1):
                v = _dot(xb, xf[oi + g * s2: oi + g * s2 + d], d)
                gram[beta, g] = v
                gram[g, beta] = v
        for beta in range(b):
            f_hat = 0.0
            for j in range(kp):
                s, ds = _act(a[beta, j], fl)
                sa[beta, j] = s
                delta[beta, j] = lam[r, j] * ds
                f_hat += lam[r, j] * s
            yb = y[r, i, beta]
            outer[beta] = -yb if fl.correlation else -2.0 * (yb - f_hat)
            for j in range(kp):
                delta[beta, j] *= outer[beta]
        health = np.inf  # minⱼ 1/nⱼ; NaN, once seen, sticks (as torch's amin)
        has_next = i + 1 < n
        on = base + (i + 1) * s1
        nf = 0  # rows for the one-pass update (b = 1, trainable, a next step to dot with)
        for j in range(kp):
            ej = eta if mask[r, j] else 0.0
            ug = 0.0
            g2 = 0.0
            for beta in range(b):
                ug += delta[beta, j] * a[beta, j]
                row_g = 0.0
                for g in range(b):
                    row_g += gram[beta, g] * delta[g, j]
                g2 += delta[beta, j] * row_g
            ug *= inv_b
            g2 *= inv_b * inv_b
            if fl.free:  # plain SGD ŵⱼ ← ŵⱼ − ηGⱼ; health (1 + η²‖Gⱼ‖²)^{−1/2}
                inv = 1.0 / math.sqrt(1.0 + ej * ej * g2)
                alpha[j] = 1.0
                coef[j] = ej * inv_b
            else:
                inv = 1.0 / math.sqrt(1.0 + ej * ej * (g2 - ug * ug))
                alpha[j] = inv + inv * (ej * ug)  # (1 + η⟨ŵ,G⟩)/n
                coef[j] = ej * inv * inv_b  # × δ_βj: the coefficient of x_β
            if health == health and (inv < health or inv != inv):
                health = inv
            pre_j = has_pre and not mask[r, j]
            if ej != 0.0 and b == 1 and has_next and not pre_j:
                fused[nf] = j
                nf += 1
                continue
            row = rows[r, j]
            if ej != 0.0:
                for beta in range(b):
                    cb = coef[j] * delta[beta, j]
                    ob = oi + beta * s2
                    xb = xf[ob: ob + d]
                    if beta == 0:
                        for t in range(d):
                            row[t] = alpha[j] * row[t] - cb * xb[t]
                    else:
                        for t in range(d):
                            row[t] -= cb * xb[t]
            if has_next:
                for beta in range(b):
                    if pre_j:
                        a_next[beta, j] = a_pre[r, i + 1, beta, j]
                    else:
                        ob = on + beta * s2
                        a_next[beta, j] = _dot(row, xf[ob: ob + d], d)
        if nf:  # one pass: ŵⱼ ← αⱼŵⱼ − cⱼx and the next aⱼ = ⟨ŵⱼ, x′⟩, up to 4 rows at once
            x0 = xf[oi: oi + d]
            x1 = xf[on: on + d]
            q = 0
            while q < nf:
                m = 4 if nf - q >= 4 else (2 if nf - q >= 2 else 1)
                for u in range(m):
                    j = fused[q + u]
                    cf[u] = alpha[j]
                    cf[4 + u] = coef[j] * delta[0, j]
                if m == 4:
                    j0, j1, j2, j3 = fused[q], fused[q + 1], fused[q + 2], fused[q + 3]
                    s_0, s_1, s_2, s_3 = _fused4(rows[r, j0], rows[r, j1], rows[r, j2],
                                                 rows[r, j3], x0, x1, cf, d)
                    a_next[0, j0] = s_0
                    a_next[0, j1] = s_1
                    a_next[0, j2] = s_2
                    a_next[0, j3] = s_3
                elif m == 2:
                    j0, j1 = fused[q], fused[q + 1]
                    s_0, s_1 = _fused2(rows[r, j0], rows[r, j1], x0, x1, cf, d)
                    a_next[0, j0] = s_0
                    a_next[0, j1] = s_1
                else:
                    a_next[0, fused[q]] = _fused1(rows[r, fused[q]], x0, x1, cf, 0, d)
                q += m
        if fl.train:
            for j in range(kp):
                gl = 0.0
                for beta in range(b):
                    gl += outer[beta] * sa[beta, j]
                lam[r, j] -= eta_c * (gl * inv_b)
        ar.norms[i, r] = health
        a, a_next = a_next, a


@njit(cache=True, nogil=True)
def _network_block(lo, hi, ar, cv, fl):
    for r in range(lo, hi):
        _network_run(r, ar, cv, fl)


def _network_runs(ar, cv, fl) -> None:
    """Every run on numba's threads (``over_runs``: one compiled path whatever the threads,
    so a run's numbers do not depend on R or on the number of threads)."""
    over_runs(_network_block, ar.rows.shape[0], ar, cv, fl)


def network_chunk(rows: torch.Tensor, lam_hat: torch.Tensor, x: torch.Tensor,
                  y: torch.Tensor, eta_r: torch.Tensor, eta_c_r: torch.Tensor,
                  mask: torch.Tensor, norms: torch.Tensor, *, rule: RowRule,
                  a_pre: torch.Tensor | None = None) -> None:
    """n SGD steps of rows in place (module docstring; CPU tensors) by ``rule``: spherical
    (unit rows) or plain (``rule.free``).

    rows (R, k′, d) and lam_hat (R, k′) contiguous, updated in place; x (R, n, b, d) the
    examples (last axis contiguous), y (R, n, b) their labels; eta_r, eta_c_r (R,) step
    sizes; mask (R, k′) trainable rows; norms (n, R) receives minⱼ 1/nⱼ per step; a_pre
    (R, n, b, k′) the precomputed aⱼ of the rows the mask freezes (None: computed here).
    """
    xf, off, s0, s1, s2 = examples_view(x)
    has_pre = a_pre is not None
    pre = (a_pre.contiguous() if has_pre else torch.empty((1, 1, 1, 1), dtype=rows.dtype))
    code, p, scale = rule.activation
    arrays = RowArrays(rows.numpy(), lam_hat.numpy(), eta_r.numpy(), eta_c_r.numpy(),
                       mask.numpy(), y.contiguous().numpy(), pre.numpy(), norms.numpy())
    _network_runs(arrays, ChunkView(xf, off, s0, s1, s2, x.shape[1]),
                  RowFlags(int(code), int(p), float(scale), bool(rule.correlation),
                           bool(rule.train), has_pre, bool(rule.free)))


# ---------------------------------------------------------------------------- full-rank Δ
@njit(cache=True, fastmath=_FM)
def _linear_run(r, ar, cv, fl):
    """All n steps of run r (see :func:`linear_chunk`): arrays ``ar`` (:data:`LinearArrays`),
    examples ``cv`` (:data:`ChunkView`), switches ``fl`` (:data:`LinearFlags`)."""
    delta, xf, z, y, f0, beta_, lmat = ar.delta, cv.xf, ar.z, ar.y, ar.f0, ar.beta, ar.lmat
    norms, s1, s2, n = ar.norms, cv.s1, cv.s2, cv.n
    prox, project = fl.prox, fl.project
    k, d = delta.shape[1], delta.shape[2]
    b = y.shape[2]
    eta = ar.eta[r]
    shrink = 1.0 - 2.0 * prox * eta
    lo = k if project else 0
    dx = np.empty((b, k))
    dx_next = np.empty((b, k))
    coef = np.empty((b, k))
    wd = np.empty(k)
    cf = np.zeros(9, dtype=delta.dtype)  # the one-pass coefficients in Δ's dtype
    base = cv.off + r * cv.s0
    lr = lmat[r] if lmat.shape[0] > 1 else lmat[0]
    for beta in range(b):
        o = base + beta * s2
        for j in range(k):
            dx[beta, j] = _dot(delta[r, j], xf[o: o + d], d)
    for i in range(n):
        oi = base + i * s1
        for j in range(k):  # ⟨wⱼ, Δⱼ⟩
            s = 0.0
            for t in range(k):
                s += delta[r, j, t] * lr[j, t]
            wd[j] = s
        msq = 0.0
        for beta in range(b):
            f = 0.0
            for j in range(k):
                f += beta_[r, i, beta, j] * (dx[beta, j] - z[r, i, beta, j] * wd[j])
            res = y[r, i, beta] - f0[r, i, beta] - f
            msq += res * res
            for j in range(k):
                coef[beta, j] = (2.0 / b) * res * beta_[r, i, beta, j]
        norms[i, r] = 1.0 / math.sqrt(1.0 + msq / b)
        has_next = i + 1 < n
        on = base + (i + 1) * s1
        if b == 1 and has_next:  # one pass per row: the update and the next ⟨Δⱼ, x′⟩
            x0 = xf[oi: oi + d]
            x1 = xf[on: on + d]
            for j in range(k):  # span W (t < k): scaled only (projected) or the full update
                row = delta[r, j]
                cb = eta * coef[0, j]
                corr = eta * coef[0, j] * z[r, i, 0, j]  # unprojected: −η coef zⱼ wⱼ
                acc = 0.0
                for t in range(k):
                    v = shrink * row[t]
                    if not project:
                        v = (v + cb * x0[t]) - corr * lr[j, t]
                    row[t] = v
                    acc += v * x1[t]
                dx_next[0, j] = acc
            x0t, x1t = x0[k:], x1[k:]  # t ≥ k, four rows at a time (loops from 0)
            q = 0
            while q < k:
                m = 4 if k - q >= 4 else (2 if k - q >= 2 else 1)
                for u in range(m):
                    cf[u] = shrink
                    cf[4 + u] = -eta * coef[0, q + u]
                if m == 4:
                    s_0, s_1, s_2, s_3 = _fused4(delta[r, q, k:], delta[r, q + 1, k:],
                                                 delta[r, q + 2, k:], delta[r, q + 3, k:],
                                                 x0t, x1t, cf, d - k)
                    dx_next[0, q] += s_0
                    dx_next[0, q + 1] += s_1
                    dx_next[0, q + 2] += s_2
                    dx_next[0, q + 3] += s_3
                elif m == 2:
                    s_0, s_1 = _fused2(delta[r, q, k:], delta[r, q + 1, k:], x0t, x1t, cf,
                                       d - k)
                    dx_next[0, q] += s_0
                    dx_next[0, q + 1] += s_1
                else:
                    dx_next[0, q] += _fused1(delta[r, q, k:], x0t, x1t, cf, 0, d - k)
                q += m
            dx, dx_next = dx_next, dx
            continue
        for j in range(k):
            row = delta[r, j]
            if prox != 0.0:
                for t in range(d):
                    row[t] *= shrink
            for beta in range(b):
                cb = eta * coef[beta, j]
                ob = oi + beta * s2
                xt, rt = xf[ob + lo: ob + d], row[lo:]
                for t in range(d - lo):
                    rt[t] += cb * xt[t]
            if not project:
                zs = 0.0
                for beta in range(b):
                    zs += coef[beta, j] * z[r, i, beta, j]
                for t in range(k):
                    row[t] -= eta * (zs * lr[j, t])
            if has_next:
                for beta in range(b):
                    ob = on + beta * s2
                    dx_next[beta, j] = _dot(row, xf[ob: ob + d], d)
        dx, dx_next = dx_next, dx


@njit(cache=True, nogil=True)
def _linear_block(lo, hi, ar, cv, fl):
    for r in range(lo, hi):
        _linear_run(r, ar, cv, fl)


def _linear_runs(ar, cv, fl) -> None:
    """Every run on numba's threads (as :func:`_network_runs`)."""
    over_runs(_linear_block, ar.delta.shape[0], ar, cv, fl)


def linear_chunk(delta: torch.Tensor, x: torch.Tensor, pre, l: torch.Tensor,
                 eta_r: torch.Tensor, norms: torch.Tensor, *, prox: float,
                 project: bool) -> None:
    """n plain SGD steps of a full-rank Δ (R, k, d) in place (module docstring; CPU tensors).

    x (R, n, b, d); ``pre`` the chunk's prepared quantities
    (:class:`~dynamics.learners.linearized.LinearPrepared`): z, beta (R, n, b, k) (Wx and
    βⱼ = λⱼσ′(zⱼ)), y, f0 (R, n, b); l (k, k) or (R, k, k) the rows wⱼ (first k
    coordinates); norms (n, R) receives (1 + mean_b r²)^{−1/2} per step.
    """
    xf, off, s0, s1, s2 = examples_view(x)
    lmat = (l if l.dim() == 3 else l[None]).contiguous()
    arrays = LinearArrays(delta.numpy(), pre.z.contiguous().numpy(),
                          pre.y.contiguous().numpy(), pre.f0.contiguous().numpy(),
                          pre.beta.contiguous().numpy(), lmat.numpy(), eta_r.numpy(),
                          norms.numpy())
    _linear_runs(arrays, ChunkView(xf, off, s0, s1, s2, x.shape[1]),
                 LinearFlags(float(prox), bool(project)))

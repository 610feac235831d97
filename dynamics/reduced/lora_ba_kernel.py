r"""The numba step of the ``lora-ba`` exact chain (:mod:`.lora_ba_chain` derives it).

State of a run: B (k×r), Z (r×t) = A's coordinates in A = span(W, e) (t = k + 1; span(W, W*)
for given rows, W then k×t in ``lf``) and C (r×r,
lower triangular) with CCᵀ = S = A_⊥A_⊥ᵀ; its stream. One step (:func:`draw` then
:func:`step`) draws per example x_A (t), x_E (r) (the coordinates along A_⊥'s row space) and ε,
then, A trained, Bartlett's factor Λ (b×b) of the rest parts (Λₙₙ² ~ χ²_{n_rest − n}, N(0, 1)
below the diagonal), and writes the new (B, Z, C) to the work arrays (the state is replaced only
where all of it is finite, else the run is frozen as diverged).
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from numba import njit

from dynamics.reduced import _rng
from dynamics.reduced._drive import DIVERGED, HIT, RUNNING, drive
from hermite.activations_numba import sigma, sigma_and_deriv

__all__ = ["LbHyper", "work_arrays", "draw", "step", "overlap", "cholesky", "init_factors",
           "advance_block"]

PSD_TOL = 1e-12  # relative size of a pivot of S counted as zero (round-off of S′'s sums)

LbHyper = namedtuple("LbHyper", ["code", "hp", "asc", "scale", "eta", "lr_ratio", "train_a",
                                 "batch", "noise_sd", "rest_dof", "n_steps", "stop_level",
                                 "normalize", "tcode", "thp", "tasc", "squared"])
LbHyper.__doc__ = """Settings of one call: σ(asc·x) by (code, p, asc); s = α/r; η; η_B/η_A;
A trained; batch b; label-noise sd; dof of the rest's Wishart (d − t − r); horizon; stop level
of the overlap (inf: none); rows normalised (False: H's rows as they are, Nⱼ = 1, c = 0);
the teacher σ*(tasc·x) by (tcode, thp, tasc) and squared labels (y = f*² + ε)."""


@njit(cache=True, inline="always")
def _copy(out, a, factor):
    """out = factor·a for 2-d arrays (factor 0: zeros), without a temporary."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = factor * a[i, j] if factor != 0.0 else 0.0


@njit(cache=True, inline="always")
def cholesky(s, out):
    """Lower-triangular out with out·outᵀ = s (r×r, positive semi-definite): a pivot within
    ``PSD_TOL`` of s's largest diagonal entry is a zero column (A_⊥ has lost a direction: with
    r > the rank the teacher needs, the unused directions of A's rest contract and S tends to
    a singular matrix, as A does in R^d); False where s is not positive semi-definite (a
    pivot below −``PSD_TOL`` of that scale, or NaN)."""
    r = s.shape[0]
    scale = 0.0
    for i in range(r):
        scale = max(scale, abs(s[i, i]))
    tol = PSD_TOL * scale
    for i in range(r):
        for j in range(i + 1):
            acc = s[i, j]
            for q in range(j):
                acc -= out[i, q] * out[j, q]
            if i == j:
                if acc > tol:
                    out[i, i] = math.sqrt(acc)
                elif acc >= -tol:
                    out[i, i] = 0.0
                else:
                    return False
            else:
                out[i, j] = acc / out[j, j] if out[j, j] > 0.0 else 0.0
        for j in range(i + 1, r):
            out[i, j] = 0.0
    return True


@njit(cache=True, inline="always")
def draw(hyp, st, w):
    """One step's variates into the work arrays, in this order: per example x_A, x_E, ε (if
    label noise); then (A trained) Λ row by row (normals below the diagonal, then
    √χ²_{n_rest − n}). Returns the stream."""
    xa, xe, eps, lam_r = w[0], w[1], w[2], w[3]
    for n in range(hyp.batch):
        for q in range(xa.shape[1]):
            xa[n, q], st = _rng.normal(st)
        for q in range(xe.shape[1]):
            xe[n, q], st = _rng.normal(st)
        eps[n] = 0.0
        if hyp.noise_sd > 0.0:
            eps[n], st = _rng.normal(st)
    if hyp.train_a:
        for n in range(hyp.batch):
            for q in range(n):
                lam_r[n, q], st = _rng.normal(st)
            chi, st = _rng.chi2(hyp.rest_dof - n, st)
            lam_r[n, n] = math.sqrt(chi)
    return st


@njit(cache=True, inline="always")
def _terms(hyp, lf, bm, zm, cm, w):
    """P = Z_W Lᵀ, Q = ZZᵀ + CCᵀ and the row norms Nⱼ = ‖wⱼ + s(BA)ⱼ‖ (1 with rows as they
    are) into the work arrays; W's rows ``lf`` (k × t_w) are in A's first t_w coordinates."""
    k, r, t, tw = bm.shape[0], bm.shape[1], zm.shape[1], lf.shape[1]
    pm, qm, nrm = w[4], w[5], w[6]
    s = hyp.scale
    for i in range(r):
        for j in range(k):
            acc = 0.0
            for q in range(tw):
                acc += zm[i, q] * lf[j, q]
            pm[i, j] = acc
        for j in range(r):
            acc = 0.0
            for q in range(t):
                acc += zm[i, q] * zm[j, q]
            for q in range(r):
                acc += cm[i, q] * cm[j, q]
            qm[i, j] = acc
    for j in range(k):
        if not hyp.normalize:
            nrm[j] = 1.0
            continue
        wsq, bp, bqb = 0.0, 0.0, 0.0
        for q in range(tw):
            wsq += lf[j, q] * lf[j, q]
        for i in range(r):
            bp += bm[j, i] * pm[i, j]
            for q in range(r):
                bqb += bm[j, i] * qm[i, q] * bm[j, q]
        nrm[j] = math.sqrt(wsq + 2.0 * s * bp + s * s * bqb)


@njit(cache=True, inline="always")
def step(hyp, lf, vt, lam, bm, zm, cm, w):
    """One SGD step on the draws in ``w`` (chain module, (BA1)–(BA4)): the new (B, Z, C) into
    w[16], w[17], w[18]; returns Σₙ(y − f̂)² (not finite, or a failed Cholesky: NaN)."""
    k, r, t, tw = bm.shape[0], bm.shape[1], zm.shape[1], lf.shape[1]
    xa, xe, eps, lam_r = w[0], w[1], w[2], w[3]
    pm, qm, nrm, act, dsg, ax = w[4], w[5], w[6], w[7], w[8], w[9]
    gb, csum, mm, gza, gze, bcb = w[10], w[11], w[12], w[13], w[14], w[15]
    b1, z1, c1, sm = w[16], w[17], w[18], w[19]
    s, asc, nb = hyp.scale, hyp.asc, hyp.batch
    _terms(hyp, lf, bm, zm, cm, w)
    _copy(gb, gb, 0.0)
    for j in range(k):
        csum[j] = 0.0
    _copy(gza, gza, 0.0)
    _copy(gze, gze, 0.0)
    rss = 0.0
    for n in range(nb):
        for i in range(r):  # Ax = Z x_A + C x_E
            acc = 0.0
            for q in range(t):
                acc += zm[i, q] * xa[n, q]
            for q in range(r):
                acc += cm[i, q] * xe[n, q]
            ax[i] = acc
        y = hyp.noise_sd * eps[n]
        fhat, fstar = 0.0, 0.0
        for j in range(k):
            pre = 0.0
            for q in range(t):
                pre += vt[j, q] * xa[n, q]
            if hyp.squared:  # f* = Σλᵢσ*(⟨vᵢ, x⟩), squared below
                fstar += lam[j] * sigma(hyp.tasc * pre, hyp.tcode, hyp.thp)
            else:
                y += lam[j] * sigma(hyp.tasc * pre, hyp.tcode, hyp.thp)
            hx = 0.0
            for q in range(tw):
                hx += lf[j, q] * xa[n, q]
            for i in range(r):
                hx += s * bm[j, i] * ax[i]
            act[j] = hx / nrm[j]
            sv, sd = sigma_and_deriv(asc * act[j], hyp.code, hyp.hp)
            dsg[j] = asc * sd
            fhat += lam[j] * sv
        if hyp.squared:
            y += fstar * fstar
        resid = y - fhat
        rss += resid * resid
        for j in range(k):  # gⱼ = δⱼ/Nⱼ (kept in act's place after cⱼ), cⱼ = δⱼaⱼ/Nⱼ²
            g = -2.0 * resid * lam[j] * dsg[j] / nrm[j]
            if hyp.normalize:
                csum[j] += g * act[j] / nrm[j]
            act[j] = g
            for i in range(r):
                gb[j, i] += g * ax[i]
        for i in range(r):  # mₙ = Bᵀgₙ
            acc = 0.0
            for j in range(k):
                acc += bm[j, i] * act[j]
            mm[i, n] = acc
            for q in range(t):
                gza[i, q] += acc * xa[n, q]
            for q in range(r):
                gze[i, q] += acc * xe[n, q]
    step_b = hyp.lr_ratio * hyp.eta / nb
    for j in range(k):  # B′ = B − ρη/b · s(Σ g(Ax)ᵀ − diag(Σc)(Pᵀ + sBQ))
        for i in range(r):
            bq = 0.0
            for q in range(r):
                bq += bm[j, q] * qm[q, i]
            b1[j, i] = bm[j, i] - step_b * s * (gb[j, i] - csum[j] * (pm[i, j] + s * bq))
    if not hyp.train_a:
        _copy(z1, zm, 1.0)
        _copy(c1, cm, 1.0)
        return rss
    for i in range(r):  # Bᵀdiag(Σc)B
        for q in range(r):
            acc = 0.0
            for j in range(k):
                acc += bm[j, i] * csum[j] * bm[j, q]
            bcb[i, q] = acc
    ea = hyp.eta * s / nb
    for i in range(r):  # Z′ = Z − ηs/b (Σ m x_Aᵀ − [BᵀcL, 0] − s BᵀcB Z)
        for q in range(t):
            acc = gza[i, q]
            if q < tw:
                for j in range(k):
                    acc -= bm[j, i] * csum[j] * lf[j, q]
            for p in range(r):
                acc -= s * bcb[i, p] * zm[p, q]
            z1[i, q] = zm[i, q] - ea * acc
        for q in range(r):  # C_E′ = C − ηs/b (Σ m x_Eᵀ − s BᵀcB C), into c1 for now
            acc = gze[i, q]
            for p in range(r):
                acc -= s * bcb[i, p] * cm[p, q]
            c1[i, q] = cm[i, q] - ea * acc
    for i in range(r):  # MΛ (r×b) in mm's place, column by column (Λ lower triangular)
        for n in range(nb):
            acc = 0.0
            for m in range(n, nb):
                acc += mm[i, m] * lam_r[m, n]
            mm[i, n] = acc
    for i in range(r):  # S′ = C_E′C_E′ᵀ + (ηs/b)² (MΛ)(MΛ)ᵀ
        for j in range(i + 1):
            acc = 0.0
            for q in range(r):
                acc += c1[i, q] * c1[j, q]
            rest = 0.0
            for n in range(nb):
                rest += mm[i, n] * mm[j, n]
            sm[i, j] = acc + ea * ea * rest
            sm[j, i] = sm[i, j]
    if not cholesky(sm, c1):
        return math.nan
    return rss


@njit(cache=True, inline="always")
def overlap(bm, zm, cm, u, w):
    """|⟨v₁(BA), u⟩| from (B, Z, C): v₁ = Ãᵀy/‖Ãᵀy‖ (Ã = [Z, C]), y the top eigenvector of
    BᵀB·Q (Q = ÃÃᵀ; power iteration, r > 1), so the overlap is |y·Zu|/√(yᵀQy); NaN where
    BA = 0."""
    k, r, t = bm.shape[0], bm.shape[1], zm.shape[1]
    qm, nb, y = w[5], w[15], w[21]
    zu = w[20]
    for i in range(r):
        acc = 0.0
        for q in range(t):
            acc += zm[i, q] * u[q]
        zu[i] = acc
        for j in range(r):
            acc = 0.0
            for q in range(t):
                acc += zm[i, q] * zm[j, q]
            for q in range(r):
                acc += cm[i, q] * cm[j, q]
            qm[i, j] = acc
            acc = 0.0
            for q in range(k):
                acc += bm[q, i] * bm[q, j]
            nb[i, j] = acc
        y[i] = 1.0 + 0.1 * i
    for _it in range(1 if r == 1 else 2000):
        change = 0.0
        tot = 0.0
        for i in range(r):  # NQy, stored in sm's first column
            acc = 0.0
            for j in range(r):
                qy = 0.0
                for q in range(r):
                    qy += qm[j, q] * y[q]
                acc += nb[i, j] * qy
            w[19][i, 0] = acc
            tot += acc * acc
        tot = math.sqrt(tot)
        if not tot > 0.0:
            return math.nan
        for i in range(r):
            v = w[19][i, 0] / tot
            change += (v - y[i]) * (v - y[i])
            y[i] = v
        if change < 1e-26:
            break
    num, den = 0.0, 0.0
    for i in range(r):
        num += y[i] * zu[i]
        for j in range(r):
            den += y[i] * qm[i, j] * y[j]
    return abs(num) / math.sqrt(den)


@njit(cache=True)
def init_factors(seed, run, d, kaiming, b_scale, bm, zm, cm, w):
    """A₀ = [Z₀, A_⊥] with i.i.d. N(0, 1/d) (Bartlett: C₀ = T/√d, Tᵢᵢ² ~ χ²_{d−t−i}) or
    U(−1/√d, 1/√d) entries (S₀ = Σ over the d − t columns of a aᵀ, drawn one by one: O(r²d)
    once), then B₀ (zero, or N(0, b_scale²) when b_scale > 0); returns the run's stream."""
    r, t = zm.shape[0], zm.shape[1]
    st = _rng.seed_stream(seed, run)
    sd = 1.0 / math.sqrt(d)
    for i in range(r):
        for q in range(t):
            if kaiming:
                v, st = _rng.uniform(st)
                zm[i, q] = (2.0 * v - 1.0) * sd
            else:
                v, st = _rng.normal(st)
                zm[i, q] = v * sd
    if kaiming:
        sm, col = w[19], w[20]
        sm[:, :] = 0.0
        for _c in range(d - t):
            for i in range(r):
                v, st = _rng.uniform(st)
                col[i] = (2.0 * v - 1.0) * sd
            for i in range(r):
                for j in range(i + 1):
                    sm[i, j] += col[i] * col[j]
        for i in range(r):
            for j in range(i):
                sm[j, i] = sm[i, j]
        cholesky(sm, cm)
    else:
        cm[:, :] = 0.0
        for i in range(r):
            for j in range(i):
                v, st = _rng.normal(st)
                cm[i, j] = v * sd
            chi, st = _rng.chi2(d - t - i, st)
            cm[i, i] = math.sqrt(chi) * sd
    for j in range(bm.shape[0]):
        for i in range(r):
            v = 0.0
            if b_scale > 0.0:
                v, st = _rng.normal(st)
            bm[j, i] = b_scale * v
    return st


@njit(cache=True, inline="always")
def _finite(a):
    """Every entry of the 2-d array ``a`` finite (no temporary array)."""
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            if not math.isfinite(a[i, j]):
                return False
    return True


@njit(cache=True, inline="always")
def _lb_step(ctx, sc, _t):
    """One step of run ctx[0] (:func:`._drive.drive`): the state moves only where finite."""
    hyp, lf, vt, lam, u, bm, zm, cm, w = ctx[1:10]
    st = draw(hyp, sc[0], w)
    rss = step(hyp, lf, vt, lam, bm, zm, cm, w)
    b1, z1, c1 = w[16], w[17], w[18]
    if not (math.isfinite(rss) and _finite(b1) and _finite(z1) and _finite(c1)):
        return (st,), DIVERGED
    _copy(bm, b1, 1.0)
    _copy(zm, z1, 1.0)
    _copy(cm, c1, 1.0)
    if ctx[12] and overlap(bm, zm, cm, u, w) >= hyp.stop_level:
        return (st,), HIT
    return (st,), RUNNING


@njit(cache=True, inline="always")
def _lb_record(ctx, sc, c):
    """Checkpoint c: B into rec_b[r, c], [Z, C] into rec_a[r, c]."""
    r, bm, zm, cm, rec_b, rec_a = ctx[0], ctx[6], ctx[7], ctx[8], ctx[10], ctx[11]
    t = zm.shape[1]
    for i in range(zm.shape[0]):
        for j in range(bm.shape[0]):
            rec_b[r, c, j, i] = bm[j, i]
        for q in range(t):
            rec_a[r, c, i, q] = zm[i, q]
        for q in range(cm.shape[1]):
            rec_a[r, c, i, t + q] = cm[i, q]


@njit(cache=True, _nrt=False)  # allocates nothing; see _drive on reference counting
def _run_one(run, hyp, lf, vt, lam, u, bm, zm, cm, w, rec_b, rec_a, st, cp_steps):
    """Advance run ``run`` from stream ``st`` by up to ``hyp.n_steps`` steps (B, Z, C in
    place), recording at ``cp_steps``; (sc, div_step, hit_step) as :func:`._drive.drive`."""
    ctx = (run, hyp, lf, vt, lam, u, bm, zm, cm, w, rec_b, rec_a, math.isfinite(hyp.stop_level))
    return drive(_lb_step, _lb_record, ctx, (st,), hyp.n_steps, cp_steps)


@njit(cache=True, nogil=True)
def advance_block(lo, hi, hyp, lfs, vts, lams, us, states, bs, zs, cs, div, hit, cp_steps,
                  rec_b, rec_a):
    """Runs lo … hi − 1 by ``hyp.n_steps`` steps (in place), recording at ``cp_steps``."""
    k, r, t = bs.shape[1], bs.shape[2], zs.shape[2]
    w = work_arrays(k, r, t, hyp.batch)
    for run in range(lo, hi):
        sc, div[run], hit[run] = _run_one(run, hyp, lfs[run], vts[run], lams[run], us[run],
                                          bs[run], zs[run], cs[run], w, rec_b, rec_a,
                                          states[run], cp_steps)
        states[run] = sc[0]


@njit(cache=True)
def work_arrays(k, r, t, b):
    """Scratch of one run's step: draws (x_A, x_E, ε, Λ), per-step terms and the new state."""
    z = np.zeros
    return (z((b, t)), z((b, r)), z(b), z((b, b)),
            z((r, k)), z((r, r)), z(k), z(k), z(k), z(r),
            z((k, r)), z(k), z((r, b)), z((r, t)), z((r, r)), z((r, r)),
            z((k, r)), z((r, t)), z((r, r)), z((r, r)), z(r), z(r))

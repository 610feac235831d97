"""One run of the reduced chain (numba): the exact step (R3)–(R6) of the package docstring.

The run loop is :func:`._drive.drive`; the step and its parts are ``inline="always"``, so the
whole loop compiles into :func:`run_one`, without NRT (see :mod:`._drive`). Variates come from the
run's stream, or, in *given* mode (tests), from arrays: z, a, b, ε per step and example, and
the Gram matrix of the examples' parts rₙ ⊥ span(W, e, ê), from which ρ² = ‖Σₙ ḡₙ rₙ‖² =
ḡᵀ Gram ḡ. In stream mode ρ² = ‖ḡ‖² χ²_{d−k−2} (same law, see (R5)).

Packed arguments (named tuples, which numba and numba-cuda both compile): :class:`Hyper` (the
settings of a call), :class:`Inst` (per-instance rows ``prm`` = [λ (k), c (k), N (k),
u_w (k), u⊥, ξ, s, o] and the k×k factor ``L``, rows wᵢ in an orthonormal basis of span W;
``ident`` skips L z; s = 0 for unit rows, else the App. B row factor: rows s(wⱼ + ξĉⱼû), never
renormalised, output factor o = 1/ξ), :class:`Runs` (the runs' state, in place) and :class:`Records`
(checkpoints). Nothing here allocates except :func:`scratch`, so the same code runs as a CUDA
device function (:mod:`.cuda_kernel`).
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import njit

from dynamics.reduced import _rng
from dynamics.reduced._drive import M_TOL, drive, overlap_status
from hermite.activations_numba import sigma, sigma_and_deriv

__all__ = ["Hyper", "Inst", "Runs", "Records", "ChainState", "FLAT_ARGS", "RankOneSettings",
           "make_hyper", "typed_hyper", "run_one",
           "run_index", "scratch", "M_TOL", "N_WORK_K", "N_WORK_B"]

Hyper = namedtuple("Hyper", ["project", "joint", "code", "hp", "dof", "eta", "eta_c", "batch",
                             "noise_sd", "n_steps", "stop_level", "stop_abs"])
Hyper.__doc__ = """Settings of one call: variant flags, σ's (code, p), χ² dof d − k − 2, η,
η_c, batch b, label-noise sd, horizon, stop level (inf: none) and whether it applies to |m|."""
Inst = namedtuple("Inst", ["L", "ident", "prm", "inst_idx"])
Inst.__doc__ = "Per-instance L (I, k, k), ident (I,), prm (I, 4k + 4); instance of each run (R,)."
Runs = namedtuple("Runs", ["states", "mu", "nu", "pw", "chat", "div_step", "hit_step"])
Runs.__doc__ = "The runs' streams, μ, ν, p, ĉ (advanced in place) and div/hit steps (R,)."
Records = namedtuple("Records", ["cp_steps", "cp_m", "cp_mu", "cp_nu", "cp_pw", "cp_chat"])
Records.__doc__ = "Checkpoint steps (C,) and records m, μ, ν (R, C), p (R, C, k|0), ĉ (R, C, k|0)."
ChainState = namedtuple("ChainState", ["mu", "nu", "pw", "chat"])
ChainState.__doc__ = "A run's (or, with a leading run axis, the runs') μ, ν, p and ĉ."
# the flat positional order of the ``advance`` entry points (tests call them with it)
FLAT_ARGS = ("project", "joint", "L", "ident", "prm", "inst_idx", "code", "hp", "dof", "eta",
             "eta_c", "batch", "noise_sd", "states", "mu", "nu", "pw", "chat", "n_steps",
             "cp_steps", "cp_m", "cp_mu", "cp_nu", "cp_pw", "cp_chat", "div_step",
             "stop_level", "stop_abs", "hit_step")

_Pre = namedtuple("_Pre", ["lam", "uw", "u_perp", "xi", "has_uw", "refresh", "chi2_prep",
                           "res_scale", "given", "use_stop", "row_scale", "inv_out"])
_Rows = namedtuple("_Rows", ["tc1", "tc2", "wz", "ahat", "sdv", "gw", "gc", "wu", "sc1", "sc2",
                             "vu", "A", "Bv", "eps", "gvec", "Z"])

N_WORK_K = 11  # rows of the per-run scratch ``wk`` (length k each): _Rows tc1 … vu
N_WORK_B = 4  # rows of the per-run scratch ``wb`` (length b each): _Rows A … gvec


@dataclass(frozen=True)
class RankOneSettings:
    """The rank-1 chain's regime, as the learner's options and step sizes give it: projected,
    ĉ joint, χ² dof d − k − 2 (tests may override it), η, η_c, batch b and label-noise sd."""

    project: bool
    joint: bool
    dof: int
    eta: float
    eta_c: float
    batch: int
    noise_sd: float

    @classmethod
    def from_config(cls, config, d: int, k: int, dof: int | None = None) -> RankOneSettings:
        """The settings of ``config`` at dimension d and rank k (``dof``: None for d − k − 2)."""
        o = config.options
        return cls(bool(o.project), bool(o.joint_c), int(d - k - 2 if dof is None else dof),
                   float(config.eta), float(config.step_size_c), int(config.batch),
                   math.sqrt(config.label_noise))


_HYPER_TYPES = (bool, bool, int, int, int, float, float, int, float, int, float, bool)


def typed_hyper(hyp: Hyper) -> Hyper:
    """``hyp`` with the field types the kernels are compiled for."""
    return Hyper(*(cast(v) for cast, v in zip(_HYPER_TYPES, hyp, strict=True)))


def make_hyper(settings: RankOneSettings, code: tuple, n_steps: int,
               stop_level: float = math.inf, stop_abs: bool = True) -> Hyper:
    """:class:`Hyper` of one call: ``settings``, σ's ``code`` (code, p) from
    :func:`hermite.activations_numba.act_code`, the horizon and the stop rule."""
    s = settings
    return typed_hyper(Hyper(s.project, s.joint, code[0], code[1], s.dof, s.eta, s.eta_c,
                             s.batch, s.noise_sd, n_steps, stop_level, stop_abs))


@njit(cache=True)
def scratch(k, batch):
    """Per-run scratch arrays (wk, wb, Z) of :func:`run_one`."""
    return np.empty((N_WORK_K, k)), np.empty((N_WORK_B, batch)), np.empty((batch, k))


@njit(cache=True)
def _student_coeffs(L, ident, xi, pw, chat, project, wu, sc1, sc2, vu, row_scale):
    """1/N̂ⱼ, ξĉⱼ/N̂ⱼ and ⟨v̂ⱼ, û⟩ with N̂ⱼ = √(1 + 2ξĉⱼ⟨wⱼ,û⟩ + ξ²ĉⱼ²) (R2); App. B
    (``row_scale`` s > 0): s, sξĉⱼ and 0 (no renormalisation, so no term from its gradient)."""
    k = chat.shape[0]
    for j in range(k):
        acc = 0.0
        if not project:
            if ident:
                acc = pw[j]
            else:
                for i in range(k):
                    acc += L[j, i] * pw[i]
        wu[j] = acc
        xc = xi * chat[j]
        if row_scale > 0.0:
            sc1[j] = row_scale
            sc2[j] = row_scale * xc
            vu[j] = 0.0
            continue
        nh = math.sqrt(1.0 + 2.0 * xc * acc + xc * xc)
        sc1[j] = 1.0 / nh
        sc2[j] = xc / nh
        vu[j] = (acc + xc) / nh


@njit(cache=True, inline="always")
def _neuron(w, t1, t2, ux, s1, s2, s, lam, code, hp):
    """Neuron i of one example (R2): (λ(σ(tᵢ) − σ(âᵢ)), λσ′(âᵢ)ξĉᵢ/N̂ᵢ, âᵢ, σ′(âᵢ)) with
    tᵢ = w t1 + t2⟨u,x⟩ (t1 = 1/Nᵢ, t2 = ξcᵢ/Nᵢ), âᵢ = w s1 + s2 s (s1 = 1/N̂ᵢ, s2 = ξĉᵢ/N̂ᵢ),
    w = ⟨wᵢ, x⟩."""
    ah = w * s1 + s2 * s
    sv, sd = sigma_and_deriv(ah, code, hp)
    return lam * (sigma(w * t1 + t2 * ux, code, hp) - sv), lam * sd * s2, ah, sd


@njit(cache=True, inline="always")
def _dot(x, y):
    acc0 = 0.0
    acc1 = 0.0
    for i in range(0, x.shape[0] - 1, 2):
        acc0 += x[i] * y[i]
        acc1 += x[i + 1] * y[i + 1]
    if x.shape[0] % 2:
        acc0 += x[-1] * y[-1]
    return acc0 + acc1


@njit(cache=True, inline="always")
def _overlap(prm, pw, mu, project):
    """m = ⟨û, u⟩ = ⟨p, u_w⟩ + μ u⊥ (R1)."""
    k = pw.shape[0]
    m = mu * prm[4 * k]
    if not project:
        for i in range(k):
            m += pw[i] * prm[3 * k + i]
    return m


@njit(cache=True, inline="always")
def _variates(hyp, given, t, st, w):
    """z ~ N(0, I_k), a = ⟨e,x⟩, b = ⟨ê,x⟩ and label noise ε of the batch into w.Z, w.A,
    w.Bv, w.eps: from the stream ``st`` (returned advanced) or row t of the given arrays."""
    Zg, Ag, Bg, Eg, _ = given
    Z, A, Bv, eps = w.Z, w.A, w.Bv, w.eps
    k = Z.shape[1]
    for n in range(hyp.batch):
        if Zg.shape[0] > 0:
            for i in range(k):
                Z[n, i] = Zg[t, n, i]
            A[n] = Ag[t, n]
            Bv[n] = Bg[t, n]
            eps[n] = Eg[t, n]
        else:
            for i in range(k):
                Z[n, i], st = _rng.normal(st)
            A[n], st = _rng.normal(st)
            Bv[n], st = _rng.normal(st)
            if hyp.noise_sd > 0.0:
                e, st = _rng.normal(st)
                eps[n] = hyp.noise_sd * e
    return st


@njit(cache=True, inline="always")
def _example(hyp, pre, w, n, ux, s):
    """Residual term −2(y − f̂)/b and g = Σⱼ δⱼξĉⱼ/N̂ⱼ of example n (R3); âⱼ, σ′(âⱼ) into
    w.ahat, w.sdv. Two accumulators each (even/odd neurons) halve the dependency chains."""
    wz, tc1, tc2, sc1, sc2, ahat, sdv, lam = (w.wz, w.tc1, w.tc2, w.sc1, w.sc2, w.ahat, w.sdv,
                                              pre.lam)
    f0 = w.eps[n] * pre.inv_out
    f1 = 0.0
    q0 = 0.0
    q1 = 0.0
    for i in range(wz.shape[0]):
        df, dq, ah, sd = _neuron(wz[i], tc1[i], tc2[i], ux, sc1[i], sc2[i], s, lam[i],
                                 hyp.code, hyp.hp)
        ahat[i] = ah
        sdv[i] = sd
        if i % 2 == 0:
            f0 += df
            q0 += dq
        else:
            f1 += df
            q1 += dq
    res = pre.res_scale * (f0 + f1)  # −2o(y − f̂)/b
    return res, res * (q0 + q1)  # g = Σⱼ δⱼξĉⱼ/N̂ⱼ, δⱼ = res λⱼσ′(âⱼ)


@njit(cache=True, inline="always")
def _backprop(hyp, pre, L, ident, w, res, s):
    """Example terms of G_W (−Σⱼ γⱼwⱼ, γⱼ = δⱼâⱼξĉⱼ/N̂ⱼ², R3) and of ∂L/∂ĉ (R4)."""
    gw, gc, lam, sdv, ahat, sc1, sc2, vu = (w.gw, w.gc, pre.lam, w.sdv, w.ahat, w.sc1, w.sc2,
                                            w.vu)
    k = gw.shape[0]
    for j in range(k):
        beta = res * lam[j] * sdv[j]
        if not hyp.project and pre.row_scale == 0.0:  # the renormalisation's gradient
            kap = beta * ahat[j] * sc2[j] * sc1[j]
            if ident:
                gw[j] -= kap
            else:
                for i in range(k):
                    gw[i] -= kap * L[j, i]
        if hyp.joint:  # (R4)
            gc[j] += beta * pre.xi * sc1[j] * (s - ahat[j] * vu[j])


@njit(cache=True, inline="always")
def _gradient(hyp, pre, L, ident, mu, nu, pw, w):
    """Batch-mean gradient (R3, R4): returns (G_e, G_ê); G_W into w.gw, ∂L/∂ĉ into w.gc,
    the ḡₙ into w.gvec."""
    Z, wz, gw, gc, A, Bv, gvec = w.Z, w.wz, w.gw, w.gc, w.A, w.Bv, w.gvec
    k = gw.shape[0]
    ge = 0.0
    geh = 0.0
    for i in range(k):
        gw[i] = 0.0
        gc[i] = 0.0
    for n in range(hyp.batch):
        a = A[n]
        b = Bv[n]
        ux = pre.u_perp * a
        s = mu * a + nu * b
        for i in range(k):
            if ident:
                wz[i] = Z[n, i]
            else:
                acc = 0.0
                for j in range(k):
                    acc += L[i, j] * Z[n, j]
                wz[i] = acc
        if pre.has_uw:
            ux += _dot(pre.uw, Z[n])
        if not hyp.project:
            s += _dot(pw, Z[n])
        res, g = _example(hyp, pre, w, n, ux, s)
        if hyp.joint or not hyp.project:
            _backprop(hyp, pre, L, ident, w, res, s)
        gvec[n] = g
        ge += g * a
        geh += g * b
        if not hyp.project:
            for i in range(k):
                gw[i] += g * Z[n, i]
    return ge, geh


@njit(cache=True, inline="always")
def _rho2(pre, given, t, st, gvec):
    """ρ² = ‖Σₙ ḡₙ rₙ‖² (R5): ḡᵀ Gram ḡ (given) or ‖ḡ‖² χ²_{d−k−2}; (ρ², stream)."""
    Gg = given[4]
    rho2 = 0.0
    if pre.given:
        for n in range(gvec.shape[0]):
            for n2 in range(gvec.shape[0]):
                rho2 += gvec[n] * Gg[t, n, n2] * gvec[n2]
    else:
        q, st = _rng.chi2_prepared(pre.chi2_prep, st)
        for n in range(gvec.shape[0]):
            rho2 += gvec[n] * gvec[n]
        rho2 *= q
    return rho2, st


@njit(cache=True, inline="always")
def _sphere_step(hyp, mu, nu, ge, geh, rho2, pw, chat, w):
    """Spherical step of û and plain step of ĉ (R5, R6); p, ĉ in place, returns (μ′, ν′)."""
    eta = hyp.eta
    gw, gc = w.gw, w.gc
    k = gw.shape[0]
    tang = mu * ge + nu * geh
    if not hyp.project:
        for i in range(k):
            tang += pw[i] * gw[i]
    ne = mu - eta * (ge - tang * mu)
    nt = nu - eta * (geh - tang * nu)
    er = eta * math.sqrt(rho2)
    sq_rest = nt * nt + er * er
    norm2 = ne * ne + sq_rest
    if not hyp.project:
        for i in range(k):
            pw[i] = pw[i] - eta * (gw[i] - tang * pw[i])
            norm2 += pw[i] * pw[i]
    inv = 1.0 / math.sqrt(norm2)
    if not hyp.project:
        for i in range(k):
            pw[i] *= inv
    if hyp.joint:
        for j in range(k):
            chat[j] -= hyp.eta_c * gc[j]
    return ne * inv, math.sqrt(sq_rest) * inv


@njit(cache=True, inline="always")
def _step(ctx, sc, t):
    """One step of the run from step t: ((stream, μ, ν), status) (:func:`._drive.drive`)."""
    _r, hyp, inst, pre, pw, chat, _rec, given, w = ctx
    L, ident, prm = inst
    st, mu, nu = sc
    st = _variates(hyp, given, t, st, w)
    if pre.refresh:
        _student_coeffs(L, ident, pre.xi, pw, chat, hyp.project, w.wu, w.sc1, w.sc2, w.vu,
                        pre.row_scale)
    ge, geh = _gradient(hyp, pre, L, ident, mu, nu, pw, w)
    rho2, st = _rho2(pre, given, t, st, w.gvec)
    mu, nu = _sphere_step(hyp, mu, nu, ge, geh, rho2, pw, chat, w)
    m = _overlap(prm, pw, mu, hyp.project)
    return (st, mu, nu), overlap_status(m, nu, pre.use_stop, hyp.stop_level, hyp.stop_abs)


@njit(cache=True, inline="always")
def _record(ctx, sc, c):
    """Checkpoint c of run r: m, μ, ν, p, ĉ into row r of the records."""
    r, hyp, inst, _pre, pw, chat, rec, _given, _w = ctx
    _st, mu, nu = sc
    _steps, cp_m, cp_mu, cp_nu, cp_pw, cp_chat = rec
    cp_m[r, c] = _overlap(inst[2], pw, mu, hyp.project)
    cp_mu[r, c] = mu
    cp_nu[r, c] = nu
    for i in range(cp_pw.shape[2]):  # element loops: a slice assignment needs NRT on CUDA
        cp_pw[r, c, i] = pw[i]
    for i in range(cp_chat.shape[2]):
        cp_chat[r, c, i] = chat[i]


@njit(cache=True, inline="always")
def _prepare(hyp, prm, w, given):
    """Loop constants of a run (:class:`_Pre`); teacher coefficients 1/Nᵢ, ξcᵢ/Nᵢ into w."""
    tc1, tc2, gw, gc, eps = w.tc1, w.tc2, w.gw, w.gc, w.eps
    k = gw.shape[0]
    xi = prm[4 * k + 1]
    uw = prm[3 * k:4 * k]
    has_uw = False
    for i in range(k):
        tc1[i] = 1.0 / prm[2 * k + i]
        tc2[i] = xi * prm[k + i] / prm[2 * k + i]
        has_uw = has_uw or uw[i] != 0.0
        gw[i] = 0.0
        gc[i] = 0.0
    for n in range(hyp.batch):
        eps[n] = 0.0
    out = prm[4 * k + 3]
    return _Pre(prm[:k], uw, prm[4 * k], xi, has_uw, hyp.joint or not hyp.project,
                _rng.chi2_prepare(hyp.dof), -2.0 * out * out / hyp.batch, given[0].shape[0] > 0,
                math.isfinite(hyp.stop_level), prm[4 * k + 2], 1.0 / out)


@njit(cache=True, _nrt=False)  # allocates nothing; see _drive on reference counting
def run_one(r, hyp, inst, sc, pw, chat, rec, given, work):
    """Advance run ``r`` from sc = (stream, μ, ν) and p, ĉ by ``hyp.n_steps`` steps.

    ``inst`` = (L, ident, prm) of its instance; ``pw`` and ``chat`` are updated in place;
    checkpoints go to row ``r`` of ``rec``; ``given`` = (z, a, b, ε, Gram) arrays (empty:
    stream mode); ``work`` = :func:`scratch`. Returns ((stream, μ, ν), div_step, hit_step):
    div_step the first step with a non-finite state or |m| > 1 (the run is frozen there),
    hit_step the first with m ≥ stop_level (|m| if ``stop_abs``; the run stops there); −1
    when it did not happen.
    """
    wk, wb, Z = work
    w = _Rows(wk[0], wk[1], wk[2], wk[3], wk[4], wk[5], wk[6], wk[7], wk[8], wk[9], wk[10],
              wb[0], wb[1], wb[2], wb[3], Z)
    pre = _prepare(hyp, inst[2], w, given)
    _student_coeffs(inst[0], inst[1], pre.xi, pw, chat, hyp.project, w.wu, w.sc1, w.sc2, w.vu,
                    pre.row_scale)
    ctx = (r, hyp, inst, pre, pw, chat, rec, given, w)
    return drive(_step, _record, ctx, sc, hyp.n_steps, rec.cp_steps)


@njit(cache=True)
def run_index(r, hyp, inst, runs, rec, given, work):
    """Run ``r`` of ``runs`` (:class:`Runs`, in place) with its instance's row of ``inst``.
    Shared by the CPU block of runs (:mod:`._kernel`) and the CUDA kernel."""
    i = inst.inst_idx[r]
    sc, dv, ht = run_one(r, hyp, (inst.L[i], inst.ident[i], inst.prm[i]),
                         (runs.states[r], runs.mu[r], runs.nu[r]), runs.pw[r], runs.chat[r],
                         rec, given, work)
    runs.states[r] = sc[0]
    runs.mu[r] = sc[1]
    runs.nu[r] = sc[2]
    runs.div_step[r] = dv
    runs.hit_step[r] = ht

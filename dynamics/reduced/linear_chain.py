r"""The exact chain of the full-rank ``linearized`` learner: its law at any d for a cost per
step independent of d.

Derivation (from :class:`dynamics.learners.linearized.LinearizedFullRank`; no approximation)
-------------------------------------------------------------------------------------------
Canonical frame: x ~ N(0, I_d); A = the first t = k + 1 coordinates (span W, whose rows are
L's in the first k, and e, u's unit part ⊥ W). The teacher's rows vᵢ = (wᵢ + ξcᵢu)/Nᵢ and u
lie in A. The state is Δ ∈ R^{k×d}, Δ₀ = 0.

(L0) *State.* Rotations Q fixing A pointwise leave x's law, W, u, Π and the teacher
     invariant, and the step map is equivariant: F(ΔQᵀ, Qx) = F(Δ, x)Qᵀ. So the next state's
     law given Δ depends only on P = Δ's coordinates in A (k × t) and the Gram ZZᵀ of the
     rows' parts outside A; any Z (k × m) with that Gram, in some orthonormal basis E of a
     subspace of A^⊥ holding the outside parts, represents the orbit (as
     :mod:`.network_chain` (N0)). Start: P = 0, m = 0.
(L1) *One example* in the basis (A, E, rest): x_A ~ N(0, I_t), x_E ~ N(0, I_m), r ~
     N(0, I_{d−t−m}), independent. z = L x_A[:k], y = Σᵢλᵢσ(⟨vᵢ, x_A⟩) + ε, f₀ = Σⱼλⱼσ(zⱼ),
     βⱼ = λⱼσ′(zⱼ), and ⟨Δⱼ, x⟩ = ⟨Pⱼ, x_A⟩ + ⟨Zⱼ, x_E⟩, ⟨wⱼ, Δⱼ⟩ = ⟨Lⱼ, Pⱼ[:k]⟩: the residual
     r = y − f₀ − Σⱼβⱼ(⟨Δⱼ, x⟩ − zⱼ⟨wⱼ, Δⱼ⟩) does not depend on the rest.
(L2) *Step.* With cₙⱼ = η(2/b)rₙβₙⱼ and a = 1 − 2η·prox,
     Δⱼ ← aΔⱼ + Σₙ cₙⱼ Π(xₙ − zₙⱼwⱼ). In A: Pⱼ ← aPⱼ + Σₙ cₙⱼ(x_{A,n} − zₙⱼ[Lⱼ, 0])
     (projected: Π zeroes the first k coordinates, and wⱼ with them); in E:
     Zⱼ ← aZⱼ + Σₙ cₙⱼ x_{E,n}; and Σₙ cₙⱼ rₙ in the rest.
(L3) *The rest.* Only the rest parts' b × b Gram enters (c depends on x_A, x_E, ε): write
     them as the rows of ΛQᵀ (LQ; Q uniform, independent of Λ), ΛΛᵀ ~ Wishart_b(d − t − m)
     and Λ Bartlett's factor (Λₙₙ² ~ χ²_{d−t−m−n}, N(0, 1) below the diagonal). In the
     basis (A, E, Q) the rows' new rest part is (cᵀΛ)ⱼ: Zⱼ gains b columns, m grows by b.
     For b = 1 this is one χ²_{d−t−m} per step ((cᵀΛ)ⱼ = cⱼ‖r‖).
(L4) *Compression.* When m + b would exceed the storage 2k + b or leave fewer than b rest
     dimensions, Z is replaced by its k × k L factor (Householder LQ, same Gram: same orbit;
     :func:`.network_chain._compress`). Amortised O(k²) per step.

Records at checkpoints: Δ as (k, 2k + 1) in :func:`~dynamics.learners.linearized.reduce_rows`'
format (P, then the k × k L factor of Z, a copy: the state is not compressed by a
checkpoint), which is all the learner's ``trajectory`` reads (exact true loss, Monte Carlo
linear loss, overlap of the top right singular vector, theory). Needs d ≥ t + k + b.

Cost per step: b(t + m) normals (m ≤ 2k + b), b χ² draws and O(bk(k + m)) flops, i.e.
O(k²(k + b)) for b ≤ k, independent of d. Divergence (a non-finite residual, r² or new
state) marks the run and freezes it at its last finite state. First passages of the overlap
|⟨v₁, u⟩| (v₁ the top right singular vector of Δ: ⟨v₁, u⟩ = a₁ᵀPu_A/σ₁ with a₁ the top
eigenvector of the k × k Gram PPᵀ + ZZᵀ = σ₁² a₁a₁ᵀ + …, cyclic Jacobi) are checked after
every step. Runs advance in blocks on numba's threads, each on its own SplitMix64 stream
seeded from (seed, r), so the numbers do not depend on R or the thread count.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from dynamics.randomness.sampling import run_seed
from dynamics.reduced._drive import DIVERGED, HIT, RUNNING, drive
from dynamics.reduced.exact_chain import ExactChain, convention_supported
from dynamics.reduced.network_chain import (
    GivenExamples,
    _compress,
    _draw,
    _row_gram,
    chi2_table,
    min_dimension,
    storage_width,
)
from dynamics.reduced.network_simulate import compiled_activation_missing
from dynamics.reduced.params import distinct
from dynamics.reduced.segments import ChainRun, run_to_end
from dynamics.runtime.run_threads import over_runs
from dynamics.runtime.trajectory import RunResult, Trajectory, checkpoint_steps
from hermite.activations_numba import compiled_activation, sigma, sigma_and_deriv

__all__ = ["LinHyper", "LinSettings", "LinRuns", "LinRecords", "make_lin_hyper",
           "advance_linear", "step_given", "gram_top_overlap", "LinearChain", "LinearRun"]

ENGINE = "reduced"

LinHyper = namedtuple("LinHyper", ["code", "hp", "scale", "eta", "prox", "noise_sd", "batch",
                                   "project", "rest_dim", "n_steps", "stop", "stop_level"])
LinHyper.__doc__ = """Settings of one call: σ(scale·x) by (code, p, scale); η, prox, label-noise
sd, batch b, projected; rest_dim = d − t; horizon; stop rule on (overlap ≥ stop_level)."""
LinRuns = namedtuple("LinRuns", ["states", "P", "Z", "m", "inst_idx", "div_step", "hit_step"])
LinRuns.__doc__ = """The runs' streams (R,), P (R, k, t), Z (R, k, storage), used width m (R,),
instance index (R,), div/hit steps (R,)."""
LinRecords = namedtuple("LinRecords", ["cp_steps", "delta"])
LinRecords.__doc__ = """Checkpoint steps (C,) and Δ (R, C, k, 2k + 1) (reduce_rows' format)."""
# x_A, x_E, ε, Λ and its χ² constants per (m, n) (the names :func:`._draw` reads); z, β, the
# coefficients c; the new rows; Householder vector; a Z copy; the Jacobi arrays
LinWork = namedtuple("LinWork", ["xa", "xe", "eps", "lam_b", "chi", "z", "beta", "coef", "pn",
                                 "zn", "hv", "zc", "gram", "evec", "pu"])


@dataclass(frozen=True)
class LinSettings:
    """The linearized chain's regime: σ(scale·x) by ``code`` (code, p, scale) from
    :func:`hermite.activations_numba.compiled_activation`; η, prox, label-noise sd, batch b,
    projected; rest_dim = d − t (tests may override it: a wrong χ² law)."""

    code: tuple
    eta: float
    prox: float
    noise_sd: float
    batch: int
    project: bool
    rest_dim: int


def make_lin_hyper(settings: LinSettings, n_steps, stop=False,
                   stop_level=math.inf) -> LinHyper:
    """:class:`LinHyper` of one call (``settings``, horizon, stop rule) with the field types
    the kernel is compiled for."""
    s = settings
    code, hp, scale = s.code
    return LinHyper(int(code), int(hp), float(scale), float(s.eta), float(s.prox),
                    float(s.noise_sd), int(s.batch), bool(s.project), int(s.rest_dim),
                    int(n_steps), bool(stop), float(stop_level))


@njit(cache=True)
def _work(b, k, ms):
    t = k + 1
    return LinWork(np.empty((b, t)), np.empty((b, ms)), np.empty(b), np.zeros((b, b)),
                   np.empty((ms + 1, b, 3)), np.empty((b, k)), np.empty((b, k)),
                   np.empty((b, k)), np.empty((k, t)), np.empty((k, ms)), np.empty(ms),
                   np.empty((k, ms)), np.empty((k, k)), np.empty((k, k)), np.empty(k))


@njit(cache=True, inline="always")
def _update(hyp, L, V, lam, P, Z, m, w):
    """One step (L1)–(L3) on the variates in ``w``; the state changes only when the step is
    finite. Returns (new m, RUNNING or DIVERGED)."""
    k, t = P.shape[0], P.shape[1]
    b = hyp.batch
    code, hp, sc = hyp.code, hyp.hp, hyp.scale
    ok = True
    for n in range(b):
        xa, xe = w.xa[n], w.xe[n]
        y = w.eps[n]
        for i in range(k):  # the teacher (its rows in A)
            acc = 0.0
            for q in range(t):
                acc += V[i, q] * xa[q]
            y += lam[i] * sigma(sc * acc, code, hp)
        resid = y
        for j in range(k):
            zj = 0.0
            wd = 0.0
            for q in range(k):
                zj += L[j, q] * xa[q]
                wd += L[j, q] * P[j, q]
            sv, sd = sigma_and_deriv(sc * zj, code, hp)
            beta = lam[j] * sc * sd
            dx = 0.0
            for q in range(t):
                dx += P[j, q] * xa[q]
            for q in range(m):
                dx += Z[j, q] * xe[q]
            resid -= lam[j] * sv + beta * (dx - zj * wd)
            w.z[n, j] = zj
            w.beta[n, j] = beta
        if not math.isfinite(resid * resid):  # the full step's health value (1 + r²)^(−1/2)
            ok = False
        f = hyp.eta * (2.0 / b) * resid
        for j in range(k):
            w.coef[n, j] = f * w.beta[n, j]
    if not ok:
        return m, DIVERGED
    a = 1.0 - 2.0 * hyp.eta * hyp.prox
    lo = k if hyp.project else 0
    for j in range(k):
        pn, zn = w.pn[j], w.zn[j]
        for q in range(t):
            pn[q] = a * P[j, q]
        for q in range(m):
            zn[q] = a * Z[j, q]
        for n in range(b):
            c = w.coef[n, j]
            xa, xe = w.xa[n], w.xe[n]
            for q in range(lo, t):
                pn[q] += c * xa[q]
            if not hyp.project:
                cz = c * w.z[n, j]
                for q in range(k):
                    pn[q] -= cz * L[j, q]
            for q in range(m):
                zn[q] += c * xe[q]
        for l_ in range(b):
            acc = 0.0
            for n in range(l_, b):
                acc += w.coef[n, j] * w.lam_b[n, l_]
            zn[m + l_] = acc
        for q in range(t):
            if not math.isfinite(pn[q]):
                ok = False
        for q in range(m + b):
            if not math.isfinite(zn[q]):
                ok = False
    if not ok:
        return m, DIVERGED
    for j in range(k):
        for q in range(t):
            P[j, q] = w.pn[j, q]
        for q in range(m + b):
            Z[j, q] = w.zn[j, q]
    return m + b, RUNNING


def step_given(hyp, L, V, lam, P, Z, m, examples: GivenExamples):
    """One step (L1)–(L3) on given ``examples`` (tests): new (P, Z, m, status), inputs
    untouched. Z needs m + b columns."""
    P, Z = (np.array(a, dtype=np.float64) for a in (P, Z))
    ex = examples
    b, k = len(ex.eps), P.shape[0]
    w = _work(b, k, Z.shape[1])
    w.xa[:], w.xe[:, :m], w.lam_b[:], w.eps[:] = (ex.xa, np.asarray(ex.xe)[:, :m], ex.lam_b,
                                                  ex.eps)
    m, status = _step_given(hyp, np.asarray(L, np.float64), np.asarray(V, np.float64),
                            np.asarray(lam, np.float64), P, Z, int(m), w)
    return P, Z, m, status


@njit(cache=True)
def _step_given(hyp, L, V, lam, P, Z, m, w):
    return _update(hyp, L, V, lam, P, Z, m, w)


@njit(cache=True)
def _top_eigvec(G, E):
    """Cyclic Jacobi on the symmetric G (k × k, overwritten by its eigenvalues on the
    diagonal), eigenvectors into E's columns; returns the index of the largest eigenvalue."""
    k = G.shape[0]
    for i in range(k):
        for j in range(k):
            E[i, j] = 1.0 if i == j else 0.0
    for _sweep in range(100):
        off = 0.0
        diag = 0.0
        for p in range(k):
            diag += G[p, p] * G[p, p]
            for q in range(p + 1, k):
                off += G[p, q] * G[p, q]
        if off <= 1e-36 * diag or off == 0.0:
            break
        for p in range(k - 1):
            for q in range(p + 1, k):
                apq = G[p, q]
                if apq == 0.0:
                    continue
                theta = (G[q, q] - G[p, p]) / (2.0 * apq)
                if abs(theta) > 1e150:
                    tn = 0.5 / theta
                else:
                    tn = 1.0 / (abs(theta) + math.sqrt(theta * theta + 1.0))
                    if theta < 0.0:
                        tn = -tn
                c = 1.0 / math.sqrt(tn * tn + 1.0)
                s = tn * c
                for r in range(k):  # columns p, q: G J
                    grp, grq = G[r, p], G[r, q]
                    G[r, p] = c * grp - s * grq
                    G[r, q] = s * grp + c * grq
                for r in range(k):  # rows p, q: Jᵀ (G J)
                    gpr, gqr = G[p, r], G[q, r]
                    G[p, r] = c * gpr - s * gqr
                    G[q, r] = s * gpr + c * gqr
                G[p, q] = 0.0
                G[q, p] = 0.0
                for r in range(k):
                    erp, erq = E[r, p], E[r, q]
                    E[r, p] = c * erp - s * erq
                    E[r, q] = s * erp + c * erq
    best = 0
    for i in range(1, k):
        if G[i, i] > G[best, best]:
            best = i
    return best


@njit(cache=True)
def gram_top_overlap(P, Z, m, u, G, E, pu):
    """|⟨v₁, u⟩| for v₁ the top right singular vector of Δ = [P, Z[:, :m]] (u in A): a₁ᵀPu/σ₁
    with (σ₁², a₁) the top eigenpair of the Gram PPᵀ + ZZᵀ; NaN where Δ = 0. G, E (k × k)
    and pu (k) are work arrays."""
    k, t = P.shape[0], P.shape[1]
    for i in range(k):
        acc = 0.0
        for q in range(t):
            acc += P[i, q] * u[q]
        pu[i] = acc
        for j in range(i, k):
            g = _row_gram(P, Z, m, i, j)
            G[i, j] = g
            G[j, i] = g
    best = _top_eigvec(G, E)
    top = G[best, best]
    if not top > 0.0:
        return math.nan
    acc = 0.0
    for i in range(k):
        acc += E[i, best] * pu[i]
    return abs(acc) / math.sqrt(top)


@njit(cache=True, inline="always")
def _lin_step(ctx, sc, t):
    """One step of a run for :func:`._drive.drive`: compress if due (L4), draw (L1), (L3),
    update (L2) and the stop rule; sc = (stream, m)."""
    hyp, L, V, lam, u, P, Z, w, cap, _rec, _run = ctx
    st, m = sc
    if m + hyp.batch > cap:
        mm = _compress_copy(P, Z, m, w)
        if mm < 0:  # Z's norms overflow: the step cannot be taken (the state is kept)
            return (st, m), DIVERGED
        for j in range(Z.shape[0]):
            for q in range(m):
                Z[j, q] = w.zc[j, q]
        m = mm
    st = _draw(hyp, P.shape[1], m, st, w)
    m, status = _update(hyp, L, V, lam, P, Z, m, w)
    if status == RUNNING and hyp.stop:
        if gram_top_overlap(P, Z, m, u, w.gram, w.evec, w.pu) >= hyp.stop_level:
            status = HIT
    return (st, m), status


@njit(cache=True)
def _compress_copy(P, Z, m, w):
    """(L4) on a copy: w.zc ← the L factor of Z[:, :m] (columns ≥ the new width zero);
    returns the new width, or −1 where the factor is not finite (Z near overflow)."""
    zc = w.zc
    for j in range(Z.shape[0]):
        for q in range(zc.shape[1]):
            zc[j, q] = Z[j, q] if q < m else 0.0
    mm = _compress(P, zc, m, True, w.hv)  # free rows: P is not touched
    for j in range(Z.shape[0]):
        for q in range(mm):
            if not math.isfinite(zc[j, q]):
                return -1
    return mm


@njit(cache=True)
def _record(P, Z, m, w, rec, run, c):
    """Δ at checkpoint c: P, then the L factor of a copy of Z[:, :m] (k columns)."""
    k, t = P.shape[0], P.shape[1]
    zc = w.zc
    for j in range(k):
        for q in range(t):
            rec.delta[run, c, j, q] = P[j, q]
    mm = _compress_copy(P, Z, m, w)
    for j in range(k):
        for q in range(k):
            if mm < 0:  # near overflow: no finite factor
                rec.delta[run, c, j, t + q] = math.nan
            else:
                rec.delta[run, c, j, t + q] = zc[j, q] if q < mm else 0.0


@njit(cache=True, inline="always")
def _lin_record(ctx, sc, c):
    _hyp, _L, _V, _lam, _u, P, Z, w, _cap, rec, run = ctx
    _record(P, Z, sc[1], w, rec, run, c)


@njit(cache=True, _nrt=False, fastmath={"reassoc", "contract"})  # no NRT: see ._drive
def _run_one(run, hyp, L, V, lam, u, P, Z, st, m, rec, w):
    """Advance one run (P, Z in place) by up to ``hyp.n_steps`` steps from its stream ``st``
    and width m, recording at the checkpoints; returns (stream, m, div_step, hit_step)."""
    b = hyp.batch
    cap = min(Z.shape[1], hyp.rest_dim)  # m + b ≤ cap keeps ≥ b rest dimensions (L3)
    chi2_table(w.chi, hyp.rest_dim, b)  # the χ² degrees a width can ask for (L3)
    ctx = (hyp, L, V, lam, u, P, Z, w, cap, rec, run)
    sc, div_step, hit_step = drive(_lin_step, _lin_record, ctx, (st, m), hyp.n_steps,
                                   rec.cp_steps)
    return sc[0], sc[1], div_step, hit_step


@njit(cache=True, nogil=True)
def _advance_block(lo, hi, hyp, L, V, lam, u, runs, rec):
    """Runs lo … hi − 1 of ``runs`` (in place), each with its work arrays."""
    k = runs.P.shape[1]
    for run in range(lo, hi):
        i = runs.inst_idx[run]
        w = _work(hyp.batch, k, runs.Z.shape[2])
        st, m, div, hit = _run_one(run, hyp, L[i], V[i], lam[i], u[i], runs.P[run],
                                   runs.Z[run], runs.states[run], runs.m[run], rec, w)
        runs.states[run], runs.m[run] = st, m
        runs.div_step[run], runs.hit_step[run] = div, hit


def advance_linear(hyp, L, V, lam, u, runs, rec) -> None:
    """Advance every run of ``runs`` (:class:`LinRuns`, in place) by ``hyp.n_steps`` steps on
    numba's threads (:func:`dynamics.runtime.run_threads.over_runs`); per distinct instance L (I,
    k, k), teacher rows V (I, k, t), λ (I, k) and u (I, t) in A; checkpoints into ``rec``."""
    over_runs(_advance_block, runs.P.shape[0], hyp, L, V, lam, u, runs, rec)


# ---------------------------------------------------------------- the ExactChain
class _Start:
    """A batch's data in the chain's coordinates: per distinct instance L, V, λ, u (in A),
    the runs' instance index, and the learner object (its ``trajectory``)."""

    def __init__(self, config, instances):
        import torch

        from dynamics.learners.linearized import LinearizedFullRank
        from dynamics.learners.problem import Problem

        self.config, self.instances = config, list(instances)
        problem = Problem.from_instances(self.instances, "cpu", torch.float64)
        self.learner = LinearizedFullRank.from_config(config, problem)
        order, self.inst_idx = distinct(self.instances)
        k = order[0].k
        self.k, self.t = k, k + 1
        self.L = np.stack([np.asarray(i.w_factor, np.float64) for i in order])
        self.u = np.stack([np.r_[np.asarray(i.u_w, np.float64), i.u_perp] for i in order])
        rows = np.concatenate([self.L, np.zeros((len(order), k, 1))], -1)
        shift = np.stack([i.xi * np.asarray(i.c, np.float64) for i in order])
        norms = np.stack([np.asarray(i.teacher_norms(), np.float64) for i in order])
        self.V = np.ascontiguousarray((rows + shift[..., None] * self.u[:, None, :])
                                      / norms[..., None])
        self.lam = np.stack([np.asarray(i.lam, np.float64) * i.output_scale for i in order])
        self.code = compiled_activation(order[0].activation)

    def settings(self, rest_dim=None) -> LinSettings:
        """The chain's settings for this batch (``rest_dim``: None for d − t)."""
        config, o = self.config, self.config.options
        return LinSettings(self.code, config.eta, o.prox, math.sqrt(config.label_noise),
                           config.batch, o.project,
                           self.instances[0].d - self.t if rest_dim is None else rest_dim)


class LinearChain(ExactChain):
    """The exact chain of the full-rank ``linearized`` learner (:mod:`.linear_chain`):
    projected or not, prox, any b, label noise, any W and u; numba on CPU, float64."""

    name = "linearized full-rank"
    records_start = True
    first_passage_quantities = ("overlap",)

    def supported(self, config) -> tuple[bool, str]:
        if not getattr(config.options, "full_rank", False):
            return False, ("reduced engine: the linearized chain reduces full_rank only (the "
                           "rank-1 linearized step has no exact chain); use --engine full")
        ok, why = convention_supported(config, self)
        if not ok:
            return ok, why
        inst = config.instance
        teacher = inst.get("teacher", "finetune")
        if teacher != "finetune":
            return False, (f"reduced engine: the linearized chain needs a fine-tuned teacher, "
                           f"not {teacher!r}")
        why = compiled_activation_missing(inst, "linearized")
        if why:
            return False, why
        k, d = int(inst["k"]), int(inst["d"])
        need = min_dimension(k + 1, k, config.batch)
        if d < need:
            return False, (f"reduced engine: the linearized chain needs d ≥ k + 1 + k + b = "
                           f"{need} (here d = {d}); the full engine is cheap there")
        return True, ""

    def _advance(self, start: _Start, steps, n_steps, *, stop=False, stop_level=math.inf,
                 rest_dim=None):
        """Run the kernel from Δ = 0: (LinRuns, LinRecords)."""
        config = start.config
        runs, k, t, b = len(start.instances), start.k, start.t, config.batch
        storage = storage_width(k, b)
        states = np.array([run_seed(config.seed, r, "data") for r in range(runs)],
                          dtype=np.uint64)
        run_state = LinRuns(states, np.zeros((runs, k, t)), np.zeros((runs, k, storage)),
                            np.zeros(runs, dtype=np.int64), start.inst_idx,
                            np.full(runs, -1, dtype=np.int64), np.full(runs, -1, dtype=np.int64))
        rec = LinRecords(np.asarray(steps, dtype=np.int64),
                         np.zeros((runs, len(steps), k, 2 * k + 1)))
        hyp = make_lin_hyper(start.settings(rest_dim), n_steps, stop, stop_level)
        advance_linear(hyp, start.L, start.V, start.lam, start.u, run_state, rec)
        return run_state, rec

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        """The Trajectory of ``config``: the learner's own ``trajectory`` of the chain's
        records. ``_chi2_dof``: test hook, the rest dimension d − t replaced (a wrong χ²
        law)."""
        return run_to_end(self.start(config, instances=instances, backend=backend,
                                     _chi2_dof=_chi2_dof)).trajectory()

    def start(self, config, *, instances=None, backend=None, _chi2_dof=None) -> LinearRun:
        """:meth:`simulate`'s runs at step 0 (Δ = 0), to advance in segments
        (:mod:`.segments`)."""
        _check_backend(backend)
        instances = config.run_instances() if instances is None else instances
        steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
        return LinearRun(_Start(config, instances), steps, _chi2_dof)

    def initial_trajectory(self, config, *, backend=None) -> Trajectory:
        """The runs' start alone (Δ = 0: one checkpoint, step 0), as :meth:`simulate`
        records it."""
        _check_backend(backend)
        return self._record(_Start(config, config.run_instances()), np.zeros(1, np.int64))

    def _record(self, start: _Start, steps, rest_dim=None) -> Trajectory:
        """Advance the runs to ``steps[-1]``, recording at ``steps``: the learner's own
        trajectory of the records."""
        return run_to_end(LinearRun(start, steps, rest_dim)).trajectory()

    def first_passages(self, config, levels, max_steps=None, *, absolute=True, backend=None,
                       quantity: str = "overlap") -> np.ndarray:
        """(L, R) first steps at which each run's overlap |⟨v₁, u⟩| reaches each level (≥),
        checked after every step (NaN while Δ = 0, so never at step 0); NaN if not by
        ``max_steps`` (default ``config.steps``); diverged runs never. ``absolute`` is moot
        (the overlap is ≥ 0)."""
        _check_backend(backend)
        self.require_quantity(quantity)
        n = int(config.steps if max_steps is None else max_steps)
        out = np.full((len(levels), config.runs), np.nan)
        start = _Start(config, config.run_instances())
        for li, level in enumerate(levels):
            runs, _ = self._advance(start, np.zeros(0, np.int64), n, stop=True,
                                    stop_level=float(level))
            hit = runs.hit_step.astype(float)
            hit[runs.hit_step < 0] = np.nan
            out[li] = hit
        return out


class LinearRun(ChainRun):
    """The linearized chain's runs between segments: per run the stream, P, Z and its width
    m (Δ = 0 at the start); records Δ (R, C, k, 2k + 1) in ``reduce_rows``' format."""

    name = "linearized"

    def __init__(self, start: _Start, steps, rest_dim=None):
        config = start.config
        runs, k, t, b = len(start.instances), start.k, start.t, config.batch
        self.start = start
        self.settings = start.settings(rest_dim)
        per_run = {"states": np.array([run_seed(config.seed, r, "data") for r in range(runs)],
                                      dtype=np.uint64),
                   "P": np.zeros((runs, k, t)), "Z": np.zeros((runs, k, storage_width(k, b))),
                   "m": np.zeros(runs, dtype=np.int64),
                   "inst_idx": np.asarray(start.inst_idx, np.int64)}
        super().__init__(steps, per_run, {"delta": np.zeros((runs, len(steps), k, 2 * k + 1))})

    def _kernel(self, state, rec, n_steps, cp, more):
        start = self.start
        n = state["P"].shape[0]
        div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        hyp = make_lin_hyper(self.settings, n_steps)
        advance_linear(hyp, start.L, start.V, start.lam, start.u,
                       LinRuns(state["states"], state["P"], state["Z"], state["m"],
                               state["inst_idx"], div, hit), LinRecords(cp, rec["delta"]))
        return div, hit

    def trajectory(self) -> Trajectory:
        from dynamics.learners.linearized import top_overlap

        start = self.start
        steps, rec = self.recorded()
        n = len(start.instances)
        result = RunResult(replace(start.config, dtype="float64"), start.instances,
                           np.asarray(steps), {}, self.div.copy(), np.full(n, np.nan),
                           "cpu", engine=ENGINE)
        # a diverged run's frozen Δ may be near overflow; its checkpoints read NaN anyway
        delta = np.where(result.dead[..., None, None], np.nan, rec["delta"])
        u = np.zeros((n, 1, 2 * start.k + 1))
        u[:, 0, : start.t] = start.u[start.inst_idx]
        result.records.update(overlap=top_overlap(delta, u), delta=delta)
        return start.learner.trajectory(result)


def _check_backend(backend) -> None:
    if backend not in (None, "numba"):
        if backend == "numba-cuda":
            raise ValueError("the linearized chain has no CUDA kernel; use backend 'numba' "
                             "(CPU)")
        raise ValueError(f"the linearized chain's backend must be 'numba', got {backend!r}")

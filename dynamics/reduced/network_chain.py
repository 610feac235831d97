r"""The exact overlap chain of the network learners (``scratch``, ``scratch-csq``, ``sparse``):
their law at any d for a cost per step independent of d.

Derivation (from the full step of ``dynamics.learners.network``; no approximation)
-----------------------------------------------------------------------------------
Canonical frame: x ~ N(0, I_d); the teacher's rows vᵢ lie in A = the first t coordinates
(t = k + 1: span W and u's part ⊥ W; t = k for a committee teacher, whose rows are W's).
The student has k′ rows ŵⱼ (unit, or free), second layer λ̂ and a row mask (``sparse``).

(N0) *Markov property.* The law of x, the teacher and the step map are invariant under
     every rotation Q fixing A pointwise: F(Qŵ, Qx) = Q F(ŵ, x). So the law of the next
     state given the rows depends only on their orbit, i.e. on P = (⟨ŵⱼ, e_q⟩) (k′ × t,
     the rows' coordinates in A), the Gram ZZᵀ of their parts outside A, and λ̂. Any Z
     (k′ × m) whose Gram is right, written in some orthonormal basis E = (e′₁ … e′_m) of a
     subspace of A^⊥ containing the rows' outside parts, represents the orbit.
(N1) *One example.* In the basis (A, E, rest) an example is x = (x_A, x_E, r): x_A ~ N(0, I_t),
     x_E ~ N(0, I_m), r ~ N(0, I_{d−t−m}), independent. Fields: tᵢ = ⟨vᵢ, x_A⟩ (teacher),
     aⱼ = ⟨Pⱼ, x_A⟩ + ⟨Zⱼ, x_E⟩ (student); neither depends on r. Label y = Σλᵢσ(tᵢ) + ε.
(N2) *Gradient.* δⱼ = −2(y − f̂)λ̂ⱼσ′(aⱼ) (squared) or −yλ̂ⱼσ′(aⱼ) (correlation); a mini-batch
     averages: Gⱼ = Σₙ δ̄ⱼₙ xₙ with δ̄ = δ/b, ⟨ŵⱼ, Gⱼ⟩ = Σₙ δ̄ⱼₙ aⱼₙ; ∂L/∂λ̂ⱼ likewise from σ(aⱼ).
(N3) *The rest.* δ̄ depends on (x_A, x_E, ε) only. Write the b rest parts as the rows of
     R = Λ Qᵀ (the LQ decomposition: Λ b × b lower triangular, Q (d−t−m) × b orthonormal).
     Then ΛΛᵀ = RRᵀ is Wishart_b(d − t − m, I) and Λ is Bartlett's factor — Λₙₙ² ~
     χ²_{d−t−m−n}, Λₙₗ ~ N(0, 1) below the diagonal, all independent — while Q is uniform
     and independent of Λ. The rows' rest gradient Σₙ δ̄ⱼₙ rₙ = (δ̄ᵀΛ)ⱼ Qᵀ lies in span Q: in
     the basis (A, E, Q) the step is the full step in t + m + b dimensions, with the
     example n's rest coordinates Λₙ. (For b = 1: one χ²_{d−t−m}.)
(N4) *Step.* Unit rows (spherical SGD, exact retraction): with gⱼ² = ‖Gⱼ‖² (all three
     parts) and sⱼ = ⟨ŵⱼ, Gⱼ⟩, nⱼ² = 1 + η²(gⱼ² − sⱼ²) and ŵⱼ ← ((1 + ηsⱼ)ŵⱼ − ηGⱼ)/nⱼ;
     free rows: ŵⱼ ← ŵⱼ − ηGⱼ. Frozen rows (mask) keep η = 0. In coordinates:
     Pⱼ ← αⱼPⱼ − βⱼG_{A,j}, Zⱼ ← [αⱼZⱼ − βⱼG_{E,j}, −βⱼ(δ̄ᵀΛ)ⱼ]: m grows by b. λ̂ (trained)
     takes plain SGD from the pre-step state, as in the full engine.
(N5) *Compression.* When m + b would exceed the storage width (2k′ + b) or leave fewer
     than b rest dimensions, Z is replaced by its k′ × k′ L factor (Householder LQ of
     Z: Z = C Q̃ᵀ, so CCᵀ = ZZᵀ — the same orbit (N0)) and unit rows are renormalised (as the
     full engine does at chunk ends). Amortised O(k′²) per step.
(N6) *Start.* Random rows gⱼ ~ N(0, I_d): P = g_A, and the k′ outside parts have Gram
     Wishart_{k′}(d − t): Z = Bartlett's k′ × k′ factor; unit rows are then normalised,
     free rows scaled by s/√d. Given rows: P = their first t coordinates, Z = the L factor
     of the rest (exact: only the Gram matters). ``sparse``: P = W's rows, Z = 0 (m = 0).
     λ̂₀ as the full engine draws it (``dynamics.learners.network``).

Observables at checkpoints: ⟨vᵢ, ŵⱼ⟩ = ⟨vᵢ, Pⱼ⟩ (vᵢ ∈ A), the student Gram PPᵀ + ZZᵀ and λ̂:
exactly the full engine's records, handed to the learner's own ``trajectory`` (exact loss,
alignment, committee ODE). Needs d ≥ t + k′ + b (else the full engine, cheap there).

Cost per step: b(t + m) normals (m ≤ 2k′ + b) and b χ² draws, O(bk′(t + k′)) flops,
independent of d. For b = 1 the update takes no batch loops, and where the rows outgrow the
L1 cache (k′(t + 2k′ + 1) ≥ :data:`FUSE_MIN`, no stop rule) the pass that updates the rows
also takes the next step's fields (its example drawn first, the numbers in the same order), so
the rows are read once per step. The loss stop rule (b = 1) carries the overlaps along the
steps from the step's own numbers and evaluates the exact loss only where a bound on how far
it moved allows the level (:func:`_loss_hit`): the hits of the every-step rule, for less.
Divergence (a non-finite health value 1/nⱼ, gradient or state) marks the run and freezes it
at its last finite state. Runs advance in blocks on
numba's threads, each on its own SplitMix64 stream seeded from (seed, r), so the numbers do
not depend on R or on the thread count.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import njit

from dynamics.reduced import _rng
from dynamics.reduced._drive import DIVERGED, HIT, RUNNING, drive
from dynamics.runtime.run_threads import over_runs
from hermite.activations_numba import sigma, sigma_and_deriv

__all__ = ["STOP_KINDS", "NetHyper", "NetSettings", "GivenExamples", "NetRuns", "NetRecords",
           "make_net_hyper", "advance_network", "work_arrays", "storage_width", "min_dimension",
           "step_given"]

#: k′(t + storage) from which the b = 1 update also takes the next step's fields (one pass
#: over the rows per step instead of two)
FUSE_MIN = 2048

NetHyper = namedtuple("NetHyper", [
    "code", "hp", "scale", "correlation", "free", "train", "eta", "eta_c", "noise_sd",
    "batch", "rest_dim", "n_steps", "stop_kind", "stop_level", "kernel_mode", "more"])
NetHyper.__doc__ = """Settings of one call: σ(scale·x) by (code, p, scale); correlation loss;
free rows; trained λ̂; η, η_c; label-noise sd; batch b; rest_dim = d − t; horizon; stop rule
(:data:`STOP_KINDS`) and its level; how the dual kernel K is evaluated for the loss rule
(:data:`KERNEL_MODES`); ``more``: steps follow this call (a segment of a longer run,
:mod:`.segments`: the fused pass of its last step takes the next step's example, as one
call over the whole horizon does)."""
#: stop rules of a first-passage call: the alignment (mean over i of maxⱼ |cos(vᵢ, ŵⱼ)|, or
#: of cos(vᵢ, ŵᵢ) for ``sparse``) at or above the level, or the exact population loss at or
#: below it (unit rows, unit-row teacher: dual kernels)
STOP_KINDS = {"none": 0, "alignment": 1, "diagonal": 2, "loss": 3}
#: K(ρ) = Σₚ cₚ ρᵖ (polynomial σ: cₚ = μₚ², exact) or a Chebyshev series in
#: x = 1 − 2 arccos(ρ)/π (``hermite.expansion.kernels.kernel_interpolant``, certified error bound)
KERNEL_MODES = {"power": 0, "chebyshev_theta": 1}
NetRuns = namedtuple("NetRuns", ["states", "P", "Z", "m", "lam_hat", "mask", "inst_idx",
                                 "div_step", "hit_step", "slot", "ready"])
NetRuns.__doc__ = """The runs' streams (R,), P (R, k′, t), Z (R, k′, storage), used width m (R,),
λ̂ (R, k′), row mask (R, k′) as 0/1 floats, instance index (R,), div/hit steps (R,), and the
fused pass's carry (R,): the work slot of the next example and whether it is drawn (its
example then waits in the run's work arrays)."""
NetRecords = namedtuple("NetRecords", ["cp_steps", "cross", "gram", "lam_hat"])
NetRecords.__doc__ = """Checkpoint steps (C,) and ⟨vᵢ, ŵⱼ⟩ (R, C, k, k′), Gram (R, C, k′, k′),
λ̂ (R, C, k′)."""
NetWork = namedtuple("NetWork", ["xa", "xe", "eps", "dl", "lam_b", "a", "sv", "sd", "ug",
                                 "gl", "gram", "gr", "alpha", "beta", "hv", "chi", "tf", "q",
                                 "rr", "q0", "r0", "lref"])
#: the loss stop rule (b = 1) recomputes the overlaps and the exact loss only where the
#: overlaps carried along the steps put the loss within this (relative) distance of the level
SCREEN_TOL = 1e-9
#: ... and recomputes the carried overlaps from P, Z every this many steps (their rounding
#: grows ≈ 10⁻¹⁶ per step; the compressions' renormalisation is rounding too)
RESYNC = 256


@dataclass(frozen=True)
class NetSettings:
    """The network chain's regime, from the learner's options and the instance: σ(scale·x)
    by ``code`` (code, p, scale) from :func:`hermite.activations_numba.compiled_activation`;
    correlation loss; free rows; trained λ̂; η, η_c; label-noise sd; batch b; rest_dim =
    d − t (tests may override it: a wrong χ² law)."""

    code: tuple
    correlation: bool
    free: bool
    train: bool
    eta: float
    eta_c: float
    noise_sd: float
    batch: int
    rest_dim: int


@dataclass(frozen=True)
class GivenExamples:
    """One step's examples in a chain's coordinates (tests' ``step_given``): x_A (b, t),
    x_E (b, ≥ m), the Bartlett factor Λ (b, b) of the rest parts and the label noise ε (b,)
    itself (sd included)."""

    xa: np.ndarray
    xe: np.ndarray
    lam_b: np.ndarray
    eps: np.ndarray


def make_net_hyper(settings: NetSettings, n_steps, stop_kind=0, stop_level=math.inf,
                   kernel_mode=0, more=False) -> NetHyper:
    """:class:`NetHyper` of one call (``settings``, horizon, stop rule, kernel mode, whether
    steps follow) with the field types the kernel is compiled for."""
    s = settings
    code, hp, scale = s.code
    return NetHyper(int(code), int(hp), float(scale), bool(s.correlation), bool(s.free),
                    bool(s.train), float(s.eta), float(s.eta_c), float(s.noise_sd),
                    int(s.batch), int(s.rest_dim), int(n_steps), int(stop_kind),
                    float(stop_level), int(kernel_mode), bool(more))


def storage_width(width: int, batch: int) -> int:
    """Columns of Z kept between compressions (N5): 2k′ + b."""
    return 2 * width + batch


def min_dimension(t: int, width: int, batch: int) -> int:
    """The least d the chain needs: t + k′ + b (a compressed Z plus one batch of new
    directions must fit in A^⊥)."""
    return t + width + batch


@njit(cache=True)
def _work(b, k, kp, t, ms):
    # x_A, x_E, ε, Λ have 2b rows: b = 1 keeps the next step's example in slot 1 − r; the
    # teacher's fields (k,) and the loss stop rule's overlaps Ĝ (k′, k′), VP̂ᵀ (k, k′), those
    # of its last loss evaluation and (that loss, a bound on |K′|, whether it is set)
    return NetWork(np.empty((2 * b, t)), np.empty((2 * b, ms)), np.empty(2 * b),
                   np.empty((b, kp)), np.zeros((2 * b, b)),
                   np.empty(kp), np.empty(kp), np.empty(kp), np.empty(kp), np.empty(kp),
                   np.empty((b, b)), np.empty((kp, b)), np.empty(kp), np.empty(kp),
                   np.empty(ms), np.empty((ms + 1, b, 3)), np.empty(k), np.empty((kp, kp)),
                   np.empty((k, kp)), np.empty((kp, kp)), np.empty((k, kp)), np.zeros(3))


@njit(cache=True)
def chi2_table(chi, rest_dim, b):
    """chi[mm, n] = the prepared χ²_{rest_dim − mm − n} (N3): every degree a width mm and
    example n of a batch can ask for."""
    for mm in range(chi.shape[0]):
        for n in range(b):
            dof, dd, cc = _rng.chi2_prepare(max(rest_dim - mm - n, 0))
            chi[mm, n, 0] = dof
            chi[mm, n, 1] = dd
            chi[mm, n, 2] = cc


@njit(cache=True, inline="always")
def _dot4(a, b, lo, hi):
    """Σ_{lo ≤ q < hi} a[q] b[q] in four interleaved partial sums (a fixed order, so the
    same numbers on every target; four independent chains instead of one)."""
    d0 = d1 = d2 = d3 = 0.0
    q = lo
    while q + 4 <= hi:
        d0 += a[q] * b[q]
        d1 += a[q + 1] * b[q + 1]
        d2 += a[q + 2] * b[q + 2]
        d3 += a[q + 3] * b[q + 3]
        q += 4
    while q < hi:
        d0 += a[q] * b[q]
        q += 1
    return (d0 + d1) + (d2 + d3)


@njit(cache=True, inline="always")
def _row_gram(P, Z, m, i, j):
    """⟨ŵᵢ, ŵⱼ⟩ = Pᵢ·Pⱼ + Zᵢ·Zⱼ (Z's first m columns), summed in that order."""
    g = 0.0
    for q in range(P.shape[1]):
        g += P[i, q] * P[j, q]
    for q in range(m):
        g += Z[i, q] * Z[j, q]
    return g


@njit(cache=True)
def _compress(P, Z, m, free, hv):
    """(N5) Z[:, :m] ← its L factor by Householder reflections from the right (columns ≥ k′
    become 0); unit rows renormalised. Returns the new width min(m, k′)."""
    kp = Z.shape[0]
    for j in range(min(kp, m)):
        zj = Z[j]
        norm2 = 0.0
        for q in range(j, m):
            hv[q] = zj[q]
            norm2 += zj[q] * zj[q]
        norm = math.sqrt(norm2)
        if norm == 0.0:
            continue
        alpha = -norm if hv[j] > 0.0 else norm  # v = x − αe₁ without cancellation
        hv[j] -= alpha
        vv = norm2 - 2.0 * alpha * zj[j] + alpha * alpha
        if vv == 0.0:
            continue
        zj[j] = alpha  # row j reflects onto αe₁ exactly
        for q in range(j + 1, m):
            zj[q] = 0.0
        two_over_vv = 2.0 / vv
        i = j + 1
        while i + 2 <= kp:  # two rows per pass over v: half the loads of v, more chains
            za, zb = Z[i], Z[i + 1]
            a0 = a1 = b0 = b1 = 0.0
            q = j
            while q + 2 <= m:
                a0 += za[q] * hv[q]
                a1 += za[q + 1] * hv[q + 1]
                b0 += zb[q] * hv[q]
                b1 += zb[q + 1] * hv[q + 1]
                q += 2
            if q < m:
                a0 += za[q] * hv[q]
                b0 += zb[q] * hv[q]
            fa, fb = (a0 + a1) * two_over_vv, (b0 + b1) * two_over_vv
            for q in range(j, m):
                za[q] -= fa * hv[q]
                zb[q] -= fb * hv[q]
            i += 2
        if i < kp:
            zi = Z[i]
            f = _dot4(zi, hv, j, m) * two_over_vv
            for q in range(j, m):
                zi[q] -= f * hv[q]
    new_m = min(m, kp)
    for i in range(kp):
        for q in range(new_m, m):
            Z[i, q] = 0.0
    if not free:
        for i in range(kp):
            n2 = _row_gram(P, Z, new_m, i, i)
            if n2 > 0.0:
                inv = 1.0 / math.sqrt(n2)
                for q in range(P.shape[1]):
                    P[i, q] *= inv
                for q in range(new_m):
                    Z[i, q] *= inv
    return new_m


@njit(cache=True)
def _alignment(V, P, Z, m, free, diagonal):
    """Mean over teacher rows i of maxⱼ |cos(vᵢ, ŵⱼ)|, or of cos(vᵢ, ŵᵢ) (``diagonal``)
    (``dynamics.learners.network.alignment``)."""
    k, t = V.shape
    kp = P.shape[0]
    total = 0.0
    for i in range(k):
        vn = 0.0
        for q in range(t):
            vn += V[i, q] * V[i, q]
        best = 0.0
        lo, hi = (i, i + 1) if diagonal else (0, kp)
        for j in range(lo, hi):
            dot = 0.0
            wn = 0.0
            for q in range(t):
                dot += V[i, q] * P[j, q]
                wn += P[j, q] * P[j, q]
            if free:
                for q in range(m):
                    wn += Z[j, q] * Z[j, q]
                c = dot / math.sqrt(vn * wn) if vn * wn > 0.0 else 0.0
            else:
                c = dot / math.sqrt(vn) if vn > 0.0 else 0.0
            best = c if diagonal else max(best, abs(c))
        total += best
    return total / k


@njit(cache=True, inline="always")
def _dual_kernel(rho, mode, coef):
    """K(ρ) from :data:`KERNEL_MODES` ``mode`` and its coefficients (ρ clipped to [−1, 1])."""
    r = min(1.0, max(-1.0, rho))
    n = coef.shape[0]
    if mode == 0:
        acc = 0.0
        for p in range(n - 1, -1, -1):
            acc = acc * r + coef[p]
        return acc
    x = 1.0 - 2.0 * math.acos(r) / math.pi
    b1 = 0.0
    b2 = 0.0
    for p in range(n - 1, 0, -1):
        b0 = coef[p] + 2.0 * x * b1 - b2
        b2 = b1
        b1 = b0
    return coef[0] + x * b1 - b2


@njit(cache=True)
def _overlaps(V, P, Z, m, Q, R):
    """The student Gram Ĝ = PPᵀ + ZZᵀ into Q (upper triangle) and VP̂ᵀ into R."""
    k, t = V.shape
    kp = P.shape[0]
    for j in range(kp):
        for j2 in range(j, kp):
            Q[j, j2] = _row_gram(P, Z, m, j, j2)
        for i in range(k):
            c = 0.0
            for q in range(t):
                c += V[i, q] * P[j, q]
            R[i, j] = c


@njit(cache=True)
def _loss_of(hyp, lam, teacher_term, Q, R, lam_hat, coef):
    """Exact population loss E(f* − f̂)² of unit rows against a unit-row teacher from their
    overlaps (Q's upper triangle, R): λᵀK(VVᵀ)λ (``teacher_term``) + λ̂ᵀK(Ĝ)λ̂ − 2λᵀK(VP̂ᵀ)λ̂
    (``dynamics.measures.network_loss``)."""
    k, kp = R.shape
    out = teacher_term
    for j in range(kp):
        for j2 in range(j, kp):
            term = lam_hat[j] * lam_hat[j2] * _dual_kernel(Q[j, j2], hyp.kernel_mode, coef)
            out += term if j2 == j else 2.0 * term
        for i in range(k):
            out -= 2.0 * lam[i] * lam_hat[j] * _dual_kernel(R[i, j], hyp.kernel_mode, coef)
    return out


@njit(cache=True, inline="always")
def _carry_overlaps(w, kp, k):
    """The overlaps after a b = 1 step from those before: ŵⱼ ← αⱼŵⱼ − cⱼx with cⱼ = βⱼδ̄ⱼ
    (N4) gives ⟨ŵⱼ, ŵₗ⟩ ← αⱼαₗĜⱼₗ − αⱼcₗaⱼ − αₗcⱼaₗ + cⱼcₗ‖x‖² and ⟨vᵢ, ŵⱼ⟩ ← αⱼ(VP̂ᵀ)ᵢⱼ −
    cⱼtᵢ (fields aⱼ, tᵢ and ‖x‖² of the step's example). Exact up to rounding, which the
    recomputation (:func:`_overlaps`) every :data:`RESYNC` steps resets."""
    x2 = w.gram[0, 0]
    for j in range(kp):
        al, cj, aj = w.alpha[j], w.beta[j] * w.dl[0, j], w.a[j]
        for j2 in range(j, kp):
            al2, c2 = w.alpha[j2], w.beta[j2] * w.dl[0, j2]
            w.q[j, j2] = (al * al2 * w.q[j, j2] - al * c2 * aj - al2 * cj * w.a[j2]
                          + cj * c2 * x2)
        for i in range(k):
            w.rr[i, j] = al * w.rr[i, j] - cj * w.tf[i]


@njit(cache=True)
def kernel_slope_bound(mode, coef):
    """sup over |ρ| ≤ 1 of |K′(ρ)| bounded by Σₚ p|cₚ| for the power series (mode 0); ∞ for
    the interpolant (no bound used)."""
    if mode != 0:
        return math.inf
    out = 0.0
    for p in range(1, coef.shape[0]):
        out += p * abs(coef[p])
    return out


@njit(cache=True, inline="always")
def _loss_moved(lam, lam_hat, w):
    """Σⱼ≤ₗ (2 − δⱼₗ)|λ̂ⱼλ̂ₗ||Ĝⱼₗ − Ĝ⁰ⱼₗ| + Σᵢⱼ 2|λᵢλ̂ⱼ||(VP̂ᵀ)ᵢⱼ − (VP̂ᵀ)⁰ᵢⱼ|: times
    sup|K′|, a bound on how far the loss moved since its last evaluation (K applies to the
    clipped overlaps, and clipping is 1-Lipschitz)."""
    k, kp = w.rr.shape
    out = 0.0
    for j in range(kp):
        lj = abs(lam_hat[j])
        acc = 0.5 * lj * abs(w.q[j, j] - w.q0[j, j])
        for j2 in range(j + 1, kp):
            acc += abs(lam_hat[j2]) * abs(w.q[j, j2] - w.q0[j, j2])
        for i in range(k):
            acc += abs(lam[i]) * abs(w.rr[i, j] - w.r0[i, j])
        out += 2.0 * lj * acc
    return out


@njit(cache=True, inline="always")
def _clear_above(value, scale, level):
    """``value`` more than :data:`SCREEN_TOL`·(1 + |scale|) above ``level``."""
    return value - SCREEN_TOL * (1.0 + abs(scale)) > level


@njit(cache=True, inline="always")
def _loss_hit(hyp, V, lam, teacher_term, P, Z, m, lam_hat, coef, w, carried):
    """The loss stop rule after a step: the exact loss (overlaps recomputed from P, Z) at or
    below the level. ``carried``: w's overlaps were carried along (b = 1,
    :func:`_carry_overlaps`). Then a step is passed over where the loss cannot be within
    :data:`SCREEN_TOL` of the level: first where the carried overlaps moved too little since
    the loss was last evaluated (:func:`_loss_moved` times sup|K′|, power series and a fixed
    λ̂), then where the loss of the carried overlaps is that far above it. Their rounding
    (≲ 10⁻¹³ between their recomputations, every :data:`RESYNC` steps) cannot bridge it,
    so the hits are those of the exact loss evaluated after every step."""
    if carried:
        ref = w.lref
        if ref[2] > 0.0 and not hyp.train:
            low = ref[0] - ref[1] * _loss_moved(lam, lam_hat, w)
            if _clear_above(low, ref[0], hyp.stop_level):
                return False
        near = _loss_of(hyp, lam, teacher_term, w.q, w.rr, lam_hat, coef)
        for j in range(w.q.shape[0]):
            for j2 in range(j, w.q.shape[0]):
                w.q0[j, j2] = w.q[j, j2]
            for i in range(w.rr.shape[0]):
                w.r0[i, j] = w.rr[i, j]
        ref[0], ref[2] = near, 1.0
        if _clear_above(near, near, hyp.stop_level):
            return False
    _overlaps(V, P, Z, m, w.q, w.rr)
    return _loss_of(hyp, lam, teacher_term, w.q, w.rr, lam_hat, coef) <= hyp.stop_level


@njit(cache=True, inline="always")
def _draw(hyp, t, m, st, w):
    """The step's variates from the stream (N1), (N3): x_A (b, t), x_E (b, m), the label
    noise (b,) and Bartlett's factor Λ (b, b) of the rest parts (dof d − t − m − n)."""
    b = hyp.batch
    for n in range(b):
        for q in range(t):
            w.xa[n, q], st = _rng.normal(st)
        for q in range(m):
            w.xe[n, q], st = _rng.normal(st)
        w.eps[n] = 0.0
        if hyp.noise_sd > 0.0:
            e, st = _rng.normal(st)
            w.eps[n] = hyp.noise_sd * e
    for n in range(b):  # χ²_{d−t−m−n}, its Marsaglia–Tsang constants tabulated per (m, n)
        c = w.chi[m, n]
        q2, st = _rng.chi2_prepared((np.int64(c[0]), c[1], c[2]), st)
        w.lam_b[n, n] = math.sqrt(q2)
        for l_ in range(n):
            w.lam_b[n, l_], st = _rng.normal(st)
    return st


@njit(cache=True, inline="always")
def _label1(hyp, V, ident, lam, w, r):
    """The label y = Σᵢλᵢσ(tᵢ) + ε of slot r's example, written over its ε (N1)."""
    k, t = V.shape
    code, hp, sc = hyp.code, hyp.hp, hyp.scale
    xa = w.xa[r]
    y = w.eps[r]
    for i in range(k):
        if ident:
            acc = xa[i]
        else:
            acc = 0.0
            for q in range(t):
                acc += V[i, q] * xa[q]
        w.tf[i] = acc
        y += lam[i] * sigma(sc * acc, code, hp)
    w.eps[r] = y


@njit(cache=True, inline="always")
def _field1(hyp, j, acc, w):
    """Row j's field aⱼ = acc and σ(aⱼ), σ′(aⱼ) into the work arrays."""
    sv, sd = sigma_and_deriv(hyp.scale * acc, hyp.code, hyp.hp)
    w.a[j] = acc
    w.sv[j] = sv
    w.sd[j] = hyp.scale * sd


@njit(cache=True, inline="always")
def _fields1(hyp, P, Z, m, w, r):
    """The student's fields on slot r's example (N1)."""
    t = P.shape[1]
    xa, xe = w.xa[r], w.xe[r]
    for j in range(P.shape[0]):
        acc = 0.0
        for q in range(t):
            acc += P[j, q] * xa[q]
        for q in range(m):
            acc += Z[j, q] * xe[q]
        _field1(hyp, j, acc, w)


@njit(cache=True, inline="always")
def _update(hyp, V, ident, lam, P, Z, m, lam_hat, mask, w):
    """One step (N1)–(N4) on the variates in ``w``; the state changes only when the step is
    finite. ``ident``: V = [I, 0] (the teacher's fields are x_A's first k coordinates).
    Returns (new m, RUNNING or DIVERGED).

    ‖Gⱼ‖² = δ̄ⱼᵀ K δ̄ⱼ with K the b × b Gram of the examples (all three parts), so the
    gradients are never formed: each row is updated in one pass."""
    t = V.shape[1]
    kp = P.shape[0]
    b = hyp.batch
    for j in range(kp):
        w.ug[j] = 0.0
        w.gl[j] = 0.0
    for n in range(b):
        xa, xe = w.xa[n], w.xe[n]
        _label1(hyp, V, ident, lam, w, n)
        y = w.eps[n]
        _fields1(hyp, P, Z, m, w, n)
        f_hat = 0.0
        for j in range(kp):
            f_hat += lam_hat[j] * w.sv[j]
        outer = -y if hyp.correlation else -2.0 * (y - f_hat)
        for j in range(kp):
            dl = outer * lam_hat[j] * w.sd[j] / b
            w.dl[n, j] = dl
            w.ug[j] += dl * w.a[j]
            w.gl[j] += outer * w.sv[j] / b
        for n2 in range(n + 1):  # the examples' Gram K (rest parts: rows of Λ)
            acc = 0.0
            for q in range(t):
                acc += xa[q] * w.xa[n2, q]
            for q in range(m):
                acc += xe[q] * w.xe[n2, q]
            for q in range(n2 + 1):
                acc += w.lam_b[n, q] * w.lam_b[n2, q]
            w.gram[n, n2] = acc
            w.gram[n2, n] = acc
    ok = True
    for j in range(kp):
        g2 = 0.0
        for n in range(b):
            acc = 0.0
            for n2 in range(b):
                acc += w.gram[n, n2] * w.dl[n2, j]
            g2 += w.dl[n, j] * acc
        for l_ in range(b):
            acc = 0.0
            for n in range(l_, b):
                acc += w.dl[n, j] * w.lam_b[n, l_]
            w.gr[j, l_] = acc
        eta = hyp.eta * mask[j]
        ug = w.ug[j]
        if hyp.free:
            inv = 1.0 / math.sqrt(1.0 + eta * eta * g2)
            w.alpha[j], w.beta[j] = 1.0, eta
        else:
            inv = 1.0 / math.sqrt(1.0 + eta * eta * (g2 - ug * ug))
            w.alpha[j], w.beta[j] = inv * (1.0 + eta * ug), eta * inv
        if not (math.isfinite(g2) and math.isfinite(inv) and inv > 0.0
                and math.isfinite(w.alpha[j])):
            ok = False
        if hyp.train and not math.isfinite(lam_hat[j] - hyp.eta_c * w.gl[j]):
            ok = False
    if not ok:
        return m, DIVERGED
    for j in range(kp):
        al, be = w.alpha[j], w.beta[j]
        if be == 0.0:  # a frozen row (sparse): untouched
            for l_ in range(b):
                Z[j, m + l_] = 0.0
        else:
            pj, zj = P[j], Z[j]
            c0 = be * w.dl[0, j]
            xa, xe = w.xa[0], w.xe[0]
            for q in range(t):  # αP − βΣₙδ̄ₙxₙ, the first example fused with the scaling
                pj[q] = al * pj[q] - c0 * xa[q]
            for q in range(m):
                zj[q] = al * zj[q] - c0 * xe[q]
            for n in range(1, b):
                c = be * w.dl[n, j]
                xa, xe = w.xa[n], w.xe[n]
                for q in range(t):
                    pj[q] -= c * xa[q]
                for q in range(m):
                    zj[q] -= c * xe[q]
            for l_ in range(b):
                zj[m + l_] = -be * w.gr[j, l_]
        if hyp.train:
            lam_hat[j] -= hyp.eta_c * w.gl[j]
    return m + b, RUNNING


@njit(cache=True, inline="always")
def _draw1(hyp, t, m, st, w, r):
    """:func:`_draw` for one example (b = 1) into slot r of the work arrays (row r of x_A,
    x_E, ε and Λ): the same numbers in the same order."""
    xa, xe = w.xa[r], w.xe[r]
    for q in range(t):
        xa[q], st = _rng.normal(st)
    for q in range(m):
        xe[q], st = _rng.normal(st)
    w.eps[r] = 0.0
    if hyp.noise_sd > 0.0:
        e, st = _rng.normal(st)
        w.eps[r] = hyp.noise_sd * e
    c = w.chi[m, 0]
    q2, st = _rng.chi2_prepared((np.int64(c[0]), c[1], c[2]), st)
    w.lam_b[r, 0] = math.sqrt(q2)
    return st


@njit(cache=True, inline="always")
def _grad1(hyp, m, lam_hat, mask, w, r):
    """(N2), (N4) for one example (b = 1) from its label and fields: δ̄ⱼ, ∂L/∂λ̂ⱼ, αⱼ, βⱼ
    into the work arrays. K = ‖x‖² is a scalar and ‖Gⱼ‖² = δ̄ⱼ²K. Returns whether the step
    is finite (the :func:`_update` checks)."""
    kp, t = w.a.shape[0], w.xa.shape[1]
    xa, xe = w.xa[r], w.xe[r]
    y = w.eps[r]
    f_hat = 0.0
    for j in range(kp):
        f_hat += lam_hat[j] * w.sv[j]
    outer = -y if hyp.correlation else -2.0 * (y - f_hat)
    lam11 = w.lam_b[r, 0]
    gram = 0.0  # the example's squared norm (all three parts)
    for q in range(t):
        gram += xa[q] * xa[q]
    for q in range(m):
        gram += xe[q] * xe[q]
    gram += lam11 * lam11
    w.gram[0, 0] = gram
    ok = True
    free = hyp.free
    for j in range(kp):
        dl = outer * lam_hat[j] * w.sd[j]
        w.dl[0, j] = dl
        w.gl[j] = outer * w.sv[j]
        g2 = dl * (gram * dl)
        eta = hyp.eta * mask[j]
        if free:  # α = 1, β = η; the health value 1/√(1 + η²g²) is finite and > 0 iff
            s2 = 1.0 + eta * eta * g2  # 0 < 1 + η²g² < ∞
            w.alpha[j], w.beta[j] = 1.0, eta
            if not (math.isfinite(g2) and s2 > 0.0 and math.isfinite(s2)):
                ok = False
        else:
            ug = dl * w.a[j]
            inv = 1.0 / math.sqrt(1.0 + eta * eta * (g2 - ug * ug))
            al = inv * (1.0 + eta * ug)
            w.alpha[j], w.beta[j] = al, eta * inv
            if not (math.isfinite(g2) and math.isfinite(inv) and inv > 0.0
                    and math.isfinite(al)):
                ok = False
        if hyp.train and not math.isfinite(lam_hat[j] - hyp.eta_c * w.gl[j]):
            ok = False
    return ok


@njit(cache=True, inline="always")
def _apply1(hyp, P, Z, m, lam_hat, w, r, r_next):
    """(N4) for one example (b = 1): the rows from slot r's step; with ``r_next`` ≥ 0 the
    same pass also takes the fields on slot r_next's example (the next step's, width m + 1),
    so each row is read once per step."""
    t = P.shape[1]
    xa, xe = w.xa[r], w.xe[r]
    lam11 = w.lam_b[r, 0]
    nxt = r_next >= 0
    xa2, xe2 = w.xa[max(r_next, 0)], w.xe[max(r_next, 0)]
    for j in range(P.shape[0]):
        al, be = w.alpha[j], w.beta[j]
        pj, zj = P[j], Z[j]
        acc = 0.0
        if be == 0.0:  # a frozen row (sparse): untouched
            zj[m] = 0.0
            if nxt:
                for q in range(t):
                    acc += pj[q] * xa2[q]
                for q in range(m):
                    acc += zj[q] * xe2[q]
        else:
            c0 = be * w.dl[0, j]
            znew = -be * (w.dl[0, j] * lam11)
            zj[m] = znew
            if nxt:
                acc = znew * xe2[m]
                if hyp.free:  # α = 1
                    for q in range(t):
                        v = pj[q] - c0 * xa[q]
                        pj[q] = v
                        acc += v * xa2[q]
                    for q in range(m):
                        v = zj[q] - c0 * xe[q]
                        zj[q] = v
                        acc += v * xe2[q]
                else:
                    for q in range(t):
                        v = al * pj[q] - c0 * xa[q]
                        pj[q] = v
                        acc += v * xa2[q]
                    for q in range(m):
                        v = al * zj[q] - c0 * xe[q]
                        zj[q] = v
                        acc += v * xe2[q]
            elif hyp.free:
                for q in range(t):
                    pj[q] -= c0 * xa[q]
                for q in range(m):
                    zj[q] -= c0 * xe[q]
            else:
                for q in range(t):
                    pj[q] = al * pj[q] - c0 * xa[q]
                for q in range(m):
                    zj[q] = al * zj[q] - c0 * xe[q]
        if hyp.train:
            lam_hat[j] -= hyp.eta_c * w.gl[j]
        if nxt:
            _field1(hyp, j, acc, w)


@njit(cache=True, inline="always")
def _update1(hyp, V, ident, lam, P, Z, m, lam_hat, mask, w):
    """:func:`_update` for one example (b = 1), the same arithmetic without the batch loops
    (slot 0 of the work arrays). Returns (new m, status)."""
    _label1(hyp, V, ident, lam, w, 0)
    _fields1(hyp, P, Z, m, w, 0)
    if not _grad1(hyp, m, lam_hat, mask, w, 0):
        return m, DIVERGED
    _apply1(hyp, P, Z, m, lam_hat, w, 0, -1)
    return m + 1, RUNNING


@njit(cache=True, inline="always")
def _update_any(hyp, V, ident, lam, P, Z, m, lam_hat, mask, w):
    """The step's update: :func:`_update1` for b = 1, else :func:`_update`."""
    if hyp.batch == 1:
        return _update1(hyp, V, ident, lam, P, Z, m, lam_hat, mask, w)
    return _update(hyp, V, ident, lam, P, Z, m, lam_hat, mask, w)


def step_given(hyp, V, lam, P, Z, m, lam_hat, mask, examples: GivenExamples):
    """One step (N1)–(N4) on given ``examples`` (tests): new (P, Z, m, λ̂, status), inputs
    untouched. Z needs m + b columns."""
    P, Z, lam_hat = (np.array(a, dtype=np.float64) for a in (P, Z, lam_hat))
    ex = examples
    b, kp, t = len(ex.eps), P.shape[0], P.shape[1]
    w = _work(b, len(lam), kp, t, Z.shape[1])
    w.xa[:b], w.xe[:b, :m], w.lam_b[:b], w.eps[:b] = (ex.xa, np.asarray(ex.xe)[:, :m],
                                                      ex.lam_b, ex.eps)
    m, status = _update_any(hyp, np.asarray(V, np.float64), False,
                            np.asarray(lam, np.float64), P, Z, int(m), lam_hat,
                            np.asarray(mask, np.float64), w)
    return P, Z, m, lam_hat, status


@njit(cache=True)
def _record(V, P, Z, m, lam_hat, rec, run, c):
    """Checkpoint c of ``run``: :func:`_overlaps` into the records (the Gram mirrored below
    its diagonal) and λ̂."""
    gram = rec.gram[run, c]
    _overlaps(V, P, Z, m, gram, rec.cross[run, c])
    for i in range(P.shape[0]):
        for j in range(i):
            gram[i, j] = gram[j, i]
        rec.lam_hat[run, c, i] = lam_hat[i]


@njit(cache=True, inline="always")
def _net_step(ctx, sc, t):
    """One step of a run for :func:`._drive.drive`: compress if due (N5), draw, update, and
    the stop rule; sc = (stream, m, slot, ready). For b = 1 without a stop rule the update's
    pass over the rows also takes the next step's fields when no compression falls between
    (``ready``: slot's example drawn, labelled and its fields taken); the numbers are drawn
    in the same order either way."""
    hyp, V, ident, lam, P, Z, lam_hat, mask, w, teacher_term, coef, cap, _rec, _run = ctx
    st, m, r, ready = sc
    b = hyp.batch
    # the fused pass pays where the rows outgrow the L1 cache (measured per step: K = 50
    # −5 … −8%; K = 2 and k′ = 4 +5 … +10%, so small widths keep two passes)
    if b == 1 and hyp.stop_kind == 0 and P.shape[0] * (P.shape[1] + Z.shape[1]) >= FUSE_MIN:
        if not ready:
            if m + 1 > cap:
                m = _compress(P, Z, m, hyp.free, w.hv)
            st = _draw1(hyp, P.shape[1], m, st, w, r)
            _label1(hyp, V, ident, lam, w, r)
            _fields1(hyp, P, Z, m, w, r)
        if not _grad1(hyp, m, lam_hat, mask, w, r):
            return (st, m, r, True), DIVERGED
        # the next step (in this call, or in the next one: ``more``) needs no compression
        if (t + 1 < hyp.n_steps or hyp.more) and m + 2 <= cap:
            r2 = 1 - r
            st = _draw1(hyp, P.shape[1], m + 1, st, w, r2)
            _label1(hyp, V, ident, lam, w, r2)
            _apply1(hyp, P, Z, m, lam_hat, w, r, r2)
            return (st, m + 1, r2, True), RUNNING
        _apply1(hyp, P, Z, m, lam_hat, w, r, -1)
        return (st, m + 1, r, False), RUNNING
    carry = hyp.stop_kind == 3 and b == 1  # the loss rule's overlaps carried along the steps
    if m + b > cap:
        m = _compress(P, Z, m, hyp.free, w.hv)
    if carry and t % RESYNC == 0:
        _overlaps(V, P, Z, m, w.q, w.rr)
    st = _draw(hyp, P.shape[1], m, st, w)
    m, status = _update_any(hyp, V, ident, lam, P, Z, m, lam_hat, mask, w)
    if status == RUNNING and hyp.stop_kind > 0:
        if hyp.stop_kind == 3:
            if carry:
                _carry_overlaps(w, P.shape[0], V.shape[0])
            if _loss_hit(hyp, V, lam, teacher_term, P, Z, m, lam_hat, coef, w, carry):
                status = HIT
        elif _alignment(V, P, Z, m, hyp.free, hyp.stop_kind == 2) >= hyp.stop_level:
            status = HIT
    return (st, m, 0, False), status


@njit(cache=True, inline="always")
def _net_record(ctx, sc, c):
    """Checkpoint c of the run: its overlaps and λ̂ into the records."""
    _hyp, V, _ident, _lam, P, Z, lam_hat, _mask, _w, _tt, _coef, _cap, rec, run = ctx
    _record(V, P, Z, sc[1], lam_hat, rec, run, c)


@njit(cache=True, _nrt=False, fastmath={"reassoc", "contract"})  # no NRT: see ._drive
def _run_one(run, hyp, V, ident, lam, P, Z, lam_hat, mask, st, m, rec, w, teacher_term,
             coef, slot, ready):
    """Advance one run (P, Z, λ̂ in place) by up to ``hyp.n_steps`` steps from its stream
    ``st``, width m and fused-pass carry (``slot``, ``ready``: an example drawn ahead into
    ``w``), recording at the checkpoints (:func:`._drive.drive`); returns (stream, m, slot,
    ready, div_step, hit_step)."""
    b = hyp.batch
    cap = min(Z.shape[1], hyp.rest_dim)  # m + b ≤ cap keeps ≥ b rest dimensions (N3)
    chi2_table(w.chi, hyp.rest_dim, b)
    w.lref[1], w.lref[2] = kernel_slope_bound(hyp.kernel_mode, coef), 0.0
    ctx = (hyp, V, ident, lam, P, Z, lam_hat, mask, w, teacher_term, coef, cap, rec, run)
    sc, div_step, hit_step = drive(_net_step, _net_record, ctx, (st, m, slot, ready),
                                   hyp.n_steps, rec.cp_steps)
    return sc[0], sc[1], sc[2], sc[3], div_step, hit_step


@njit(cache=True, nogil=True)
def _advance_block(lo, hi, hyp, V, ident, lam, runs, rec, teacher_term, coef, work):
    """Runs lo … hi − 1 of ``runs`` (in place), each with its rows of ``work``."""
    for run in range(lo, hi):
        i = runs.inst_idx[run]
        w = NetWork(work[0][run], work[1][run], work[2][run], work[3][run], work[4][run],
                    work[5][run], work[6][run], work[7][run], work[8][run], work[9][run],
                    work[10][run], work[11][run], work[12][run], work[13][run],
                    work[14][run], work[15][run], work[16][run], work[17][run],
                    work[18][run], work[19][run], work[20][run], work[21][run])
        st, m, slot, ready, div, hit = _run_one(
            run, hyp, V[i], ident[i], lam[i], runs.P[run], runs.Z[run], runs.lam_hat[run],
            runs.mask[run], runs.states[run], runs.m[run], rec, w, teacher_term[i], coef,
            runs.slot[run], runs.ready[run])
        runs.states[run], runs.m[run] = st, m
        runs.slot[run], runs.ready[run] = slot, ready
        runs.div_step[run], runs.hit_step[run] = div, hit


def work_arrays(runs: int, batch: int, k: int, kp: int, t: int, storage: int) -> tuple:
    """Every run's work arrays (:class:`NetWork` fields, leading axis R, zeros): kept
    between the calls of a run advanced in segments (the fused pass's example drawn ahead
    lives there)."""
    one = _work(batch, k, kp, t, storage)
    return tuple(np.zeros((runs, *a.shape)) for a in one)


def advance_network(hyp, V, ident, lam, runs, rec, teacher_term, coef, work=None) -> None:
    """Advance every run of ``runs`` (:class:`NetRuns`, in place) by ``hyp.n_steps`` steps on
    numba's threads (:func:`dynamics.runtime.run_threads.over_runs`); V (I, k, t) teacher rows,
    ident (I,) V = [I, 0], λ (I, k) per instance; checkpoints into ``rec``. The loss stop rule reads
    ``teacher_term`` (I,) λᵀK(VVᵀ)λ and K's coefficients ``coef`` (``hyp.kernel_mode``).
    ``work``: the runs' :func:`work_arrays` (fresh ones if None)."""
    n, kp, t = runs.P.shape
    if work is None:
        work = work_arrays(n, hyp.batch, V.shape[1], kp, t, runs.Z.shape[2])
    over_runs(_advance_block, n, hyp, V, ident, lam, runs, rec, teacher_term, coef, work)

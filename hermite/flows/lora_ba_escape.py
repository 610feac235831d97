r"""The escape of ``lora-ba``'s search phase from B = 0 (issue 39): rate, noise kick, T(d).

Linearisation at the saddle (B = 0, Z = 0, A's rest Gram S)
-----------------------------------------------------------
Write the rows H = W + sB[Z, R] (Z: A's coordinates in span(W, u), t = k + 1; R: its rest, RRᵀ
= S). To second order in (B, Z) the population loss (``hermite.flows.lora_ba``) is

    F ≈ F₀ + s tr(Gᵀ B Z) + ½ s² tr(Bᵀ M B S),                                        (L0)

G = ∂F/∂H at H = W (k × t, rows in the span: ``row_gradient``) and M (k × k) the Hessian of F
in the rows' excursions εⱼ out of the span (hⱼ = wⱼ + εⱼe, e ⊥ span; the rest part of row j
is s(BR)ⱼ, so ⟨εᵢ, εⱼ⟩ = s²(BSBᵀ)ᵢⱼ). With ωⱼ = ‖wⱼ‖, ŵ = w/ω, ρ⁰ = ŴŴᵀ, κ⁰ᵢⱼ = ⟨vᵢ, ŵⱼ⟩ and
ε̃ⱼ = εⱼ/ωⱼ: ⟨ĥᵢ, ĥⱼ⟩ = ρ⁰ᵢⱼ(1 − ε̃ᵢ²/2 − ε̃ⱼ²/2) + ε̃ᵢε̃ⱼ and ⟨vᵢ, ĥⱼ⟩ = κ⁰ᵢⱼ(1 − ε̃ⱼ²/2) to
second order, so (K′ the dual kernel's derivative, exact)

    M = D M̃ D,  D = diag(1/ω),  M̃ᵢⱼ = 2λᵢλⱼK′(ρ⁰ᵢⱼ) (i ≠ j),
    M̃ⱼⱼ = 2λⱼ(Σᵢ λᵢK′(κ⁰ᵢⱼ)κ⁰ᵢⱼ − Σ_{i≠j} λᵢK′(ρ⁰ᵢⱼ)ρ⁰ᵢⱼ).                            (M)

The flow (dB/dτ = −ρ_B∂F/∂B, dZ/dτ = −∂F/∂Z, ρ_B = lr_ratio) is then, per column of B and row
of Z in the eigenbasis of S (eigenvalue s_S; S itself moves at O(B²)),

    d(b, z)/dτ = L (b, z),   L = −[[ρ_B s² s_S M, ρ_B s G], [s Gᵀ, 0]]   ((k + t)²),    (L1)

and the escape rate λ₊ is L's largest eigenvalue (a closed form: the eigenvalue of a
(k + t)-square matrix of dual-kernel values). M > 0 (leaving the span costs loss) damps B: the
rate is below s√ρ_B σ₁(G), the value without the normalisation's term. Rank r: the largest λ₊
over S's eigenvalues (the smallest s_S escapes first).

The kick of B's noise
---------------------
With ψ = ℓ·(b, z) the unstable amplitude (ℓ L = λ₊ℓ, ℓ·r₊ = 1, r₊ the right eigenvector),
ψ₀ = ℓ_z·z₀ ~ N(0, ‖ℓ_z‖²/d) for Gaussian A₀. At B = 0 one step moves B by −ρ_Bηs g(Ax)ᵀ/b
(summed over the batch), Ax = Zx + Rx_E with Rx_E ⊥ g, so B gets a martingale of covariance
ρ_B²ηs²S·E₀[ggᵀ]/b per unit τ (E₀ at H = W, ``gradient_covariance``): not small, it is η·d
times ψ₀'s variance. Accumulated on the unstable amplitude, ψ e^{−λ₊τ} → ψ₀ + ζ with

    Var ζ = ρ_B²ηs²s_S ℓ_bᵀE₀[ggᵀ]ℓ_b/(2λ₊b),                                         (K)

a Gaussian independent of ψ₀: the runs escape from an effective amplitude of variance
(‖ℓ_z‖² + η·d·ρ_B²s²s_S ℓ_bᵀE₀ℓ_b/(2λ₊b))/d. Z's noise is O(η) (it is ∝ B), dropped.

Steps to an overlap level
-------------------------
From (B, Z) = ε r₊ the flow reaches |⟨v₁, u⟩| = level at τ(ε) = ln(1/ε)/λ₊ + C′ + O(ε): C′
from the corrected flow (``corrected_flow``: the rest's noise acts once B is O(1)) at ε =
``EPS_START``. A run's amplitude is |ψ₀ + ζ|, median q·σ_eff/√d (q = 0.6745, the median of
|N(0, 1)|), so the median first passage is

    T(d) = (1/η)(½ ln d/λ₊ + C),   C = C′ − ln(q σ_eff)/λ₊,                           (T)

at fixed η·d: T/(d ln d) → 1/(2 η d λ₊).

The line beside SGD (:func:`kicked_overlap`): a run escapes from ψ₀ + ζ, i.e. at the time of
its start's corrected flow moved by ln|1 + ζ/ψ₀|/λ₊; the mean over ζ of that flow's overlap
read at the moved times is the expected overlap of runs from the start, to leading order in
the escape.

Rank r > 1 (:func:`rank_kick_shifts`)
-------------------------------------
B (k × r), Z (r × t), S = RRᵀ (r × r). (L0) holds as written (⟨εᵢ, εⱼ⟩ = s²(BSBᵀ)ᵢⱼ), so

    dB/dτ = −ρ_B(s² M B S + s G Zᵀ),  dZ/dτ = −s BᵀG,                                  (Lr)

and with S = Σ_a s_a q_a q_aᵀ the pairs (B q_a, q_aᵀZ) decouple, each obeying (L1) at s_S = s_a:
for A's rows in any position the unstable space is spanned by the r modes (r₊_b q_aᵀ, q_a r₊_zᵀ)
of rate λ₊(s_a), ψ_a = ⟨ℓ_b q_aᵀ, B⟩ + ⟨q_a ℓ_zᵀ, Z⟩ (eq. (Lr′); (L1)'s slower unstable
eigenvalues, 0.28 and 0.30 against λ₊ = 1.38 for relu, k = 3, s_S = 0.95 (the instance of
``tests/test_lora_ba_rank_kick.py``), are left out as at rank 1). B's noise per unit τ is
ρ_B²ηs²/b · E₀[ggᵀ] ⊗ S (the rest's x is independent of g), diagonal in the q_a, so the kicks
are independent, Cov ζ_aa′ = Σ_aa′/(λ_a + λ_a′), Var ζ_a = (K) at s_S = s_a.              (Kr)

In the linear phase the state's norm² is Σ_a ψ_a²e^{2λ_aτ}; the kicked run's is Σ_a (ψ_a +
ζ_a)²e^{2λ_aτ}. With τ_e the unkicked escape (norm 1) the kicked run is read as the unkicked
one moved by δ:

    Σ_a ψ_a² e^{2λ_a(τ_e + δ)} = Σ_a (ψ_a + ζ_a(τ))² e^{2λ_aτ_e},                            (E)

ζ_a(τ) = (1 − e^{−2λ_aτ})^{1/2}ζ_a the kick accumulated by the reading time τ (the linear phase's
state at τ has amplitude ψ + ζ(τ); ζ(τ) → ζ well before the escape, at 2λ₊τ ≫ 1); at r = 1
and ζ(τ) = ζ rank 1's ln|1 + ζ/ψ₀|/λ₊; exact in the linear phase where the λ_a are equal
(B → BQ, A → QᵀA leaves BA and S ∝ I alone, so only |ψ| matters), a per-mode move otherwise.
The line is the corrected flow's overlap read at τ + δ, averaged over ``RANK_KICKS`` fixed
Sobol′ kicks (the learner).

Given rows (``hermite.flows.lora_ba.BARowsGeometry``, normalised, labels y)
--------------------------------------------------------------------------
W (k × t) and the teacher rows V in a t-dim frame (t = dim span(W, W*)): span(W, u) becomes
span(W, W*) and everything above holds with t for k + 1. G = ∂F/∂H at H = W of those rows, (M)
as written (the rows' norms ω, ρ⁰ and κ⁰ = ⟨vᵢ, ŵⱼ⟩ of the unit teacher rows; a teacher σ* ≠ σ
changes only the teacher's sum: K×′ = E[σ*′σ′] for K′ in Σᵢλᵢκ⁰ᵢⱼK′(κ⁰ᵢⱼ), since V enters F
only through λᵀK×(VĤᵀ)λ), E₀[ggᵀ] of the rows at H = W, A₀'s mean rest 1 − t/d, and the
overlap read along the given direction u (``direction``). Rows as they are (Nⱼ = 1: the
expansion of ⟨ĥᵢ, ĥⱼ⟩ above does not apply) have none.

Labels y² (``BARowsGeometry.squared``; ``hermite.flows.lora_ba_squared``): the teacher's term
is −2Σⱼλⱼ Σᵢᵢ′ λᵢλᵢ′ T(ρ*ᵢᵢ′, κᵢⱼ, κᵢ′ⱼ), and since κᵢⱼ = κ⁰ᵢⱼ(1 − ε̃ⱼ²/2) moves at second
order only, it moves by T's first derivatives (Price: ∂T/∂κᵢ = E[σ*′σ*σ′]) only, so (M) holds
with the teacher's sum

    Σᵢ λᵢK′(κ⁰ᵢⱼ)κ⁰ᵢⱼ → Σᵢᵢ′ λᵢλᵢ′ (∂T/∂κᵢ κ⁰ᵢⱼ + ∂T/∂κᵢ′ κ⁰ᵢ′ⱼ) = ⟨∂C/∂ĥⱼ, ŵⱼ⟩          (M2)

(``squared_rest_teacher``); G, E₀[ggᵀ] (y = f*²) and the rest as written. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.special

from hermite._quadrature import sobol_normals
from hermite.expansion.kernels import dual_kernel_derivative
from hermite.flows.linearized import _geometry
from hermite.flows.lora_ba import (
    BANoise,
    _geo,
    _teacher_kernel,
    corrected_flow,
    gradient_covariance,
    row_gradient,
)
from hermite.flows.lora_ba_squared import squared_rest_teacher

__all__ = ["rest_hessian", "saddle_matrix", "EscapeMode", "escape_mode", "kick_variance",
           "EscapeTime", "escape_time", "passage_time", "kicked_overlap", "kick_grid",
           "read_kicked", "rank_saddle_matrix", "RankModes", "rank_modes", "kick_covariance",
           "rank_kick_shifts"]

EPS_START = 1e-5  # the flow's start amplitude on the unstable direction (C′, eq. (T))
MEDIAN_ABS_NORMAL = 0.6744897501960817  # median of |N(0, 1)|
TIME_POINTS = 4001  # grid of the flow's first passage (linear interpolation between points)


def _escape_geometry(instance):
    """The rows of an instance or a normalised ``BARowsGeometry`` (labels y or y²; module
    docstring); ValueError otherwise."""
    geo = _geo(instance)
    if not getattr(geo, "normalize", True):
        raise ValueError("the escape's theory needs normalised rows")
    return geo


def rest_hessian(instance) -> np.ndarray:
    """M (k, k), eq. (M): the Hessian of F in the rows' excursions out of span(W, u) (given
    rows: span(W, W*); σ* ≠ σ: K×′ in the teacher's sum; labels y²: eq. (M2))."""
    geo = _escape_geometry(instance)
    omega = np.linalg.norm(geo.w, axis=-1)
    wh = geo.w / omega[:, None]
    rho = np.clip(wh @ wh.T, -1.0, 1.0)
    kap = np.clip(geo.v @ wh.T, -1.0, 1.0)  # κ⁰ᵢⱼ = ⟨vᵢ, ŵⱼ⟩
    lam = geo.lam
    ks = lam[:, None] * lam[None, :] * dual_kernel_derivative(geo.act, rho)
    if getattr(geo, "squared", False):  # labels f*²: eq. (M2)
        teach = squared_rest_teacher(geo, wh)
    else:
        teach = (lam[:, None] * lam[None, :] * _teacher_kernel(geo, kap) * kap).sum(0)
    m = 2.0 * ks
    np.fill_diagonal(m, 0.0)
    diag = 2.0 * (teach - (ks * rho).sum(0) + np.diag(ks) * np.diag(rho))
    m[np.diag_indices_from(m)] = diag
    return m / np.outer(omega, omega)


def saddle_matrix(instance, *, scale: float = 1.0, lr_ratio: float = 1.0,
                  rest: float = 1.0) -> np.ndarray:
    """L ((k + t), (k + t)), eq. (L1), of one column of B and row of Z at A's rest Gram
    eigenvalue ``rest``."""
    geo = _escape_geometry(instance)
    g = row_gradient(instance, geo.w)  # (k, t)
    k, t = g.shape
    out = np.zeros((k + t, k + t))
    out[:k, :k] = -lr_ratio * scale**2 * rest * rest_hessian(instance)
    out[:k, k:] = -lr_ratio * scale * g
    out[k:, :k] = -scale * g.T
    return out


@dataclass(frozen=True)
class EscapeMode:
    """The unstable direction of eq. (L1): rate λ₊, right eigenvector r₊ = (b, z) and left
    ℓ = (b, z) with ℓ·r₊ = 1."""

    rate: float
    right_b: np.ndarray
    right_z: np.ndarray
    left_b: np.ndarray
    left_z: np.ndarray


def escape_mode(instance, *, scale: float = 1.0, lr_ratio: float = 1.0,
                rest: float = 1.0) -> EscapeMode:
    """λ₊ and its eigenvectors (:class:`EscapeMode`) of :func:`saddle_matrix`."""
    mat = saddle_matrix(instance, scale=scale, lr_ratio=lr_ratio, rest=rest)
    val, right = np.linalg.eig(mat)
    i = int(np.argmax(val.real))
    valt, left = np.linalg.eig(mat.T)
    j = int(np.argmin(np.abs(valt - val[i])))
    rv, lv = right[:, i].real, left[:, j].real
    rv = rv / np.linalg.norm(rv)
    lv = lv / (lv @ rv)
    k = _geo(instance).w.shape[0]
    return EscapeMode(float(val[i].real), rv[:k], rv[k:], lv[:k], lv[k:])


def kick_variance(instance, mode: EscapeMode, noise: BANoise, *, scale: float = 1.0,
                  lr_ratio: float = 1.0, rest: float = 1.0) -> float:
    """Var ζ, eq. (K): B's noise accumulated on the unstable amplitude ψ."""
    k, t = _geo(instance).w.shape
    b = np.zeros((k, 1))
    a = np.zeros((1, t + 1))
    a[0, -1] = math.sqrt(rest)
    cov = gradient_covariance(instance, b, a, scale, noise)
    return (lr_ratio**2 * noise.eta * scale**2 * rest * float(mode.left_b @ cov @ mode.left_b)
            / (2.0 * mode.rate * noise.batch))


def passage_time(times, overlap, level: float) -> float:
    """The first τ with overlap ≥ level, linear between the grid points (NaN: never)."""
    ov = np.nan_to_num(np.asarray(overlap, float))
    hit = np.flatnonzero(ov >= level)
    if hit.size == 0:
        return math.nan
    i = int(hit[0])
    if i == 0:
        return float(times[0])
    f = (level - ov[i - 1]) / (ov[i] - ov[i - 1])
    return float(times[i - 1] + f * (times[i] - times[i - 1]))


@dataclass(frozen=True)
class EscapeTime:
    """Eq. (T) at one (instance, η·d, d): rate λ₊, constant C, σ_eff² (the runs' effective
    amplitude variance times d), C′ and the predicted median steps ``steps``."""

    rate: float
    offset: float
    sigma2: float
    flow_offset: float
    steps: float


def _direction(instance, direction, width: int) -> np.ndarray:
    """The overlap's direction u (``direction`` (t,), or the instance's) padded to ``width``."""
    u = np.zeros(width)
    given = _geometry(instance).u if direction is None else np.asarray(direction, float)
    u[: given.size] = given
    return u


def escape_time(instance, noise: BANoise, *, level: float = 0.9, scale: float = 1.0,
                lr_ratio: float = 1.0, horizon: float = 40.0, direction=None) -> EscapeTime:
    """Eq. (T) for rank 1 and Gaussian A₀ at the SGD ``noise`` (η, d, b): λ₊ (:func:`
    escape_mode` at s_S = 1 − t/d, A₀'s mean rest), σ_eff² = ‖ℓ_z‖² + d·Var ζ, C′ from the
    corrected flow started at ``EPS_START``·r₊ (τ ≤ ``horizon``); overlap along ``direction``
    (t,) (given rows; None: the instance's u)."""
    t = _geo(instance).w.shape[-1]
    rest = 1.0 - t / noise.d
    mode = escape_mode(instance, scale=scale, lr_ratio=lr_ratio, rest=rest)
    sigma2 = float(mode.left_z @ mode.left_z) + noise.d * kick_variance(
        instance, mode, noise, scale=scale, lr_ratio=lr_ratio, rest=rest)
    b0 = EPS_START * mode.right_b[None, :, None]
    a0 = np.concatenate([EPS_START * mode.right_z, [math.sqrt(rest)]])[None, None]
    times = np.linspace(0.0, horizon, TIME_POINTS)
    out = corrected_flow(instance, b0, a0, times, noise, scale=scale, lr_ratio=lr_ratio)
    ba = (out.b[0] @ out.a[0])[:, 0]  # (T, D): the rank-1 update's row
    u = _direction(instance, direction, ba.shape[-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        overlap = np.abs(ba @ u) / np.linalg.norm(ba, axis=-1)
    tau = passage_time(times, overlap, level)
    flow_offset = tau - math.log(1.0 / EPS_START) / mode.rate
    offset = flow_offset - math.log(MEDIAN_ABS_NORMAL * math.sqrt(sigma2)) / mode.rate
    steps = (0.5 * math.log(noise.d) / mode.rate + offset) / noise.eta
    return EscapeTime(mode.rate, offset, sigma2, flow_offset, steps)



KICK_NODES = 256  # equal-probability nodes of the kick ζ in :func:`kicked_overlap`
FINE_POINTS = 801  # the corrected flow's grid of τ, interpolated at the shifted times
EXTEND = 1.0  # the flow runs past the last time by the largest shift, at most this × that time
RANK_KICKS = 64  # rank r > 1: quasi-random kicks ζ ∈ R^r common to every start (power of 2)
RANK_KICK_SEED = 39  # their scrambled Sobol′ set
ROOT_STEPS = 60  # Newton steps of eq. (E) (log-sum-exp in its unknown: convex, increasing)


def kick_grid(times, shifts) -> np.ndarray:
    """The flow's grid of τ for reading it at ``times`` + ``shifts`` (each run's shifts, a
    sequence of arrays): ``times`` and ``FINE_POINTS`` points to the last time plus the largest
    shift (at most ``EXTEND`` × the last time more; beyond it the curve holds its last
    value)."""
    end = float(np.max(times, initial=0.0))
    reach = min(max(0.0, max(float(np.max(s)) for s in shifts)), EXTEND * end)
    return np.union1d(times, np.linspace(0.0, end + reach,
                                         int(FINE_POINTS * (1.0 + reach / max(end, 1e-300)))))


def read_kicked(times, fine, curve, shifts) -> np.ndarray:
    """(n, T) the mean over each run's shifts (m,) or (T, m) (per time) of its curve (n, F) on
    ``fine`` read at ``times`` + shift (0 before τ = 0; NaN for a run whose curve is not
    finite)."""
    res = np.full((len(shifts), np.size(times)), np.nan)
    for i, shift in enumerate(shifts):
        if np.isfinite(curve[i]).all():
            res[i] = np.interp(np.asarray(times)[:, None] + np.atleast_2d(shift), fine,
                               curve[i], left=0.0).mean(1)
    return res


def kicked_overlap(instance, b0, a0, times, noise: BANoise, *, scale: float = 1.0,
                   lr_ratio: float = 1.0, nodes: int = KICK_NODES,
                   direction=None) -> np.ndarray:
    """(n, T) the mean overlap |⟨v₁, u⟩| of runs from each start (B₀ (n, k, 1), A₀ (n, 1,
    t + 1); u = ``direction`` (t,) for given rows, None: the instance's) at the times τ, B's
    kick (eq. (K)) included: the corrected flow's overlap f(τ) from the start, whose
    unstable amplitude is ψ₀ = ℓ·(b₀, z₀), read at τ + ln|1 + ζ/ψ₀|/λ₊
    (the escape from ψ₀ + ζ is the one from ψ₀ moved in time, exact in the linear phase) and
    averaged over ``nodes`` equal-probability nodes of ζ ~ N(0, Var ζ) (rank 1, A trained;
    before τ = 0 the overlap counts as 0). Rank r > 1: :func:`rank_kick_shifts`."""
    b0, a0 = np.asarray(b0, float), np.asarray(a0, float)
    n, k, r = b0.shape
    t = _geo(instance).w.shape[-1]
    if r != 1:
        raise ValueError(f"the kicked overlap is rank 1's (here r = {r}; rank_kick_shifts)")
    times = np.asarray(times, float)
    x = scipy.special.ndtri((np.arange(nodes) + 0.5) / nodes)
    shifts = []  # each run's time shifts ln|1 + ζ/ψ₀|/λ₊ at the nodes of ζ
    for i in range(n):
        rest = float(a0[i, 0, t:] @ a0[i, 0, t:])
        kw = dict(scale=scale, lr_ratio=lr_ratio, rest=rest)
        mode = escape_mode(instance, **kw)
        psi = float(mode.left_b @ b0[i, :, 0] + mode.left_z @ a0[i, 0, :t])
        var = kick_variance(instance, mode, noise, **kw) if mode.rate > 0 else 0.0
        ratio = np.abs(1.0 + math.sqrt(var) * x / max(abs(psi), 1e-300))
        shifts.append(np.log(np.maximum(ratio, 1e-300)) / mode.rate if var > 0
                      else np.zeros(1))
    fine = kick_grid(times, shifts)
    out = corrected_flow(instance, b0, a0, fine, noise, scale=scale, lr_ratio=lr_ratio)
    row = out.a[:, :, 0]  # (n, F, D): A's row (v₁ of the rank-1 B·A where B ≠ 0)
    u = _direction(instance, direction, row.shape[-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        curve = np.abs(row @ u) / np.linalg.norm(row, axis=-1)
    curve = np.where(np.linalg.norm(out.b[..., 0], axis=-1) > 0, curve, 0.0)
    return read_kicked(times, fine, curve, shifts)


# ---------------------------------------------------------------------- rank r > 1
def rank_saddle_matrix(instance, rest_gram, *, scale: float = 1.0,
                       lr_ratio: float = 1.0) -> np.ndarray:
    """L_r ((kr + rt)²), eq. (Lr): the flow linearised at B = 0, Z = 0 in (vec B, vec Z)
    (row-major, B (k, r), Z (r, t)) at A's rest Gram S = ``rest_gram`` (r, r)."""
    geo = _escape_geometry(instance)
    g = row_gradient(instance, geo.w)  # (k, t)
    k, t = g.shape
    s_gram = np.asarray(rest_gram, float)
    r = s_gram.shape[0]
    nb, eye = k * r, np.eye(r)
    out = np.zeros((nb + r * t, nb + r * t))
    out[:nb, :nb] = -lr_ratio * scale**2 * np.kron(rest_hessian(instance), s_gram)
    out[:nb, nb:] = -lr_ratio * scale * np.einsum("im,ab->iabm", g, eye).reshape(nb, r * t)
    out[nb:, :nb] = -scale * np.einsum("im,ab->amib", g, eye).reshape(r * t, nb)
    return out


@dataclass(frozen=True)
class RankModes:
    """The r leading unstable modes of eq. (Lr), one per eigenvector q_a of S (eq. (Lr′)):
    rates λ_a (r,), right vectors (B (r, k, r), Z (r, r, t)) and left ones with ψ_a =
    ⟨left_b[a], B⟩ + ⟨left_z[a], Z⟩, ⟨left[a], right[a′]⟩ = δ_aa′; ``gram`` S, ``rest`` its
    eigenvalues s_a, ``axes`` (r, r) the q_a (columns)."""

    rates: np.ndarray
    right_b: np.ndarray
    right_z: np.ndarray
    left_b: np.ndarray
    left_z: np.ndarray
    gram: np.ndarray
    rest: np.ndarray
    axes: np.ndarray

    def amplitudes(self, b, z) -> np.ndarray:
        """(…, r) ψ of states B (…, k, r), Z (…, r, t)."""
        return (np.einsum("akr,...kr->...a", self.left_b, b)
                + np.einsum("art,...rt->...a", self.left_z, z))


def rank_modes(instance, rest_gram, *, scale: float = 1.0, lr_ratio: float = 1.0) -> RankModes:
    """:class:`RankModes` of A's rest Gram S (r, r): in S's eigenbasis (B q_a, q_aᵀZ) obeys
    eq. (L1) at s_S = s_a, so mode a is :func:`escape_mode` at ``rest`` = s_a, placed as
    (r₊_b q_aᵀ, q_a r₊_zᵀ) (eq. (Lr′))."""
    s_gram = np.asarray(rest_gram, float)
    rest, axes = np.linalg.eigh(s_gram)
    modes = [escape_mode(instance, scale=scale, lr_ratio=lr_ratio, rest=float(s))
             for s in rest]
    outer = np.einsum
    return RankModes(np.array([m.rate for m in modes]),
                     outer("ak,ra->akr", np.stack([m.right_b for m in modes]), axes),
                     outer("ra,at->art", axes, np.stack([m.right_z for m in modes])),
                     outer("ak,ra->akr", np.stack([m.left_b for m in modes]), axes),
                     outer("ra,at->art", axes, np.stack([m.left_z for m in modes])),
                     s_gram, rest, axes)


def _saddle_moment(instance, scale: float, noise: BANoise) -> np.ndarray:
    """E₀[ggᵀ] (k, k) at B = 0 (H = W: A does not enter), on rank 1's points."""
    k, t = _geo(instance).w.shape
    a = np.zeros((1, t + 1))
    a[0, -1] = 1.0
    return gradient_covariance(instance, np.zeros((k, 1)), a, scale, noise)


def kick_covariance(instance, modes: RankModes, noise: BANoise, *, scale: float = 1.0,
                    lr_ratio: float = 1.0, moment=None) -> np.ndarray:
    """Cov ζ (r, r), eq. (Kr): B's noise (covariance ρ_B²ηs²/b · E₀[ggᵀ] ⊗ S per unit τ)
    accumulated on the amplitudes, Σ_aa′/(λ_a + λ_a′); diagonal (S's eigenbasis), rank 1
    :func:`kick_variance`. ``moment``: E₀[ggᵀ] if known."""
    cov = _saddle_moment(instance, scale, noise) if moment is None else moment
    lb = np.einsum("akr,rb->akb", modes.left_b, modes.axes)  # ℓ_b,a ⊗ (q_a's coordinates)
    sig = np.einsum("akb,kl,clb->ac", lb, cov, lb * modes.rest[None, None, :])
    sig = lr_ratio**2 * noise.eta * scale**2 / noise.batch * sig
    return sig / (modes.rates[:, None] + modes.rates[None, :])


def _exp_root(weights, rates, target) -> np.ndarray:
    """x (…) with Σ_a w_a e^{2λ_a x} = target (…) (w ≥ 0, λ > 0): Newton on the log, convex and
    increasing in x."""
    lw = np.log(np.maximum(weights, 1e-300))
    lt = np.log(np.maximum(target, 1e-300))
    x = (lt - np.log(np.sum(weights))) / (2.0 * np.max(rates))
    for _ in range(ROOT_STEPS):
        e = lw + 2.0 * rates * np.asarray(x)[..., None]
        p = scipy.special.softmax(e, axis=-1)
        x = x - (scipy.special.logsumexp(e, axis=-1) - lt) / (2.0 * (p * rates).sum(-1))
    return x


def rank_kick_shifts(instance, b0, a0, times, noise: BANoise, *, scale: float = 1.0,
                     lr_ratio: float = 1.0, kicks: int = RANK_KICKS) -> list:
    """Each start's time shifts (n arrays (T, ``kicks``)) at the reading times τ (T,), eq. (E):
    B₀ (n, k, r), A₀ (n, r, t + r); the kick accumulated by τ, ζ_a(τ) = (1 − e^{−2λ_aτ})^{1/2}
    ζ_a, ζ = Cov ζ^{1/2}x at ``kicks`` fixed Sobol′ normals x ∈ R^r (common to every start);
    a start without an escaping mode (or with ψ = 0) gets no shift."""
    b0, a0 = np.asarray(b0, float), np.asarray(a0, float)
    n, k, r = b0.shape
    t = _geo(instance).w.shape[-1]
    times = np.asarray(times, float)
    x = sobol_normals(r, kicks, RANK_KICK_SEED)
    moment = _saddle_moment(instance, scale, noise)
    shifts = []
    for i in range(n):
        rest = a0[i, :, t:]
        modes = rank_modes(instance, rest @ rest.T, scale=scale, lr_ratio=lr_ratio)
        psi = modes.amplitudes(b0[i], a0[i, :, :t])
        if not ((modes.rates > 0).all() and np.any(psi)):
            shifts.append(np.zeros((times.size, 1)))
            continue
        val, vec = np.linalg.eigh(kick_covariance(instance, modes, noise, scale=scale,
                                                  lr_ratio=lr_ratio, moment=moment))
        zeta = x @ (vec * np.sqrt(np.maximum(val, 0.0))).T  # (kicks, r)
        part = np.sqrt(-np.expm1(-2.0 * np.outer(np.maximum(times, 0.0), modes.rates)))
        escape = _exp_root(psi**2, modes.rates, 1.0)  # eq. (E)'s τ_e
        grow = np.exp(2.0 * modes.rates * escape)
        kicked = ((psi + part[:, None, :] * zeta[None]) ** 2 * grow).sum(-1)  # (T, kicks)
        shifts.append(_exp_root(psi**2 * grow, modes.rates, kicked))
    return shifts

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
           "EscapeTime", "escape_time", "passage_time", "kicked_overlap"]

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


def kicked_overlap(instance, b0, a0, times, noise: BANoise, *, scale: float = 1.0,
                   lr_ratio: float = 1.0, nodes: int = KICK_NODES,
                   direction=None) -> np.ndarray:
    """(n, T) the mean overlap |⟨v₁, u⟩| of runs from each start (B₀ (n, k, 1), A₀ (n, 1,
    t + 1); u = ``direction`` (t,) for given rows, None: the instance's) at the times τ, B's
    kick (eq. (K)) included: the corrected flow's overlap f(τ) from the start, whose
    unstable amplitude is ψ₀ = ℓ·(b₀, z₀), read at τ + ln|1 + ζ/ψ₀|/λ₊
    (the escape from ψ₀ + ζ is the one from ψ₀ moved in time, exact in the linear phase) and
    averaged over ``nodes`` equal-probability nodes of ζ ~ N(0, Var ζ) (rank 1, A trained;
    before τ = 0 the overlap counts as 0)."""
    b0, a0 = np.asarray(b0, float), np.asarray(a0, float)
    n, k, r = b0.shape
    t = _geo(instance).w.shape[-1]
    if r != 1:
        raise ValueError(f"the kicked overlap is rank 1's (here r = {r})")
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
    # the flow is read up to the last time plus the largest shift (at most EXTEND × the last
    # time more; beyond it the curve holds its last value)
    end = float(times.max(initial=0.0))
    reach = min(max(0.0, max(float(s.max()) for s in shifts)), EXTEND * end)
    fine = np.union1d(times, np.linspace(0.0, end + reach,
                                         int(FINE_POINTS * (1.0 + reach / max(end, 1e-300)))))
    out = corrected_flow(instance, b0, a0, fine, noise, scale=scale, lr_ratio=lr_ratio)
    row = out.a[:, :, 0]  # (n, F, D): A's row (v₁ of the rank-1 B·A where B ≠ 0)
    u = _direction(instance, direction, row.shape[-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        curve = np.abs(row @ u) / np.linalg.norm(row, axis=-1)
    curve = np.where(np.linalg.norm(out.b[..., 0], axis=-1) > 0, curve, 0.0)
    res = np.full((n, times.size), np.nan)
    for i, shift in enumerate(shifts):
        if np.isfinite(curve[i]).all():
            res[i] = np.interp(times[:, None] + shift[None, :], fine, curve[i],
                               left=0.0).mean(1)
    return res

"""Refitting the second layer on features built from a learned û (paper App. F.2, eq. 17).

Given û, the 2k features are φᵢ±(x) = σ(⟨fᵢ±, x⟩) with unit rows
fᵢ± = (wᵢ ± (ξ/√k) û)/‖wᵢ ± (ξ/√k) û‖, and the refit model is f_a = aᵀφ, a ∈ R^{2k}
(order: the k "+" features, then the k "−" features). For quantized c = ±1/√k and û = u the
teacher is exactly f* = Σᵢ λᵢ φᵢ,sign(cᵢ), so the optimal a reaches loss 0 (Thm 36).

Everything depends on x only through its coordinates in span(W) ⊕ span(u, û), so the fit
sample is drawn in the reduced coordinates (x_W ∈ R^k, x_e, x_rest) of
``dynamics.measures.observables.reduced_coordinates`` — û = (û_w, û_k, ‖rest‖), u = (u_w, u⊥, 0) —
which is exact in law. Population quantities are exact with dual kernels K(ρ) = E[σ(z₁)σ(z₂)]
(App. D.1, ``dynamics.measures.network_loss``):

    E(f* − aᵀφ)² = E f*² − 2aᵀb + aᵀAa,   A = K(F Fᵀ),  b = K(F Vᵀ) λ,  E f*² = λᵀK(VVᵀ)λ,

F the feature rows, V the teacher rows. Recorded per run and checkpoint (:func:`refit_records`):
``refit_loss`` (a fitted by least squares on ``refit_samples`` examples, labels with the run's
label noise, the sample seeded from (config.seed, run) and fixed across checkpoints; loss
evaluated exactly), ``refit_loss_population`` (a = A⁺b, loss E f*² − bᵀA⁺b), and
``base_loss`` E(f* − f₀)² of the base network f₀ = Σᵢ λᵢσ(⟨wᵢ,x⟩).
"""

from __future__ import annotations

import math

import numpy as np

import hermite
from dynamics.measures.network_loss import network_loss, teacher_rows
from dynamics.measures.observables import group_runs
from dynamics.randomness.sampling import run_seed

__all__ = [
    "REFIT_RCOND",
    "feature_rows",
    "teacher_rows_reduced",
    "population_terms",
    "refit_loss",
    "population_refit",
    "refit_sample",
    "teacher_labels",
    "sample_features",
    "fit_second_layer",
    "base_loss",
    "refit_records",
]

REFIT_RCOND = 1e-10  # eigenvalues of A below this × the largest are dropped in A⁺


def feature_rows(instance, coords: np.ndarray) -> np.ndarray:
    """Unit feature rows fᵢ± (…, 2k, k+2) in reduced coordinates from û's coords (…, k+2).

    fᵢ± = (wᵢ ± (ξ/√k) û)/‖·‖ with wᵢ = (Lᵢ, 0, 0) (L = ``instance.w_factor``); û need not be
    ⊥ span W (unprojected runs).
    """
    k = instance.k
    coords = np.asarray(coords, dtype=float)
    base = np.zeros((k, k + 2))
    base[:, :k] = instance.w_factor
    shift = (instance.xi / math.sqrt(k)) * coords[..., None, :]
    rows = np.concatenate([base + shift, base - shift], axis=-2)
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def teacher_rows_reduced(instance) -> np.ndarray:
    """Teacher rows vᵢ = (wᵢ + ξcᵢu)/Nᵢ (k, k+2) in reduced coordinates (last column 0)."""
    v = teacher_rows(instance)
    return np.concatenate([v, np.zeros((instance.k, 1))], axis=1)


def _kernel(activation, gram):

    return hermite.dual_kernel(activation, np.clip(gram, -1.0, 1.0))


def population_terms(instance, rows: np.ndarray):
    """(E f*², A (…, 2k, 2k), b (…, 2k)) for feature rows (…, 2k, k+2):
    A = K(F Fᵀ) = E[φφᵀ], b = K(F Vᵀ)λ = E[φ f*], E f*² = λᵀK(VVᵀ)λ."""
    act, lam = instance.activation, instance.lam
    v = teacher_rows_reduced(instance)
    ey2 = float(lam @ _kernel(act, v @ v.T) @ lam)
    a = _kernel(act, np.einsum("...id,...jd->...ij", rows, rows))
    b = _kernel(act, np.einsum("...id,jd->...ij", rows, v)) @ lam
    return ey2, a, b


def refit_loss(ey2: float, a_mat: np.ndarray, b: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """E(f* − aᵀφ)² = E f*² − 2aᵀb + aᵀAa for coefficients ``coef`` (…, 2k)."""
    quad = np.einsum("...i,...ij,...j->...", coef, a_mat, coef)
    return ey2 - 2.0 * np.einsum("...i,...i->...", coef, b) + quad


def population_refit(ey2: float, a_mat: np.ndarray, b: np.ndarray):
    """Population-optimal a = A⁺b (…, 2k) and its loss E f*² − bᵀA⁺b (…,).

    A⁺ from the eigendecomposition with eigenvalues ≤ ``REFIT_RCOND`` × max dropped; the loss
    is evaluated as E f*² − Σⱼ (qⱼᵀb)²/sⱼ, which stays accurate when A is ill-conditioned.
    """
    s, q = np.linalg.eigh(a_mat)
    keep = s > REFIT_RCOND * s.max(axis=-1, keepdims=True)
    proj = np.einsum("...ij,...i->...j", q, b)  # qⱼᵀb
    inv = np.where(keep, 1.0 / np.where(keep, s, 1.0), 0.0)
    coef = np.einsum("...ij,...j->...i", q, inv * proj)
    return coef, ey2 - (inv * proj * proj).sum(-1)


def _refit_rng(seed: int, run: int) -> np.random.Generator:
    """The refit sample's stream of run ``run``: depends on (seed, run) only."""
    return np.random.default_rng(run_seed(seed, run, "refit"))


def refit_sample(seed: int, run: int, k: int, size: int, label_noise: float = 0.0):
    """(x (size, k+2) standard normals in reduced coordinates, label noise (size,)):
    the fit sample of run ``run``; the noise is √label_noise · N(0, 1) (zeros if 0)."""
    rng = _refit_rng(seed, run)
    x = rng.standard_normal((size, k + 2))
    noise = math.sqrt(label_noise) * rng.standard_normal(size) if label_noise > 0 else \
        np.zeros(size)
    return x, noise


def teacher_labels(instance, x: np.ndarray) -> np.ndarray:
    """f*(x) = Σᵢ λᵢσ(⟨vᵢ,x⟩) for reduced-coordinate examples x (n, k+2)."""
    return np.asarray(instance.activation.fn(x @ teacher_rows_reduced(instance).T)) @ \
        instance.lam


def sample_features(instance, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """φ(x) = σ(x Fᵀ) (n, 2k) for rows F (2k, k+2) and examples x (n, k+2)."""
    return np.asarray(instance.activation.fn(x @ rows.T), dtype=float)


def fit_second_layer(instance, rows: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares a = argmin Σₙ (yₙ − aᵀφ(xₙ))² (minimum norm) for each set of feature
    rows (C, 2k, k+2) on one sample x (n, k+2), y (n,); returns (C, 2k)."""
    rows = np.asarray(rows, dtype=float)
    out = np.empty(rows.shape[:-1])
    for j in range(rows.shape[0]):
        out[j] = np.linalg.lstsq(sample_features(instance, rows[j], x), y, rcond=None)[0]
    return out


def base_loss(instance) -> float:
    """E(f* − f₀)² of the base network f₀ = Σᵢ λᵢσ(⟨wᵢ,x⟩) (exact, dual kernels)."""
    k = instance.k
    rows = np.concatenate([instance.w_factor, np.zeros((k, 1))], axis=1)
    return float(network_loss(instance, rows, instance.lam))


def refit_records(config, instances, coords: np.ndarray, dead: np.ndarray) -> dict:
    """``refit_loss`` (R, C), ``refit_loss_population`` (R, C) and ``base_loss`` (R,).

    coords (R, C, k+2) are û's reduced coordinates at the checkpoints; dead (R, C) marks a
    diverged run's checkpoints (NaN there, as where coords are not finite). Run r's fit
    sample comes from (config.seed, r) and is shared by all its checkpoints.
    """
    coords = np.asarray(coords, dtype=float)
    runs, cps = coords.shape[:2]
    fit, pop = np.full((runs, cps), np.nan), np.full((runs, cps), np.nan)
    base = np.full(runs, np.nan)
    for inst, idx in group_runs(instances):
        base[idx] = base_loss(inst)
        for r in idx:
            x, noise = refit_sample(config.seed, int(r), inst.k, config.options.refit_samples,
                                    config.label_noise)
            ok = ~np.asarray(dead[r], dtype=bool) & np.isfinite(coords[r]).all(-1)
            if not ok.any():
                continue
            rows = feature_rows(inst, coords[r, ok])
            ey2, a_mat, b = population_terms(inst, rows)
            pop[r, ok] = population_refit(ey2, a_mat, b)[1]
            y_clean = teacher_labels(inst, x)
            coef = fit_second_layer(inst, rows, x, y_clean + noise)
            fit[r, ok] = refit_loss(ey2, a_mat, b, coef)
    return {"refit_loss": fit, "refit_loss_population": pop, "base_loss": base}

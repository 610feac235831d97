"""Hermite theory of the population dynamics: μ_p(σ), dual kernels, h(m), Φ(m), population ODE.

Paper: "Low-rank fine-tuning lies between lazy training and feature learning" (seed 004),
Prop. 4 (population gradient), §3.1 (overlap dynamics), Theorems 11–13/16 (step sizes).

The package in rooms, from the bottom up (a room imports only from rooms above it in this
list; ``tests/test_layering.py`` checks it):

- the root: the activations (:mod:`hermite.activations`, their numba twins in
  :mod:`hermite.activations_numba`) and Gauss–Hermite quadrature;
- :mod:`hermite.expansion`: an activation's Hermite coefficients μ_p(σ), dual kernels, h(m),
  the population loss Φ(m) and their tables;
- :mod:`hermite.flows`: the d → ∞ population flows — the overlap ODE (§3.1), the step-size
  theorems (11–13, 16), the rank-r matrix ODE, the linearized (NTK) model;
- :mod:`hermite.finite_d`: finite-d corrections — one-step noise moments, the noise-corrected
  map, the LNA band, step-size and stability criteria;
- :mod:`hermite.finetune`: the joint (û, ĉ) fine-tuning model — its population flow and
  corrected flow, bands, the escape line, the finite-ξ ensemble;
- :mod:`hermite.committee`: the committee machine's ODE, diffusion and first passages.

The names below are imported on first use (PEP 562): ``import hermite.activations`` (or
``from hermite import get_activation``) loads that module alone, not numba's kernels.
"""

from __future__ import annotations

import importlib

# name → the submodule that defines it
_WHERE = {
    "hermite_coefficients": "expansion.coefficients",
    "parseval_residual": "expansion.coefficients",
    "gaussian_second_moment": "expansion.coefficients",
    "derivative_second_moment": "expansion.coefficients",
    "dual_kernel": "expansion.kernels",
    "dual_kernel_derivative": "expansion.kernels",
    "kernel_interpolant": "expansion.kernels",
    "h": "expansion.gradient",
    "h0_sign": "expansion.gradient",
    "H_METHODS": "expansion.gradient",
    "HSeries": "expansion.series",
    "h_direct": "expansion.series",
    "truncation_bound": "expansion.series",
    "HTable": "expansion.table",
    "population_loss": "expansion.loss",
    "population_loss_derivative": "expansion.loss",
    "population_ode": "flows.ode",
    "ode_continuous": "flows.ode",
    "steps_to_reach": "flows.ode",
    "finetune_ode": "finetune.population",
    "finetune_steps_to_reach": "finetune.population",
    "finetune_ode_kind": "finetune.population",
    "FinetuneModel": "finetune.population",
    "FinetuneODE": "finetune.population",
    "PairKernel": "finetune.population",
    "FinetuneRegime": "flows.regime",
    "FinetuneStart": "flows.regime",
    "SolverSettings": "flows.regime",
    "Schedule": "flows.theorems",
    "population_lower_bound": "flows.theorems",
    "theorem11_schedule": "flows.theorems",
    "theorem12_schedule": "flows.theorems",
    "theorem13_schedule": "flows.theorems",
    "theorem16_schedule": "flows.theorems",
    "noise_moments": "finite_d.noise",
    "one_step_moments": "finite_d.noise",
    "NoiseMoments": "finite_d.noise",
    "OneStepMoments": "finite_d.noise",
    "drift_table": "finite_d.corrected_ode",
    "regime_table": "finite_d.corrected_ode",
    "DriftTable": "finite_d.corrected_ode",
    "corrected_ode": "finite_d.corrected_ode",
    "corrected_mean": "finite_d.corrected_ode",
    "noise_floor": "finite_d.corrected_ode",
    "stationary_moments": "finite_d.corrected_ode",
    "corrected_steps_to_reach": "finite_d.corrected_ode",
    "theory_band": "finite_d.lna",
    "TheoryBand": "finite_d.lna",
    "BandForm": "finite_d.lna",
    "initial_law": "finite_d.lna",
    "max_step_size": "finite_d.stepsize",
    "StepSizeReport": "finite_d.stepsize",
    "A_matrix": "flows.rank",
    "overlap_drift": "flows.rank",
    "population_loss_rank": "flows.rank",
    "matrix_ode": "flows.rank",
    "rank_correlations": "flows.rank",
    "RankConstants": "flows.rank",
    "singular_values": "flows.rank",
    "signed_smallest": "flows.rank",
    "escape_coefficients": "flows.pretrained",
    "escape_rate": "flows.pretrained",
    "escape_time": "flows.pretrained",
    "pretrained_flow": "flows.pretrained",
    "pretrained_loss": "flows.pretrained",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    try:
        module = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'hermite' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"hermite.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

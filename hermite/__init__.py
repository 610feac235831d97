"""Hermite theory of the population dynamics: μ_p(σ), dual kernels, h(m), Φ(m), population ODE.

Paper: "Low-rank fine-tuning lies between lazy training and feature learning" (seed 004),
Prop. 4 (population gradient), §3.1 (overlap dynamics), Theorems 11–13/16 (step sizes).
"""

from .coefficients import (
    derivative_second_moment,
    gaussian_second_moment,
    hermite_coefficients,
    parseval_residual,
)
from .corrected_ode import (
    DriftTable,
    corrected_mean,
    corrected_ode,
    corrected_steps_to_reach,
    drift_table,
    noise_floor,
    stationary_moments,
)
from .gradient import H_METHODS, h, h0_sign
from .kernels import dual_kernel, dual_kernel_derivative, kernel_interpolant
from .lna import TheoryBand, initial_law, theory_band
from .loss import population_loss, population_loss_derivative
from .noise import NoiseMoments, OneStepMoments, noise_moments, one_step_moments
from .ode import ode_continuous, population_ode, steps_to_reach
from .rank import (
    A_matrix,
    RankConstants,
    matrix_ode,
    overlap_drift,
    population_loss_rank,
    rank_correlations,
    signed_smallest,
    singular_values,
)
from .series import HSeries, h_direct, truncation_bound
from .stepsize import StepSizeReport, max_step_size
from .table import HTable
from .theorems import (
    Schedule,
    population_lower_bound,
    theorem11_schedule,
    theorem12_schedule,
    theorem13_schedule,
    theorem16_schedule,
)

__all__ = [
    "hermite_coefficients",
    "parseval_residual",
    "gaussian_second_moment",
    "derivative_second_moment",
    "dual_kernel",
    "dual_kernel_derivative",
    "kernel_interpolant",
    "h",
    "h0_sign",
    "H_METHODS",
    "HSeries",
    "h_direct",
    "truncation_bound",
    "HTable",
    "population_loss",
    "population_loss_derivative",
    "population_ode",
    "ode_continuous",
    "steps_to_reach",
    "Schedule",
    "population_lower_bound",
    "theorem11_schedule",
    "theorem12_schedule",
    "theorem13_schedule",
    "theorem16_schedule",
    "noise_moments",
    "one_step_moments",
    "NoiseMoments",
    "OneStepMoments",
    "drift_table",
    "DriftTable",
    "corrected_ode",
    "corrected_mean",
    "noise_floor",
    "stationary_moments",
    "corrected_steps_to_reach",
    "theory_band",
    "TheoryBand",
    "initial_law",
    "max_step_size",
    "StepSizeReport",
    "A_matrix",
    "overlap_drift",
    "population_loss_rank",
    "matrix_ode",
    "rank_correlations",
    "RankConstants",
    "singular_values",
    "signed_smallest",
]

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
from .gradient import H_METHODS, h, h0_sign
from .kernels import dual_kernel, dual_kernel_derivative, kernel_interpolant
from .loss import population_loss, population_loss_derivative
from .ode import ode_continuous, population_ode, steps_to_reach
from .series import HSeries, h_direct, truncation_bound
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
]

"""Hermite theory of the population dynamics: μ_p(σ), dual kernels, h(m), Φ(m), population ODE.

Paper: "Low-rank fine-tuning lies between lazy training and feature learning" (seed 004),
Prop. 4 (population gradient), §3.1 (overlap dynamics), Theorems 11–13/16 (step sizes).

The names below are imported on first use (PEP 562): ``import hermite.activations`` (or
``from hermite import get_activation``) loads that module alone, not numba's kernels.
"""

from __future__ import annotations

import importlib
import sys
import types

# name → the submodule that defines it
_WHERE = {
    "hermite_coefficients": "coefficients",
    "parseval_residual": "coefficients",
    "gaussian_second_moment": "coefficients",
    "derivative_second_moment": "coefficients",
    "dual_kernel": "kernels",
    "dual_kernel_derivative": "kernels",
    "kernel_interpolant": "kernels",
    "h": "gradient",
    "h0_sign": "gradient",
    "H_METHODS": "gradient",
    "HSeries": "series",
    "h_direct": "series",
    "truncation_bound": "series",
    "HTable": "table",
    "population_loss": "loss",
    "population_loss_derivative": "loss",
    "population_ode": "ode",
    "ode_continuous": "ode",
    "steps_to_reach": "ode",
    "finetune_ode": "finetune_population",
    "finetune_steps_to_reach": "finetune_population",
    "finetune_ode_kind": "finetune_population",
    "FinetuneModel": "finetune_population",
    "FinetuneODE": "finetune_population",
    "PairKernel": "finetune_population",
    "Schedule": "theorems",
    "population_lower_bound": "theorems",
    "theorem11_schedule": "theorems",
    "theorem12_schedule": "theorems",
    "theorem13_schedule": "theorems",
    "theorem16_schedule": "theorems",
    "noise_moments": "noise",
    "one_step_moments": "noise",
    "NoiseMoments": "noise",
    "OneStepMoments": "noise",
    "drift_table": "corrected_ode",
    "DriftTable": "corrected_ode",
    "corrected_ode": "corrected_ode",
    "corrected_mean": "corrected_ode",
    "noise_floor": "corrected_ode",
    "stationary_moments": "corrected_ode",
    "corrected_steps_to_reach": "corrected_ode",
    "theory_band": "lna",
    "TheoryBand": "lna",
    "initial_law": "lna",
    "max_step_size": "stepsize",
    "StepSizeReport": "stepsize",
    "A_matrix": "rank",
    "overlap_drift": "rank",
    "population_loss_rank": "rank",
    "matrix_ode": "rank",
    "rank_correlations": "rank",
    "RankConstants": "rank",
    "singular_values": "rank",
    "signed_smallest": "rank",
}

__all__ = list(_WHERE)



class _Package(types.ModuleType):
    """A function named like its own submodule (``corrected_ode``) stays the function after
    the submodule is imported (the import system then sets the package attribute to the
    module, which an eager ``from .x import x`` used to overwrite)."""

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if isinstance(value, types.ModuleType) and _WHERE.get(name) == name:
            return getattr(value, name)
        return value


sys.modules[__name__].__class__ = _Package


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

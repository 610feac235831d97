"""Theory curves recorded beside a rank-1 run, from each run's own m₀.

- the population ODE m̄_{t+1} = m̄_t + η h(m̄_t)(u_perp² − m̄_t²) (Prop. 4), exact for the
  projected learner with ĉ frozen and unit rows; NaN elsewhere;
- where :func:`finite_d_applies`, the noise-corrected map (``hermite.corrected_ode``) and the
  10–90% linear-noise band (``hermite.theory_band``);
- :func:`initial_drift_sign`, sign h(0), which fixes the aligned start of Thm 5.
"""

from __future__ import annotations

import numpy as np

import hermite

from .instance import Instance, build_instance
from .observables import group_runs, unit_rows

__all__ = [
    "FINITE_D_MAX_ETA_D",
    "theory_applies",
    "record_theory",
    "finite_d_applies",
    "theory_records",
    "initial_drift_sign",
]

FINITE_D_MAX_ETA_D = 10.0  # beyond η·d ≈ 10 SGD is far past its noise floor / diverges


def theory_applies(config) -> bool:
    """Whether the population ODE of m is exact for this learner (projected, ĉ frozen, unit
    rows)."""
    return config.options.project and not config.options.joint_c and unit_rows(config)


def record_theory(config, instances: list[Instance], m0: np.ndarray,
                  steps: np.ndarray) -> np.ndarray:
    """(R, C) population-ODE prediction at ``steps`` from each run's m₀ (NaN if none)."""
    out = np.full((len(instances), len(steps)), np.nan)
    if not theory_applies(config):
        return out

    for inst, idx in group_runs(instances):
        out[idx] = hermite.population_ode(inst, config.eta, np.asarray(m0)[idx],
                                          np.asarray(steps))
    return out


def finite_d_applies(config, d: int | None = None) -> bool:
    """Whether the noise-corrected ODE and band are recorded: frozen ĉ, projected, b = 1 and
    η·d ≤ ``FINITE_D_MAX_ETA_D`` (the finite-d map is an expansion in η with ηd = O(1));
    ``d``: the runs' dimension (default: the spec's)."""
    d = build_instance(config.instance).d if d is None else d
    return (theory_applies(config) and config.batch == 1 and config.finite_d_theory
            and config.eta * d <= FINITE_D_MAX_ETA_D)


def theory_records(config, instances: list[Instance], m0: np.ndarray,
                   steps: np.ndarray) -> dict:
    """Every theory curve of a trajectory, as Trajectory keyword arguments.

    ``ode`` (plain population ODE, :func:`record_theory`) always; where
    :func:`finite_d_applies`, also ``ode_corrected`` (``hermite.corrected_ode`` at the run's
    d, η and label noise, from each run's m₀) and the 10–90% ``band_lower``/``band_upper`` of
    ``hermite.theory_band`` (mixture over the group's m₀).
    """
    out = {"ode": record_theory(config, instances, m0, steps)}
    if not finite_d_applies(config, instances[0].d):
        return out

    shape = (len(instances), len(steps))
    corr, lo, hi = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    steps = np.asarray(steps)
    for inst, idx in group_runs(instances):
        m0_g = np.asarray(m0)[idx]
        corr[idx] = hermite.corrected_ode(inst, config.eta, inst.d, m0_g, steps,
                                          label_noise=config.label_noise)
        band = hermite.theory_band(inst, config.eta, inst.d, steps, m0=m0_g,
                                   label_noise=config.label_noise)
        lo[idx], hi[idx] = band.lower, band.upper
    out.update(ode_corrected=corr, band_lower=lo, band_upper=hi)
    return out


def initial_drift_sign(instances: list[Instance]) -> np.ndarray:
    """sign h(0) per run (Thm 5's aligned start needs m₀ h(0) > 0)."""

    out = np.zeros(len(instances))
    for inst, idx in group_runs(instances):
        out[idx] = np.sign(float(np.asarray(hermite.h(inst, 0.0)).reshape(-1)[0]))
    return out

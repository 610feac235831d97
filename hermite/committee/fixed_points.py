"""Linearly stable fixed points of the committee ODE.

On the free coordinates z (:class:`~hermite.committee.free_coordinates.FreeCoordinates`) the
order parameters follow dz/dα = f(z). A point z is taken for a *stable fixed point* when

* it is close to a zero of f: the Newton step to it, ‖J⁻¹ f(z)‖∞, is below
  :data:`NEWTON_TOL`, with J the Jacobian by central differences,

      J_ij = (f_i(z + h e_j) − f_i(z − h e_j)) / 2h;

* the zero is hyperbolic and attracting: max Re λ(J) < −10⁻⁹ η̄ (η̄ = ``model.lr``), so an
  exactly marginal direction (an unlearned teacher neuron's R = 0 under an odd activation's
  first-order drift, where f is quadratic in R) does not count.

A flow that comes to rest at such a point above a target loss never reaches it: the
first passage (:mod:`.first_passage`) stops there as ``stuck``. J costs 2·dim z drift
evaluations, so it is only formed where max |f(z)| < :data:`DRIFT_GATE`.
"""

from __future__ import annotations

import math

import numpy as np

from hermite.committee.free_coordinates import FreeCoordinates
from hermite.committee.ode import CommitteeModel, CommitteeState

__all__ = ["NEWTON_TOL", "DRIFT_GATE", "stable_fixed_point"]

NEWTON_TOL = 1e-6  # a stable fixed point: the Newton step to the drift's zero is shorter
DRIFT_GATE = 1e-6  # the Jacobian is only computed where max |drift| is below this


def stable_fixed_point(model: CommitteeModel, st: CommitteeState, y: np.ndarray,
                       flow: FreeCoordinates | None = None, h: float = 1e-6
                       ) -> tuple[bool, float, float]:
    """(stable, Newton step length, max Re eigenvalue) at the packed state ``y``.

    The drift f on the free coordinates of ``st`` (``flow``, built if not given), its
    Jacobian J by central differences (step h); ``stable`` when |J⁻¹f|∞ < :data:`NEWTON_TOL`
    and every eigenvalue of J has a real part below −1e-9·η̄ (module docstring). Only
    computed where max |f| < :data:`DRIFT_GATE` (else (False, inf, nan)); a singular J
    gives (False, inf, nan) too."""
    flow = flow if flow is not None else FreeCoordinates(model, st)
    z = flow.z(y)
    f = flow.drift(z)
    if np.abs(f).max() > DRIFT_GATE:
        return False, math.inf, math.nan
    J = np.empty((z.size, z.size))
    for j in range(z.size):
        e = np.zeros(z.size)
        e[j] = h
        J[:, j] = (flow.drift(z + e) - flow.drift(z - e)) / (2 * h)
    try:
        newton = float(np.abs(np.linalg.solve(J, f)).max())
    except np.linalg.LinAlgError:
        return False, math.inf, math.nan
    lam_max = float(np.linalg.eigvals(J).real.max())
    return bool(newton < NEWTON_TOL and lam_max < -1e-9 * float(model.lr)), newton, lam_max

"""First passage of the committee ODE below a loss level, with its plateau escape.

From a state (Q₀, R₀, v₀) of unit student rows (``rows="unit"``, the ``scratch`` learners)
the order parameters follow the committee ODE dz/dα = f(z) (:mod:`.ode`, on the free
coordinates of :mod:`.free_coordinates`), α = steps/N. With ε(α) the generalisation error
along it (:func:`~hermite.committee.ode.committee_loss`), the first passage of a level L*
and the escape from the initial plateau are

    α*  = inf{α ≥ 0 : ε(α) ≤ L*},
    α_e = inf{α ≥ 0 : max_km |R_km(α)| ≥ :data:`ESCAPE_OVERLAP`},

reported in steps, α·N (inf: not reached). |R_km| is the cosine between student row k and
teacher row m when the teacher rows have unit norm (T_mm = 1). A flow that comes to rest
first never gets there: at a linearly stable fixed point above L* (``stuck``,
:func:`~hermite.committee.fixed_points.stable_fixed_point`), or at a non-hyperbolic rest point
(``stalled``: a row or a teacher neuron left at R ≈ 0, where an odd activation's drift is
quadratic, so it moves off only on a time ∝ 1/R if at all). Derivation and its use in
Claim 2: docs/theory/committee.md ("Claim 2 from theory"; benchmarks/claim2_scratch.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.integrate
import scipy.optimize

from hermite.committee.fixed_points import DRIFT_GATE, NEWTON_TOL, stable_fixed_point
from hermite.committee.free_coordinates import FreeCoordinates
from hermite.committee.ode import CommitteeModel, CommitteeState

__all__ = ["ESCAPE_OVERLAP", "RTOL", "ATOL", "FirstPassage", "PassageSettings",
           "committee_first_passage"]

ESCAPE_OVERLAP = 0.5  # the initial plateau ends when some row's |cosine| to a teacher row does
RTOL, ATOL = 1e-7, 1e-10  # the solver's default tolerances


@dataclass(frozen=True)
class FirstPassage:
    """One committee-ODE first passage (steps = α·N; inf = not reached).

    step: first step with ε ≤ level; escape: first step where some |R_km| reaches
    :data:`ESCAPE_OVERLAP`; loss0, loss_end: ε at the start and where the integration
    stopped (α_end); end: ``"hit"``; ``"stuck"`` (it stopped at a linearly stable fixed point
    with ε > level: the ODE never reaches the level); ``"stalled"`` (at α_max, max |drift| <
    :data:`~hermite.committee.fixed_points.DRIFT_GATE` but not a hyperbolic fixed point);
    ``"horizon"`` (still moving at α_max); ``"cap"`` (cut at the evaluation budget,
    α_end < α_max); evaluations: drift evaluations; loss_probe: ε at α = ``alpha_probe``
    (NaN: not asked, or beyond where the integration stopped; a stuck state's ε is its value
    from there on). The end "hit" counts from the first passage even when the integration
    went on to the probe."""

    step: float
    escape: float
    loss0: float
    loss_end: float
    alpha_end: float
    end: str
    evaluations: int
    loss_probe: float = math.nan

    @property
    def stuck(self) -> bool:
        return self.end == "stuck"


@dataclass(frozen=True)
class PassageSettings:
    """How far and how :func:`committee_first_passage` integrates: up to α = ``alpha_max``;
    fixed-point checks from ``alpha_first`` on (None: α_max/4⁸); on past a hit to record ε at
    ``alpha_probe`` (None: stop at the hit); at most ``max_evals`` drift evaluations (None:
    no cap); the scipy ``OdeSolver`` ``method`` and its tolerances ``rtol``, ``atol``."""

    alpha_max: float
    alpha_first: float | None = None
    alpha_probe: float | None = None
    max_evals: int | None = None
    method: str = "LSODA"
    rtol: float = RTOL
    atol: float = ATOL


def committee_first_passage(model: CommitteeModel, state: CommitteeState, level: float,
                            n: int, settings: PassageSettings | None = None,
                            **keywords) -> FirstPassage:
    """First α with ε(α) ≤ ``level`` for the committee ODE from ``state``, as steps α·n
    (n: the input dimension N = d), integrated as ``settings`` say (or as the
    :class:`PassageSettings` its ``keywords`` make: ``alpha_max=…``; an unknown one is
    a TypeError).

    One scipy ``OdeSolver`` (``method``; LSODA: the flow is stiff once rows have specialised)
    on the free coordinates, stepped up to ``alpha_max``; after each step the crossings of
    ε = level (the hit: stop) and of max |R| = :data:`ESCAPE_OVERLAP` (the escape) are located
    on the step's dense output (Brent). From ``alpha_first`` (default α_max/4⁸) on,
    :func:`~hermite.committee.fixed_points.stable_fixed_point` is checked at geometrically
    spaced α (sooner where the last check's Newton step and slowest contraction rate predict
    convergence); a stable fixed point above the level stops the integration (``stuck``).
    With ``alpha_probe`` the integration goes on past a hit up to it, to record ε there.
    After ``max_evals`` drift evaluations it stops where it is (ended ``cap``, at
    α_end < α_max). ε is :func:`~hermite.committee.ode.committee_loss` (any loss); unit rows
    only (free rows' |R_km| is not a cosine)."""
    if settings is None:
        settings = PassageSettings(**keywords)
    elif keywords:
        raise TypeError("committee_first_passage: give settings or their keywords, not both "
                        f"(got {', '.join(keywords)})")
    if model.rows != "unit":
        raise ValueError("committee_first_passage needs unit rows (rows='unit'): its escape "
                         "is max |R_km|, a cosine only for unit rows")
    st = model.check_state(state)
    flow = FreeCoordinates(model, st)
    z = flow.z(st.pack())
    loss0 = flow.loss(z)
    if loss0 <= level and settings.alpha_probe is None:
        return FirstPassage(0.0, 0.0, loss0, loss0, 0.0, "hit", 0)
    alpha_max, max_evals = float(settings.alpha_max), settings.max_evals
    probe = math.nan if settings.alpha_probe is None else float(settings.alpha_probe)
    probe_loss = loss0 if probe == 0.0 else math.nan
    hit = 0.0 if loss0 <= level else math.inf
    check = float(settings.alpha_first) if settings.alpha_first is not None \
        else alpha_max / 4.0**8
    escape = 0.0 if flow.max_overlap(z) >= ESCAPE_OVERLAP else math.inf
    solver = getattr(scipy.integrate, settings.method)(lambda _t, zz: flow.drift(zz), 0.0, z,
                                                       alpha_max, rtol=settings.rtol,
                                                       atol=settings.atol)

    def crossing(fun, t0, t1):
        dense = solver.dense_output()
        return scipy.optimize.brentq(lambda t: fun(dense(t)), t0, t1, xtol=1e-12 * t1,
                                     rtol=1e-12)

    while solver.status == "running" and (max_evals is None or flow.evaluations < max_evals):
        t0 = solver.t
        msg = solver.step()
        if solver.status == "failed":
            raise RuntimeError(f"committee ODE: {msg}")
        t1, z = solver.t, solver.y
        if not np.all(np.isfinite(z)):
            raise RuntimeError("committee ODE diverged")
        if t0 < probe <= t1:
            probe_loss = flow.loss(solver.dense_output()(probe))
        if not math.isfinite(escape) and flow.max_overlap(z) >= ESCAPE_OVERLAP:
            escape = crossing(lambda zz: flow.max_overlap(zz) - ESCAPE_OVERLAP, t0, t1) * n
        end_loss = flow.loss(z)
        if not math.isfinite(hit) and end_loss <= level:
            hit = crossing(lambda zz: flow.loss(zz) - level, t0, t1)
            escape = min(escape, hit * n)
            if math.isnan(probe):  # stop at the first passage itself
                return FirstPassage(hit * n, escape, loss0, level, hit, "hit",
                                    flow.evaluations)
        if math.isfinite(hit):
            if t1 >= probe:
                return FirstPassage(hit * n, escape, loss0, end_loss, t1, "hit",
                                    flow.evaluations, probe_loss)
            continue
        if t1 >= check and solver.status == "running":
            stable, newton, lam = stable_fixed_point(model, st, flow.full(z), flow)
            if stable:
                return FirstPassage(math.inf, escape, loss0, end_loss, t1, "stuck",
                                    flow.evaluations, end_loss if probe > t1 else probe_loss)
            wait = 2.0 * t1
            if math.isfinite(newton) and lam < 0:  # converging: predicted time to the tolerance
                wait = min(wait, t1 + 1.2 * math.log(max(newton / NEWTON_TOL, 1.0)) / -lam)
            check = max(wait, 1.25 * t1)
    if math.isfinite(hit):
        return FirstPassage(hit * n, escape, loss0, flow.loss(z), solver.t, "hit",
                            flow.evaluations, probe_loss)
    if solver.status == "running":  # cut at max_evals
        end = "cap"
    else:
        end = "stalled" if np.abs(flow.drift(z)).max() < DRIFT_GATE else "horizon"
    return FirstPassage(math.inf, escape, loss0, flow.loss(z), solver.t, end, flow.evaluations,
                        probe_loss)

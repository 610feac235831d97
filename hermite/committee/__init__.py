"""Order-parameter ODEs of the soft committee machine for any activation (torch-free).

Saad & Solla (1995), Goldt et al. (2019): a two-layer student ŷ = Σ_k v_k g(λ_k) learns a
teacher y = Σ_m A_m g(ν_m) by online SGD; in the high-dimensional limit the order parameters
Q, R (and v) follow deterministic ODEs in α = steps/N whose coefficients are Gaussian
integrals of g (:mod:`.integrals`). Free rows (Saad–Solla's O(1) weights) and loradyn's unit
rows (the ``scratch`` learners' spherical step), squared and correlation (CSQ) loss, first
and second order in the step size (:mod:`.ode`). Around them: the flow on its free
coordinates (:mod:`.free_coordinates`), its linearly stable fixed points
(:mod:`.fixed_points`) and the first passage of a loss level with the plateau escape
(:mod:`.first_passage`); SGD's step noise as a diffusion (:mod:`.diffusion`). The pair
integrals of a student σ against a teacher σ* ≠ σ (:mod:`.cross`; ``lora-ba``'s rows as they
are). Derivation: docs/theory/committee.md.
"""

from hermite.committee.first_passage import (
    ESCAPE_OVERLAP,
    FirstPassage,
    PassageSettings,
    committee_first_passage,
)
from hermite.committee.fixed_points import stable_fixed_point
from hermite.committee.free_coordinates import FreeCoordinates
from hermite.committee.integrals import (
    INTEGRAL_METHODS,
    QUADRATURE_DEFAULTS,
    CommitteeIntegrals,
    scaled_erf,
)
from hermite.committee.ode import (
    INTEGRATORS,
    LOSSES,
    ROWS,
    CommitteeModel,
    CommitteeState,
    CommitteeTrajectory,
    DriftTerms,
    committee_alignment,
    committee_drift,
    committee_loss,
    committee_ode,
    committee_ode_batch,
    committee_step,
    committee_terms,
    committee_terms_batch,
)

__all__ = [
    "CommitteeIntegrals",
    "scaled_erf",
    "INTEGRAL_METHODS",
    "QUADRATURE_DEFAULTS",
    "CommitteeModel",
    "CommitteeState",
    "CommitteeTrajectory",
    "DriftTerms",
    "committee_drift",
    "committee_terms",
    "committee_terms_batch",
    "committee_step",
    "committee_ode",
    "committee_ode_batch",
    "committee_loss",
    "committee_alignment",
    "ROWS",
    "LOSSES",
    "INTEGRATORS",
    "FreeCoordinates",
    "stable_fixed_point",
    "FirstPassage",
    "PassageSettings",
    "committee_first_passage",
    "ESCAPE_OVERLAP",
]

"""The committee-machine ODE beside a network learner's curves (issue 17, part 3).

For ``scratch``, ``scratch-csq`` and ``sparse`` runs, the order-parameter ODE of
:mod:`hermite.committee` (Saad–Solla, unit or free rows) from each run's own initial
overlaps: Q₀ = the student Gram, R₀ = crossᵀ, v₀ = λ̂₀ at the first checkpoint; teacher T =
the teacher rows' Gram (a committee teacher's too), A = λ·output_scale; η̄ = η·d,
η̄_v = η_c·d (trained second layer), label noise, batch; ``sparse``: only its s rows move
(``trainable``) and the alignment is diagonal. What the runs' ODEs and diffusion share is one
:class:`CommitteeRegime`, built once from the learner's options, the config and the instance.
Integrated to α = steps/d at the checkpoints: the expected one-step map where the horizon is
short (≤ :data:`ODE_EVALS` steps), ``solve_ivp`` otherwise. Runs with identical initial
state (and instance, mask) share one ODE; the distinct starts of one model are integrated
together as one stacked system (:func:`integrate_batch`), whose adaptive steps follow the
fastest-moving start, so the batch costs about the drift evaluations of one start.

Cost: first-order drifts are cheap (≈ 0.2 ms with closed-form 2-D integrals); the η²
terms of activations without closed-form second-order integrals cost ≈ 1 ms (relu, k = k′
= 2; compiled nested quadrature, :mod:`hermite.committee._fast`) to seconds (sigmoid, tanh…
at K + M ≥ 6: 4-D quadrature) per drift evaluation. A deterministic estimate
(:func:`drift_seconds` × evaluations × ODEs, × :data:`BATCH_SHARE` for a batch of relu/abs
starts) decides: beyond :data:`SECOND_ORDER_BUDGET_S`
seconds, or K + M > :data:`SECOND_ORDER_MAX_FIELDS` there, the ODE is integrated to first
order in η̄ only, and says so: the datasets' ``order`` (1), ``order_reason`` and ``note``
attributes (the note quantifies the dropped η² terms at the first start: their share of
the drift and η·d) and a note on stderr. What else a figure must say is recorded on the
datasets too: ``no_theory`` (the ODE failed from every start), ``partial`` (from some: NaN
there), the ``note``'s tail where the diffusion was skipped for its cost or failed, and on
``ode_loss`` ``clamped_below_zero`` = n, the values whose plain sum Σ c_a c_b I2 was below 0
(an integrated state just outside the PSD cone near ε = 0; ``hermite.committee`` gives the
loss of the feature Gram's PSD part there, ≥ 0). ``config.finite_d_theory``
(``--no-finite-d-theory``) switches the whole overlay off, as it does finetune's finite-d
theory.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import numpy as np

from dynamics.randomness.sampling import run_seed
from hermite.committee import (
    CommitteeIntegrals,
    CommitteeModel,
    CommitteeState,
    committee_alignment,
    committee_drift,
    committee_ode,
    committee_ode_batch,
)
from hermite.committee.diffusion import (
    DIFFUSION_STEP,
    committee_diffusion,
    diffusion_points,
    psd_repaired,
)

__all__ = ["ODE_EVALS", "SECOND_ORDER_BUDGET_S", "SECOND_ORDER_MAX_FIELDS",
           "CommitteeRegime", "CommitteeStarts", "committee_applies", "committee_model",
           "committee_state", "drift_seconds",
           "rounding_repaired", "second_order_share", "first_order_note",
           "plan_order", "plan_diffusion", "diffusion_seconds", "integrate", "integrate_batch",
           "committee_records", "DIFFUSION_PATHS"]

ODE_EVALS = 400  # drift evaluations of one solve_ivp run (DOP853, rtol 1e-6), measured
SECOND_ORDER_BUDGET_S = 20.0  # estimated seconds of η² terms allowed per trajectory
SECOND_ORDER_MAX_FIELDS = 6  # K + M beyond which non-closed η² terms are always dropped
RTOL, ATOL = 1e-6, 1e-9
#: the starts of one model are integrated as one stacked ODE (hermite.committee_ode_batch);
#: for these families its η² terms are one compiled call per group of fields, on numba's
#: threads. BATCH_SHARE: its cost over that of the starts one by one, measured (ReLU,
#: K = M = 2, 64 starts at d = 1000, 2 cores): 19.0 s on one thread, 12.4 s on two, against
#: 44 s one by one (0.43, 0.28); the estimate takes one thread's, with a margin
BATCHED_FAMILIES = ("relu", "abs")
NOISE_NOTE_ETA_D = 0.1  # from this η·d on the step noise's escape is recorded (diffusion)
DIFFUSION_PATHS = 128  # diffusion paths in all (at least one per distinct start)
BATCH_SHARE = 0.5


def committee_applies(config, instances) -> bool:
    """Whether the overlay is recorded: ``config.finite_d_theory`` and unit rows."""
    return bool(config.finite_d_theory) and all(i.unit_rows for i in instances)


def committee_model(inst, *, loss: str, eta: float, eta_c: float | None = None,
                    label_noise: float = 0.0, batch: int = 1, trainable=None,
                    second_order: bool = True, rows: str = "unit",
                    method: str = "auto") -> CommitteeModel:
    """The committee model of a network learner (unit or free ``rows``) on instance ``inst``
    (dimension ``inst.d``): ``CommitteeModel.lr`` = η̄ = η·d (nn2pp's lr is 2·η·d: its loss
    has a ½, docs/theory/committee-engine.md), lr_v = η_c·d (None: λ̂ frozen), loss_scale 1."""
    d = float(inst.d)
    return CommitteeModel(
        inst.activation, inst.teacher_gram(), np.asarray(inst.lam, float) * inst.output_scale,
        lr=eta * d, rows=rows, loss=loss, loss_scale=1.0,
        lr_v=None if eta_c is None else eta_c * d, noise_var=label_noise, batch=int(batch),
        second_order=second_order, method=method,
        trainable=None if trainable is None or np.all(trainable) else
        tuple(bool(t) for t in trainable))


def committee_state(cross, gram, lam_hat, rows: str = "unit") -> CommitteeState:
    """(Q, R, v) from cross ⟨vᵢ, ŵⱼ⟩ (k, k′), the student Gram (k′, k′) and λ̂ (k′,): unit
    rows: Q the Gram with its diagonal set to 1 (rows are unit up to rounding),
    R = crossᵀ/‖ŵⱼ‖; free rows: Q the Gram, R = crossᵀ."""
    gram = np.asarray(gram, dtype=np.float64)
    if rows == "free":
        return CommitteeState.from_arrays(0.5 * (gram + gram.T),
                                          np.asarray(cross, dtype=np.float64).T,
                                          np.asarray(lam_hat, dtype=np.float64))
    n = np.sqrt(np.diag(gram))
    Q = gram / np.outer(n, n)
    Q = 0.5 * (Q + Q.T)
    np.fill_diagonal(Q, 1.0)
    R = np.asarray(cross, dtype=np.float64).T / n[:, None]
    return CommitteeState.from_arrays(Q, R, np.asarray(lam_hat, dtype=np.float64))


@dataclass(frozen=True)
class CommitteeStarts:
    """Each run's initial overlaps: cross ⟨vᵢ, ŵⱼ⟩ (R, k, k′), student Gram (R, k′, k′), λ̂
    (R, k′) and its trainable rows ``masks`` (R, k′) (None: all)."""

    cross: np.ndarray
    gram: np.ndarray
    lam_hat: np.ndarray
    masks: np.ndarray | None = None

    def __post_init__(self):
        for name in ("cross", "gram", "lam_hat"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        masks = np.ones(self.lam_hat.shape, dtype=bool) if self.masks is None else \
            np.asarray(self.masks, bool)
        object.__setattr__(self, "masks", masks)

    @property
    def K(self) -> int:
        """Student rows k′."""
        return self.gram.shape[-1]

    @property
    def M(self) -> int:
        """Teacher rows k."""
        return self.cross.shape[-2]


@dataclass(frozen=True)
class CommitteeRegime:
    """A network learner's committee theory, what its ODE, diffusion and first passage share:
    the instances' ``activation`` and dimension ``d``; K student and M teacher rows; the
    ``loss`` (squared, correlation) and ``rows`` (unit, free); the step size ``eta``
    (η̄ = η·d) and the second layer's ``eta_c`` (None: λ̂ frozen); the label-noise variance
    and the mini-batch; the ``diagonal`` alignment (sparse); ``second_order``: the η² terms
    kept (None: planned by :func:`committee_records`); the Gaussian integrals' ``method``."""

    activation: object
    d: int
    K: int
    M: int
    loss: str
    eta: float
    eta_c: float | None = None
    label_noise: float = 0.0
    batch: int = 1
    rows: str = "unit"
    diagonal: bool = False
    second_order: bool | None = True
    method: str = "auto"

    @classmethod
    def of_learner(cls, config, inst, starts: CommitteeStarts, *, loss: str, rows: str,
                   diagonal: bool, train_second_layer: bool) -> CommitteeRegime:
        """The regime of ``config``'s runs from ``starts`` on instance ``inst``, for a learner
        with this ``loss``, ``rows`` and ``diagonal`` alignment (λ̂ trained at
        ``config.step_size_c`` with ``train_second_layer``); its order to be planned."""
        return cls(inst.activation, inst.d, starts.K, starts.M, loss, config.eta,
                   eta_c=config.step_size_c if train_second_layer else None,
                   label_noise=config.label_noise, batch=config.batch, rows=rows,
                   diagonal=diagonal, second_order=None)

    @property
    def eta_d(self) -> float:
        """η̄ = η·d."""
        return self.eta * self.d

    def model(self, inst, trainable=None) -> CommitteeModel:
        """Its :func:`committee_model` on instance ``inst`` (``trainable``: the rows that
        move, None: all)."""
        if self.second_order is None:
            raise ValueError("the committee regime's order is not planned (second_order None)")
        return committee_model(inst, loss=self.loss, eta=self.eta, eta_c=self.eta_c,
                               label_noise=self.label_noise, batch=self.batch,
                               trainable=trainable, second_order=self.second_order,
                               rows=self.rows, method=self.method)


def drift_seconds(activation, K: int, M: int, second_order: bool) -> float:
    """Deterministic estimate of one drift evaluation's cost (seconds, one core of the
    2-core test machine, docs/theory/committee.md "Cost"), fitted to measurements with
    P = K + M fields and K(K + 1)/2 student pairs: first order 0.2 ms (closed-form 2-D
    integrals) or 2.5 ms·P (2-D quadrature); η² terms, per pair, 0.3 ms·(P/4)^4.5 for relu
    and 0.7 ms·(P/4)^4.5 for abs (compiled nested quadrature), 9 ms·16^(P−4) for a smooth
    activation without closed forms where the direct P-dimensional quadrature is used
    (P ≤ 4), 2.5 ms per 4-D I4 otherwise, 33 ms·(P/4)^4 for a kinked one."""
    integ = CommitteeIntegrals(activation)
    P, pairs = K + M, K * (K + 1) / 2
    first = 2e-4 if integ.family != "quadrature" else 2.5e-3 * P
    if not second_order:
        return first
    if integ.closed("i4"):
        return first + 3e-4
    if integ.family == "relu":
        return first + pairs * 3e-4 * (P / 4) ** 4.5
    if integ.family == "abs":
        return first + pairs * 7e-4 * (P / 4) ** 4.5
    if integ._direct_e2(P, P):
        return first + pairs * 9e-3 * 16.0 ** (P - 4)
    if not integ.activation.breakpoints:
        return first + pairs * 2.5e-3 * P * (P + 1) / 2
    return first + 0.1 * (pairs / 3) * (P / 4) ** 4


def plan_order(activation, K: int, M: int, n_odes: int, evals: int) -> tuple[int, str]:
    """(order, reason): 2 where the η² terms are affordable (module docstring), else 1."""
    if CommitteeIntegrals(activation).closed("i4"):
        return 2, "closed-form second-order integrals"
    if K + M > SECOND_ORDER_MAX_FIELDS:
        return 1, (f"K + M = {K + M} > {SECOND_ORDER_MAX_FIELDS}: the η² terms need a "
                   "quadrature costing seconds per drift evaluation")
    est = n_odes * evals * drift_seconds(activation, K, M, True)
    if n_odes > 1 and CommitteeIntegrals(activation).family in BATCHED_FAMILIES:
        est *= BATCH_SHARE  # one stacked ODE, its η² terms in one compiled call (threads)
    if est > SECOND_ORDER_BUDGET_S:
        return 1, (f"the η² terms would take ≈ {est:.0f} s ({n_odes} ODE(s) × {evals} "
                   f"evaluations) > {SECOND_ORDER_BUDGET_S:g} s")
    return 2, f"η² terms ≈ {est:.1f} s"


def second_order_share(model: CommitteeModel, state: CommitteeState) -> float:
    """‖η² part‖/‖first-order part‖ of d(Q, R)/dα at ``state``: how much a first-order ODE
    drops there (η̄ S/D in the notation of docs/theory/committee.md)."""
    full = committee_drift(model, state)
    first = committee_drift(replace(model, second_order=False), state)
    a = np.concatenate([first.Q.ravel(), first.R.ravel()])
    b = np.concatenate([full.Q.ravel(), full.R.ravel()]) - a
    return float(np.linalg.norm(b) / max(np.linalg.norm(a), 1e-300))


def first_order_note(start, reason: str, K: int, M: int, eta_d: float) -> str:
    """The ``note`` of a first-order ODE: η·d, the share of the drift it drops at the start
    ``start`` = (second-order model, state) (one second-order drift evaluation, skipped
    where that costs more than a second, or ``start`` is None) and why the η² terms were
    dropped."""
    text = f"committee ODE to first order in η·d only (η·d = {eta_d:.3g}"
    if start is not None and drift_seconds(start[0].activation, K, M, True) <= 1.0:
        try:
            share = second_order_share(*start)
            text += f"; the dropped η² terms are {100 * share:.0f} % of the drift at the start"
        except (ValueError, RuntimeError):
            pass
    return text + f"): {reason}; reliable only where η·d ≪ 1"


def integrate(model: CommitteeModel, state: CommitteeState, steps, d: int, *,
              diagonal: bool = False, tally: dict | None = None
              ) -> tuple[np.ndarray, np.ndarray, str]:
    """(loss (C,), alignment (C,), integrator) at checkpoint ``steps`` (from steps[0]).
    ``tally``: its ``below_zero`` grows by the checkpoints whose plain loss sum was below 0
    (``CommitteeTrajectory.below_zero``: the loss there is that of the PSD part, ≥ 0)."""
    steps = np.asarray(steps, dtype=np.int64)
    alphas = (steps - steps[0]) / float(d)
    span = int(steps[-1] - steps[0])
    integrator = "map" if span <= ODE_EVALS else "solve_ivp"
    with np.errstate(divide="ignore", over="ignore"):  # degenerate pairs (R = T) in quadrature
        tr = committee_ode(model, state, alphas, integrator=integrator, N=float(d),
                           rtol=RTOL, atol=ATOL)
    if tally is not None:
        tally["below_zero"] = tally.get("below_zero", 0) + tr.below_zero
    return tr.loss, _alignment(tr, model, diagonal), integrator


def _alignment(tr, model: CommitteeModel, diagonal: bool) -> np.ndarray:
    """The ODE trajectory's alignment at its checkpoints: its own (max over student rows),
    or ⟨teacher i, student i⟩ (``diagonal``, sparse)."""
    if not diagonal:
        return tr.alignment
    return np.array([committee_alignment(tr.state(i), model.T, diagonal=True)
                     for i in range(len(tr.loss))])


def integrate_batch(model: CommitteeModel, states, steps, d: int, *,
                    diagonal: bool = False, tally: dict | None = None
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(loss (C,), alignment (C,))] of :func:`integrate` (``solve_ivp``) for several starts
    of one model at once (``hermite.committee.committee_ode_batch``: one stacked system);
    ``tally["each"]``: each start's ``below_zero`` (:func:`integrate`)."""
    steps = np.asarray(steps, dtype=np.int64)
    alphas = (steps - steps[0]) / float(d)
    with np.errstate(divide="ignore", over="ignore"):
        trs = committee_ode_batch(model, states, alphas, rtol=RTOL, atol=ATOL)
    if tally is not None:  # per start, in the order of ``states``
        tally["each"] = [tr.below_zero for tr in trs]
    return [(tr.loss, _alignment(tr, model, diagonal)) for tr in trs]


def plan_diffusion(regime: CommitteeRegime, span: int, starts: int, checkpoints: int,
                   paths: int | None = -1, why: dict | None = None) -> int | None:
    """Paths per start of the diffusion (``hermite.committee.diffusion``) of ``regime``
    recorded instead of the deterministic ODE over ``span`` steps from ``starts`` distinct
    starts, or None: where η·d ≥ :data:`NOISE_NOTE_ETA_D` (the step noise
    moves the plateau escape) over more than :data:`ODE_EVALS` steps, with
    :data:`DIFFUSION_PATHS` paths in all (at least one per start) within
    :data:`SECOND_ORDER_BUDGET_S` by :func:`diffusion_seconds`. ``paths`` ≥ 1 forces that
    many, None forces the ODE. ``why``: gets ``skipped`` (one line) where the diffusion was
    due but is over the budget."""
    if paths is None or paths >= 1:
        return paths
    if regime.eta_d < NOISE_NOTE_ETA_D or span <= ODE_EVALS:
        return None
    per = max(1, -(-DIFFUSION_PATHS // starts))
    steps = math.ceil(span / regime.d / DIFFUSION_STEP) + checkpoints
    points = diffusion_points(regime.eta_d, regime.d, regime.batch)
    cost = diffusion_seconds(regime.activation, regime.K, regime.M, starts * per, steps,
                             points)
    if cost > SECOND_ORDER_BUDGET_S:
        if why is not None:
            why["skipped"] = (f"the diffusion with SGD's step noise was skipped: ≈ {cost:.0f} s "
                              f"> {SECOND_ORDER_BUDGET_S:g} s ({starts * per} paths; loradyn "
                              "hermite committee --noise-paths gives it from run 0's start)")
        return None
    return per


def diffusion_seconds(activation, K: int, M: int, paths: int, steps: int,
                      points: int) -> float:
    """Estimated seconds of a diffusion (2-core test machine, one numba thread): per Heun
    step 3 ms of numpy bookkeeping plus, per path and example, ≈ 180 ns + 3.5 ns·(KP + P²)
    (P = K + M: the normals, the sample sums twice, the closed-form first-order drift),
    + 230 ns for a σ dearer than relu/abs, × 8.5 without a compiled σ (numpy); and per path
    two first-order drifts by quadrature where σ has no closed forms (:func:`drift_seconds`).
    Measured (128 paths × 512 examples): relu K = M = 2 249 ns, K = M = 4 517 ns, erf 484 ns,
    relu without the compiled sums 2246 ns; tanh K = M = 3 21 ms per path and step."""
    from hermite.activations_numba import compiled_activation

    integ = CommitteeIntegrals(activation)
    P = K + M
    per = 180e-9 + 3.5e-9 * (K * P + P * P)
    if integ.family not in ("relu", "abs"):
        per += 230e-9
    if compiled_activation(integ.activation) is None:
        per *= 8.5
    drift = 2.0 * drift_seconds(activation, K, M, False) if integ.family == "quadrature" \
        else 0.0
    return steps * (3e-3 + paths * (points * per + drift))


def _diffusion_records(config, instances, steps, groups, start, paths,
                       regime: CommitteeRegime) -> tuple[dict, dict]:
    """:func:`committee_records` from the diffusion of ``regime``, ``paths`` per distinct
    start (``groups``: the runs of each start; ``start(r, second_order)``: run r's model and
    state)."""
    runs, cps = len(instances), len(steps)
    diagonal, rows, eta_d = regime.diagonal, regime.rows, regime.eta_d
    out_loss, out_align = np.full((runs, cps), np.nan), np.full((runs, cps), np.nan)
    se, repaired, em_steps = 0.0, 0, 0
    alphas = (np.asarray(steps) - steps[0]) / float(instances[0].d)
    points = diffusion_points(eta_d, instances[0].d, config.batch)
    batches: dict = {}  # the starts of one model (instance, trainable rows)
    for idx in groups.values():
        model, state = start(idx[0], True)
        batches.setdefault((id(instances[idx[0]]), model.trainable), []).append(
            (idx, model, state))
    for bi, ready in enumerate(batches.values()):
        tr = committee_diffusion(ready[0][1], [st for _, _, st in ready], alphas,
                                 float(instances[ready[0][0][0]].d), paths=paths,
                                 seed=run_seed(config.seed, bi, "theory"),
                                 points=points, diagonal=diagonal)
        for j, (idx, _, _) in enumerate(ready):
            out_loss[idx], out_align[idx] = tr.loss[j], tr.alignment[j]
        if paths > 1:  # standard error of the runs' mean of the theory
            se = max(se, float(np.nanmax(np.sqrt((tr.loss_se ** 2).sum(0)) / len(ready))))
        repaired, em_steps = repaired + tr.repaired, tr.steps
    total = paths * len(groups)
    note = (f"mean of {total} path(s) ({paths} per start) of the order parameters' diffusion "
            f"(η·d = {eta_d:.3g}): the second-order ODE's drift plus SGD's step noise, "
            "covariance η̄²Cov(ζ + η̄χ)/(N b) (hermite.committee.diffusion; Heun steps dα = "
            f"{DIFFUSION_STEP:g}, {points} examples per step)")
    if paths > 1:
        note += f"; Monte Carlo standard error of the runs' mean ≤ {se:.2g}"
    attrs = {"order": 2, "order_reason": "η² terms sampled with the noise (S = E δδᵀ)",
             "integrator": "diffusion", "distinct_odes": len(groups),
             "paths_per_start": int(paths), "em_steps": int(em_steps), "points": points,
             "psd_repairs": int(repaired), "rows": rows, "note": note,
             "description": "committee-machine order parameters as a diffusion "
                            f"(hermite.committee.diffusion, {rows} rows) from the run's "
                            "initial overlaps: SGD's mean, noise included"}
    return ({"ode_loss": out_loss, "ode_alignment": out_align},
            {"ode_loss": attrs, "ode_alignment": attrs})


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def rounding_repaired(state: CommitteeState, T: np.ndarray, rows: str,
                      tol: float = 1e-5) -> CommitteeState:
    """``state`` with Q moved (R, T kept) to the nearest Q whose joint Gram
    [[Q, R], [Rᵀ, T]] is PSD, when rounding made it indefinite by at most ``tol``·‖Q‖ (a
    float32 run started in a degenerate configuration, e.g. student rows in the span of
    the teacher's): ``hermite.committee.diffusion.psd_repaired`` (the Schur complement's
    negative eigenvalues set to 0, unit rows renormalised). A larger violation is left for
    the ODE's own check to name."""
    Q, R, moved = psd_repaired(state.Q[None], state.R[None], T, rows == "unit", tol=tol)
    if not moved[0]:
        return state
    return CommitteeState.from_arrays(Q[0], R[0], state.v)


def committee_records(config, instances, steps, starts: CommitteeStarts,
                      regime: CommitteeRegime, *, quiet: bool = False,
                      noise: int | None = -1) -> tuple[dict, dict]:
    """({"ode_loss": (R, C), "ode_alignment": (R, C)}, their HDF5 attributes) of ``regime``
    from each run's initial overlaps ``starts``; ({}, {}) where :func:`committee_applies` is
    false.

    ``regime.second_order``: the order asked for (None: :func:`plan_order`). An ODE that fails
    (a state the ODE rejects, divergence) gives NaN for its runs and a note. ``noise``: paths
    per start of the diffusion with SGD's step noise (:func:`plan_diffusion`; −1: planned,
    None: the deterministic ODE).
    """
    if not committee_applies(config, instances):
        return {}, {}
    runs, cps = len(instances), len(steps)
    cross0, gram0, lam0, masks = starts.cross, starts.gram, starts.lam_hat, starts.masks
    groups: dict = {}
    for r, inst in enumerate(instances):
        key = (id(inst), cross0[r].tobytes(), gram0[r].tobytes(), lam0[r].tobytes(),
               masks[r].tobytes())
        groups.setdefault(key, []).append(r)
    K, M, rows, diagonal = regime.K, regime.M, regime.rows, regime.diagonal
    span = int(steps[-1] - steps[0])
    evals = min(span, ODE_EVALS)
    if regime.second_order is None:
        order, reason = plan_order(instances[0].activation, K, M, len(groups), evals)
    else:
        order, reason = (2 if regime.second_order else 1), "requested"

    def start(r, second: bool):
        model = replace(regime, second_order=second).model(instances[r], masks[r])
        state = committee_state(cross0[r], gram0[r], lam0[r], rows)
        if config.dtype == "float32":  # overlaps rounded to ~1e-7
            state = rounding_repaired(state, model.T, rows)
        return model, state

    eta_d = regime.eta_d
    if regime.second_order is not None and noise == -1:
        noise = None  # an order asked for: the deterministic ODE
    planned: dict = {}
    noise = plan_diffusion(regime, span, len(groups), cps, noise, why=planned)
    diffusion_failed = None
    if noise is not None:
        try:
            return _diffusion_records(config, instances, steps, groups, start, noise, regime)
        except (ValueError, RuntimeError) as exc:
            diffusion_failed = (f"the diffusion with SGD's step noise failed ({exc}): the "
                                "deterministic ODE instead")
            if not quiet:
                _note(f"committee diffusion failed ({exc}); the ODE instead")
    note = None
    if order == 1:  # say what the first-order curve leaves out (module docstring)
        try:
            first = start(next(iter(groups.values()))[0], True)
        except (ValueError, RuntimeError):
            first = None
        note = first_order_note(first, reason, K, M, eta_d)
        if regime.second_order is None and not quiet:
            _note(f"{note}; --no-finite-d-theory skips it")
    out_loss, out_align = np.full((runs, cps), np.nan), np.full((runs, cps), np.nan)
    failed, integrator = [], "map" if span <= ODE_EVALS else "solve_ivp"
    below = 0  # values of out_loss whose plain sum was < 0 (hermite.committee: PSD part)
    batches: dict = {}  # starts of one model (instance, trainable rows): one stacked ODE
    for idx in groups.values():
        batches.setdefault((id(instances[idx[0]]), masks[idx[0]].tobytes()), []).append(idx)
    for members in batches.values():
        ready = []
        for idx in members:
            try:
                ready.append((idx, *start(idx[0], order == 2)))
            except (ValueError, RuntimeError) as exc:
                failed.append(f"runs {idx[0]}…{idx[-1]}: {exc}")
        d = instances[members[0][0]].d
        if integrator == "solve_ivp" and len(ready) > 1:
            tally: dict = {}
            try:
                res = integrate_batch(ready[0][1], [st for _, _, st in ready], steps, d,
                                      diagonal=diagonal, tally=tally)
                for (idx, _, _), (lo, al), n in zip(ready, res, tally["each"], strict=True):
                    out_loss[idx], out_align[idx] = lo, al
                    below += n * len(idx)
                continue
            except (ValueError, RuntimeError):
                pass  # a start the stacked ODE cannot take: each on its own, to name it
        for idx, model, state in ready:
            tally = {}
            try:
                lo, al, integrator = integrate(model, state, steps, d, diagonal=diagonal,
                                               tally=tally)
            except (ValueError, RuntimeError) as exc:
                failed.append(f"runs {idx[0]}…{idx[-1]}: {exc}")
                continue
            out_loss[idx], out_align[idx] = lo, al
            below += tally.get("below_zero", 0) * len(idx)
    if failed and not quiet:
        _note(f"committee ODE failed for {len(failed)} initial state(s), NaN there: "
              f"{failed[0]}")
    if note is None and eta_d >= NOISE_NOTE_ETA_D:
        note = (f"deterministic committee ODE from each run's start (η·d = {eta_d:.3g}): it "
                "leaves out SGD's step noise, which makes the plateau escape earlier than "
                "the ODE's (docs/theory/committee.md)")
    for extra in (planned.get("skipped"), diffusion_failed):  # what was not recorded instead
        if extra:
            note = extra if note is None else f"{note}; {extra}"
    attrs = {"order": order, "order_reason": reason, "integrator": integrator,
             "distinct_odes": len(groups),
             "rows": rows,
             "description": f"committee-machine order-parameter ODE (hermite.committee, {rows} "
                            "rows) from the run's initial overlaps"}
    lost = int(np.isnan(out_loss).all(axis=1).sum())
    if failed and lost == runs:  # the plot's legend names it (sims.plots.curves.LEFT_OUT)
        attrs["no_theory"] = (f"committee ODE left out: it failed from every run's initial "
                              f"state ({failed[0]})")
    elif failed:
        attrs["partial"] = (f"committee ODE failed for {lost} of {runs} runs' initial states, "
                            f"its median is over the others ({failed[0]})")
    if note is not None:
        attrs["note"] = note
    loss_attrs = dict(attrs)
    if below:  # ode_loss only: the alignment has no such sum
        said = (f"{below} of its loss values come from integrated states just outside the PSD "
                "cone (integration tolerance near ε = 0: the plain sum Σ c_a c_b I2 was below "
                "0 there); they are the loss of the PSD part of the feature Gram, ≥ 0 and "
                "resolved only to the tolerance")
        loss_attrs["clamped_below_zero"] = below
        loss_attrs["note"] = f"{note}; {said}" if note else f"committee ODE: {said}"
    return ({"ode_loss": out_loss, "ode_alignment": out_align},
            {"ode_loss": loss_attrs, "ode_alignment": attrs})

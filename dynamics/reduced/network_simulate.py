"""The network learners' exact chain (:mod:`.network_chain`) as an :class:`ExactChain`: support,
start, simulation and first passages of the alignment."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np

from dynamics.randomness.sampling import run_seed
from dynamics.reduced.exact_chain import ExactChain
from dynamics.reduced.network_chain import (
    STOP_KINDS,
    NetRecords,
    NetRuns,
    NetSettings,
    NetWork,
    advance_network,
    make_net_hyper,
    min_dimension,
    storage_width,
    work_arrays,
)
from dynamics.reduced.params import distinct
from dynamics.reduced.segments import ChainRun, run_to_end
from dynamics.runtime.trajectory import RunResult, Trajectory, checkpoint_steps
from dynamics.setup.config import RunConfig
from hermite.activations_numba import compiled_activation

__all__ = ["NetworkChain", "NetworkRun", "ChainStart", "loss_levels_supported",
           "kernel_series"]

ENGINE = "reduced"


class ChainStart:
    """A batch's start in the chain's coordinates (:mod:`.network_chain` (N6)).

    P (R, k′, t), Z (R, k′, storage), m (R,) columns of Z in use, λ̂ (R, k′), mask (R, k′)
    as 0/1 floats, V (I, k, t), ident (I,) (V = [I, 0]) and λ (I, k) per distinct
    instance, inst_idx (R,), t.
    ``learner``: the full engine's learner object of the batch (its records → trajectory).
    """

    def __init__(self, config: RunConfig, instances):
        from dynamics.learners import get_learner
        from dynamics.learners.problem import Problem

        self.config, self.instances = config, list(instances)
        cls = get_learner(config.learner)
        problem = Problem.from_instances(self.instances, "cpu", _float64())
        self.learner = cls.from_config(config, problem)
        v_all = self.learner.teacher_rows().double().numpy()  # (R, k, k + 1)
        order, self.inst_idx = distinct(self.instances)
        first = [int(np.argmax(self.inst_idx == i)) for i in range(len(order))]
        k = order[0].k
        self.t = k + 1 if np.abs(v_all[..., k]).max() > 0.0 else k
        self.V = np.ascontiguousarray(v_all[first][..., : self.t])
        self.lam = np.stack([np.asarray(i.lam, dtype=np.float64) for i in order])
        eye = np.eye(k, self.t)
        self.ident = np.array([np.array_equal(v, eye) for v in self.V])
        self.kernel = kernel_series(order[0].activation)  # (mode, coefficients, error)
        self.teacher_term = np.array([_teacher_term(i) for i in order])
        width = self.learner.width
        self.storage = storage_width(width, config.batch)
        P, Z, lam_hat = self.learner.chain_start(config, self.instances, self.t, self.storage)
        self.P, self.Z, self.lam_hat = P, Z, lam_hat
        self.m = np.full(len(self.instances), min(width, Z.shape[2]), dtype=np.int64)
        self.mask = self.learner.mask.cpu().numpy().astype(np.float64)

    def settings(self, rest_dim=None) -> NetSettings:
        """The chain's settings for this batch (``rest_dim``: None for d − t)."""
        config, learner, inst0 = self.config, self.learner, self.instances[0]
        return NetSettings(compiled_activation(inst0.activation),
                           learner.loss_name == "correlation", learner.free,
                           learner.train_second_layer, config.eta, config.step_size_c,
                           math.sqrt(config.label_noise), config.batch,
                           inst0.d - self.t if rest_dim is None else rest_dim)

    def copy(self) -> ChainStart:
        """The same start with state arrays of its own (the kernel advances them in place)."""
        out = copy.copy(self)
        out.P, out.Z, out.m, out.lam_hat = (a.copy() for a in (self.P, self.Z, self.m,
                                                                self.lam_hat))
        return out

    def loss(self) -> np.ndarray:
        """(R,) the runs' exact population loss now (unit rows: the learner module's
        ``exact_loss``)."""
        from dynamics.learners.network import exact_loss

        cross, gram = self.overlaps()
        return exact_loss(self.instances, cross[:, None], gram[:, None],
                          self.lam_hat[:, None])[:, 0]

    def overlaps(self) -> tuple[np.ndarray, np.ndarray]:
        """(cross ⟨vᵢ, ŵⱼ⟩ (R, k, k′), student Gram (R, k′, k′)) of the runs now."""
        cross = np.einsum("rkt,rjt->rkj", self.V[self.inst_idx], self.P)
        gram = np.einsum("rit,rjt->rij", self.P, self.P)
        for r, m in enumerate(self.m):
            gram[r] += self.Z[r, :, :m] @ self.Z[r, :, :m].T
        return cross, gram

    def alignment(self) -> np.ndarray:
        """(R,) the runs' alignment now (the learner's ``alignment_of`` its overlaps)."""
        cross, gram = self.overlaps()
        return self.learner.alignment_of(cross[:, None], gram[:, None], self.instances)[:, 0]


def _teacher_term(instance) -> float:
    """λᵀK(VVᵀ)λ, the loss's student-free term (NaN for a committee teacher: not used)."""
    if instance.committee:
        return float("nan")
    import hermite

    lam = np.asarray(instance.lam, dtype=float)
    gram = np.clip(instance.teacher_gram(), -1.0, 1.0)
    return float(lam @ hermite.dual_kernel(instance.activation, gram) @ lam)


def _float64():
    import torch

    return torch.float64


def compiled_activation_missing(inst: dict, chain: str) -> str:
    """"" when the instance's activation has a compiled σ, else the one-line reason."""
    from hermite.activations import get_activation

    try:
        act = compiled_activation(get_activation(str(inst.get("activation"))))
    except (KeyError, ValueError):
        act = None
    if act is None:
        return (f"reduced engine: activation {inst.get('activation')!r} has no compiled "
                f"version for the {chain} chain")
    return ""


class NetworkChain(ExactChain):
    """The exact chain of ``scratch``, ``scratch-csq`` and ``sparse`` (:mod:`.network_chain`):
    unit or free rows, fixed or trained λ̂, squared or correlation loss, any b, label noise,
    fine-tuned or committee teacher, random or given rows; numba on CPU, float64."""

    name = "network"
    records_start = True

    def supported(self, config) -> tuple[bool, str]:
        inst = config.instance
        why = compiled_activation_missing(inst, "network")
        if why:
            return False, why
        from dynamics.learners import get_learner

        k, d = int(inst["k"]), int(inst["d"])
        width = get_learner(config.learner).neurons(config, k)
        committee = inst.get("teacher") == "committee"  # its rows lie in span W: t = k
        need = min_dimension(k if committee else k + 1, width, config.batch)
        if d < need:
            t = "k" if committee else "k + 1"
            return False, (f"reduced engine: the network chain needs d ≥ {t} + k′ + b = "
                           f"{need} (here d = {d}); the full engine is cheap there")
        return True, ""

    def _advance(self, start: ChainStart, steps, n_steps, *, stop_kind="none",
                 stop_level=math.inf, rest_dim=None, backend="numba"):
        """Run the kernel on ``start`` (in place): (NetRuns, NetRecords)."""
        config, inst0 = start.config, start.instances[0]
        runs, k, width = len(start.instances), inst0.k, start.learner.width
        states = np.array([run_seed(config.seed, r, "data") for r in range(runs)],
                          dtype=np.uint64)
        run_state = NetRuns(states, start.P, start.Z, start.m, start.lam_hat, start.mask,
                            start.inst_idx, np.full(runs, -1, dtype=np.int64),
                            np.full(runs, -1, dtype=np.int64), np.zeros(runs, dtype=np.int64),
                            np.zeros(runs, dtype=bool))
        C = len(steps)
        rec = NetRecords(np.asarray(steps, dtype=np.int64), np.empty((runs, C, k, width)),
                         np.empty((runs, C, width, width)), np.empty((runs, C, width)))
        hyp = make_net_hyper(start.settings(rest_dim), n_steps, STOP_KINDS[stop_kind],
                             stop_level, start.kernel[0])
        args = (hyp, start.V, start.ident, start.lam, run_state, rec, start.teacher_term,
                start.kernel[1])
        if backend == "numba-cuda":
            from dynamics.reduced.network_cuda import advance_network as advance_cuda

            advance_cuda(*args)
        else:
            advance_network(*args)
        return run_state, rec

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        """The Trajectory of ``config``: the full engine's observables (the learner's own
        ``trajectory``) from the chain's records. ``_chi2_dof``: test hook, the rest
        dimension d − t replaced (a wrong χ² law)."""
        return run_to_end(self.start(config, instances=instances, backend=backend,
                                     _chi2_dof=_chi2_dof)).trajectory()

    def start(self, config, *, instances=None, backend=None, _chi2_dof=None) -> NetworkRun:
        """:meth:`simulate`'s runs at step 0, to advance in segments (:mod:`.segments`)."""
        backend = _check_backend(config, backend)
        instances = config.run_instances() if instances is None else instances
        steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
        return NetworkRun(ChainStart(config, instances), steps, backend, _chi2_dof)

    def _record(self, start: ChainStart, steps, backend, rest_dim=None) -> Trajectory:
        """Advance ``start`` to ``steps[-1]``, recording at ``steps``: the learner's own
        trajectory of the records."""
        return run_to_end(NetworkRun(start, steps, backend, rest_dim)).trajectory()

    first_passage_quantities = ("overlap", "loss")

    def quantity_supported(self, config, quantity: str) -> tuple[bool, str]:
        ok, why = super().quantity_supported(config, quantity)
        if ok and quantity == "loss":
            ok, why = loss_levels_supported(config, config.run_instances()[0])
        return ok, why

    def first_passages(self, config, levels, max_steps=None, *, absolute=True,
                       backend=None, quantity: str = "overlap") -> np.ndarray:
        """(L, R) first steps at which each run's ``overlap`` (its alignment) reaches each
        level (≥), or its exact population ``loss`` falls to it (≤; unit rows and a unit-row
        teacher), checked after every step; 0 where the start is there already; NaN if not
        by ``max_steps`` (default ``config.steps``); diverged runs never. ``absolute`` is
        moot (the scratch alignment is ≥ 0; ``sparse``'s signed cos(vᵢ, ŵᵢ) is compared as
        it is)."""
        backend = _check_backend(config, backend)
        self.require_quantity(quantity)
        instances = config.run_instances()
        if quantity == "loss":
            ok, why = loss_levels_supported(config, instances[0])
            if not ok:
                raise ValueError(why)
            kind = "loss"
        else:
            kind = "diagonal" if _learner(config).diagonal_alignment else "alignment"
        n = int(config.steps if max_steps is None else max_steps)
        out = np.full((len(levels), config.runs), np.nan)
        start = ChainStart(config, instances)
        now = start.loss() if quantity == "loss" else start.alignment()
        for li, level in enumerate(levels):
            there = now <= level if quantity == "loss" else now >= level
            runs, _ = self._advance(start.copy(), np.zeros(0, np.int64), n, stop_kind=kind,
                                    stop_level=float(level), backend=backend)
            hit = runs.hit_step.astype(float)
            hit[runs.hit_step < 0] = np.nan
            hit[there] = 0.0
            out[li] = hit
        return out

    def initial_trajectory(self, config, *, backend=None) -> Trajectory:
        """The runs' start alone (one checkpoint, step 0), as :meth:`simulate` records it."""
        backend = _check_backend(config, backend)
        return self._record(ChainStart(config, config.run_instances()),
                            np.zeros(1, np.int64), backend)


class NetworkRun(ChainRun):
    """The network chain's runs between segments: per run the stream, P, Z, its width m,
    λ̂, the row mask, the fused pass's carry and work arrays (:mod:`.network_chain`);
    records ⟨vᵢ, ŵⱼ⟩, the student Gram and λ̂ (the full engine's records)."""

    name = "network"

    def __init__(self, start: ChainStart, steps, backend="numba", rest_dim=None):
        config, inst0 = start.config, start.instances[0]
        runs, k, width = len(start.instances), inst0.k, start.learner.width
        self.start, self.backend, self.m0 = start, backend, start.alignment()
        self.settings = start.settings(rest_dim)
        kp, t = start.P.shape[1], start.P.shape[2]
        work = work_arrays(runs, config.batch, k, kp, t, start.Z.shape[2])
        per_run = {"states": np.array([run_seed(config.seed, r, "data") for r in range(runs)],
                                      dtype=np.uint64),
                   "P": start.P, "Z": start.Z, "m": start.m, "lam_hat": start.lam_hat,
                   "mask": start.mask, "inst_idx": np.asarray(start.inst_idx, np.int64),
                   "slot": np.zeros(runs, dtype=np.int64), "ready": np.zeros(runs, dtype=bool)}
        per_run |= {f"work{i}": a for i, a in enumerate(work)}
        C = len(steps)
        records = {"cross": np.empty((runs, C, k, width)),
                   "gram": np.empty((runs, C, width, width)),
                   "lam_hat": np.empty((runs, C, width))}
        super().__init__(steps, per_run, records)

    def _kernel(self, state, rec, n_steps, cp, more):
        start = self.start
        n = state["P"].shape[0]
        div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        hyp = make_net_hyper(self.settings, n_steps, STOP_KINDS["none"], math.inf,
                             start.kernel[0], more)
        runs = NetRuns(state["states"], state["P"], state["Z"], state["m"], state["lam_hat"],
                       state["mask"], state["inst_idx"], div, hit, state["slot"],
                       state["ready"])
        work = tuple(state[f"work{i}"] for i in range(len(NetWork._fields)))
        args = (hyp, start.V, start.ident, start.lam, runs,
                NetRecords(cp, rec["cross"], rec["gram"], rec["lam_hat"]), start.teacher_term,
                start.kernel[1])
        if self.backend == "numba-cuda":
            from dynamics.reduced.network_cuda import advance_network as advance_cuda

            advance_cuda(*args, work=work)
        else:
            advance_network(*args, work=work)
        return div, hit

    def trajectory(self) -> Trajectory:
        start = self.start
        steps, rec = self.recorded()
        result = RunResult(replace(start.config, dtype="float64"), start.instances,
                           np.asarray(steps), {"cross": rec["cross"], "gram": rec["gram"],
                                               "lam_hat": rec["lam_hat"]},
                           self.div.copy(), self.m0, "cpu", engine=ENGINE)
        return start.learner.trajectory(result)


def loss_levels_supported(config, instance) -> tuple[bool, str]:
    """(True, "") where the kernel evaluates the exact loss every step: unit rows and a
    unit-row (fine-tuned) teacher, whose loss is a sum of dual kernels."""
    o = config.options
    if getattr(o, "rows", "unit") == "free" or instance.committee:
        return False, ("first passages of the loss: the network chain evaluates the exact loss "
                       "every step for unit rows and a fine-tuned teacher only (free rows or a "
                       "committee teacher: use levels on the alignment, or a trajectory)")
    return True, ""


def kernel_series(activation) -> tuple[int, np.ndarray, float]:
    """(mode, coefficients, error bound) of the dual kernel K for the kernel's loss rule:
    a polynomial σ's exact power series Σ μₚ²ρᵖ, else the certified Chebyshev interpolant in
    θ = arccos ρ (``hermite.expansion.kernels.kernel_interpolant``)."""
    import hermite
    from dynamics.reduced.network_chain import KERNEL_MODES
    from hermite.expansion.kernels import kernel_interpolant

    degree = getattr(getattr(activation, "theory", activation), "polynomial_degree", None)
    if degree is not None:
        mu = np.asarray(hermite.hermite_coefficients(activation, degree), dtype=np.float64)
        return KERNEL_MODES["power"], np.ascontiguousarray(mu * mu), 0.0
    interp = kernel_interpolant(activation, "kernel")
    return (KERNEL_MODES["chebyshev_theta"], np.ascontiguousarray(interp.coef, np.float64),
            float(interp.error_bound))


def _learner(config):
    from dynamics.learners import get_learner

    return get_learner(config.learner)


BACKENDS = ("numba", "numba-cuda")


def _check_backend(config, backend) -> str:
    """The backend: ``numba`` (CPU) or ``numba-cuda`` (one thread per run; the default when
    the config's device is CUDA)."""
    from dynamics.randomness.sampling import resolve_device

    device = resolve_device(config.device).type
    if backend is None:
        backend = "numba-cuda" if device == "cuda" else "numba"
    if backend not in BACKENDS:
        raise ValueError(f"the network chain's backend must be one of {', '.join(BACKENDS)}, "
                         f"got {backend!r}")
    if backend == "numba-cuda" and device != "cuda":
        raise ValueError(f"the numba-cuda backend runs on device 'cuda' only, got "
                         f"{config.device!r}")
    return backend

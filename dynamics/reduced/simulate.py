"""Public entry points of the reduced engine: support check, simulation, first passage."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from dynamics.measures.losses import needs_coordinates
from dynamics.overlays.assembly import rank_one_trajectory
from dynamics.overlays.finetune import initial_drift_sign
from dynamics.randomness.sampling import resolve_device, resolve_dtype, run_seed
from dynamics.reduced import _kernel, torch_chain
from dynamics.reduced._chain import ChainState, Inst, RankOneSettings, Records, Runs, make_hyper
from dynamics.reduced.exact_chain import ExactChain, convention_supported
from dynamics.reduced.params import ChainParams, pack_instances
from dynamics.reduced.segments import ChainRun, run_to_end
from dynamics.runtime.trajectory import RunResult, Trajectory, checkpoint_steps
from dynamics.setup.config import RunConfig
from hermite.activations_numba import act_code

__all__ = ["ENGINE", "BACKENDS", "RankOneChain", "RankOneRun", "TorchRankOneRun",
           "reduced_supported", "simulate_resolved", "start_resolved", "simulate_reduced",
           "start_rank_one", "first_passage_reduced", "first_passages_reduced",
           "initial_trajectory"]

ENGINE = "reduced"
BACKENDS = ("numba", "numba-cuda", "torch")


def _chain(config: RunConfig):
    """(the learner's exact chain or None, the learner class); ValueError for an unknown
    learner (``config.validate`` names it)."""
    from dynamics.learners import get_learner

    learner = get_learner(config.learner)
    return learner.exact_chain(), learner


def reduced_supported(config: RunConfig) -> tuple[bool, str]:
    """(True, "") when the learner's exact chain (``Learner.exact_chain``) covers ``config``,
    else (False, one-line reason): no chain, the App. B conventions, or what the chain's own
    ``supported`` names."""
    from dynamics.learners import LEARNERS

    chain, learner = _chain(config)
    if chain is None:
        having = [name for name in LEARNERS if _has_chain(name)]
        return False, (f"reduced engine: learner {learner.name!r} has no exact finite-state "
                       f"reduction (only {', '.join(repr(n) for n in having)})")
    ok, why = convention_supported(config, chain)
    if not ok:
        return ok, why
    return chain.supported(config)


def _has_chain(name: str) -> bool:
    from dynamics.learners import get_learner

    return get_learner(name).exact_chain() is not None


def _supported_chain(config: RunConfig):
    """The chain of a validated config it supports (ValueError naming why not)."""
    config.validate()
    ok, why = reduced_supported(config)
    if not ok:
        raise ValueError(why)
    return _chain(config)[0]


class RankOneChain(ExactChain):
    """The exact chain of ``finetune`` (module docstring of :mod:`dynamics.reduced`): every
    setting (projected or not, ĉ frozen or joint, any b, label noise, any W and u, unit rows
    or the App. B conventions) reduces."""

    name = "rank-1"
    records_start = True
    conventions = ("unit", "appB", "appB-sqrt")

    def supported(self, config) -> tuple[bool, str]:
        return convention_supported(config, self)

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
        return _record(config, backend, steps, _chi2_dof, instances)

    def start(self, config, *, instances=None, backend=None, _chi2_dof=None):
        steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
        return start_rank_one(config, backend, steps, _chi2_dof, instances)

    def initial_trajectory(self, config, *, backend=None) -> Trajectory:
        return _record(config, backend, np.zeros(1, dtype=np.int64), None)

    def first_passages(self, config, levels, max_steps=None, *, absolute=True,
                       backend=None, quantity="overlap") -> np.ndarray:
        self.require_quantity(quantity)
        return _first_passages(config, levels, max_steps, absolute, backend)


def _choose_backend(config: RunConfig, backend: str | None, act_name: str):
    device = resolve_device(config.device)
    if backend is None:
        if act_code(act_name) is None:
            backend = "torch"
        else:
            backend = "numba" if device.type == "cpu" else "numba-cuda"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "numba" and device.type != "cpu":
        raise ValueError("the numba backend runs on device 'cpu' only")
    if backend == "numba-cuda" and device.type != "cuda":
        raise ValueError("the numba-cuda backend runs on device 'cuda' only")
    if backend.startswith("numba") and act_code(act_name) is None:
        raise ValueError(f"activation {act_name!r} has no compiled version; use backend torch")
    return backend, device


@dataclass(frozen=True)
class RankOneSetup:
    """The rank-1 chain's runs as one config sets them up: the config, its packed instances
    (:class:`~.params.ChainParams`) and run instances, backend and device; ``dof`` overrides
    the χ² degrees of freedom d − k − 2 (tests: a deliberately wrong law)."""

    config: RunConfig
    params: ChainParams
    instances: list
    backend: str
    device: torch.device
    dof: int | None = None

    @property
    def settings(self) -> RankOneSettings:
        return RankOneSettings.from_config(self.config, self.instances[0].d, self.params.k,
                                           self.dof)

    @property
    def activation(self):
        return self.instances[0].activation

    def advance_fn(self):
        """The numba backend's :func:`advance_runs` (CPU blocks, or one CUDA thread per run,
        every step of a call in one launch)."""
        if self.backend == "numba-cuda":
            from dynamics.reduced import cuda_kernel

            return cuda_kernel.advance_runs
        return _kernel.advance_runs

    def tensor(self, a):
        """``a`` as a tensor of the config's dtype on the device (torch backend)."""
        return torch.as_tensor(a, dtype=resolve_dtype(self.config.dtype), device=self.device)

    def runs(self, states, mu, nu, pw=None, chat=None) -> Runs:
        """The runs' block (:class:`~._chain.Runs`) from their streams, μ and ν, p (default
        0) and ĉ (default the instances'), neither diverged nor stopped."""
        n, k = mu.shape[0], self.params.k
        return Runs(states, mu, nu, np.zeros((n, k)) if pw is None else pw,
                    self.params.c_hat0.copy() if chat is None else chat,
                    np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64))

    def torch_params(self) -> torch_chain.TorchParams:
        return torch_chain.TorchParams.from_params(self.params, self.device,
                                                   resolve_dtype(self.config.dtype))


def _initial_state(config: RunConfig, params: ChainParams, instances):
    """μ₀, ν₀ (R,) by (R0), streams seeded from (seed, r); sign flips for ``aligned``."""
    runs, d, k = config.runs, instances[0].d, params.k
    states = np.zeros(runs, dtype=np.uint64)
    mu, nu = np.empty(runs), np.empty(runs)
    _kernel.init_runs(run_seed(config.seed, 0, "data"), d - k, states, mu, nu)
    u_perp = params.prm[params.inst_idx, 4 * k]
    if config.options.init == "aligned":
        mu[mu * u_perp * initial_drift_sign(instances) < 0] *= -1.0
    return states, mu, nu, mu * u_perp


def _run(setup: RankOneSetup, runs: Runs, cp, n_steps, stop_level=math.inf, stop_abs=True):
    """Advance all runs of ``runs`` (numba backends: their streams, μ, ν, p and ĉ in place;
    torch: from their μ, ν, p, ĉ, into div/hit only); returns (records dict (R, C[, k]),
    div_step, hit_step)."""
    config, k = setup.config, setup.params.k
    n = runs.mu.shape[0]
    if setup.backend == "torch":
        t = setup.tensor
        return torch_chain.advance(
            setup.torch_params(), setup.activation, setup.settings,
            ChainState(t(runs.mu), t(runs.nu), t(runs.pw), t(runs.chat)), n_steps, cp,
            run_seed(config.seed, 1, "data"), stop_level, stop_abs)
    n_cp = len(cp)
    rec = {"m": np.empty((n, n_cp)), "mu": np.empty((n, n_cp)), "nu": np.empty((n, n_cp)),
           "pw": np.empty((n, n_cp, 0 if config.options.project else k)),
           "chat": np.empty((n, n_cp, k if config.options.joint_c else 0))}
    hyp = make_hyper(setup.settings, act_code(setup.activation.name), n_steps, stop_level,
                     stop_abs)
    p = setup.params
    setup.advance_fn()(hyp, Inst(p.L, p.ident, p.prm, p.inst_idx), runs,
                       Records(np.asarray(cp, dtype=np.int64), rec["m"], rec["mu"], rec["nu"],
                               rec["pw"], rec["chat"]))
    rec["pw"] = rec["pw"] if not config.options.project else None
    rec["chat"] = rec["chat"] if config.options.joint_c else None
    return rec, runs.div_step, runs.hit_step


def simulate_reduced(config: RunConfig, *, backend: str | None = None,
                     _chi2_dof: int | None = None) -> Trajectory:
    """Simulate ``config`` with its learner's exact chain; same outputs as the full engine.

    backend : ``numba`` (CPU default; computes in float64 whatever ``config.dtype``) or
    ``torch`` (default on CUDA; honours ``config.dtype``), where the chain has them. Raises
    ValueError where :func:`reduced_supported` says no. ``_chi2_dof`` is a test hook (wrong
    χ² law).
    """
    return _supported_chain(config).simulate(config, backend=backend, _chi2_dof=_chi2_dof)


def simulate_resolved(run) -> Trajectory:
    """A run resolved once (:class:`~dynamics.engines.resolve.ResolvedRun`: validated, instances
    built) on its learner's chain, with those instances; ValueError where the chain does
    not cover it (``--engine reduced`` asked where it is not exact)."""
    return run_to_end(start_resolved(run)).trajectory()


def start_resolved(run):
    """:func:`simulate_resolved`'s runs at step 0, as a
    :class:`~dynamics.reduced.segments.ChainRun` to advance in segments (the engine's
    driver: progress, interruption, resume files)."""
    ok, why = reduced_supported(run.config)
    if not ok:
        raise ValueError(why)
    return run.learner.exact_chain().start(run.config, instances=run.run_instances)


def initial_trajectory(config: RunConfig, *, backend: str | None = None) -> Trajectory:
    """The runs' initial state only (one checkpoint, step 0), exactly as
    :func:`simulate_reduced` records it; what a first-passage-only scaling cell stores
    beside its exact hitting times (:func:`first_passage_reduced`, same streams). Chains with
    ``records_start`` only (the rank-1 chain)."""
    return _supported_chain(config).initial_trajectory(config, backend=backend)


def _record(config, backend, steps, dof, instances=None) -> Trajectory:
    """Run the rank-1 chain to ``steps[-1]``, recording at ``steps`` (in segments:
    :mod:`.segments`)."""
    return run_to_end(start_rank_one(config, backend, steps, dof, instances)).trajectory()


def start_rank_one(config, backend, steps, dof=None, instances=None):
    """The rank-1 chain's runs at step 0 (:class:`RankOneRun`, or :class:`TorchRankOneRun`
    on the torch backend), to be advanced in segments towards ``steps[-1]``."""
    instances = config.run_instances() if instances is None else instances
    params = pack_instances(instances)
    backend, device = _choose_backend(config, backend, instances[0].activation.name)
    states, mu, nu, m0 = _initial_state(config, params, instances)
    cls = TorchRankOneRun if backend == "torch" else RankOneRun
    return cls(RankOneSetup(config, params, instances, backend, device, dof), steps, states,
               mu, nu, m0)


class RankOneRun(ChainRun):
    """The rank-1 chain's runs between segments (numba, numba-cuda): per run the stream, μ,
    ν, p and ĉ; records m, μ, ν (R, C), p, ĉ (R, C, k) where the variant moves them."""

    name = "rank-1"

    def __init__(self, setup: RankOneSetup, steps, states, mu, nu, m0):
        config, params = setup.config, setup.params
        runs, k = config.runs, params.k
        o = config.options
        self.setup, self.config, self.params = setup, config, params
        self.instances, self.backend, self.device, self.m0 = (setup.instances, setup.backend,
                                                              setup.device, m0)
        self.settings, self.code = setup.settings, act_code(setup.activation.name)
        C = len(steps)
        per_run = {"states": states, "mu": mu, "nu": nu, "pw": np.zeros((runs, k)),
                   "chat": params.c_hat0.copy(), "inst_idx": params.inst_idx.copy()}
        records = {"m": np.empty((runs, C)), "mu": np.empty((runs, C)),
                   "nu": np.empty((runs, C)),
                   "pw": np.empty((runs, C, 0 if o.project else k)),
                   "chat": np.empty((runs, C, k if o.joint_c else 0))}
        super().__init__(steps, per_run, records)

    def _kernel(self, state, rec, n_steps, cp, more):
        n = state["mu"].shape[0]
        div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        hyp = make_hyper(self.settings, self.code, n_steps)
        p = self.params
        self.setup.advance_fn()(
            hyp, Inst(p.L, p.ident, p.prm, state["inst_idx"]),
            Runs(state["states"], state["mu"], state["nu"], state["pw"], state["chat"], div,
                 hit),
            Records(cp, rec["m"], rec["mu"], rec["nu"], rec["pw"], rec["chat"]))
        return div, hit

    def trajectory(self) -> Trajectory:
        steps, rec = self.recorded()
        rec = dict(rec)
        rec["pw"] = rec["pw"] if not self.config.options.project else None
        rec["chat"] = rec["chat"] if self.config.options.joint_c else None
        return _trajectory(self.config, self.instances, steps, rec, self.div.copy(), self.m0,
                           self.backend, self.device)


class TorchRankOneRun(ChainRun):
    """The rank-1 chain's runs between segments on the torch backend
    (:class:`.torch_chain.TorchRun`: one generator for all runs, so every run takes every
    call, the stopped ones frozen by the chain itself)."""

    name = "rank-1"
    backend = "torch"

    def __init__(self, setup: RankOneSetup, steps, states, mu, nu, m0):
        config, t = setup.config, setup.tensor
        self.config, self.instances, self.device, self.m0 = (config, setup.instances,
                                                             setup.device, m0)
        start = ChainState(t(mu), t(nu), t(np.zeros((config.runs, setup.params.k))),
                           t(setup.params.c_hat0.copy()))
        self.torch_run = torch_chain.TorchRun(setup.torch_params(), setup.activation,
                                              setup.settings, start,
                                              run_seed(config.seed, 1, "data"))
        super().__init__(steps, {"mu": mu}, {})

    def advance(self, n: int) -> None:
        t0 = self.t
        t1 = min(t0 + max(int(n), 0), self.total)
        c1 = int(np.searchsorted(self.cp_steps, t1, side="right"))
        self.torch_run.advance(t0, t1, self.cp_steps[self.c:c1])
        self.t, self.c = t1, c1
        self.div[:] = self.torch_run.div.cpu().numpy()
        self.hit[:] = self.torch_run.hit.cpu().numpy()

    def trajectory(self) -> Trajectory:
        rec, _, _ = self.torch_run.results()
        steps = self.cp_steps[: self.c]
        return _trajectory(self.config, self.instances, steps, rec, self.div.copy(), self.m0,
                           "torch", self.device)

    def run_state(self):
        rs = super().run_state()
        arrays, values = self.torch_run.state()
        rs.arrays = {k: v for k, v in rs.arrays.items() if k in ("div", "hit")}
        rs.arrays |= {f"torch/{k}": v for k, v in arrays.items()}
        rs.values = {"torch": values}
        return rs

    def load_run_state(self, rs) -> None:
        rs.require(kind=self.kind, total=self.total, checkpoints=int(self.cp_steps.size),
                   runs=self.runs)
        self.torch_run.load({k.removeprefix("torch/"): v for k, v in rs.arrays.items()
                             if k.startswith("torch/")}, rs.values.get("torch", {}))
        self.t, self.c = int(rs.step), int(rs.reached)
        self.div[:] = rs.array("div", self.div.shape, self.div.dtype)
        self.hit[:] = rs.array("hit", self.hit.shape, self.hit.dtype)


def _trajectory(config, instances, steps, rec, div, m0, backend, device) -> Trajectory:
    """Observables as the full engine records them (:mod:`dynamics.overlays.assembly`)."""
    coords = None
    if needs_coordinates(config):
        pw = rec["pw"] if rec["pw"] is not None else np.zeros(rec["m"].shape + (instances[0].k,))
        coords = np.concatenate([pw, rec["mu"][..., None], rec["nu"][..., None]], -1)
    records = {"overlap": rec["m"], "c_hat": rec["chat"], "coords": coords}
    dtype = "float64" if backend.startswith("numba") else config.dtype
    return rank_one_trajectory(RunResult(config, instances, steps, records, div, m0, device,
                                         engine=ENGINE, dtype=dtype))


def first_passage_reduced(config: RunConfig, level: float, max_steps: int | None = None, *,
                          absolute: bool = True, backend: str | None = None) -> np.ndarray:
    """(R,) first step at which m ≥ ``level`` (|m| if ``absolute``), NaN if not by max_steps.

    Each run stops at its hit, so the cost is the hitting time, not the horizon
    (``max_steps``, default ``config.steps``). Diverged runs count as never.
    """
    if not math.isfinite(level):
        raise ValueError(f"level must be finite, got {level}")
    return first_passages_reduced(config, [level], max_steps, absolute=absolute,
                                  backend=backend)[0]


def first_passages_reduced(config: RunConfig, levels, max_steps: int | None = None, *,
                           absolute: bool = True, backend: str | None = None,
                           quantity: str = "overlap") -> np.ndarray:
    """(L, R) first steps at which m ≥ each of ``levels`` (|m| if ``absolute``), NaN if not
    by max_steps; the same numbers as :func:`first_passage_reduced` level by level (the
    learner's chain: ``ExactChain.first_passages``). ``quantity = "loss"``: the first steps
    at which the exact population loss is ≤ each level (chains that list it in
    ``first_passage_quantities``; ValueError naming why elsewhere)."""
    levels = [float(x) for x in levels]
    if not levels or not all(math.isfinite(x) for x in levels):
        raise ValueError(f"levels must be finite numbers, got {levels}")
    return _supported_chain(config).first_passages(config, levels, max_steps, absolute=absolute,
                                                   backend=backend, quantity=quantity)


def _first_passages(config, levels, max_steps, absolute, backend) -> np.ndarray:
    """Rank-1 chain: ONE pass per run over the sorted levels: after its hit of one level a run
    resumes from its full state (chain and stream) towards the next, so a run costs its
    hitting time of the highest level it reaches."""
    instances = config.run_instances()
    backend, device = _choose_backend(config, backend, instances[0].activation.name)
    if backend == "torch" and len(levels) > 1:  # no resumable state: a fresh pass per level
        return np.array([_first_passages(config, [x], max_steps, absolute, backend)[0]
                         for x in levels])
    params = pack_instances(instances)
    setup = RankOneSetup(config, params, instances, backend, device)
    states, mu, nu, m0 = _initial_state(config, params, instances)
    horizon = int(config.steps if max_steps is None else max_steps)
    runs, k = config.runs, params.k
    pw, chat = np.zeros((runs, k)), params.c_hat0.copy()
    out = np.full((len(levels), runs), np.nan)
    order = np.argsort(levels, kind="stable")
    elapsed = np.zeros(runs, dtype=np.int64)  # steps taken so far (= last hit)
    alive = np.ones(runs, dtype=bool)  # hit every lower level within the horizon
    for j in order:
        level = levels[j]
        now = params.prm[params.inst_idx, 4 * k] * mu
        if not config.options.project:
            now = now + np.einsum("ri,ri->r", pw, params.prm[params.inst_idx, 3 * k:4 * k])
        already = alive & ((np.abs(now) if absolute else now) >= level)
        out[j, already] = elapsed[already]
        todo = alive & ~already
        if not todo.any():
            continue
        sel = np.flatnonzero(todo)  # only these runs move; each keeps its own stream
        sub = dataclasses.replace(
            setup, config=dataclasses.replace(config, runs=sel.size),
            params=dataclasses.replace(params, inst_idx=params.inst_idx[sel],
                                       c_hat0=params.c_hat0[sel]))
        st, m_, n_, p_, c_ = states[sel], mu[sel], nu[sel], pw[sel], chat[sel]
        _, div, hit = _run(sub, sub.runs(st, m_, n_, p_, c_),
                           np.zeros(0, dtype=np.int64), int(horizon - elapsed[sel].min()),
                           level, absolute)
        states[sel], mu[sel], nu[sel], pw[sel], chat[sel] = st, m_, n_, p_, c_
        total = elapsed[sel] + hit
        ok = (hit >= 0) & (div < 0) & (total <= horizon)
        out[j, sel[ok]] = total[ok]
        elapsed[sel[ok]] = total[ok]
        alive = already.copy()
        alive[sel[ok]] = True
    start = (np.abs(m0) if absolute else m0)[None, :] >= np.asarray(levels)[:, None]
    out[start] = 0.0
    return out

"""The reduced engine for the rank-r ``lora`` learner: drives :mod:`.rank_chain` (numba).

Exact where the chain's derivation holds: projected Û, U ⊥ span W (u_alpha = 0), b = 1, unit
rows. The trajectory is assembled by the full learner's own ``trajectory`` from the recorded
overlap matrices M (R, C, r, r) (and Ĉ when trained), so both engines report the same
observables, theory (matrix ODE) included.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import hermite
from dynamics.instances.lora_instance import run_lora_instances
from dynamics.learners import Problem, RunResult
from dynamics.learners.lora import LoRA
from dynamics.randomness.sampling import run_seed
from dynamics.reduced import rank_chain
from dynamics.reduced.exact_chain import ExactChain, passage_steps
from dynamics.reduced.params import distinct, join_flat
from dynamics.reduced.segments import ChainRun, run_to_end
from dynamics.runtime.trajectory import Trajectory, checkpoint_steps
from hermite.activations_numba import act_code

__all__ = ["RankChain", "RankRun", "rank_supported", "simulate_rank_reduced",
           "start_rank_reduced", "first_passage_rank"]


def rank_supported(config) -> tuple[bool, str]:
    """(True, "") when the rank-r chain (:mod:`.rank_chain`) is exact for this ``lora``
    config, else (False, one-line reason): it needs projected Û, b = 1, U ⊥ span W
    (u_alpha = 0) and a σ with a compiled version."""
    why = []
    if not config.options.project:
        why.append("unprojected Û")
    if config.batch != 1:
        why.append("mini-batches (b > 1)")
    if float(config.instance.get("u_alpha", 0.0) or 0.0) != 0.0:
        why.append("U with a component in span W (u_alpha > 0)")
    if act_code(str(config.instance.get("activation"))) is None:
        why.append(f"activation {config.instance.get('activation')!r} (no compiled version)")
    if why:
        return False, ("reduced engine: the rank-r chain does not cover " + ", ".join(why)
                       + "; use --engine full")
    return True, ""


class RankChain(ExactChain):
    """The exact rank-r chain of ``lora`` (:mod:`.rank_chain`)."""

    name = "rank-r"

    def supported(self, config) -> tuple[bool, str]:
        return rank_supported(config)

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        if backend not in (None, "numba") or _chi2_dof is not None:
            raise ValueError("the rank-r chain has only the numba backend and its own χ² law")
        return simulate_rank_reduced(config, instances)

    def start(self, config, *, instances=None, backend=None, _chi2_dof=None) -> RankRun:
        if backend not in (None, "numba") or _chi2_dof is not None:
            raise ValueError("the rank-r chain has only the numba backend and its own χ² law")
        return start_rank_reduced(config, instances)

    def first_passages(self, config, levels, max_steps=None, *, absolute=True,
                       backend=None, quantity="overlap") -> np.ndarray:
        """All r singular values of M ≥ level (absolute by nature)."""
        self.require_quantity(quantity)
        return np.array([first_passage_rank(config, x, max_steps) for x in levels])


def _setup(config, instances=None):
    """(instances, rank-r instances, the chain's per-instance arrays) of a supported config."""
    ok, why = rank_supported(config)
    if not ok:
        raise ValueError(why)
    instances = config.run_instances() if instances is None else instances
    linst = run_lora_instances(config, instances)
    order, idx = distinct(linst)
    k = order[0].k
    arrays = {
        "L": np.stack([np.asarray(li.w_factor, float) for li in order]),
        "ident": np.array([np.array_equal(li.w_factor, np.eye(k)) for li in order]),
        "lam": np.stack([np.asarray(li.lam, float) for li in order]),
        "C": np.stack([np.asarray(li.C, float) for li in order]),
        "tnorm": np.stack([np.asarray(li.teacher_norms(), float) for li in order]),
        "xi": np.array([li.xi for li in order], dtype=float),
        "idx": idx,
        "chat": np.stack([np.asarray(li.C_hat, float) for li in linst]),
    }
    return instances, linst, arrays


def _initial(config, linst):
    """(states, M₀, B₀): Haar frames by (Q5), sign-flipped like the full learner if aligned."""
    runs, r, d, k = config.runs, linst[0].rank, linst[0].d, linst[0].k
    states = np.zeros(runs, dtype=np.uint64)
    m0, b0 = np.empty((runs, r, r)), np.empty((runs, r, r))
    rank_chain.init_runs(run_seed(config.seed, 0, "data"), d - k, states, m0, b0)
    if config.options.init == "aligned":

        order, idx = distinct(linst)
        a0 = np.stack([hermite.A_matrix(li, np.zeros((r, r))) for li in order])[idx]
        m0[np.einsum("nab,nab->n", m0, a0) < 0] *= -1.0
    return states, m0, b0


def _advance(config, linst, arrays, states, m, b, cp, n_steps, stop_level=math.inf):
    runs, r, k = config.runs, linst[0].rank, linst[0].k
    code, hp = act_code(linst[0].activation.name)
    cp_m = np.full((runs, len(cp), r, r), np.nan)
    cp_chat = np.full((runs, len(cp), k, r) if config.options.joint_c else (runs, 0, k, r), np.nan)
    div = np.full(runs, -1, dtype=np.int64)
    hit = np.full(runs, -1, dtype=np.int64)
    chat = arrays["chat"].copy()
    hyp = rank_chain.make_rank_hyper(
        config.options.joint_c, code, hp, linst[0].d - k - 2 * r, config.eta, config.step_size_c,
        math.sqrt(config.label_noise), rank_chain.RETRACTIONS[config.options.retraction], n_steps,
        stop_level)
    inst = rank_chain.RankInst(arrays["L"], arrays["ident"], arrays["lam"], arrays["C"],
                               arrays["tnorm"], arrays["xi"], arrays["idx"])
    runs_ = rank_chain.RankRuns(states, m, b, chat, div, hit)
    rec = rank_chain.RankRecords(np.asarray(cp, dtype=np.int64), cp_m, cp_chat)
    # flat, through rank_chain.advance (a test patches it)
    rank_chain.advance(*join_flat(rank_chain.FLAT_ARGS, hyp, inst, runs_, rec))
    return cp_m, (cp_chat if config.options.joint_c else None), div, hit


def simulate_rank_reduced(config, instances=None) -> Trajectory:
    """Simulate a ``lora`` config on the rank-r chain; the same Trajectory as the full engine
    (float64 always)."""
    return run_to_end(start_rank_reduced(config, instances)).trajectory()


def start_rank_reduced(config, instances=None) -> RankRun:
    """:func:`simulate_rank_reduced`'s runs at step 0, to advance in segments
    (:mod:`.segments`)."""
    instances, linst, arrays = _setup(config, instances)
    states, m, b = _initial(config, linst)
    steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
    return RankRun(config, instances, linst, arrays, states, m, b, steps)


class RankRun(ChainRun):
    """The rank-r chain's runs between segments: per run the stream, M, B and Ĉ; records
    M (R, C, r, r) and Ĉ (R, C, k, r) when trained."""

    name = "rank-r"

    def __init__(self, config, instances, linst, arrays, states, m, b, steps):
        runs, r, k = config.runs, linst[0].rank, linst[0].k
        self.config, self.instances, self.linst, self.arrays = config, instances, linst, arrays
        self.m0 = hermite.signed_smallest(m)
        C = len(steps)
        joint = config.options.joint_c
        per_run = {"states": states, "m": m, "b": b, "chat": arrays["chat"].copy(),
                   "idx": arrays["idx"].copy()}
        records = {"m": np.full((runs, C, r, r), np.nan),
                   "chat": np.full((runs, C, k, r) if joint else (runs, 0, k, r), np.nan)}
        super().__init__(steps, per_run, records)

    def _kernel(self, state, rec, n_steps, cp, more):
        config, linst, arrays = self.config, self.linst, self.arrays
        n, k = state["m"].shape[0], linst[0].k
        code, hp = act_code(linst[0].activation.name)
        div, hit = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        hyp = rank_chain.make_rank_hyper(
            config.options.joint_c, code, hp, linst[0].d - k - 2 * linst[0].rank, config.eta,
            config.step_size_c, math.sqrt(config.label_noise),
            rank_chain.RETRACTIONS[config.options.retraction], n_steps, math.inf)
        inst = rank_chain.RankInst(arrays["L"], arrays["ident"], arrays["lam"], arrays["C"],
                                   arrays["tnorm"], arrays["xi"], state["idx"])
        runs_ = rank_chain.RankRuns(state["states"], state["m"], state["b"], state["chat"],
                                    div, hit)
        records = rank_chain.RankRecords(cp, rec["m"], rec["chat"])
        # flat, through rank_chain.advance (a test patches it)
        rank_chain.advance(*join_flat(rank_chain.FLAT_ARGS, hyp, inst, runs_, records))
        return div, hit

    def trajectory(self) -> Trajectory:
        config, instances, linst = self.config, self.instances, self.linst
        steps, rec = self.recorded()
        records = {"overlap_matrix": rec["m"]} | ({"c_hat": rec["chat"]}
                                                  if config.options.joint_c else {})
        result = RunResult(config, instances, steps, records, self.div.copy(), self.m0,
                           torch.device("cpu"), engine="reduced")
        problem = Problem.from_instances(instances, torch.device("cpu"), torch.float64)
        learner = LoRA(problem, linst, eta=config.eta, eta_c=config.step_size_c, project=True,
                       joint_c=config.options.joint_c, batch=1, label_noise=config.label_noise,
                       prox=config.options.prox, retraction=config.options.retraction)
        traj = learner.trajectory(result)
        traj.dtype = "float64"
        return traj


def first_passage_rank(config, level: float, max_steps: int | None = None) -> np.ndarray:
    """(R,) first step at which every singular value of M is ≥ ``level`` (all r directions
    recovered), NaN if not by ``max_steps``; each run stops at its hit."""
    _instances, linst, arrays = _setup(config)
    states, m, b = _initial(config, linst)
    start = np.linalg.svd(m, compute_uv=False).min(-1) >= level
    n = int(config.steps if max_steps is None else max_steps)
    _, _, _, hit = _advance(config, linst, arrays, states, m, b, np.zeros(0, np.int64), n,
                            float(level))
    return passage_steps(hit, start)

"""The network learners' exact chain (:mod:`.network_chain`) as an :class:`ExactChain`: support,
start, simulation and first passages of the alignment."""

from __future__ import annotations

import math
from dataclasses import replace

import numba
import numpy as np

from ..config import RunConfig
from ..sampling import run_seed
from ..trajectory import RunResult, Trajectory, checkpoint_steps
from .exact_chain import ExactChain
from .network_chain import (
    STOP_KINDS,
    NetRecords,
    NetRuns,
    advance_network,
    make_net_hyper,
    min_dimension,
    storage_width,
)
from .params import distinct

__all__ = ["NetworkChain", "ChainStart"]

ENGINE = "reduced"


class ChainStart:
    """A batch's start in the chain's coordinates (:mod:`.network_chain` (N6)).

    P (R, k′, t), Z (R, k′, storage), m (R,) columns of Z in use, λ̂ (R, k′), mask (R, k′)
    as 0/1 floats, V (I, k, t), ident (I,) (V = [I, 0]) and λ (I, k) per distinct
    instance, inst_idx (R,), t.
    ``learner``: the full engine's learner object of the batch (its records → trajectory).
    """

    def __init__(self, config: RunConfig, instances):
        from ..learners import get_learner
        from ..learners.problem import Problem

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
        width = self.learner.width
        self.storage = storage_width(width, config.batch)
        P, Z, lam_hat = self.learner.chain_start(config, self.instances, self.t, self.storage)
        self.P, self.Z, self.lam_hat = P, Z, lam_hat
        self.m = np.full(len(self.instances), min(width, Z.shape[2]), dtype=np.int64)
        self.mask = self.learner.mask.cpu().numpy().astype(np.float64)

    def alignment(self) -> np.ndarray:
        """(R,) the runs' alignment now (the learner's :meth:`alignment_of` its overlaps)."""
        cross = np.einsum("rkt,rjt->rkj", self.V[self.inst_idx], self.P)
        gram = np.einsum("rit,rjt->rij", self.P, self.P)
        for r, m in enumerate(self.m):
            gram[r] += self.Z[r, :, :m] @ self.Z[r, :, :m].T
        return self.learner.alignment_of(cross[:, None], gram[:, None], self.instances)[:, 0]


def _float64():
    import torch

    return torch.float64


def _act(activation) -> tuple[int, int, float] | None:
    """(code, p, scale) of the compiled σ (``network_kernel.kernel_activation``), or None."""
    from ..learners.network_kernel import kernel_activation

    return kernel_activation(activation)


class NetworkChain(ExactChain):
    """The exact chain of ``scratch``, ``scratch-csq`` and ``sparse`` (:mod:`.network_chain`):
    unit or free rows, fixed or trained λ̂, squared or correlation loss, any b, label noise,
    fine-tuned or committee teacher, random or given rows; numba on CPU, float64."""

    name = "network"

    def supported(self, config) -> tuple[bool, str]:
        from hermite.activations import get_activation

        inst = config.instance
        try:
            act = _act(get_activation(str(inst.get("activation"))))
        except (KeyError, ValueError):
            act = None
        if act is None:
            return False, (f"reduced engine: activation {inst.get('activation')!r} has no "
                           "compiled version for the network chain")
        from ..learners import get_learner

        k, d = int(inst["k"]), int(inst["d"])
        width = get_learner(config.learner).neurons(config, k)
        need = min_dimension(k + 1, width, config.batch)
        if d < need:
            return False, (f"reduced engine: the network chain needs d ≥ k + 1 + k′ + b = "
                           f"{need} (here d = {d}); the full engine is cheap there")
        return True, ""

    def _advance(self, start: ChainStart, steps, n_steps, *, stop_kind="none",
                 stop_level=math.inf, rest_dim=None):
        config, inst0 = start.config, start.instances[0]
        runs, k, width = len(start.instances), inst0.k, start.learner.width
        code, hp, scale = _act(inst0.activation)
        states = np.array([run_seed(config.seed, r, "data") for r in range(runs)],
                          dtype=np.uint64)
        run_state = NetRuns(states, start.P, start.Z, start.m, start.lam_hat, start.mask,
                            start.inst_idx, np.full(runs, -1, dtype=np.int64),
                            np.full(runs, -1, dtype=np.int64))
        C = len(steps)
        rec = NetRecords(np.asarray(steps, dtype=np.int64), np.empty((runs, C, k, width)),
                         np.empty((runs, C, width, width)), np.empty((runs, C, width)))
        learner = start.learner
        hyp = make_net_hyper(code, hp, scale, learner.loss_name == "correlation",
                             learner.free, learner.train_second_layer, config.eta,
                             config.step_size_c, math.sqrt(config.label_noise), config.batch,
                             inst0.d - start.t if rest_dim is None else rest_dim, n_steps,
                             STOP_KINDS[stop_kind], stop_level)
        with numba.parallel_chunksize(1):
            advance_network(hyp, start.V, start.ident, start.lam, run_state, rec)
        return run_state, rec

    def simulate(self, config, *, instances=None, backend=None, _chi2_dof=None) -> Trajectory:
        """The Trajectory of ``config``: the full engine's observables (the learner's own
        ``trajectory``) from the chain's records. ``_chi2_dof``: test hook, the rest
        dimension d − t replaced (a wrong χ² law)."""
        _check_backend(backend)
        instances = config.run_instances() if instances is None else instances
        start = ChainStart(config, instances)
        m0 = start.alignment()
        steps = checkpoint_steps(config.steps, config.checkpoints, config.spacing)
        runs, rec = self._advance(start, steps, int(steps[-1]), rest_dim=_chi2_dof)
        result = RunResult(replace(config, dtype="float64"), start.instances, np.asarray(steps),
                           {"cross": rec.cross, "gram": rec.gram, "lam_hat": rec.lam_hat},
                           runs.div_step.copy(), m0, "cpu", engine=ENGINE)
        return start.learner.trajectory(result)

    def first_passages(self, config, levels, max_steps=None, *, absolute=True,
                       backend=None) -> np.ndarray:
        """(L, R) first steps at which each run's alignment (the trajectory's ``overlap``)
        reaches each level, checked after every step; NaN if not by ``max_steps`` (default
        ``config.steps``); diverged runs never. ``absolute`` is moot (alignment ≥ 0 for the
        scratch learners; ``sparse``'s signed cos(vᵢ, ŵᵢ) is compared as it is)."""
        _check_backend(backend)
        instances = config.run_instances()
        n = int(config.steps if max_steps is None else max_steps)
        kind = "diagonal" if _learner(config).diagonal_alignment else "alignment"
        out = np.full((len(levels), config.runs), np.nan)
        for li, level in enumerate(levels):
            start = ChainStart(config, instances)
            m0 = start.alignment()
            runs, _ = self._advance(start, np.zeros(0, np.int64), n, stop_kind=kind,
                                    stop_level=float(level))
            hit = runs.hit_step.astype(float)
            hit[runs.hit_step < 0] = np.nan
            hit[m0 >= level] = 0.0
            out[li] = hit
        return out


def _learner(config):
    from ..learners import get_learner

    return get_learner(config.learner)


def _check_backend(backend) -> None:
    if backend not in (None, "numba"):
        raise ValueError(f"the network chain has only the numba backend, got {backend!r}")

"""Helpers of the exact-chain tests: runs of the rank-1 chain with ĉ trained jointly, without
the theory a Trajectory records (the tests that compare theory with many runs compute their
own), and the two-sample KS p-values of two engines' trajectories."""

from __future__ import annotations

import numpy as np
from scipy import stats

from dynamics.setup.config import RunConfig


def rank_one_chain(cfg: RunConfig, mu0=None):
    """(checkpoint steps, records, μ₀ (R,), m₀ (R,), the packed params, instances) of ``cfg``'s
    runs on
    the rank-1 exact chain, no theory; from the learner's initial law or, with ``mu0`` (R,),
    all from μ₀ (p = 0, ν = √(1 − μ₀²), the instance's ĉ; m₀ is then the law's draw)."""
    from dynamics.reduced.params import pack_instances
    from dynamics.reduced.simulate import RankOneSetup, _choose_backend, _initial_state, _run
    from dynamics.runtime.trajectory import checkpoint_steps

    inst = cfg.run_instances()
    params = pack_instances(inst)
    backend, device = _choose_backend(cfg, None, inst[0].activation.name)
    steps = checkpoint_steps(cfg.steps, cfg.checkpoints, cfg.spacing)
    states, mu, nu, m0 = _initial_state(cfg, params, inst)
    if mu0 is not None:
        mu[:], nu[:] = mu0, np.sqrt(1.0 - mu0 * mu0)
    start = mu.copy()
    setup = RankOneSetup(cfg, params, inst, backend, device)
    rec, _, _ = _run(setup, setup.runs(states, mu, nu), steps, int(steps[-1]))
    return steps, rec, start, m0, params, inst


def joint_chain_runs(act, d, k, eta_d, runs=1024):
    """(steps, m (R, C), cos(ĉ, c) (R, C), instance, m₀, η) of exact-chain runs, no theory."""
    spec = dict(activation=act, k=k, d=d, xi=1.0, c="gaussian", c_hat="gaussian", seed=1)
    cfg = RunConfig(instance=spec, eta=eta_d / d, steps=int(6 * d / eta_d), runs=runs, seed=3,
                    checkpoints=13, spacing="linear", engine="reduced", joint_c=True,
                    init="aligned").validate()
    steps, rec, _, m0, _, inst = rank_one_chain(cfg)
    c = inst[0].c
    cos = rec["chat"] @ c / np.linalg.norm(rec["chat"], axis=-1) / np.linalg.norm(c)
    return steps, rec["m"], cos, inst[0], m0, cfg.eta


def ks_pvalues(a, b, quantities, first=0) -> dict:
    """(quantity, checkpoint step) → two-sample KS p-value between Trajectories ``a`` and
    ``b`` (same checkpoints) of each ``quantities[name](trajectory)`` (R, C), at the
    checkpoints from index ``first`` on; non-finite values left out."""
    out = {}
    for name, get in quantities.items():
        x, y = get(a), get(b)
        for c in range(first, x.shape[1]):
            xs, ys = x[:, c][np.isfinite(x[:, c])], y[:, c][np.isfinite(y[:, c])]
            out[name, int(a.steps[c])] = stats.ks_2samp(xs, ys).pvalue
    return out

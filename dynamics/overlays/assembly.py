"""The Trajectory of rank-1 (û, ĉ) runs (``finetune``), from either engine's records.

Both the full engine (``Finetune.trajectory``) and the reduced rank-1 chain
(``dynamics.reduced.simulate``) hand their checkpoint records to :func:`rank_one_trajectory`,
so the two report the same observables: loss (:mod:`dynamics.measures.losses`), theory curves
(:mod:`dynamics.overlays.finetune`, from each run's start: its records at step 0) and, with
``config.options.refit``, the refit losses (:mod:`dynamics.measures.refit`, App. F.2).
"""

from __future__ import annotations

import numpy as np

from dynamics.measures.losses import (
    LOSS_EXACT,
    coordinate_loss,
    exact_loss,
    loss_kind,
    monte_carlo_loss,
    overlap_suffices,
)
from dynamics.measures.observables import c_overlap
from dynamics.measures.refit import refit_records
from dynamics.overlays.finetune import theory_records
from dynamics.runtime.trajectory import RunResult, Trajectory, make_trajectory, mask_dead

__all__ = ["rank_one_trajectory"]


def rank_one_trajectory(result: RunResult) -> Trajectory:
    """The Trajectory of rank-1 runs from their records.

    ``result.records``: ``overlap`` (R, C); ``c_hat`` (R, C, k) when ĉ is trained (else absent
    or None); ``coords`` (R, C, k+2) of û in span(W) ⊕ e ⊕ rest, needed for the loss of every
    state but the projected unit-row one and for ``config.options.refit``
    (:func:`~dynamics.measures.losses.needs_coordinates`). Records from the step a run diverged on
    are NaN; the loss follows :func:`~dynamics.measures.losses.exact_loss` (projected, unit rows:
    from
    m), :func:`~dynamics.measures.losses.coordinate_loss` (any other state with a Gaussian pair
    kernel)
    or :func:`~dynamics.measures.losses.monte_carlo_loss` (none:
    :func:`~dynamics.measures.losses.loss_kind`),
    the theory curves :func:`~dynamics.overlays.finetune.theory_records` from the records at
    step 0 (not masked; with joint ĉ also ``extra/ode_c_overlap``); with
    ``config.options.refit``, ``extra`` holds :func:`~dynamics.measures.refit.refit_records`.
    """
    config, instances, rec = result.config, result.instances, result.records
    overlap = mask_dead(result, np.asarray(rec["overlap"]))
    c_hats, coords = rec.get("c_hat"), rec.get("coords")
    c_ov = None
    if c_hats is not None:
        c_hats = mask_dead(result, c_hats)
        c_ov = c_overlap(c_hats, np.stack([i.c for i in instances])[:, None, :])
    kind = loss_kind(config)
    if kind == LOSS_EXACT and overlap_suffices(config):
        loss = exact_loss(instances, overlap, c_hats)
    else:
        coords = mask_dead(result, coords)
        ch = c_hats if c_hats is not None else np.stack([i.c_hat for i in instances])
        if kind == LOSS_EXACT:
            loss = coordinate_loss(instances, coords, ch, eta=config.eta)
        else:
            loss = monte_carlo_loss(instances, coords, ch, seed=config.seed,
                                    size=config.eval_size)
    extra = refit_records(config, instances, coords, result.dead) if config.options.refit else {}
    theory = theory_records(config, instances, result.m0, result.steps, _start(rec, result))
    extra |= theory.pop("extra", {})
    attrs = theory.pop("extra_attrs", {})
    return make_trajectory(result, overlap, loss, loss_kind=kind, c_overlap=c_ov, extra=extra,
                           theory=theory, extra_attrs=attrs)


def _start(rec: dict, result: RunResult) -> dict:
    """The runs' records at step 0 (the first checkpoint, which every engine records before
    its first step): û's reduced coordinates and ĉ where they are kept, else None (the
    theory then takes p₀ = 0, μ₀ = m₀/u_perp and the instances' ĉ: the learner's start)."""
    if result.steps.size == 0 or result.steps[0] != 0:
        return {}
    out = {}
    for name in ("coords", "c_hat"):
        arr = rec.get(name)
        if arr is not None and np.ndim(arr) >= 2 and np.shape(arr)[1] > 0:
            out[name] = np.asarray(arr)[:, 0]
    return out

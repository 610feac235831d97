"""Claim 2 (issue 4 acceptance): fine-tuning vs learning the same teacher from scratch.

Instance: He₃, k = 4, d = 200, ξ = 1, W = ``claim2`` (teacher neurons orthonormal, App. C.3),
seed 0, with the student's frozen ĉ = c (``c_hat: teacher``; the spec's default quantized ĉ
is a different sign pattern, for which the loss *rises* with the overlap).

1. ``finetune`` (projected, ĉ frozen, η = c/d, exact reduced chain) for each c of a grid;
   T_ft(c) = median over runs of the first checkpoint with ⟨û, u⟩ ≥ 0.9. The best c (smallest
   T_ft with every run reaching 0.9) is the reference; L* = Φ(0.9), the exact population
   loss fine-tuning has when its overlap is 0.9 (it is a function of m alone here).
2. ``scratch`` (squared loss) and ``scratch-csq`` (correlation loss): k′ = k random unit rows,
   λ̂ = λ fixed, η = c/d, B steps; per run the first checkpoint with exact loss ≤ L*.

Prints, per learner, η·d, the fraction of runs that reached the target, the median and the
10–90% range of the steps (``> B`` where the quantile lies among runs that never got there),
the ratio median/T_ft, and at step B the median loss, median alignment (mean over teacher
neurons of the best |⟨vᵢ, ŵⱼ⟩|) and the fraction of runs whose k teacher neurons are best
matched by k distinct rows (else the loss cannot reach 0: the CSQ rows do not repel).

Theory (issue 17, part 4, "Claim 2 from theory"; docs/theory/committee.md):

* fine-tuning: per run, the population ODE dm/dt = η h(m)(u⊥² − m²) from the run's own m₀
  (``hermite.steps_to_reach``, d → ∞) and the finite-d noise-corrected map
  (``hermite.corrected_steps_to_reach``), first passage of 0.9, medians beside SGD's T_ft;
* from scratch: per run, the committee-machine ODE (``hermite.committee``, unit rows) from the
  run's own initial overlaps (Q₀, R₀, λ̂₀ — the very rows the SGD run starts from), integrated
  with an event on ε(α) = L* (``hermite.committee.committee_first_passage``) up to α_max =
  ``--ode-steps``/d, far beyond the SGD budget. A run whose ODE stops at a *linearly stable
  fixed point* with ε > L* (``hermite.committee.stable_fixed_point``: a Newton step < 1e-6 to
  a zero of the drift whose Jacobian has only eigenvalues with negative real part) never gets
  there: ``stuck``; one that ends at α_max at a non-hyperbolic rest point (a row or a teacher neuron left at R ≈ 0, where
  the He₃ drift is quadratic) is ``stalled``. Also the ODE's *escape* step, where some
  |R_km| first reaches 0.5 (the end of the initial plateau: the quantity whose scaling in d is
  the plateau law).
* ``--d 100 200 400`` repeats everything per d and prints one table over d; ``--theory-only``
  skips the from-scratch SGD (fine-tuning's reduced chain is kept: it is cheap).

ODE orders (``--order``, default ``1 auto``): order 1 drops the η̄² terms, order 2 (what
``plan_order`` picks here: closed-form He₃ integrals) keeps them. They do *not* barely differ:
at the plateau the first-order drift of a pair grows like 3γη̄R² (γ = 2 squared, 1 CSQ; for
K = M = 1 exactly dR/dα = 3γη̄(R² − R⁴), tested) while the η̄² terms add −(η̄²/2)S_kk R, so
R shrinks below R* ≈ η̄ S_kk/(6γ). He₃'s δ is heavy-tailed: at the d = 200 runs' initial rows
the median S_kk is 460 (squared: R* ≈ 0.19 at η̄ = 0.005) and 12.8 (CSQ: R* ≈ 0.021 at
η̄ = 0.01), against a median max_km |R₀| of 0.15 — and the order-2 ODE of ``scratch`` left
the plateau in none of the runs integrated (4 per d, d = 100…1600). The ODE follows the
*mean* of R; in SGD the same noise also diffuses R (isotropic kicks leave the uniform law on
the sphere invariant), which is presumably why SGD still escapes (not measured beyond the
escape steps in the tables). Cost: order 2 ≈ 13 ms per drift evaluation at K = M = 4
(≈ 26 ms without :func:`_malloc_tuned`) against ≈ 0.6 ms; LSODA took 311–1363 evaluations
per order-2 run and 582 to over 4000 per order-1 run at d = 200, and one order-2 run at
d = 100 took 20 077 — hence the caps (``--max-evals``: 4000 at order 2, 30 000 at order 1,
end ``cap``) and, by default, order 1 on all runs and order 2 on the first 4.

Usage: ``python benchmarks/claim2_scratch.py [--runs 16 --budget 300000 ...]``;
``python benchmarks/claim2_scratch.py --theory-only --d 100 200 400 800 1600``.

Measured (2 shared CPU cores; docs/theory/committee.md, "Claim 2 from theory", discusses them).
``python benchmarks/claim2_scratch.py`` (2 min 12 s wall), its table over d::

        d      learner      c ord SGD rch   SGD med   SGD esc SGD L_B   n ODE rch stuck stall  cap   ODE med   ODE 10%   ODE 90%   ODE esc ODE L_B SGD/Tft ODE/Tft ODE/Tth
      200     finetune   0.05   0    1.00      2711         -       -  16    1.00  0.00  0.00 0.00      1480      1404      1625         -       -     1.0     0.5     0.5
      200 ft-corrected   0.05   0    1.00      2711         -       -  16    1.00  0.00  0.00 0.00      3002      2919      3143         -       -     1.0     1.1     1.0
      200      scratch  0.005   1    0.06       inf    136728   2.364  16    0.06  0.69  0.25 0.00       inf       inf       inf     60213   2.000     inf     inf     inf
      200      scratch  0.005   2    0.06       inf    136728   2.364   4    0.00  1.00  0.00 0.00       inf       inf       inf       inf   8.000     inf     inf     inf
      200  scratch-csq   0.01   1    0.00       inf     48080   3.741  16    0.12  0.62  0.25 0.00       inf    309926       inf     46527   2.000     inf     inf     inf
      200  scratch-csq   0.01   2    0.00       inf     48080   3.741   4    0.00  1.00  0.00 0.00       inf       inf       inf     38629   4.494     inf     inf     inf

``python benchmarks/claim2_scratch.py --theory-only --d 100 200 400 800 1600`` (7 min 50 s)::

        d      learner      c ord SGD rch   SGD med   SGD esc SGD L_B   n ODE rch stuck stall  cap   ODE med   ODE 10%   ODE 90%   ODE esc ODE L_B SGD/Tft ODE/Tft ODE/Tth
      100     finetune   0.05   0    1.00      1191         -       -  16    1.00  0.00  0.00 0.00       738       687       846         -       -     1.0     0.6     0.5
      100 ft-corrected   0.05   0    1.00      1191         -       -  16    1.00  0.00  0.00 0.00      1425      1367      1529         -       -     1.0     1.2     1.0
      100      scratch  0.005   1       -         -         -       -  16    0.31  0.44  0.19 0.00       inf    681003       inf     13743   1.549       -     inf     inf
      100      scratch  0.005   2       -         -         -       -   4    0.00  0.75  0.00 0.25       inf       inf       inf       inf   8.000       -     inf     inf
      100  scratch-csq   0.01   1       -         -         -       -  16    0.12  0.50  0.38 0.00       inf    484972       inf     13819   4.000       -     inf     inf
      100  scratch-csq   0.01   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf     15547   5.280       -     inf     inf
      200     finetune   0.05   0    1.00      2711         -       -  16    1.00  0.00  0.00 0.00      1480      1404      1625         -       -     1.0     0.5     0.5
      200 ft-corrected   0.05   0    1.00      2711         -       -  16    1.00  0.00  0.00 0.00      3002      2919      3143         -       -     1.0     1.1     1.0
      200      scratch  0.005   1       -         -         -       -  16    0.06  0.69  0.25 0.00       inf       inf       inf     60213   2.000       -     inf     inf
      200      scratch  0.005   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf       inf   8.000       -     inf     inf
      200  scratch-csq   0.01   1       -         -         -       -  16    0.12  0.62  0.25 0.00       inf    309926       inf     46527   2.000       -     inf     inf
      200  scratch-csq   0.01   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf     38629   4.494       -     inf     inf
      400     finetune   0.05   0    1.00      6023         -       -  16    1.00  0.00  0.00 0.00      2964      2862      3162         -       -     1.0     0.5     0.5
      400 ft-corrected   0.05   0    1.00      6023         -       -  16    1.00  0.00  0.00 0.00      6224      6116      6416         -       -     1.0     1.0     1.0
      400      scratch  0.005   1       -         -         -       -  16    0.38  0.31  0.25 0.00       inf    969609       inf    122912   3.543       -     inf     inf
      400      scratch  0.005   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf       inf   8.000       -     inf     inf
      400  scratch-csq   0.01   1       -         -         -       -  16    0.00  0.81  0.19 0.00       inf       inf       inf    121373   4.000       -     inf     inf
      400  scratch-csq   0.01   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf    130554   5.635       -     inf     inf
      800     finetune   0.05   0    1.00     11926         -       -  16    1.00  0.00  0.00 0.00      5936      5791      6208         -       -     1.0     0.5     0.5
      800 ft-corrected   0.05   0    1.00     11926         -       -  16    1.00  0.00  0.00 0.00     12738     12587     13003         -       -     1.0     1.1     1.0
      800      scratch  0.005   1       -         -         -       -  16    0.25  0.19  0.56 0.00       inf   6413723       inf    393367   7.715       -     inf     inf
      800      scratch  0.005   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf       inf   8.000       -     inf     inf
      800  scratch-csq   0.01   1       -         -         -       -  16    0.00  0.69  0.31 0.00       inf       inf       inf    358069   7.962       -     inf     inf
      800  scratch-csq   0.01   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf    369933   7.964       -     inf     inf
     1600     finetune   0.05   0    1.00     26573         -       -  16    1.00  0.00  0.00 0.00     11881     11680     12263         -       -     1.0     0.4     0.5
     1600 ft-corrected   0.05   0    1.00     26573         -       -  16    1.00  0.00  0.00 0.00     25828     25622     26202         -       -     1.0     1.0     1.0
     1600      scratch  0.005   1       -         -         -       -  16    0.44  0.19  0.38 0.00       inf   4843966       inf   1269964   7.999       -     inf     inf
     1600      scratch  0.005   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf       inf   8.000       -     inf     inf
     1600  scratch-csq   0.01   1       -         -         -       -  16    0.12  0.56  0.31 0.00       inf   4148735       inf   1207923   7.999       -     inf     inf
     1600  scratch-csq   0.01   2       -         -         -       -   4    0.00  1.00  0.00 0.00       inf       inf       inf   1288509   8.000       -     inf     inf
        finetune ord 0 ODE first passage: median ∝ d^1.00 (log-log least squares over the d with a finite median)
        finetune ord 0 SGD first passage: median ∝ d^1.11 (log-log least squares over the d with a finite median)
    ft-corrected ord 0 ODE first passage: median ∝ d^1.04 (log-log least squares over the d with a finite median)
    ft-corrected ord 0 SGD first passage: median ∝ d^1.11 (log-log least squares over the d with a finite median)
         scratch ord 1 ODE escape: median ∝ d^1.58 (log-log least squares over the d with a finite median)
     scratch-csq ord 1 ODE escape: median ∝ d^1.58 (log-log least squares over the d with a finite median)
     scratch-csq ord 2 ODE escape: median ∝ d^1.60 (log-log least squares over the d with a finite median)

Reading: fine-tuning's noise-corrected map gives SGD's T_ft within 20% at every d (3% at
d = 400 and 1600), the population ODE 0.4–0.6 of it. No committee-ODE median reaches L* at
any d: order 1 reaches it in 6–44% (scratch) and 0–12% (CSQ) of the runs, the others end at
a stable spurious fixed point (``stuck``: rows sharing a teacher neuron, a neuron unlearned)
or a non-hyperbolic rest point (``stalled``); order 2 in none. So the ODE-predicted ratio to
T_ft is ∞, as SGD's is > 111 within B at d = 200 (1 of 16 runs, 0 for CSQ). The order-1
escape grows as d^1.58 (both losses) — the information-exponent-3 plateau, α ∝ 1/(η̄R₀) ∝ √d,
i.e. steps ∝ d^1.5, not d·log d — and at d = 200 comes 2.3× earlier than SGD's (60213 vs
136728 steps; CSQ 46527 vs 48080).
"""

# ruff: noqa: E501  (the measured tables above are wider than a line)
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import hermite
from dynamics.engines.engine import FullRun, simulate
from dynamics.instances.instance import build_instance
from dynamics.learners.directions import initial_directions
from dynamics.overlays.committee import ODE_EVALS, committee_model, committee_state, plan_order
from dynamics.setup.config import RunConfig
from hermite.committee import (
    ESCAPE_OVERLAP,
    FirstPassage,
    PassageSettings,
    committee_first_passage,
)

LOSS_OF = {"scratch": "squared", "scratch-csq": "correlation"}


def first_hit(steps: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """Per run, the first checkpoint step where ``hit`` (R, C) holds; inf if never."""
    out = steps[np.argmax(hit, axis=1)].astype(float)
    out[~hit.any(axis=1)] = np.inf
    return out


def quantiles(t: np.ndarray) -> tuple[float, float, float]:
    """10%, 50%, 90% (inverted CDF: actual run values, inf for runs that never hit)."""
    q = np.quantile(t, [0.1, 0.5, 0.9], method="inverted_cdf")
    return float(q[0]), float(q[1]), float(q[2])


def fmt(t: float, budget: int | float | None) -> str:
    """A step count; ``> budget`` for inf (``never`` without a budget)."""
    if np.isfinite(t):
        return f"{t:.0f}"
    return "never" if budget is None else f"> {budget:.3g}" if budget >= 1e6 else f"> {budget}"


def spec_for(k: int, d: int) -> dict:
    return {"activation": "he3", "k": k, "d": d, "xi": 1.0, "W": "claim2", "seed": 0,
            "c_hat": "teacher"}


def target_loss(inst, level: float = 0.9) -> float:
    """L* = Φ(level): fine-tuning's exact population loss at overlap ``level``."""
    return float(np.ravel(hermite.population_loss(inst, np.array([level])))[0])


# ------------------------------------------------------------------ committee ODE, first passage
def initial_overlaps(spec: dict, learner: str, c: float, runs: int, seed: int):
    """(instances, cross (R, k, k′), Gram (R, k′, k′), λ̂ (R, k′)) of the SGD runs' initial rows
    (the engine's own initialisation, nothing advanced)."""
    d = spec["d"]
    run = FullRun(RunConfig(instance=spec, learner=learner, eta=c / d, steps=1, runs=runs,
                            seed=seed, checkpoints=2, spacing="linear",
                            finite_d_theory=False).validate())
    obs = run.learner.observe(run.state)
    return run.instances, obs["cross"], obs["gram"], obs["lam_hat"]


def scratch_ode(spec: dict, learner: str, c: float, runs: int, seed: int, level: float, *,
                alpha_max: float, order: int = 2, probe_steps: float | None = None,
                max_evals: int | None = None) -> list[FirstPassage]:
    """Per run, :func:`hermite.committee.committee_first_passage` of ``learner`` (η = c/d) from its initial rows (the
    first ``runs`` runs: each run's rows come from its own seed, whatever the run count)."""
    instances, cross, gram, lam = initial_overlaps(spec, learner, c, runs, seed)
    d = spec["d"]
    out = []
    for r, inst in enumerate(instances):
        model = committee_model(inst, loss=LOSS_OF[learner], eta=c / d,
                                second_order=order == 2)
        state = committee_state(cross[r], gram[r], lam[r])
        out.append(committee_first_passage(model, state, level, d, PassageSettings(
            alpha_max, alpha_probe=None if probe_steps is None else probe_steps / d,
            max_evals=max_evals)))
    return out


def finetune_theory(spec: dict, c: float, runs: int, seed: int, level: float = 0.9,
                    corrected: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per run (m₀ of the SGD runs), the steps to overlap ``level``: the population ODE
    (continuous, d → ∞) and the noise-corrected finite-d map (NaN if not ``corrected``)."""
    d = spec["d"]
    cfg = RunConfig(instance=spec, learner="finetune", eta=c / d, steps=1, runs=runs,
                    seed=seed).validate()
    instances = cfg.run_instances()
    _, m0 = initial_directions(cfg, instances)
    inst = instances[0]
    pop = np.array([hermite.steps_to_reach(inst, c / d, m, level) for m in m0])
    cor = (np.asarray(hermite.corrected_steps_to_reach(inst, c / d, d, level, m0), float)
           if corrected else np.full(m0.size, np.nan))
    return pop, cor


# ------------------------------------------------------------------ one d
def finetune_part(spec, args, *, verbose: bool) -> dict:
    """SGD (reduced chain) and theory over the c grid; the reference c and T_ft's."""
    d = spec["d"]
    rows, best = [], None
    for c in args.ft_c:
        t0 = time.time()
        steps = max(2000, int(5 * d / c))  # T_ft ≈ (0.4 to 0.8)·d/c below the noise floor
        tr = simulate(RunConfig(instance=spec, learner="finetune", eta=c / d, steps=steps,
                                runs=args.runs, seed=args.seed, checkpoints=2000,
                                spacing="linear", engine="auto", finite_d_theory=False))
        t = first_hit(tr.steps, tr.overlap >= 0.9)
        pop, cor = finetune_theory(spec, c, args.runs, args.seed,
                                   corrected=not args.no_corrected)
        row = {"c": c, "steps": steps, "t": t, "pop": pop, "cor": cor, "sec": time.time() - t0}
        rows.append(row)
        lo, med, hi = quantiles(t)
        frac = float(np.isfinite(t).mean())
        if verbose:
            cmed = fmt(quantiles(cor)[1], None) if not args.no_corrected else "-"
            print(f"{c:8.3g} {frac:8.2f} {fmt(med, steps):>8} {fmt(lo, steps):>8} "
                  f"{fmt(hi, steps):>8} {quantiles(pop)[1]:9.0f} {cmed:>9} "
                  f"{np.isfinite(cor).mean():6.2f} {row['sec']:6.1f}")
        if frac == 1.0 and (best is None or med < best["t_ft"]):
            best = {"c": c, "t_ft": med, "row": row}
    if best is None:
        raise SystemExit(f"d = {d}: no fine-tuning step size reached overlap 0.9 in every run")
    row = best["row"]
    best["rows"] = rows
    best["t_pop"] = quantiles(row["pop"])[1]
    best["t_cor"] = quantiles(row["cor"])[1] if not args.no_corrected else math.nan
    # the corrected map's own choice of c (smallest median with every run reaching 0.9)
    ok = [r for r in rows if np.all(np.isfinite(r["cor"]))]
    if ok:
        rc = min(ok, key=lambda r: quantiles(r["cor"])[1])
        best["c_cor"], best["t_cor_best"] = rc["c"], quantiles(rc["cor"])[1]
    else:
        best["c_cor"], best["t_cor_best"] = math.nan, math.inf
    return best


def sgd_scratch(spec, learner, c, args, l_star) -> dict:
    """The from-scratch SGD runs (full engine, no ODE overlay): per run the first passage of
    L*, the escape step (first checkpoint with some |⟨vᵢ, ŵⱼ⟩| ≥ ``ESCAPE_OVERLAP``), the loss
    at B; medians of loss and alignment at B, the distinct-rows fraction."""
    d, t0 = spec["d"], time.time()
    run = FullRun(RunConfig(instance=spec, learner=learner, eta=c / d, steps=args.budget,
                            runs=args.runs, seed=args.seed, checkpoints=args.checkpoints,
                            spacing="linear", finite_d_theory=False).validate())
    tr = run.run()
    cross = run.records.arrays()["cross"]  # (R, C, k, k′)
    best_row = np.abs(run.learner.observe(run.state)["cross"]).argmax(-1)  # (R, k)
    return {"hit": first_hit(tr.steps, tr.loss <= l_star),
            "escape": first_hit(tr.steps, np.abs(cross).max((-1, -2)) >= ESCAPE_OVERLAP),
            "loss_B_runs": tr.loss[:, -1], "loss_B": float(np.nanmedian(tr.loss[:, -1])),
            "align_B": float(np.nanmedian(tr.overlap[:, -1])),
            "distinct": float(np.mean([len(set(b)) == len(b) for b in best_row])),
            "diverged": int(tr.diverged.sum()), "sec": time.time() - t0}


def ode_scratch(spec, learner, c, args, l_star, order: int, runs: int,
                max_evals: int | None = None) -> dict:
    """:func:`scratch_ode` of the first ``runs`` runs, summarised."""
    t0 = time.time()
    hits = scratch_ode(spec, learner, c, runs, args.seed, l_star,
                       alpha_max=args.ode_steps / spec["d"], order=order,
                       probe_steps=args.budget, max_evals=max_evals)
    return {"order": order, "runs": runs, "hits": hits,
            "hit": np.array([h.step for h in hits]),
            "escape": np.array([h.escape for h in hits]),
            "stuck": float(np.mean([h.end == "stuck" for h in hits])),
            "stalled": float(np.mean([h.end == "stalled" for h in hits])),
            "cap": float(np.mean([h.end == "cap" for h in hits])),
            "loss_end": _median_finite([h.loss_end for h in hits]),
            "loss_B": _median_finite([h.loss_probe for h in hits]),
            "sec": time.time() - t0}


def _median_finite(x) -> float:
    """Median of the finite values (NaN if none): a loss at B is NaN where the ODE stopped
    short of B."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else math.nan


def ratio(x: float, t: float, cap: float | None = None) -> str:
    if np.isfinite(x):
        return f"{x / t:.1f}"
    return "inf" if cap is None else f"> {cap / t:.0f}"


def one_d(d: int, args, *, verbose: bool) -> dict:
    """Fine-tuning (SGD + theory) and the from-scratch learners (SGD unless ``theory_only``,
    committee ODE for each order of ``args.orders``) at one d."""
    spec = spec_for(args.k, d)
    inst = build_instance(spec)
    if verbose:
        print(f"\ninstance {spec}; runs {args.runs}, seed {args.seed}, float64, cpu")
        print("\nfinetune (projected, ĉ = c frozen, reduced engine): steps to overlap 0.9; "
              "theory per run from its m₀: population ODE (d → ∞) and the noise-corrected map")
        print(f"{'c = η·d':>8} {'reached':>8} {'median':>8} {'10%':>8} {'90%':>8} "
              f"{'pop ODE':>9} {'corrected':>9} {'c-reach':>6} {'sec':>6}")
    ft = finetune_part(spec, args, verbose=verbose)
    l_star, l_zero = target_loss(inst), target_loss(inst, 0.0)
    if verbose:
        print(f"reference: c = {ft['c']:g}, T_ft = {ft['t_ft']:.0f} steps (T_ft/d = "
              f"{ft['t_ft'] / d:.1f}); population ODE {ft['t_pop']:.0f}, corrected map "
              f"{fmt(ft['t_cor'], None)} at that c; the corrected map's own best: c = "
              f"{ft['c_cor']:g}, {fmt(ft['t_cor_best'], None)} steps; L* = Φ(0.9) = "
              f"{l_star:.4f} (Φ(0) = {l_zero:.4f})")
    res = {"d": d, "ft": ft, "l_star": l_star, "scratch": []}
    cap, B = args.ode_steps, args.budget
    for learner, cs in (("scratch", args.scratch_c), ("scratch-csq", args.csq_c)):
        for c in cs:
            sgd = None if args.theory_only else sgd_scratch(spec, learner, c, args, l_star)
            odes = [ode_scratch(spec, learner, c, args, l_star, o, n, m) for o, n, m in
                    zip(args.orders, args.ode_runs_list, args.max_evals_list, strict=True)]
            res["scratch"].append({"learner": learner, "c": c, "sgd": sgd, "odes": odes})
    if not verbose:
        return res
    print(f"\nfrom scratch (k′ = k, λ̂ = λ fixed, budget B = {B}): steps to loss ≤ L*; escape "
          f"= first step with some |cosine(teacher row, student row)| ≥ {ESCAPE_OVERLAP}")
    if not args.theory_only:
        print(f"SGD ({args.runs} runs): reached, median, 10%, 90%, median/T_ft; at B: median "
              "loss, alignment, fraction of runs with distinct best rows; median escape")
        print(f"{'learner':>12} {'c':>6} {'reached':>7} {'median':>9} {'10%':>9} {'90%':>9} "
              f"{'/T_ft':>6} {'L_B':>6} {'align':>6} {'dist':>5} {'escape':>8} {'sec':>5}")
        for e in res["scratch"]:
            g = e["sgd"]
            lo, med, hi = quantiles(g["hit"])
            print(f"{e['learner']:>12} {e['c']:6.3g} {np.isfinite(g['hit']).mean():7.2f} "
                  f"{fmt(med, B):>9} {fmt(lo, B):>9} {fmt(hi, B):>9} "
                  f"{ratio(med, ft['t_ft'], B):>6} {g['loss_B']:6.3f} {g['align_B']:6.3f} "
                  f"{g['distinct']:5.2f} {fmt(quantiles(g['escape'])[1], B):>8} "
                  f"{g['sec']:5.0f}")
            if g["diverged"]:
                print(f"{'':>12} ({g['diverged']} runs diverged)")
    print(f"committee ODE per run from its initial rows, up to {cap:.3g} steps: reached, "
          "stuck (stable fixed point above L*), stalled (non-hyperbolic rest point), cap (cut "
          "at the evaluation budget), median, "
          "10%, 90%, median/T_ft, median loss at B, median escape, median loss where it "
          "stopped")
    print(f"{'learner':>12} {'c':>6} {'order':>5} {'runs':>4} {'reached':>7} {'stuck':>5} "
          f"{'stall':>5} {'cap':>4} {'median':>9} {'10%':>9} {'90%':>9} {'/T_ft':>6} {'L_B':>6} "
          f"{'escape':>9} {'L_end':>6} {'sec':>5}")
    for e in res["scratch"]:
        for o in e["odes"]:
            lo, med, hi = quantiles(o["hit"])
            print(f"{e['learner']:>12} {e['c']:6.3g} {o['order']:5d} {o['runs']:4d} "
                  f"{np.isfinite(o['hit']).mean():7.2f} {o['stuck']:5.2f} {o['stalled']:5.2f} "
                  f"{o['cap']:4.2f} "
                  f"{fmt(med, cap):>9} {fmt(lo, cap):>9} {fmt(hi, cap):>9} "
                  f"{ratio(med, ft['t_ft'], cap):>6} {o['loss_B']:6.3f} "
                  f"{fmt(quantiles(o['escape'])[1], cap):>9} {o['loss_end']:6.3f} "
                  f"{o['sec']:5.0f}")
    if args.per_run:
        print("per run: SGD first passage, escape, loss at B | ODE (each order) first "
              "passage, escape, loss at B, loss and α·d where it stopped, how it ended")
        for e in res["scratch"]:
            for r in range(max([o["runs"] for o in e["odes"]] + [0])):
                parts = []
                if e["sgd"] is not None:
                    g = e["sgd"]
                    parts.append(f"SGD {fmt(g['hit'][r], B):>9} {fmt(g['escape'][r], B):>9} "
                                 f"{g['loss_B_runs'][r]:6.3f}")
                for o in e["odes"]:
                    if r < o["runs"]:
                        h = o["hits"][r]
                        parts.append(f"o{o['order']} {fmt(h.step, cap):>9} "
                                     f"{fmt(h.escape, cap):>9} {h.loss_probe:6.3f} "
                                     f"{h.loss_end:6.3f}@{h.alpha_end * d:.3g} {h.end}")
                print(f"{e['learner']:>12} run {r:2d}: " + " | ".join(parts))
    return res


def table_rows(results: list[dict]) -> list[dict]:
    """One row per (d, learner, ODE order): the table over d (also what the tests read).

    ``finetune``: c = SGD's best, ODE columns = the population ODE (d → ∞) at that c;
    ``ft-corrected``: c = the noise-corrected map's own best c of the grid (smallest median
    with every run reaching 0.9), SGD columns = SGD at that c, ODE columns = the corrected
    map (absent with ``--no-corrected``); scratch learners: SGD (NaN with ``--theory-only``)
    and the committee ODE of the row's order. Ratios: ``sgd_ratio``, ``ode_ratio`` = the
    row's SGD / ODE median over T_ft (SGD, finetune row); ``theory_ratio`` = its ODE median
    over T_th, the ft-corrected row's ODE median (the population ODE's at SGD's c with
    ``--no-corrected``). Medians are inverted-CDF medians (inf: more than half never)."""
    rows = []
    for res in results:
        ft, d = res["ft"], res["d"]
        t_ft = ft["t_ft"]

        def theory(x, row):
            lo, med, hi = quantiles(x)
            row.update(ode_runs=len(x), ode_reached=float(np.isfinite(x).mean()),
                       ode_median=med, ode_q10=lo, ode_q90=hi)
            return row

        none = {"order": 0, "sgd_escape": math.nan, "sgd_loss_B": math.nan, "ode_stuck": 0.0,
                "ode_stalled": 0.0, "ode_cap": 0.0, "escape_median": math.nan,
                "ode_loss_B": math.nan}
        group = [theory(ft["row"]["pop"], {
            "d": d, "learner": "finetune", "c": ft["c"],
            "sgd_reached": float(np.isfinite(ft["row"]["t"]).mean()), "sgd_median": t_ft,
            **none})]
        for rc in (r for r in ft["rows"] if r["c"] == ft["c_cor"]):
            group.append(theory(rc["cor"], {
                "d": d, "learner": "ft-corrected", "c": rc["c"],
                "sgd_reached": float(np.isfinite(rc["t"]).mean()),
                "sgd_median": quantiles(rc["t"])[1], **none}))
        t_th = group[-1]["ode_median"]
        for e in res["scratch"]:
            g = e["sgd"]
            sg = ({"sgd_reached": float(np.isfinite(g["hit"]).mean()),
                   "sgd_median": quantiles(g["hit"])[1],
                   "sgd_escape": quantiles(g["escape"])[1], "sgd_loss_B": g["loss_B"]}
                  if g is not None else
                  {"sgd_reached": math.nan, "sgd_median": math.nan, "sgd_escape": math.nan,
                   "sgd_loss_B": math.nan})
            for o in e["odes"]:
                group.append(theory(o["hit"], {
                    "d": d, "learner": e["learner"], "c": e["c"], "order": o["order"], **sg,
                    "ode_stuck": o["stuck"], "ode_stalled": o["stalled"], "ode_cap": o["cap"],
                    "escape_median": quantiles(o["escape"])[1], "ode_loss_B": o["loss_B"]}))
        for row in group:
            row["sgd_ratio"] = row["sgd_median"] / t_ft
            row["ode_ratio"] = row["ode_median"] / t_ft
            row["theory_ratio"] = row["ode_median"] / t_th
        rows.extend(group)
    return rows


TABLE_COLUMNS = ("d", "learner", "c", "order", "sgd_reached", "sgd_median", "sgd_escape",
                 "sgd_loss_B", "ode_runs", "ode_reached", "ode_stuck", "ode_stalled", "ode_cap",
                 "ode_median", "ode_q10", "ode_q90", "escape_median", "ode_loss_B",
                 "sgd_ratio", "ode_ratio", "theory_ratio")


def format_table(rows: list[dict]) -> str:
    """The table over d as text (inf: never within the horizon / budget; -: not computed;
    ord 0: fine-tuning's one-dimensional theory)."""
    head = (f"{'d':>5} {'learner':>12} {'c':>6} {'ord':>3} {'SGD rch':>7} {'SGD med':>9} "
            f"{'SGD esc':>9} {'SGD L_B':>7} {'n':>3} {'ODE rch':>7} {'stuck':>5} {'stall':>5} "
            f"{'cap':>4} "
            f"{'ODE med':>9} {'ODE 10%':>9} {'ODE 90%':>9} {'ODE esc':>9} {'ODE L_B':>7} "
            f"{'SGD/Tft':>7} {'ODE/Tft':>7} {'ODE/Tth':>7}")
    lines = [head]

    def n(x, spec=".0f", width=9):
        x = float(x)
        if math.isnan(x):
            return "-".rjust(width)
        if math.isinf(x):
            return "inf".rjust(width)
        return format(x, spec).rjust(width)

    for r in rows:
        lines.append(f"{r['d']:>5} {r['learner']:>12} {r['c']:6.3g} {r['order']:3d} "
                     f"{n(r['sgd_reached'], '.2f', 7)} {n(r['sgd_median'])} "
                     f"{n(r['sgd_escape'])} {n(r['sgd_loss_B'], '.3f', 7)} "
                     f"{r['ode_runs']:3d} {n(r['ode_reached'], '.2f', 7)} "
                     f"{n(r['ode_stuck'], '.2f', 5)} {n(r['ode_stalled'], '.2f', 5)} "
                     f"{n(r['ode_cap'], '.2f', 4)} "
                     f"{n(r['ode_median'])} {n(r['ode_q10'])} {n(r['ode_q90'])} "
                     f"{n(r['escape_median'])} {n(r['ode_loss_B'], '.3f', 7)} "
                     f"{n(r['sgd_ratio'], '.1f', 7)} "
                     f"{n(r['ode_ratio'], '.1f', 7)} {n(r['theory_ratio'], '.1f', 7)}")
    return "\n".join(lines)


def scaling_exponent(rows: list[dict], learner: str, key: str, order: int = 0) -> float | None:
    """Least-squares slope of log(median) on log d over the rows of (``learner``, ``order``)
    with a finite positive median (None with fewer than two such d)."""
    pts = [(r["d"], r[key]) for r in rows if r["learner"] == learner and r["order"] == order
           and np.isfinite(r[key]) and r[key] > 0]
    if len(pts) < 2:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--d", type=int, nargs="+", default=[200])
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ft-c", type=float, nargs="+", default=[0.01, 0.02, 0.03, 0.05, 0.07, 0.1])
    ap.add_argument("--scratch-c", type=float, nargs="*", default=[0.005])
    ap.add_argument("--csq-c", type=float, nargs="*", default=[0.01])
    ap.add_argument("--budget", type=int, default=300_000, help="scratch steps B")
    ap.add_argument("--checkpoints", type=int, default=600)
    ap.add_argument("--theory-only", action="store_true",
                    help="skip the SGD of the from-scratch learners (committee ODE only)")
    ap.add_argument("--order", nargs="+", choices=("auto", "1", "2"), default=["1", "auto"],
                    help="committee-ODE orders: 1 drops the η̄² terms, 2 keeps them, auto: "
                         "plan_order's choice (module docstring)")
    ap.add_argument("--ode-runs", type=int, nargs="+", default=None,
                    help="committee ODE for the first N runs only, one N per --order "
                         "[default: all runs at order 1, 4 at order 2]")
    ap.add_argument("--ode-steps", type=float, default=None,
                    help="committee-ODE horizon in steps [default: 100·B·(d/200)^1.5]")
    ap.add_argument("--max-evals", type=int, nargs="+", default=None,
                    help="drift evaluations per committee-ODE run before it is cut short, one "
                         "value or one per --order [default: 30000 at order 1, 4000 at 2]")
    ap.add_argument("--no-corrected", action="store_true",
                    help="skip fine-tuning's noise-corrected map (≈ 2.5 s per c and d)")
    ap.add_argument("--per-run", action="store_true", help="print each run's SGD/ODE steps")
    return ap.parse_args(argv)


def _per_order(values, orders, default, name):
    if values is None:
        return [default(o) for o in orders]
    if len(values) == 1:
        return list(values) * len(orders)
    if len(values) == len(orders):
        return list(values)
    raise SystemExit(f"{name} takes one value or one per --order")


def ode_orders(args, d: int) -> tuple[list[int], list[int], list[str], list[int]]:
    """(orders, runs per order, reasons, evaluation caps): ``--order`` 1 or 2 as given, auto =
    ``plan_order`` (K = M = k, ODE_EVALS evaluations); ``--ode-runs``, ``--max-evals``: one
    value for every order or one per order."""
    inst = build_instance(spec_for(args.k, d))
    orders, reasons = [], []
    for o in args.order:
        if o == "auto":
            n = args.runs
            order, why = plan_order(inst.activation, args.k, args.k, n, ODE_EVALS)
        else:
            order, why = int(o), "requested"
        orders.append(order)
        reasons.append(why)
    runs = [min(n, args.runs) for n in _per_order(
        args.ode_runs, orders, lambda o: args.runs if o == 1 else 4, "--ode-runs")]
    caps = _per_order(args.max_evals, orders, lambda o: 30000 if o == 1 else 4000,
                      "--max-evals")
    return orders, runs, reasons, caps


def measure(args, *, verbose: bool = False) -> list[dict]:
    """:func:`one_d` for every d of ``args.d`` (the ODE horizon defaults to
    100·B·(d/200)^1.5 steps)."""
    results = []
    for d in args.d:
        a = argparse.Namespace(**vars(args))
        if a.ode_steps is None:
            a.ode_steps = 100.0 * args.budget * (d / 200.0) ** 1.5
        a.orders, a.ode_runs_list, reasons, a.max_evals_list = ode_orders(args, d)
        if verbose:
            print("committee-ODE orders: " + "; ".join(
                f"{o} ({n} runs, ≤ {m} drift evaluations each, {why})" for o, n, why, m in
                zip(a.orders, a.ode_runs_list, reasons, a.max_evals_list, strict=True)))
        results.append(one_d(d, a, verbose=verbose))
    return results


def main(argv=None) -> None:
    args = parse(argv)
    t0 = time.time()
    results = measure(args, verbose=True)
    print(f"\ntable over d (k = {args.k}, SGD {args.runs} runs; medians in steps; ord: "
          "committee-ODE order of the scratch rows, 0 = fine-tuning's 1-D theory: finetune = "
          "population ODE at SGD's best c, ft-corrected = noise-corrected map at its own best "
          "c; n: runs in the ODE columns; Tft = SGD T_ft, Tth = ft-corrected's median)")
    rows = table_rows(results)
    print(format_table(rows))
    if len(args.d) > 1:
        keys = (("escape_median", "ODE escape"), ("sgd_escape", "SGD escape"),
                ("ode_median", "ODE first passage"), ("sgd_median", "SGD first passage"))
        for learner, order in dict.fromkeys((r["learner"], r["order"]) for r in rows):
            for key, what in keys:
                p = scaling_exponent(rows, learner, key, order)
                if p is not None:
                    print(f"{learner:>12} ord {order} {what}: median ∝ d^{p:.2f} (log-log "
                          "least squares over the d with a finite median)")
    print(f"total {time.time() - t0:.0f} s")


def _malloc_tuned() -> None:
    """Re-run this script once with glibc's mmap/trim thresholds raised (Linux only): the
    committee integrals allocate large temporaries per drift evaluation, and by default glibc
    maps and unmaps them each time — half of a second-order evaluation was page faults
    (measured 26 ms → 13 ms per K = M = 4 He₃ drift; the numbers are the same)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not sys.platform.startswith("linux"):
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**30), MALLOC_TRIM_THRESHOLD_=str(2**30))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


if __name__ == "__main__":
    _malloc_tuned()
    main()

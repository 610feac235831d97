"""Theorem 19 measured: fine-tuning's T ∝ d against learning the same teacher from scratch.

Instance (Claim 2): k = 4, W = ``claim2`` (teacher neurons orthonormal), ξ = 1, ĉ = c
(``c_hat: teacher``), λ = 1, σ = He₃ or He₄ (information exponent p = 3, 4), seed 0.

* Target: L* = Φ(0.9), fine-tuning's exact population loss at overlap 0.9.
* Fine-tuning (``finetune``, projected, ĉ frozen, rank-1 chain): T_ft = first passage of
  ⟨û, u⟩ ≥ 0.9 at η = c_ft/d.
* From scratch (``scratch``: squared loss; ``scratch-csq``: correlation loss; k′ = k random
  unit rows, λ̂ = λ fixed), on the exact network chain: T = first passage of the exact
  population loss ≤ L*, checked after every step, at η = c/d^{p/2} (online SGD on
  information exponent p: Ben Arous et al. 2021 take η ∝ d^{−p/2} up to logs), horizon
  H·d^{p−1} steps; runs that do not get there by the horizon count as never (censored).

Per (σ, learner, c): the median T over runs at each d (a censored median: NaN once half the
runs never arrive), the fraction that never arrive, and the slope b of log median T =
a + b log d with a 95 % bootstrap CI (runs resampled within each d;
``sims.experiments.fit.fit_power_law``). Lines for comparison: the CSQ lower bound d^{p/2},
the online-SGD information-exponent law d^{p−1}, and d (fine-tuning).

    python benchmarks/theorem19.py --sigma he3 --d 100 141 200 283 400 --runs 16 \
        --c 0.05 0.1 --horizon 40 [--out results/theorem19_he3.json --plot ...]

Everything runs on the exact chains (float64, CPU, numba threads = cores).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import hermite
from dynamics.config import RunConfig
from dynamics.instance import build_instance
from dynamics.reduced import first_passages_reduced
from dynamics.reduced.network_simulate import NetworkChain
from sims.experiments.fit import censored_median, fit_power_law

LEVEL = 0.9
#: the series of the committee ODE's first passages (``--ode-runs``)
ODE_NAME = "committee ODE escape (1st order)"


def spec_for(sigma: str, d: int) -> dict:
    return {"activation": sigma, "k": 4, "d": d, "xi": 1.0, "W": "claim2", "seed": 0,
            "c_hat": "teacher"}


def degree(sigma: str) -> int:
    return int(sigma.removeprefix("he"))


def target_loss(sigma: str, d: int) -> float:
    inst = build_instance(spec_for(sigma, d))
    return float(np.ravel(hermite.population_loss(inst, np.array([LEVEL])))[0])


def finetune_times(sigma: str, d: int, runs: int, c_ft: float, seed: int,
                   horizon: float = 400.0) -> np.ndarray:
    """First passages of ⟨û, u⟩ ≥ 0.9 of ``finetune`` at η = c_ft/d (NaN: not by
    horizon·d steps)."""
    config = RunConfig(instance=spec_for(sigma, d), learner="finetune", eta=c_ft / d,
                       steps=int(horizon * d), runs=runs, seed=seed, engine="reduced",
                       finite_d_theory=False)
    return first_passages_reduced(config, [LEVEL])[0]


def finetune_scan(sigma: str, ds, cs, runs: int, seed: int, horizon: float) -> list[dict]:
    """Fine-tuning's median T/d (censored), its 25–75 % range and the fraction of runs short
    of overlap 0.9 by horizon·d steps, per (c_ft, d): where η = c_ft/d is in the T ∝ d
    regime (T/d flat in d) and where SGD's noise keeps the overlap below 0.9."""
    out = []
    for c in cs:
        for d in ds:
            t = finetune_times(sigma, d, runs, c, seed, horizon) / d
            q = np.nanquantile(t, [0.25, 0.75]) if np.isfinite(t).any() else [math.nan] * 2
            out.append({"c_ft": c, "d": d, "median T/d": censored_median(t),
                        "T/d 25%": float(q[0]), "T/d 75%": float(q[1]),
                        "never": float(np.mean(np.isnan(t)))})
            print(json.dumps(out[-1]), flush=True)
    return out


def scratch_config(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
                   seed: int) -> RunConfig:
    """The from-scratch runs at d: η = c/d^{p/2}, horizon·d^{p−1} steps, the exact chain."""
    p = degree(sigma)
    return RunConfig(instance=spec_for(sigma, d), learner=learner, eta=c / d ** (p / 2),
                     steps=int(math.ceil(horizon * d ** (p - 1))), runs=runs, seed=seed,
                     engine="reduced", finite_d_theory=False)


def scratch_times(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
                  seed: int) -> tuple[np.ndarray, int]:
    config = scratch_config(sigma, learner, d, runs, c, horizon, seed)
    hits = NetworkChain().first_passages(config, [target_loss(sigma, d)], quantity="loss")
    return hits[0], config.steps


def ode_times(sigma: str, learner: str, d: int, runs: int, c: float, horizon: float,
              seed: int, max_evals: int = 30_000) -> np.ndarray:
    """Plateau escapes (steps; NaN = not by the horizon) of the committee ODE
    (``hermite.committee.committee_first_passage``, first order: the η̄² terms dropped) from
    each of the first ``runs`` chain runs' own starts (the rows the SGD runs start from),
    η̄ = η·d with η = c/d^{p/2}: the first step where some |cos(ŵⱼ, vᵢ)| reaches
    ``ESCAPE_OVERLAP`` (0.5). Its first passage of L* is no law here: from most starts the
    ODE comes to rest at a spurious fixed point above L* (loss ≈ 1.2–1.5), which SGD
    leaves."""
    from dynamics.committee_overlay import committee_model, committee_state
    from dynamics.reduced.network_simulate import ChainStart
    from hermite.committee import committee_first_passage

    config = scratch_config(sigma, learner, d, runs, c, horizon, seed)
    start = ChainStart(config, config.run_instances())
    cross, gram = start.overlaps()
    level = target_loss(sigma, d)
    out = np.full(runs, np.nan)
    for r, inst in enumerate(start.instances):
        model = committee_model(inst, loss=start.learner.loss_name, eta=config.eta,
                                second_order=False)
        hit = committee_first_passage(model, committee_state(cross[r], gram[r],
                                                             start.lam_hat[r]),
                                      level, d, alpha_max=config.steps / d,
                                      max_evals=max_evals)
        if math.isfinite(hit.escape):
            out[r] = hit.escape
    return out


def measure(sigma, ds, runs, cs, c_ft, horizon, seed, learners, ode_runs=0,
            ode_only=False) -> dict:
    p = degree(sigma)
    out = {"sigma": sigma, "p": p, "level": LEVEL, "runs": runs, "c_ft": c_ft,
           "horizon": f"{horizon}·d^{p - 1}", "eta": f"c/d^{p / 2:g}", "rows": []}
    series: dict = {}
    for d in ds:
        t0 = time.perf_counter()
        ft = finetune_times(sigma, d, runs, c_ft, seed)
        series.setdefault(("finetune", c_ft), []).append(ft)
        row = {"d": d, "L*": target_loss(sigma, d),
               f"finetune c={c_ft:g}": {"median": censored_median(ft),
                                        "never": float(np.mean(np.isnan(ft)))}}
        for learner in learners:
            for c in cs:
                found = []  # (series, first passages, horizon in steps)
                if not ode_only:
                    found.append((learner, *scratch_times(sigma, learner, d, runs, c, horizon,
                                                          seed)))
                if ode_runs:
                    found.append((f"{ODE_NAME} {learner}",
                                  ode_times(sigma, learner, d, ode_runs, c, horizon, seed), None))
                for name, hits, steps in found:
                    series.setdefault((name, c), []).append(hits)
                    row[f"{name} c={c:g}"] = {"median": censored_median(hits),
                                              "never": float(np.mean(np.isnan(hits))),
                                              "horizon": steps}
        row["seconds"] = time.perf_counter() - t0
        out["rows"].append(row)
        print(json.dumps(row, default=float), flush=True)
    out["times"] = {f"{k[0]} c={k[1]:g}": [list(map(float, t)) for t in v]
                    for k, v in series.items()}
    out["fits"] = fits_of(out)
    return out


def keyed_rows(res: dict) -> list[dict]:
    """``res``'s rows with every series under its ``times`` key (files written before
    fine-tuning's row key named its c call it ``finetune``)."""
    name = f"finetune c={res['c_ft']:g}" if not isinstance(res["c_ft"], list) else None
    return [{(name if k == "finetune" else k): v for k, v in row.items()}
            for row in res["rows"]]


def series_d(res: dict, key: str) -> list:
    """The d of ``res``'s rows that have series ``key`` (its times are in this order)."""
    return [row["d"] for row in keyed_rows(res) if key in row]


def fits_of(res: dict) -> dict:
    """Per series of ``res`` (its times: per-d lists of first-passage steps, NaN = never): the
    slope of log median T on log d with its 95 % bootstrap CI (``fit_power_law``), or why
    there is none."""
    fits = {}
    for key, per_d in res["times"].items():
        ds = series_d(res, key)
        try:
            fit = fit_power_law(ds, [np.asarray(t, dtype=float) for t in per_d])
            fits[key] = {"slope": fit.slope, "ci": list(fit.slope_ci),
                         "d_fitted": [float(x) for x, m in zip(fit.d, fit.median_T, strict=True)
                                      if np.isfinite(m)]}
        except ValueError as err:
            fits[key] = {"slope": None, "why": str(err)}
    return fits


def merged(results: list[dict]) -> dict:
    """One result from several ``measure`` results of one σ, run count and horizon over
    different d (or different series at the same d): rows joined by d, each series' times in
    d order, fits redone over every d a series has."""
    first = results[0]
    same = ("sigma", "runs", "horizon", "eta", "level")
    for res in results[1:]:
        if any(res[key] != first[key] for key in same):
            raise ValueError(f"cannot merge: the results differ in one of {same}")
    rows: dict = {}
    for res in results:
        for row in keyed_rows(res):
            have = rows.setdefault(row["d"], {"d": row["d"], "L*": row["L*"], "seconds": 0.0})
            have["seconds"] += row["seconds"]
            have.update({k: v for k, v in row.items() if k not in ("d", "L*", "seconds")})
    ds = sorted(rows)
    out = {key: first[key] for key in ("sigma", "p", *same)}
    c_ft = sorted({c for res in results
                   for c in (res["c_ft"] if isinstance(res["c_ft"], list) else [res["c_ft"]])})
    out["c_ft"] = c_ft[0] if len(c_ft) == 1 else c_ft
    out["rows"] = [rows[d] for d in ds]
    out["times"] = {}
    for key in dict.fromkeys(k for res in results for k in res["times"]):
        by_d = {d: t for res in results if key in res["times"]
                for d, t in zip(series_d(res, key), res["times"][key], strict=True)}
        out["times"][key] = [by_d[d] for d in ds if d in by_d]
    out["fits"] = fits_of(out)
    return out


def plot(results: list[dict], path: Path) -> None:
    """One log-log figure of every series of ``results`` (``measure``'s dicts of one σ): the
    medians with their fitted slope and CI, the series no fit exists for named with their
    fraction of runs that never arrived, and the reference laws d, d^{p/2} (CSQ bound) and
    d^{p−1} (online SGD on information exponent p), anchored at the first measured point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    p, runs = results[0]["p"], results[0]["runs"]
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    notes, drawn, anchors = [], set(), {}
    for res in results:
        for key in dict.fromkeys(k for r in keyed_rows(res) for k in r):
            if key in ("d", "L*", "seconds") or key in drawn:
                continue
            drawn.add(key)
            rows = [r for r in keyed_rows(res) if key in r]
            ds = np.array([r["d"] for r in rows], dtype=float)
            med = np.array([r[key]["median"] for r in rows], dtype=float)
            never = [r[key]["never"] for r in rows]
            fit = res["fits"].get(key)
            if fit is None or fit.get("slope") is None:
                horizon = res["horizon"]
                notes.append(f"{key}: never reached L* within {horizon} steps in "
                             + ", ".join(f"{100 * x:.0f}" for x in never)
                             + f" % of runs (d = {', '.join(f'{x:g}' for x in ds)})")
                continue
            label = (f"{key}: slope {fit['slope']:.2f} [{fit['ci'][0]:.2f}, "
                     f"{fit['ci'][1]:.2f}]; never {100 * min(never):.0f}–{100 * max(never):.0f} %")
            ode = key.startswith(ODE_NAME)
            ax.loglog(ds, med, "s--" if ode else "o-", label=label)
            if not ode:
                anchors.setdefault("ft" if key.startswith("finetune") else "scratch",
                                   (ds[0], med[0]))
    dref = np.geomspace(min(r["d"] for res in results for r in res["rows"]),
                        max(r["d"] for res in results for r in res["rows"]), 20)
    for expo, name, anchor in ((1.0, "∝ d", "ft"), (p / 2, f"∝ d^{p / 2:g} (CSQ bound)", "scratch"),
                               (p - 1.0, f"∝ d^{p - 1} (online SGD, info. exponent {p})",
                                "scratch")):
        if anchor not in anchors:
            continue
        d0, t0 = anchors[anchor]
        ax.loglog(dref, t0 * (dref / d0) ** expo, ":", color="0.45", lw=1.2, label=name)
    ax.xaxis.set_major_locator(FixedLocator(sorted({r["d"] for res in results
                                                    for r in res["rows"]})))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("d")
    ax.set_ylabel("steps to L* (median over runs)")
    ax.set_title(f"Theorem 19: σ = He{p}, k = 4 (claim2), ξ = 1, ĉ = c, {runs} runs per d; "
                 f"η = c/d (finetune), c/d^{p / 2:g} (from scratch)", fontsize=8)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * (high / low) ** 0.6)  # room above the data for the legend
    ax.legend(fontsize=7, loc="upper left")
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=6.5, va="bottom")
        fig.subplots_adjust(bottom=0.12 + 0.03 * len(notes))
    fig.tight_layout(rect=(0, 0.04 * len(notes), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _read_results(files, flag, combine=list):
    """``combine`` of the saved --out files; a missing, half-written or mismatched file is a
    one-line error (exit status 1)."""
    try:
        return combine([json.loads(f.read_text()) for f in files])
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"theorem19.py {flag}: {type(err).__name__}: {err}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sigma", default="he3", choices=["he3", "he4"])
    ap.add_argument("--d", type=int, nargs="+", default=[100, 141, 200, 283, 400])
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--c", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--c-ft", type=float, default=0.05)
    ap.add_argument("--horizon", type=float, default=40.0)
    ap.add_argument("--learners", nargs="*", default=["scratch", "scratch-csq"],
                    help="From-scratch learners beside fine-tuning (none: fine-tuning alone).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ode-runs", type=int, default=0,
                    help="Also the first-order committee ODE's plateau escape from the first "
                         "N runs' starts, per learner and c.")
    ap.add_argument("--finetune-scan", type=float, nargs="+", metavar="C_FT",
                    help="Fine-tuning alone at η = c_ft/d for these c_ft over --d (horizon "
                         "--horizon·d steps): median T/d and the runs short of 0.9; exit.")
    ap.add_argument("--ode-only", action="store_true",
                    help="With --ode-runs: the ODE series (and fine-tuning) without the SGD.")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, nargs="+",
                    help="Draw --plot from these saved --out files (one σ) and exit.")
    ap.add_argument("--merge", type=Path, nargs="+",
                    help="Join these saved --out files (one σ, run count, horizon; different "
                         "d) into --out with the fits over all d, draw --plot, and exit.")
    args = ap.parse_args(argv)
    if args.replot:
        if args.plot is None:
            ap.error("--replot needs --plot")
        plot(_read_results(args.replot, "--replot"), args.plot)
        return 0
    if args.finetune_scan:
        rows = finetune_scan(args.sigma, args.d, args.finetune_scan, args.runs, args.seed,
                             args.horizon)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1, default=float) + "\n")
        return 0
    if args.merge:
        res = _read_results(args.merge, "--merge", merged)
    else:
        res = measure(args.sigma, args.d, args.runs, args.c, args.c_ft, args.horizon,
                      args.seed, args.learners, args.ode_runs, args.ode_only)
    print(json.dumps(res["fits"], indent=1, default=float))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=float) + "\n")
    if args.plot:
        plot([res], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

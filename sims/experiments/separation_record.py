"""benchmarks/theorem19.py's records of the Theorem 19 measurement (JSON-ready dicts):
:func:`measure` over d for fine-tuning and the from-scratch learners at several c (and the
committee ODE's escape), :func:`merged` of measurements split over d, :func:`fits_of` their
slopes, :func:`finetune_scan` (where η = c_ft/d is in fine-tuning's T ∝ d regime) and
:func:`plot` of one σ's records. The runs themselves: :mod:`sims.experiments.separation`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from sims.experiments.fit import censored_median, fit_power_law
from sims.experiments.separation import (
    LEVEL,
    degree,
    finetune_times,
    ode_times,
    scratch_times,
    target_loss,
)

__all__ = ["ODE_NAME", "measure", "merged", "fits_of", "keyed_rows", "series_d",
           "finetune_scan", "plot"]

#: the series of the committee ODE's first passages (``ode_runs``)
ODE_NAME = "committee ODE escape (1st order)"


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
    old = {"finetune": name}  # the row key of files before (renamed to the series' name)
    return [{(old[k] if k in old else k): v for k, v in row.items()} for row in res["rows"]]


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

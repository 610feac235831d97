"""The theory lines of the paper's figures against the mean of ≥ 1024 exact-chain runs (issue
40: "the line against the mean of ≥ 1024 exact-chain runs at the figure's d (and at 10× that
d), within the same tolerance").

One representative cell per figure (:data:`REGIMES`), taken from the figure's own recipe
(``sims.experiments.figures``, full or ``--quick`` size) and run through the house's run path,
``simulate(RunConfig(..., engine="reduced"))`` with ``--runs`` runs (default 1024), so that
the theory lines are the ones the figure draws, each from the runs' own starts. Every line is
audited with :func:`dynamics.overlays.audit.audit_trajectory` (paired differences, tolerance
max(4 SE, 0.03) for overlaps, 3 % for losses: docs/theory/audit.md).

The house draws a costly line (the finite-d corrected ODE, the finite-ξ line) from as many
starts as its cost budget allows (``dynamics.overlays.finetune``: ``CORRECTED_BUDGET_S``,
``FINITE_XI_BUDGET_S``); ``--line-budget S`` sets both budgets to S seconds for this script
only (the library's values are untouched elsewhere) so that a line comes from more starts.
The table says from how many starts each line was drawn; its SE uses the runs where the line
exists.

    python benchmarks/chain_audit.py [--regimes fig4-relu-xi1,fig5] [--quick] [--d-mult 10]
                                     [--runs 1024] [--horizon 1.0] [--line-budget 20]
                                     [--device cpu|cuda] [--json out.json]
                                     [--markdown out.md] [--estimate]

``--horizon F``: F × the figure's horizon (its steps/d, same number of checkpoints).
``--estimate``: print the cost estimate and stop. Prints, per regime, the estimate, the
measured seconds and a markdown table (line, vs, max |Δ|, at step, max |Δ|/SE, passage
ratio, starts, runs, verdict).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

import dynamics.overlays.finetune as finetune_overlay
from dynamics.engines.engine import advance_chain, interruptible, start
from dynamics.overlays.audit import (
    LINES,
    array_of,
    audit_line,
    audit_trajectory,
    fmt_value,
    not_drawn,
)
from dynamics.randomness.sampling import resolve_device
from sims.experiments.figures import FIGURES
from sims.experiments.sweep_spec import parse_sweep

COSTS_MEASURED = ("one thread on the shared 2-core machine beside two other jobs, 32 runs at the "
                  "quick size, eighth session (docs/theory/audit.md)")


@dataclass(frozen=True)
class Regime:
    """One representative cell of a figure: ``figure`` (a recipe name) and ``match``, the
    values its cell must have (instance keys: activation, xi/√k as ``xi_sqrt_k``; run
    options: joint_c, project, u_alpha, learner, instance_seeds)."""

    figure: str
    match: tuple
    what: str
    rate_k: float
    """k × the chain's run-steps/s (its step costs about ∝ k: fig1-relu's 4.0·10⁵ run-steps/s at
    k = 20 predicts the 1.6·10⁵ measured at k = 50), :data:`COSTS_MEASURED`"""
    lines_s: float
    """seconds of theory lines per start, :data:`COSTS_MEASURED` (the plain ODE, and the costly
    lines at a 5 s budget each spread over the 32 starts: an upper estimate)"""


REGIMES = {
    "fig1-relu": Regime("fig1", (("activation", "relu"), ("xi_sqrt_k", 1.0)),
                        "ReLU, ξ = √k, ĉ joint, û unprojected", 20 * 3.98e5, 0.84),
    "fig6-he3": Regime("fig6", (("xi_sqrt_k", 4.0),),
                       "He₃, ξ = 4√k (ξ²/d = 0.53 quick, 0.32 full), ĉ joint, unprojected",
                       10 * 1.16e6, 0.72),
    "fig2-frozen": Regime("fig2", (("joint_c", False),), "ReLU, ξ = 1, projected, ĉ frozen",
                          20 * 9.05e5, 0.28),
    "fig2-joint": Regime("fig2", (("joint_c", True),), "ReLU, ξ = 1, projected, ĉ joint",
                         20 * 7.71e5, 0.28),
    "fig3-finetune": Regime("fig3", (("learner", "finetune"),),
                            "fine-tuning, ReLU, ξ = √k, ĉ joint, projected", 20 * 8.26e5, 0.41),
    "fig4-relu-xi1": Regime("fig4", (("activation", "relu"), ("xi_sqrt_k", None)),
                            "ReLU, ξ = 1, ĉ joint, û unprojected", 20 * 5.22e5, 0.81),
    "fig4-he3-xi1": Regime("fig4", (("activation", "he3"), ("xi_sqrt_k", None)),
                           "He₃, ξ = 1, ĉ joint, û unprojected", 20 * 3.89e5, 1.8),
    "fig5": Regime("fig5", (("u_alpha", 0.5), ("instance_seeds", "shared")),
                   "ReLU, ξ = 1, ‖Π_W u‖ = 1/2, ĉ joint, unprojected", 20 * 2.61e5, 0.16),
}
# fig4's ξ = √k ReLU cell is fig1's (a) cell: "fig1-relu" covers both. Fig. 3's linearized
# learner (rank 1) has no exact chain ("only full_rank has an exact chain"): its lines are
# not audited here, Fig. 3's fine-tuning cell is.


def _value(config, key):
    inst = config.instance
    if key == "xi_sqrt_k":
        ratio = inst.get("xi", 1.0) / math.sqrt(inst["k"])
        return None if abs(inst.get("xi", 1.0) - 1.0) < 1e-9 else round(ratio, 3)
    if key in inst:
        return inst[key]
    if hasattr(config.options, key):
        return getattr(config.options, key)
    return getattr(config, key)


def regime_config(name: str, quick: bool, runs: int, d_mult: int = 1,
                  horizon: float = 1.0, seed: int = 0, shared: bool = False):
    """The RunConfig of regime ``name``: its figure's cell (the recipe's sweep at full or
    quick size) with ``runs`` runs on the reduced engine, d × ``d_mult`` (η·d and steps/d
    kept), ``horizon`` × its steps/d and, with ``shared``, one instance for every run."""
    if name not in REGIMES:
        raise ValueError(f"unknown regime {name!r}; valid: {', '.join(REGIMES)}")
    if runs < 2 or d_mult < 1 or not horizon > 0:
        raise ValueError(f"need runs ≥ 2, d multiplier ≥ 1 and horizon > 0, got {runs}, "
                          f"{d_mult}, {horizon}")
    regime = REGIMES[name]
    sweep = FIGURES[regime.figure].sweep(quick)
    spec = parse_sweep(sweep)
    cells = [c for c in spec.cells()
             if all(_value(c.config, key) == want for key, want in regime.match)]
    if len(cells) != 1:
        raise ValueError(f"regime {name}: {len(cells)} cells of {regime.figure} match "
                          f"{dict(regime.match)}, want 1")
    cell = cells[0]
    steps_per_d = cell.config.steps / cell.config.instance["d"]
    setting = dict(cell.axes) | {
        "runs": runs, "engine": "reduced", "seed": seed,
        "d": cell.config.instance["d"] * d_mult,
        "eta_times_d": cell.config.eta * cell.config.instance["d"],
        "steps_per_d": steps_per_d * horizon}
    if shared:
        setting["instance_seeds"] = "shared"
    setting.pop("eta", None)
    setting.pop("steps", None)
    base = {key: v for key, v in sweep["base"].items() if key not in setting}
    base["instance"] = {key: v for key, v in sweep["base"]["instance"].items()
                        if key not in setting}
    one = dict(sweep) | {"base": base, "axes": {}, "cases": [setting]}
    return parse_sweep(one).cells()[0].config


def estimate(name: str, config) -> dict:
    """Estimated seconds on one thread (the costs of :data:`REGIMES`, :data:`COSTS_MEASURED`):
    the chain, runs × steps at ``rate_k``/k, and the theory lines, ``lines_s`` per start plus
    the costly lines' budgets (the house's or ``--line-budget``'s) beyond the 5 s measured."""
    regime, k = REGIMES[name], config.instance["k"]
    budgets = finetune_overlay.CORRECTED_BUDGET_S + finetune_overlay.FINITE_XI_BUDGET_S
    return {"run_steps": config.runs * config.steps,
            "chain_s": config.runs * config.steps * k / regime.rate_k,
            "lines_s": config.runs * regime.lines_s + max(0.0, budgets - 10.0)}


def finite_rows(theory) -> int:
    """The runs whose theory line has a finite value (the starts it was drawn from)."""
    theory = np.asarray(theory, dtype=float).reshape(np.shape(theory)[0], -1)
    return int(np.isfinite(theory).any(axis=1).sum())


@contextmanager
def _stop_after(seconds: float | None):
    """SIGINT to this process after ``seconds`` (None: never): inside
    :func:`~dynamics.engines.engine.interruptible` the chain then stops at the end of its
    segment, at the checkpoints reached."""
    timer = None
    if seconds is not None:
        timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def audit_regime(name: str, config, chain_seconds: float | None = None,
                 arrays: str | None = None, extra: dict | None = None) -> dict:
    """Run ``config`` and audit its every line; the JSON record of the regime. The chain
    (with a progress line on stderr every ``LORADYN_PROGRESS_INTERVAL`` s) and the theory lines
    are timed apart; ``chain_seconds``: stop the chain after that long, at the checkpoints
    reached, and audit those (the record's ``reached_step`` says where); ``arrays``: save the
    audited arrays there (.npz) for :func:`pool`; ``extra``: more fields of the record."""
    t0 = time.perf_counter()
    runner = start(config)
    with interruptible(keep=True), _stop_after(chain_seconds):
        advance_chain(runner, progress=True)
    t1 = time.perf_counter()
    traj = runner.trajectory()
    t2 = time.perf_counter()
    reached = int(np.asarray(traj.steps)[-1]) if len(traj.steps) else 0
    print(f"{name}: chain {t1 - t0:.0f} s to step {reached} of {config.steps} "
          f"({config.runs * reached / max(t1 - t0, 1e-9):.3g} run-steps/s), theory lines "
          f"{t2 - t1:.0f} s", flush=True)
    pairs = {n: (np.asarray(array_of(traj, LINES[n].against), dtype=np.float64),
                 np.asarray(array_of(traj, n), dtype=np.float64)) for n in audit_trajectory(traj)}
    inst = config.instance
    record = {"regime": name, "figure": REGIMES[name].figure, "what": REGIMES[name].what,
              "d": inst["d"], "k": inst["k"], "xi": inst.get("xi", 1.0),
              "activation": inst["activation"], "eta_times_d": config.eta * inst["d"],
              "steps": config.steps, "reached_step": reached, "runs": config.runs,
              "seed": config.seed, "seconds": t2 - t0, "chain_seconds": t1 - t0,
              "lines_seconds": t2 - t1, "instance_seeds": config.instance_seeds,
              "estimate": estimate(name, config), "lines": audited_rows(traj.steps, pairs),
              "unaudited": [n for n in LINES if n not in pairs and array_of(traj, n) is not None]
              } | (extra or {})
    if arrays:
        np.savez_compressed(arrays, steps=np.asarray(traj.steps), meta=json.dumps(record),
                            **{f"x:{n}": x for n, (x, _) in pairs.items()},
                            **{f"theory:{n}": th for n, (_, th) in pairs.items()})
    return record


def audited_rows(steps, pairs: dict) -> list[dict]:
    """The table rows of the lines ``pairs`` = {line: (SGD quantity, theory) (R, C, …)}:
    :func:`~dynamics.overlays.audit.audit_line` (as ``audit_trajectory`` audits a file),
    the starts each line was drawn from, and whether a figure leaves it out."""
    audits = {n: audit_line(n, LINES[n], steps, x, th) for n, (x, th) in pairs.items()}
    hidden = not_drawn(audits)
    return [audit.as_json() | {"line": n, "starts": finite_rows(pairs[n][1]),
                               "not_drawn": n in hidden, "passed": audit.passed}
            for n, audit in audits.items()]


POOLED_KEYS = ("regime", "d", "k", "xi", "activation", "eta_times_d", "steps")


def pool(paths: list[str]) -> dict:
    """One record from the arrays of several runs of the same regime (``--arrays``, other
    ``--seed`` each, e.g. in parallel processes): their runs concatenated and audited as one
    run of them all, over the checkpoints every shard reached."""
    shards = []
    for path in paths:
        with np.load(path) as f:
            shards.append({key: f[key] for key in f.files})
    metas = [json.loads(str(s["meta"])) for s in shards]
    for meta, path in zip(metas[1:], paths[1:], strict=True):
        if any(meta[key] != metas[0][key] for key in POOLED_KEYS):
            raise ValueError(f"{path} is not a run of the regime of {paths[0]} "
                             f"({', '.join(POOLED_KEYS)} differ)")
    seeds = [m["seed"] for m in metas]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"shards of the same seed would repeat runs: seeds {seeds}")
    count = min(s["steps"].size for s in shards)
    steps = shards[0]["steps"][:count]
    names = [n for n in (k.removeprefix("x:") for k in shards[0] if k.startswith("x:"))
             if all(f"x:{n}" in s for s in shards)]
    pairs = {n: tuple(np.concatenate([s[f"{part}:{n}"][:, :count] for s in shards])
                      for part in ("x", "theory")) for n in names}
    return metas[0] | {
        "runs": sum(m["runs"] for m in metas), "reached_step": int(steps[-1]),
        "seed": seeds, "shards": len(shards),
        "seconds": max(m["seconds"] for m in metas),
        "chain_seconds": max(m["chain_seconds"] for m in metas),
        "lines_seconds": max(m["lines_seconds"] for m in metas),
        "instance_seeds": f"{metas[0]['instance_seeds']} within each of {len(shards)} shards",
        "lines": audited_rows(steps, pairs),
        "unaudited": sorted(set().union(*(m["unaudited"] for m in metas)) - set(names))}


def markdown(record: dict) -> list[str]:
    """The regime's table (docs/theory/audit.md, "Against 1024 exact-chain runs")."""
    head = (f"#### {record['regime']} ({record['what']}): d = {record['d']}, k = "
            f"{record['k']}, ξ = {record['xi']:.4g}, η·d = {record['eta_times_d']:.4g}, "
            f"{record['steps']} steps, {record['runs']} runs, instance seeds "
            f"{record['instance_seeds']} ({record['seconds']:.0f} s: chain "
            f"{record['chain_seconds']:.0f} s, lines {record['lines_seconds']:.0f} s)")
    if record["reached_step"] < record["steps"]:
        head += (f" — **the chain stopped at step {record['reached_step']} of "
                 f"{record['steps']}** (`--chain-seconds`): audited up to there")
    out = [head, "",
           "| theory line | vs | max \\|Δ\\| | at step | max \\|Δ\\|/SE | passage ratio | "
           "starts | runs | tolerance |", "|---|---|---|---|---|---|---|---|---|"]
    for row in record["lines"]:
        ratio = "–" if row["kind"] != "overlap" else fmt_value(
            math.nan if row["passage_ratio"] is None else row["passage_ratio"], ".3g")
        verdict = "within" if row["passed"] else f"**outside** from step {row['fail_step']}"
        if row["not_drawn"]:
            verdict += " (not drawn)"
        z = math.nan if row["max_se"] is None else row["max_se"]
        out.append(f"| `{row['line'].removeprefix('extra/')}` | "
                   f"{row['against'].replace('extra/', '').replace('|', chr(92) + '|')} | "
                   f"{row['max_abs']:.3g} | {row['at_step']} | {fmt_value(z, '.3g')} | "
                   f"{ratio} | {row['starts']} | {row['runs']}/{row['total_runs']} | "
                   f"{verdict} |")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regimes", default=",".join(REGIMES),
                    help=f"comma-separated, of: {', '.join(REGIMES)}")
    ap.add_argument("--quick", action="store_true", help="the figures' --quick sizes")
    ap.add_argument("--d-mult", type=int, default=1, help="d × this (η·d, steps/d kept)")
    ap.add_argument("--runs", type=int, default=1024)
    ap.add_argument("--horizon", type=float, default=1.0, help="× the figure's steps/d")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared-instance", action="store_true",
                    help="one instance for every run (Fig. 2 draws one per run: the lines "
                         "then cost ≈ 11 s per run on the 2-core machine)")
    ap.add_argument("--line-budget", type=float, default=None,
                    help="seconds for each costly theory line (default: the house's)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the chain runs (cuda: numba-cuda, ≈ 1.2·10⁸ run-steps/s on "
                         "one H200; the theory lines stay on the CPU)")
    ap.add_argument("--chain-seconds", type=float, default=None,
                    help="stop each chain after this many seconds, at the checkpoints reached, "
                         "and audit those (so that a time limit still leaves a record)")
    ap.add_argument("--arrays", default=None, metavar="DIR",
                    help="also save each regime's audited arrays as DIR/REGIME-seedS.npz")
    ap.add_argument("--pool", nargs="+", default=None, metavar="NPZ",
                    help="audit the runs of these saved arrays (one regime, other seeds) as "
                         "one run of them all, and stop")
    ap.add_argument("--estimate", action="store_true", help="print the estimate and stop")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    if args.pool:
        try:
            rec = pool(args.pool)
        except (OSError, KeyError, ValueError) as exc:  # a missing, foreign or bad file
            ap.error(f"--pool: {exc}")
        _report([rec], markdown(rec), args.json, args.markdown)
        return
    if args.line_budget is not None:
        finetune_overlay.CORRECTED_BUDGET_S = args.line_budget
        finetune_overlay.FINITE_XI_BUDGET_S = args.line_budget
    names = [n.strip() for n in args.regimes.split(",") if n.strip()]
    if args.chain_seconds is not None and not args.chain_seconds > 0:
        ap.error(f"--chain-seconds must be > 0, got {args.chain_seconds:g}")
    try:
        configs = {n: regime_config(n, args.quick, args.runs, args.d_mult, args.horizon,
                                    args.seed, args.shared_instance) for n in names}
        if not args.estimate:
            resolve_device(args.device)  # cuda without CUDA: one line, before any work
    except ValueError as exc:  # a bad option: one line
        ap.error(str(exc))
    configs = {n: dataclasses.replace(cfg, device=args.device) for n, cfg in configs.items()}
    for n, cfg in configs.items():
        e = estimate(n, cfg)
        print(f"{n}: d = {cfg.instance['d']}, k = {cfg.instance['k']}, {cfg.steps} steps × "
              f"{cfg.runs} runs = {e['run_steps']:.3g} run-steps; on one thread ≈ "
              f"{e['chain_s']:.0f} s of chain + {e['lines_s']:.0f} s of theory lines "
              "(at the rates measured on the shared 2-core machine)", flush=True)
    if args.estimate:
        return
    if args.arrays:
        os.makedirs(args.arrays, exist_ok=True)
    records, lines = [], []
    for n, cfg in configs.items():
        npz = os.path.join(args.arrays, f"{n}-seed{args.seed}.npz") if args.arrays else None
        records.append(audit_regime(n, cfg, args.chain_seconds, npz, {
            "quick": args.quick, "d_mult": args.d_mult, "horizon": args.horizon,
            "line_budget": args.line_budget, "device": args.device}))
        lines += markdown(records[-1]) + [""]
        _report(records, lines, args.json, args.markdown)


def _report(records: list, lines: list, json_path: str | None, md_path: str | None) -> None:
    """Print the last table; (re)write the JSON and markdown with every record so far."""
    table = markdown(records[-1])
    print("\n".join(table) + "\n", flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(records, fh, indent=1)
    if md_path:
        with open(md_path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines))


if __name__ == "__main__":
    main()

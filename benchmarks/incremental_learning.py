"""Incremental learning of a rank-2 teacher by the ``lora`` learner (full engine).

Teacher C = A diag(s₁, s₂) Bᵀ (``C = spectrum``) with s₁ = 1, s₂ = 1/ratio, Ĉ = C frozen,
projected Riemannian online SGD of Û ∈ St(d, 2) (polar retraction), η = c/d. For each ratio
s₁/s₂ it records, per run, T_a = the first step at which the a-th singular value of
M = UᵀÛ (descending) reaches 0.5 (linear interpolation between linearly spaced checkpoints),
and the same for the matrix ODE (``hermite.matrix_ode``) from each run's M₀. Output: a table
``<out>.txt`` (the command, settings, medians, quartiles, T₂/T₁) and a figure ``<out>.png``.

``--ode-check`` instead runs the acceptance check of the matrix ODE (d = 2000, k = 8, r = 2,
small η): the run-mean of each singular value of SGD against the run-mean of the ODE over the
whole curve, written to ``results/incremental_ode_check.{txt,png}``.

    python benchmarks/incremental_learning.py            # ratios 1, 2, 3, 5 at d = 500
    python benchmarks/incremental_learning.py --ode-check
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

import hermite
from dynamics.engines.engine import simulate
from dynamics.instances.instance import build_instance
from dynamics.instances.lora_instance import build_lora_instance
from dynamics.setup.config import RunConfig

LEVEL = 0.5


def instance_spec(args, d: int) -> dict:
    return {"activation": args.activation, "k": args.k, "d": d, "xi": args.xi,
            "c_hat": "teacher", "lam": "ones", "W": "orthonormal", "seed": args.instance_seed}


def first_passage(steps: np.ndarray, curve: np.ndarray, level: float) -> np.ndarray:
    """Per run (curve (R, C)), the step at which curve first reaches ``level``, linearly
    interpolated between checkpoints; NaN if never."""
    out = np.full(curve.shape[0], np.nan)
    for r, y in enumerate(curve):
        hit = np.nonzero(y >= level)[0]
        if hit.size == 0:
            continue
        j = hit[0]
        if j == 0:
            out[r] = steps[0]
            continue
        y0, y1 = y[j - 1], y[j]
        out[r] = steps[j - 1] + (level - y0) / (y1 - y0) * (steps[j] - steps[j - 1])
    return out


def horizon(args, spectrum) -> int:
    """Steps for the slower direction to pass the level with margin, from a coarse ODE."""
    inst = build_lora_instance(build_instance(instance_spec(args, args.d)), 2,
                               {"C": "spectrum", "spectrum": spectrum})
    m0 = np.eye(2) / np.sqrt(args.d)  # typical |M₀| ~ d^{−1/2}
    coarse = 20
    eta = args.c / args.d
    grid = np.arange(0, 400_000 // coarse + 1, 50)
    sv = hermite.singular_values(hermite.matrix_ode(inst, eta * coarse, m0, grid))
    t2 = grid[np.argmax(sv[:, 1] >= LEVEL)] * coarse
    return int(min(args.max_steps, max(2000, args.margin * t2)))


def measure(args, ratio: float) -> dict:
    spectrum = [1.0, 1.0 / ratio]
    steps = horizon(args, spectrum)
    cfg = RunConfig(instance=instance_spec(args, args.d), learner="lora", rank=2,
                    eta=args.c / args.d, steps=steps, runs=args.runs, seed=args.seed,
                    checkpoints=args.checkpoints, spacing="linear",
                    extra={"C": "spectrum", "spectrum": spectrum})
    t0 = time.time()
    tr = simulate(cfg)
    sv, osv = tr.extra["singular_values"], tr.extra["ode_singular_values"]
    out = {"ratio": ratio, "spectrum": spectrum, "steps": steps, "seconds": time.time() - t0,
           "curve_steps": tr.steps, "sv": sv, "osv": osv}
    for a in (0, 1):
        out[f"T{a + 1}"] = first_passage(tr.steps, sv[..., a], LEVEL)
        out[f"T{a + 1}_ode"] = first_passage(tr.steps, osv[..., a], LEVEL)
    return out


def _quart(x):
    x = x[np.isfinite(x)]
    if not x.size:
        return (np.nan,) * 3
    return tuple(np.percentile(x, [25, 50, 75]))


def report(args, rows, out: Path) -> None:
    lines = ["# Incremental learning, rank-2 LoRA teacher (benchmarks/incremental_learning.py)",
             f"# command: python {' '.join(shlex.quote(a) for a in sys.argv)}",
             f"# learner lora, full engine, float64, cpu; activation {args.activation}, "
             f"k = {args.k}, d = {args.d}, xi = {args.xi}, lam = ones, W orthonormal, "
             f"C = A diag(1, 1/ratio) B^T (spectrum), C_hat = C frozen, projected, polar "
             f"retraction, eta = {args.c}/d, {args.runs} runs (seed {args.seed}), "
             f"instance seed {args.instance_seed}",
             f"# T_a = first step with the a-th singular value of M = U^T U_hat >= {LEVEL} "
             "(interpolated between linear checkpoints); q25/median/q75 over runs; "
             "ODE = matrix ODE from each run's M0",
             "ratio  steps  reached1 reached2   T1_q25   T1_med   T1_q75   T2_q25   T2_med"
             "   T2_q75  T2/T1_med  T2/T1_q25  T2/T1_q75  T1_ode  T2_ode  T2/T1_ode  sec"]
    for row in rows:
        t1, t2 = row["T1"], row["T2"]
        ratio_runs = t2 / t1
        q1, q2, qr = _quart(t1), _quart(t2), _quart(ratio_runs)
        o1, o2 = np.nanmedian(row["T1_ode"]), np.nanmedian(row["T2_ode"])
        lines.append(
            f"{row['ratio']:5.1f} {row['steps']:6d} {np.isfinite(t1).mean():8.2f} "
            f"{np.isfinite(t2).mean():8.2f} {q1[0]:8.0f} {q1[1]:8.0f} {q1[2]:8.0f} "
            f"{q2[0]:8.0f} {q2[1]:8.0f} {q2[2]:8.0f} {qr[1]:10.2f} {qr[0]:10.2f} "
            f"{qr[2]:10.2f} {o1:7.0f} {o2:7.0f} {o2 / o1:10.2f} {row['seconds']:4.0f}")
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(rows)))
    for row, col in zip(rows, colors, strict=True):
        s = row["curve_steps"]
        for a, ls in ((0, "-"), (1, "--")):
            ax0.plot(s, row["sv"][..., a].mean(0), ls, color=col,
                     label=f"s1/s2 = {row['ratio']:g}" if a == 0 else None)
            ax0.plot(s, row["osv"][..., a].mean(0), ":", color="k", lw=0.8)
    ax0.axhline(LEVEL, color="grey", lw=0.6)
    ax0.set_xscale("log")
    ax0.set_xlabel("SGD step")
    ax0.set_ylabel("singular values of M (mean over runs)")
    ax0.set_title("σ1 solid, σ2 dashed; matrix ODE dotted")
    ax0.legend(fontsize=8)
    ratios = np.array([r["ratio"] for r in rows])
    q = np.array([_quart(r["T2"] / r["T1"]) for r in rows])
    ax1.errorbar(ratios, q[:, 1], yerr=[q[:, 1] - q[:, 0], q[:, 2] - q[:, 1]], fmt="o-",
                 capsize=3, label="SGD: median, quartiles over runs")
    ode = np.array([np.nanmedian(r["T2_ode"]) / np.nanmedian(r["T1_ode"]) for r in rows])
    ax1.plot(ratios, ode, "s--", label="matrix ODE")
    fine = np.linspace(ratios.min(), ratios.max(), 50)
    ax1.plot(fine, 1.0 + fine**2, ":", color="grey", label="guide: 1 + (s1/s2)²")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    for axis in (ax1.xaxis, ax1.yaxis):
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set_xticks(ratios)
    ax1.set_yticks([v for v in (1, 2, 5, 10, 20, 50, 100) if v <= 1.3 * np.nanmax(q)])
    ax1.set_xlabel("s1/s2")
    ax1.set_ylabel("T2/T1 (steps to σ ≥ 0.5)")
    ax1.set_title(f"d = {args.d}, k = {args.k}, ξ = {args.xi}, η = {args.c}/d, "
                  f"{args.runs} runs")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def ode_check(args) -> None:
    """Acceptance: d = 2000, k = 8, r = 2, small η: mean singular values vs the matrix ODE."""
    d = args.check_d
    spectrum = [float(v) for v in args.check_spectrum.split(",")]
    cfg = RunConfig(instance=instance_spec(args, d), learner="lora", rank=2,
                    eta=args.check_c / d, steps=args.check_steps, runs=args.check_runs,
                    seed=args.seed, checkpoints=40, extra={"C": "spectrum",
                                                           "spectrum": spectrum})
    t0 = time.time()
    tr = simulate(cfg)
    sv, osv = tr.extra["singular_values"], tr.extra["ode_singular_values"]
    dev = np.abs(sv.mean(0) - osv.mean(0))
    se = sv.std(0, ddof=1) / np.sqrt(sv.shape[0])
    lines = ["# Matrix ODE vs SGD (benchmarks/incremental_learning.py --ode-check)",
             f"# command: python {' '.join(shlex.quote(a) for a in sys.argv)}",
             f"# lora, full engine, float64, cpu; {args.activation}, k = {args.k}, d = {d}, "
             f"r = 2, xi = {args.xi}, spectrum {spectrum}, C_hat = C frozen, projected, polar, "
             f"eta = {args.check_c}/d, {args.check_runs} runs, {time.time() - t0:.0f} s",
             f"# max over the curve of |mean SGD - mean ODE|: sigma1 {dev[:, 0].max():.4f}, "
             f"sigma2 {dev[:, 1].max():.4f}",
             "step  sgd_s1  ode_s1  se_s1  sgd_s2  ode_s2  se_s2"]
    for j, s in enumerate(tr.steps):
        m, o = sv[:, j].mean(0), osv[:, j].mean(0)
        lines.append(f"{s:7d} {m[0]:.4f} {o[0]:.4f} {se[j, 0]:.4f} {m[1]:.4f} {o[1]:.4f} "
                     f"{se[j, 1]:.4f}")
    out = Path(args.check_out)
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for a, col in ((0, "C0"), (1, "C1")):
        ax.plot(tr.steps[1:], sv[:, 1:, a].mean(0), color=col, label=f"SGD σ{a + 1} (mean)")
        ax.plot(tr.steps[1:], osv[:, 1:, a].mean(0), "--", color="k", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("SGD step")
    ax.set_ylabel("singular values of M")
    ax.set_title(f"d = {d}, k = {args.k}, r = 2, η = {args.check_c}/d; ODE dashed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=500)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--xi", type=float, default=1.0)
    ap.add_argument("--activation", default="relu")
    ap.add_argument("--c", type=float, default=0.2, help="η·d")
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--ratios", default="1,2,3,5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instance-seed", type=int, default=0)
    ap.add_argument("--checkpoints", type=int, default=300)
    ap.add_argument("--margin", type=float, default=1.6, help="horizon / ODE's T2")
    ap.add_argument("--max-steps", type=int, default=150_000)
    ap.add_argument("--out", default="results/incremental_learning")
    ap.add_argument("--ode-check", action="store_true")
    ap.add_argument("--check-d", type=int, default=2000)
    ap.add_argument("--check-c", type=float, default=0.1)
    ap.add_argument("--check-steps", type=int, default=110_000)
    ap.add_argument("--check-spectrum", default="1,1")
    ap.add_argument("--check-runs", type=int, default=8)
    ap.add_argument("--check-out", default="results/incremental_ode_check")
    args = ap.parse_args(argv)
    if args.ode_check:
        ode_check(args)
        return
    rows = [measure(args, float(r)) for r in args.ratios.split(",")]
    report(args, rows, Path(args.out))


if __name__ == "__main__":
    main()

"""``loradyn run SPEC``: simulate R runs of online SGD and write one HDF5 trajectory file."""

from __future__ import annotations

import json
import math
import sys
import warnings

import click
import numpy as np

from dynamics.config import ENGINES, INITS, LEARNERS, SPARSE_SELECTIONS, STREAMS, RunConfig
from dynamics.defaults import ETA_C, default_eta, default_steps
from dynamics.engine import simulate
from dynamics.instance import build_instance, load_spec
from sims.io.trajectory import check_writable, write_trajectory
from sims.plots.quick import instance_title, plot_overlap

__all__ = ["run", "run_config", "summary_json"]


def run_config(spec_path, *, eta, steps, **options) -> tuple[RunConfig, list[str]]:
    """Build and validate the RunConfig; ``eta``/``steps`` None → defaults (noted in the list)."""
    spec = load_spec(spec_path)
    base = build_instance(spec)
    if base.d is None:
        raise ValueError(f"instance spec {spec_path}: key 'd' is required to simulate")
    notes = []
    if eta is None:
        eta = default_eta(base)
        if options.get("learner", "finetune") != "moment":  # moment takes no steps of size η
            notes.append(f"η = {eta * base.d:.3g}/d = {eta:.3g} (default)")
    if steps is None:
        steps = default_steps(base, eta)
        notes.append(f"steps = {steps} (default, from the population ODE)")
    config = RunConfig(instance=spec, eta=eta, steps=steps, **options)
    return config.validate(), notes


def summary_json(traj) -> dict:
    """{"steps", "overlap_mean", "overlap_std", "ode"[, "ode_corrected"]} over non-diverged
    runs (null for NaN)."""
    ok = ~traj.diverged
    ov = traj.overlap[ok] if ok.any() else np.full((1, traj.steps.size), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, std = np.nanmean(ov, axis=0), np.nanstd(ov, axis=0)
        ode = np.nanmean(traj.ode, axis=0)
        corrected = (np.nanmean(traj.ode_corrected, axis=0)
                     if traj.ode_corrected is not None else None)

    def clean(a):
        return [None if not math.isfinite(v) else float(v) for v in a]

    out = {"steps": [int(s) for s in traj.steps], "overlap_mean": clean(mean),
           "overlap_std": clean(std), "ode": clean(ode)}
    if corrected is not None:
        out["ode_corrected"] = clean(corrected)
    return out


def _summary_line(traj, notes) -> str:
    s = traj.summary()
    t05 = s["median_steps_to_0.5"]
    parts = [f"runs {s['runs']} ({s['diverged']} diverged)",
             f"median overlap at step {int(traj.steps[-1])}: {s['median_final_overlap']:.4f}",
             f"past 0.9: {100 * s['fraction_past_0.9']:.0f}%",
             "median steps to 0.5: " + (f"{t05:.0f}" if math.isfinite(t05) else "not reached")]
    return "; ".join(notes + parts)


@click.command("run")
@click.argument("spec")
@click.option("--learner", default="finetune",
              help="Learner: finetune (rank-1 LoRA, eq. 4), lora (rank r), linearized "
                   "(NTK), scratch, scratch-csq, sparse (S²FT), glm, moment.",
              metavar="|".join(LEARNERS))
@click.option("--rank", type=int, default=1,
              help="Rank r of the lora learner (teacher C: spec keys C, spectrum, C_hat).")
@click.option("--retraction", type=click.Choice(["polar", "qr"]), default="polar",
              help="Stiefel retraction of the lora learner.")
@click.option("--prox", type=float, default=0.0,
              help="Proximal regularisation prox·‖Δ‖² toward the base (finetune, linearized).")
@click.option("--full-rank", is_flag=True, help="linearized: full-rank Δ (NTK of full FT).")
@click.option("--width", type=int, default=None, help="scratch: student width k′ [k].")
@click.option("--train-second-layer", is_flag=True, help="scratch: also train λ̂.")
@click.option("--moment-order", type=click.IntRange(1, 2), default=1,
              help="moment: 1 (Stein first order) or 2 (top eigenvector).")
@click.option("--sparse-rows", type=int, default=None,
              help="sparse: rows tuned [⌈(k+d)/d⌉, rank-1 LoRA's parameter budget].")
@click.option("--sparse-select", type=click.Choice(SPARSE_SELECTIONS), default="lambda",
              help="sparse: rows of largest |λᵢ| or random rows.")
@click.option("--refit", is_flag=True,
              help="Refit the second layer on σ(⟨wᵢ ± ξ/√k û, x⟩) features (App. F.2).")
@click.option("--refit-samples", type=int, default=20_000, help="Examples of the refit.")
@click.option("--joint-c", is_flag=True, help="Train ĉ jointly with û (plain SGD).")
@click.option("--eta-c", type=float, default=None, help="Step size of ĉ (default: --eta).")
@click.option("--no-project", is_flag=True, help="Do not apply Π onto span(W)^⊥ (App. B).")
@click.option("--eta", type=float, default=None,
              help=f"Step size η [default: c/d, c ≤ {ETA_C} from the instance's noise floor].")
@click.option("--steps", type=int, default=None,
              help="SGD steps [default: from the population ODE].")
@click.option("--runs", type=int, default=64, help="Independent runs R.")
@click.option("--seed", type=int, default=0, help="Master seed.")
@click.option("--batch", type=int, default=1, help="Mini-batch size b.")
@click.option("--label-noise", type=float, default=0.0, help="Variance of label noise.")
@click.option("--init", type=click.Choice(INITS), default="uniform", help="Initial û.")
@click.option("--checkpoints", type=int, default=60, help="Number of checkpoints.")
@click.option("--spacing", type=click.Choice(["log", "linear"]), default="log",
              help="Checkpoint spacing.")
@click.option("--xi", "xi_values", type=float, multiple=True,
              help="ξ values (repeatable; runs split evenly) [default: the spec's ξ].")
@click.option("--instance-seeds", type=click.Choice(["shared", "per_run"]), default="shared",
              help="One instance for all runs, or run r uses spec seed + r.")
@click.option("--dtype", type=click.Choice(["float64", "float32"]), default="float64",
              help="Arithmetic of the simulation.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu",
              help="auto: cuda when available.")
@click.option("--engine", type=click.Choice(ENGINES), default="full",
              help="full (this engine), reduced (exact overlap chain) or auto.")
@click.option("--streams", type=click.Choice(STREAMS), default="auto",
              help="Full engine's example streams: one generator per run (run r's numbers "
                   "independent of R) or one shared (one draw per chunk: fast on CUDA); "
                   "auto: per_run on CPU, shared on CUDA.")
@click.option("--out", required=True,
              help="Output HDF5 file (written atomically).")
@click.option("--plot", default=None,
              help="Also write an overlap-vs-steps PNG.")
@click.option("--finite-d-theory/--no-finite-d-theory", default=True,
              help="Also record the noise-corrected ODE and the theory band (frozen ĉ, "
                   "projected, b = 1).")
@click.option("--json", "as_json", is_flag=True, help="Print the mean curve as JSON.")
def run(spec, learner, rank, retraction, prox, full_rank, width, train_second_layer, moment_order,
        sparse_rows, sparse_select, refit, refit_samples, joint_c, eta_c, no_project, eta,
        steps, runs, seed, batch, label_noise, init, checkpoints, spacing, xi_values,
        instance_seeds, dtype, device, engine, streams, out, plot, finite_d_theory, as_json):
    """Simulate online SGD on the instance SPEC (JSON/TOML) and write --out."""
    config, notes = run_config(
        spec, eta=eta, steps=steps, learner=learner, joint_c=joint_c, eta_c=eta_c,
        project=not no_project, runs=runs, seed=seed, batch=batch, label_noise=label_noise,
        init=init, checkpoints=checkpoints, spacing=spacing,
        xi_values=list(xi_values) or None, instance_seeds=instance_seeds, dtype=dtype,
        device=device, engine=engine, streams=streams, finite_d_theory=finite_d_theory,
        rank=rank,
        retraction=retraction, prox=prox,
        full_rank=full_rank, width=width, train_second_layer=train_second_layer,
        moment_order=moment_order, sparse_rows=sparse_rows, sparse_select=sparse_select,
        refit=refit, refit_samples=refit_samples)
    check_writable(out)
    if plot:
        check_writable(plot)
    traj = simulate(config, progress=sys.stderr.isatty())
    write_trajectory(out, traj, config, config.run_instances())
    if plot:
        plot_overlap(traj, plot, instance_title(config))
    if as_json:
        click.echo(json.dumps(summary_json(traj)))
    else:
        click.echo(_summary_line(traj, notes))
        click.echo(f"wrote {out}" + (f" and {plot}" if plot else ""))
    if traj.diverged.all():
        first = int(traj.diverged_step.min())
        raise click.ClickException(f"all {traj.runs} runs diverged (first at step {first}); "
                                   f"lower --eta (file written: {out})")

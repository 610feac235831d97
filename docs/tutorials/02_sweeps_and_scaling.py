# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sweeps and a scaling fit
#
# A grid of configurations runs as one **sweep** into one resumable HDF5 file: here the scale
# $\xi$ of the perturbation against the activation. A **scaling study** is a sweep over the
# dimension $d$ whose hitting times are fitted as $T \propto d^b$, with a bootstrap interval
# for $b$: fine-tuning needs $T \propto d$ steps whatever the activation.
#
# Both use the exact reduced engine (`engine = "auto"` picks it where it applies): the
# overlap's dimension-free Markov chain, whose cost per step does not grow with $d$
# ([Exact reductions](../theory/exact-reductions.md)). The file formats are in
# [Sweeps, plots, scaling, reproduce](../sweeps.md).

# %%
import shutil
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from sims.experiments.fit import fit_power_law
from sims.experiments.scaling import (
    analyse,
    format_table,
    parse_scaling,
    plot_scaling,
)
from sims.experiments.sweep import run_sweep
from sims.experiments.sweep_spec import parse_sweep
from sims.io import read_sweep
from sims.io.xarray import to_dataframe, to_dataset

workdir = Path(tempfile.mkdtemp(prefix="loradyn-tutorial-"))
t_start = time.perf_counter()

# %% [markdown]
# ## A sweep over ξ and the activation
#
# A sweep file is TOML (`loradyn sweep SPEC.toml --out F.h5`); `parse_sweep` takes the same
# content as a dict. `[base]` holds what every cell shares, `[axes]` the values to combine:
# 2 activations × 3 values of ξ = 6 cells. η = 0.002/d and 300·d steps; ĉ = c (`teacher`) so
# that every activation starts with a positive drift $h(0)$. The finite-$d$ theory curves
# (tutorial 1) are left out here: they cost a few seconds per distinct instance.

# %%
sweep = {
    "sweep": {"name": "xi-activation"},
    "base": {
        "runs": 16,
        "seed": 0,
        "eta_times_d": 0.002,
        "steps_per_d": 300,
        "checkpoints": 40,
        "engine": "auto",
        "finite_d_theory": False,
        "instance": {
            "k": 8,
            "d": 500,
            "W": "orthonormal",
            "c": "quantized",
            "c_hat": "teacher",
            "seed": 1,
        },
    },
    "axes": {"activation": ["relu", "he3"], "xi": [0.5, 1.0, 2.0]},
}
spec = parse_sweep(sweep)
for cell in spec.cells():
    print(
        cell.name,
        cell.label,
        "η =",
        cell.config.eta,
        "steps =",
        cell.config.steps,
    )

# %%
result = run_sweep(spec, workdir / "sweep.h5")
print(
    f"{result.computed} cells computed in {result.batches} batches, "
    f"{result.seconds:.1f} s"
)

# %% [markdown]
# Running it again computes nothing: every finished cell is found by the hash of its
# resolved configuration (that is what makes a sweep resumable after an interruption).

# %%
again = run_sweep(spec, workdir / "sweep.h5")
print(f"computed {again.computed}, reused {again.reused}")

# %% [markdown]
# ### Reading the sweep
#
# `read_sweep` gives every cell's axes, configuration and `Trajectory`; `to_dataset` gives
# one `xarray.Dataset` whose first dimensions are the swept axes
# ([xarray and pandas](../analysis.md)).

# %%
meta, cells = read_sweep(workdir / "sweep.h5")
print(meta["dimensions"], "|", len(cells), "cells")
ds = to_dataset(workdir / "sweep.h5")
print(ds)

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
d = sweep["base"]["instance"]["d"]
for ax, act in zip(axes, ds.activation.values, strict=True):
    for xi in ds.xi.values:
        cell = ds.sel(activation=act, xi=xi)
        x = cell.steps.values / d
        (line,) = ax.plot(
            x, np.abs(cell.overlap).median("run"), label=f"ξ = {xi:g}"
        )
        ax.plot(
            x,
            np.abs(cell.ode).median("run"),
            "--",
            color=line.get_color(),
            lw=1,
        )
    ax.set(xscale="log", xlabel="steps / d", title=f"σ = {act}")
axes[0].set_ylabel("median |⟨û, u⟩| (dashed: population ODE)")
axes[0].legend()
fig.tight_layout()

# %% [markdown]
# The same in a tidy frame: the median final overlap of each cell.

# %%
df = to_dataframe(ds)
last = df[df.checkpoint == df.checkpoint.max()]
last.assign(abs_overlap=last.overlap.abs()).pivot_table(
    index="activation", columns="xi", values="abs_overlap", aggfunc="median"
).round(3)

# %% [markdown]
# ## Sample complexity: T ∝ d^b
#
# A scaling file has a `[scaling]` table instead of `[axes]`: the grid of $d$, η = c/d,
# a horizon of `horizon`·d steps, the weak-recovery level (T₀.₅: the first step with
# $|\langle \hat u, u\rangle| \ge 0.5$) and the strong one (1 − ε). In `first_passage` mode no
# trajectory is recorded: each run stops at its exact first passage of each level, so a cell
# costs its hitting times, not the horizon (`loradyn scaling SPEC.toml` does all of this).

# %%
scaling = parse_scaling(
    {
        "scaling": {
            "mode": "first_passage",
            "d": [100, 300, 1000, 3000, 10000],
            "c": 0.05,
            "horizon": 80,
            "level": 0.5,
            "epsilon": 0.2,
            "n_boot": 2000,
        },
        "base": {
            "runs": 16,
            "seed": 0,
            "engine": "reduced",
            "finite_d_theory": False,
            "instance": {
                "activation": "relu",
                "k": 8,
                "xi": 1.0,
                "W": "orthonormal",
                "c": "quantized",
                "c_hat": "quantized",
                "seed": 7,
            },
        },
    }
)
out = workdir / "scaling.h5"
done = run_sweep(scaling.sweep, out)
print(f"{done.computed} cells in {done.seconds:.1f} s")
res = analyse(out, scaling)
print(format_table(res))

# %% [markdown]
# The fit is a least-squares line through the per-$d$ **median** hitting times on log-log
# axes; the 95 % interval of the slope $b$ is a percentile bootstrap that resamples the runs
# within each $d$ (`sims.experiments.fit.fit_power_law`). Runs that never reach the level
# count as $+\infty$ in the median. Calling it directly on the hitting times gives the same fit:

# %%
fit = fit_power_law(res.d, res.t_level, n_boot=2000, seed=0)
lo, hi = fit.slope_ci
print(
    f"T_0.5 ∝ d^b: b = {fit.slope:.3f}, 95 % bootstrap CI [{lo:.3f}, {hi:.3f}]"
)
print("median T_0.5 / d per d:", np.round(fit.median_T / fit.d, 2))
assert 0.8 < fit.slope < 1.2

# %% [markdown]
# The figure `loradyn scaling` draws: every run's hitting time (dots), the medians and the
# fitted lines.

# %%
fig = plot_scaling(res)
print(f"tutorial ran in {time.perf_counter() - t_start:.0f} s")
shutil.rmtree(workdir)  # the files of this tutorial
fig

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
# # A first run
#
# One fine-tuning run of loradyn from Python and from the command line: the instance, the
# simulation of R online-SGD runs, the theory beside it (the population ODE, the
# noise-corrected map and its band) and the HDF5 file it writes, read back.
#
# The setting is close to the quick start's: a ReLU network of $k = 5$ orthonormal neurons in
# $d = 200$ dimensions, $f_0(x) = \sum_i \lambda_i \sigma(\langle w_i, x\rangle)$, and a
# teacher whose rows are $w_i + \xi c_i u$ (renormalised), $\xi = 1$. The student's frozen
# second factor $\hat c$ differs from the teacher's $c$ (instance seed 1), so even $\hat u = u$
# leaves a loss, and the SGD noise keeps the overlap below 1. The student learns the
# direction $\hat u$ on the sphere by projected online SGD (the paper's eq. 4); the overlap
# $m_t = \langle \hat u_t, u\rangle$ is what everything below tracks
# ([model and notation](../model.md)).

# %%
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import hermite
from dynamics import build_instance
from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig
from sims.io import read_trajectory, write_trajectory

workdir = Path(
    tempfile.mkdtemp(prefix="loradyn-tutorial-")
)  # every file of this tutorial
t_start = time.perf_counter()

# %% [markdown]
# ## The instance and its drift h(m)
#
# An instance is a small dict (or a TOML/JSON file, see
# [Instance specification](../instance-spec.md)). Its generators (orthonormal $W$, quantized
# $c$ and $\hat c$) are resolved once from the seed. The theory needs no simulation: the
# population drift $h(m)$ of Prop. 4 comes from the Hermite expansion of $\sigma$ in closed
# form.

# %%
spec = {
    "activation": "relu",
    "k": 5,
    "d": 200,
    "xi": 1.0,
    "W": "orthonormal",
    "c": "quantized",
    "c_hat": "quantized",
    "seed": 1,
}
inst = build_instance(spec)
print(f"k = {inst.k}, d = {inst.d}, ξ = {inst.xi}, σ = {inst.activation.name}")
print("c =", np.round(inst.c, 3), " ĉ =", np.round(inst.c_hat, 3))
print(
    "Hermite coefficients μ_0..μ_4 of ReLU:",
    np.round(hermite.hermite_coefficients(inst.activation, 4), 4),
)

m = np.linspace(-1, 1, 201)
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(m, hermite.h(inst, m))
ax.axhline(0, color="0.7", lw=0.8)
ax.set(
    xlabel="overlap m", ylabel="h(m)", title="population drift of this instance"
)
fig.tight_layout()

# %% [markdown]
# ## Simulate with RunConfig and simulate
#
# A `RunConfig` holds everything that defines a batch of runs: here 32 runs, η = 0.4/d,
# 8000 steps. The runs share the instance and differ in their random streams (run r's
# numbers depend only on the seed and r).
# The full engine draws every example $x \sim N(0, I_d)$; `engine="reduced"` would run the
# exact dimension-free chain of the overlap instead ([Engines](../engines.md)).

# %%
eta = 0.4 / inst.d
config = RunConfig(
    instance=spec,
    eta=eta,
    steps=8000,
    runs=32,
    seed=0,
    checkpoints=40,
    engine="full",
).validate()
t0 = time.perf_counter()
traj = simulate(config)
print(
    f"{traj.runs} runs × {config.steps} steps in {time.perf_counter() - t0:.1f} s "
    f"({traj.engine} engine)"
)
traj.summary()

# %% [markdown]
# The `Trajectory` holds, per run and checkpoint, the overlap and the exact population loss,
# and beside them three theory curves computed from each run's own start $m_0$:
#
# * `ode`: the population ODE $\bar m_{t+1} = \bar m_t + \eta\, h(\bar m_t)(1 - \bar m_t^2)$;
# * `ode_corrected`: the finite-$d$ map, which adds the $O(\eta^2 d)$ renormalisation drift and
#   so predicts the SGD noise floor;
# * `band_lower`, `band_upper`: the 10–90 % band of the linear-noise approximation
#   ([finite-d theory](../theory/finite-d.md)).

# %%
q10, q50, q90 = np.quantile(traj.overlap, [0.1, 0.5, 0.9], axis=0)
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.fill_between(traj.steps, q10, q90, alpha=0.25, label="SGD 10–90 %")
ax.plot(traj.steps, q50, label="SGD median")
ax.plot(traj.steps, traj.ode.mean(0), "k--", label="population ODE")
ax.plot(
    traj.steps,
    traj.ode_corrected.mean(0),
    "r:",
    lw=2,
    label="noise-corrected map",
)
ax.plot(
    traj.steps,
    traj.band_lower.mean(0),
    color="r",
    lw=0.8,
    alpha=0.6,
    label="theory band 10–90 %",
)
ax.plot(traj.steps, traj.band_upper.mean(0), color="r", lw=0.8, alpha=0.6)
ax.set(xscale="symlog", xlabel="steps", ylabel="⟨û, u⟩", ylim=(-0.3, 1.0))
ax.legend(loc="upper left", fontsize=8)
fig.tight_layout()

# %% [markdown]
# The plain ODE goes to 1; SGD stops at the noise floor, which the corrected map predicts:

# %%
floor, floor_se = hermite.noise_floor(inst, eta, inst.d)
late = traj.overlap[:, traj.steps >= 5000]
print(
    f"noise floor predicted {floor:.4f} ± {floor_se:.4f}, "
    f"measured (mean over runs and the last checkpoints) {late.mean():.4f}"
)
print(
    f"plain ODE at the end: {traj.ode[:, -1].mean():.4f}; corrected map: "
    f"{traj.ode_corrected[:, -1].mean():.4f}"
)

# %% [markdown]
# ## The HDF5 file, read back
#
# `write_trajectory` stores the curves with the full resolved configuration and its
# provenance ([schema](../hdf5-schema.md)); `read_trajectory` gives back the same arrays.

# %%
path = write_trajectory(
    workdir / "first.h5", traj, config, config.run_instances()
)
back, meta = read_trajectory(path)
assert np.array_equal(back.overlap, traj.overlap) and np.array_equal(
    back.loss, traj.loss
)
print(
    "learner:",
    meta["learner"],
    "| engine:",
    meta["engine"],
    "| loss:",
    meta["loss_kind"],
)
print("η from the file:", meta["config"]["eta"])
print("datasets:", meta["datasets"])

# %% [markdown]
# The same file as an `xarray.Dataset` (optional extra `analysis`, see
# [xarray and pandas](../analysis.md)): dimensions `run` and `checkpoint`, the steps as an
# index.

# %%
from sims.io.xarray import to_dataframe, to_dataset

ds = to_dataset(path)
print(ds)
print(ds.overlap.sel(steps=int(ds.steps[-1])).median("run").item())
to_dataframe(ds).head()

# %% [markdown]
# ## The same from the command line
#
# `loradyn run` does all of the above from a spec file. With `--json` it prints the mean
# curves, the loss and a summary of every recorded quantity. Its default engine is `auto`
# (the exact chain where there is one); `--engine full` asks for the engine used above.
# (In a shell: `loradyn run spec.toml --runs 32 --steps 8000 --eta 0.002 --engine full
# --out first_cli.h5 --json`.)

# %%
spec_file = workdir / "spec.toml"
spec_file.write_text(
    "\n".join(f"{k} = {json.dumps(v)}" for k, v in spec.items()) + "\n"
)


def loradyn(*args) -> str:
    """Run the `loradyn` command of this environment; its standard output."""
    exe = Path(sys.executable).with_name("loradyn")
    cmd = [str(exe) if exe.exists() else "loradyn", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(
            f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}"
        )
    return done.stdout


out = json.loads(
    loradyn(
        "run",
        spec_file,
        "--runs",
        32,
        "--steps",
        8000,
        "--eta",
        eta,
        "--checkpoints",
        40,
        "--engine",
        "full",
        "--out",
        workdir / "first_cli.h5",
        "--json",
    )
)
print("keys:", sorted(out))
print("recorded quantities:", sorted(out["quantities"]))
print("final mean loss (JSON):", out["loss_mean"][-1])
cli_traj, _ = read_trajectory(workdir / "first_cli.h5")
print("final mean loss (file):", cli_traj.loss[~cli_traj.diverged, -1].mean())

# %% [markdown]
# Same config and seed, same numbers: the command line and `simulate` agree run for run.

# %%
assert np.allclose(cli_traj.overlap, traj.overlap, rtol=0, atol=1e-12)
print(loradyn("show", workdir / "first_cli.h5"))
print(f"tutorial ran in {time.perf_counter() - t_start:.0f} s")
shutil.rmtree(workdir)  # the files of this tutorial

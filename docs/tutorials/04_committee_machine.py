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
# # Learning from scratch: the committee machine
#
# This tutorial covers the other side of the paper's comparison: a two-layer network learnt
# from scratch, with the order-parameter ODEs of Saad & Solla beside it
# ([theory](../theory/committee.md), [in the engine](../theory/committee-engine.md)). It
# has three parts:
#
# 1. sgoldt/nn2pp's setting, SGD beside the ODE, through the plateau and the escape;
# 2. the ODE alone from a chosen start (`hermite.committee`, no simulation);
# 3. SGD from *given* initial rows (`init_rows`), where every run starts at the same point,
#    so there is one ODE curve and the SGD mean approaches it as $d$ grows.

# %%
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig
from hermite.committee import CommitteeModel, CommitteeState, committee_ode

workdir = Path(tempfile.mkdtemp(prefix="loradyn-committee-"))
t_start = time.perf_counter()

# %% [markdown]
# ## 1. nn2pp's setting
#
# In nn2pp's default setting, teacher and student have $g(x) = \mathrm{erf}(x/\sqrt2)$ and
# $K = M = 2$ hidden units, with second layers fixed to 1. The teacher's rows are
# i.i.d. $\mathcal N(0, I/N)$; so are the student's initial rows, which are free
# (unconstrained). Training is online SGD with learning rate 0.5. In loradyn this is a
# committee teacher (`teacher = "committee"`) and the `scratch` learner with `rows="free"`.
# The mapping of the units is $\eta = \mathrm{lr}/(2N)$, $\alpha$ = steps$/N$, and nn2pp's
# $\varepsilon_g$ = our loss$/2$.
#
# Each run has its own teacher (`instance_seeds="per_run"`). The committee ODE from each
# run's own initial overlaps is recorded beside it (`extra/ode_loss`).

# %%
N = 300
spec = {
    "activation": "erf(x/sqrt2)",
    "teacher": "committee",
    "k": 2,
    "d": N,
    "W": "gaussian",
    "seed": 0,
}
config = RunConfig(
    spec,
    learner="scratch",
    rows="free",
    eta=0.5 / (2 * N),
    steps=350 * N,
    runs=12,
    seed=0,
    checkpoints=120,
    instance_seeds="per_run",
    streams="counter",
).validate()
t0 = time.perf_counter()
traj = simulate(config)
print(f"{traj.runs} runs × {config.steps} steps in {time.perf_counter() - t0:.1f} s")

alpha = traj.steps / N
eg, eg_ode = traj.loss / 2, traj.extra["ode_loss"] / 2
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.loglog(alpha[1:], eg[:, 1:].T, color="C0", alpha=0.25, lw=0.8)
ax.loglog(alpha[1:], eg[:, 1:].mean(0), color="C0", lw=2, label="SGD mean")
ax.loglog(alpha[1:], eg_ode[:, 1:].mean(0), "k--", label="ODE (mean over starts)")
ax.set(
    xlabel="α = steps / N",
    ylabel="ε_g = loss / 2",
    title=f"nn2pp's default at N = {N}",
    ylim=(1e-6, 1),
)
ax.legend()
fig.tight_layout()

# %% [markdown]
# The loss falls onto the *unspecialised plateau* by $\alpha \approx 10$. There both student
# units have the same overlap with both teacher units, and $\varepsilon_g$ stays near its
# plateau value $\approx 0.0146$. Later, the small asymmetry of the start grows and the
# units specialise. That escape happens at $\alpha \approx 150$–$300$, and then the loss
# decays exponentially. The ODE, integrated from each run's own start, follows the same
# path.
#
# The table gives the values at a few $\alpha$. The README has the same comparison at
# $N = 2000$, beside nn2pp's own output.

# %%
for a in (1, 10, 50, 100, 200, 300):
    i = np.argmin(np.abs(np.log(alpha[1:] / a))) + 1
    se = eg[:, i].std(ddof=1) / np.sqrt(traj.runs)
    print(
        f"α = {alpha[i]:6.1f}: SGD {eg[:, i].mean():.5f} ± {se:.5f}, "
        f"ODE {eg_ode[:, i].mean():.5f}"
    )

# %% [markdown]
# ## 2. The ODE alone
#
# `hermite.committee` integrates the order-parameter ODEs without simulating. Their state is
# the student–student overlaps $Q$, the student–teacher overlaps $R$ and the second layer $v$;
# the teacher's $T$ and $A$ are fixed. We start on or near the symmetric subspace, where
# every student unit has the same overlap with every teacher unit. In exact arithmetic the
# ODE cannot leave that subspace; it converges to the plateau's fixed point there. An
# asymmetry of size $a$ grows exponentially on the plateau, so the escape comes later the
# smaller $a$ is, by an amount proportional to $\log(1/a)$. With $a = 0$, rounding errors
# of order $10^{-16}$ take its place, and that escape comes last. At finite $N$, SGD's
# fluctuations (order $N^{-1/2}$) provide the asymmetry. In the model, `lr` is
# $\bar\eta = \eta N$ in loradyn's units: nn2pp's lr 0.5 is 0.25 here.

# %%
model = CommitteeModel(
    activation="erf(x/sqrt2)", T=np.eye(2), A=np.ones(2), lr=0.25, rows="free"
)
alphas = np.geomspace(0.1, 2000, 200)
fig, ax = plt.subplots(figsize=(6.5, 3.8))
for asym in (0.0, 1e-6, 1e-3):
    R0 = np.full((2, 2), 0.01) + asym * np.eye(2)
    start = CommitteeState.from_arrays(0.25 * np.eye(2), R0, np.ones(2))
    tr = committee_ode(model, start, alphas, integrator="solve_ivp")
    escape = alphas[np.argmax(tr.loss / 2 < 1e-3)]
    print(f"asymmetry {asym:g}: ε_g < 1e-3 from α ≈ {escape:.0f}")
    ax.loglog(alphas, np.clip(tr.loss / 2, 1e-8, None), label=f"asymmetry {asym:g}")
ax.set(xlabel="α", ylabel="ε_g", title="ODE: the plateau and its escape", ylim=(1e-8, 1))
ax.legend()
fig.tight_layout()

# %% [markdown]
# ## 3. SGD from given rows
#
# `init_rows` (the CLI's `--init-rows FILE`) starts every run at rows read from a `.npy`
# file. The array is $k'\times d$, or $R\times k'\times d$ for one start per run. With an
# orthonormal teacher, in the canonical frame (`init_frame="canonical"`), coordinate $i$ of
# a student row is its overlap with teacher row $i$. We start both rows near the plateau,
# each slightly closer to a different teacher row:
#
# $\hat w_1 = (0.35, 0.25, 0.5, 0, \dots)$, $\hat w_2 = (0.25, 0.35, 0, 0.5, \dots)$.
#
# All runs then share one ODE curve, and the SGD mean should approach it as $d$ grows.

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.8))
for d, color in ((100, "C1"), (400, "C2")):
    rows = np.zeros((2, d))
    rows[0, :4] = (0.35, 0.25, 0.5, 0.0)
    rows[1, :4] = (0.25, 0.35, 0.0, 0.5)
    path = workdir / f"start_{d}.npy"
    np.save(path, rows)
    run = simulate(
        RunConfig(
            {
                "activation": "erf(x/sqrt2)",
                "teacher": "committee",
                "k": 2,
                "d": d,
                "W": "orthonormal",
            },
            learner="scratch",
            rows="free",
            init_rows=str(path),
            init_frame="canonical",
            eta=0.5 / d,
            steps=40 * d,
            runs=24,
            seed=1,
            checkpoints=80,
            streams="counter",
        ).validate()
    )
    a = run.steps / d
    gap = np.sqrt(np.mean((run.loss - run.extra["ode_loss"]) ** 2))
    ax.plot(a, run.loss.mean(0), color=color, label=f"SGD mean, d = {d}")
    ax.fill_between(
        a,
        np.quantile(run.loss, 0.1, axis=0),
        np.quantile(run.loss, 0.9, axis=0),
        color=color,
        alpha=0.2,
    )
    print(f"d = {d}: RMS over runs of SGD − ODE = {gap:.4f}")
ax.plot(a, run.extra["ode_loss"][0], "k--", label="ODE (one start)")
ax.set(
    xlabel="α = steps / d",
    ylabel="loss E(f* − f̂)²",
    yscale="log",
    title="one given start: SGD (10–90 %) and its ODE",
)
ax.legend()
fig.tight_layout()

# %% [markdown]
# The runs spread less at $d = 400$ than at $d = 100$; the RMS gap to the ODE shrinks like
# $d^{-1/2}$. `benchmarks/given_start.py` measures this up to $d = 1600$ (table in
# [the engine page](../theory/committee-engine.md#given-initial-rows)).
#
# The same from the command line:
#
# ```
# loradyn run spec.json --rows free --init-rows start.npy --init-frame canonical \
#     --eta 0.005 --steps 4000 --out results/given.h5 --plot results/given.png
# loradyn hermite committee spec.json --rows free --init-rows start.npy \
#     --init-frame canonical --eta 0.005 --steps 4000
# ```
#
# If the spec gives the teacher's $W$ as an explicit $k\times d$ array, the rows may also be
# given in W's own coordinates. That is what `--init-frame auto` chooses in that case, and
# loradyn maps the rows into its frame exactly.

# %%
print(f"tutorial ran in {time.perf_counter() - t_start:.0f} s")

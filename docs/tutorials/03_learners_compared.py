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
# # Fine-tuning vs linearized vs scratch, and rank r
#
# The paper's point is that low-rank fine-tuning lies **between lazy training and feature
# learning**: unlike its linearization around the pretrained model (the NTK, lazy), it does
# learn the new direction; unlike a network trained from scratch on the same teacher, it
# needs only $T \propto d$ steps whatever the activation. One engine runs all of them: the
# learner is one field of the `RunConfig` ([Learners](../learners.md)).
#
# Three small experiments, each a few seconds on two cores:
#
# 1. fine-tuning against the linearized model at $\xi = \sqrt k$ (the paper's Fig. 3a);
# 2. fine-tuning against learning the teacher from scratch, He₃ (the paper's Claim 2);
# 3. rank-2 LoRA learning a teacher with two directions of unequal strength: one after the
#    other (incremental learning).

# %%
import math
import time

import matplotlib.pyplot as plt
import numpy as np

from dynamics.engines.engine import simulate
from dynamics.setup.config import RunConfig

t_start = time.perf_counter()


def band(ax, steps, values, label, **style):
    """Median over runs and the 10–90 % band."""
    q10, q50, q90 = np.nanquantile(values, [0.1, 0.5, 0.9], axis=0)
    (line,) = ax.plot(steps, q50, label=label, **style)
    ax.fill_between(steps, q10, q90, color=line.get_color(), alpha=0.2)
    return line


# %% [markdown]
# ## 1. Fine-tuning vs its linearization (ξ = √k)
#
# ReLU, $k = 8$, $d = 200$, the perturbation as large as the base rows allow, $\xi = \sqrt k$
# (unit rows, $W$ random, $c$ and $\hat c$ Gaussian). Both learners train $\hat u$ and $\hat c$
# jointly with the same η. The `linearized` learner runs SGD on the first-order Taylor model
# $f_0 + \sum_j \lambda_j \sigma'(z_j)\langle (I - w_j w_j^\top)\Delta_j, x\rangle$ with
# $\Delta = \xi \hat c \hat u^\top$; its `loss` is the true loss of the network with the
# learned rows, `extra/loss_linear` the linear model's own.

# %%
d, k = 200, 8
spec = {
    "activation": "relu",
    "k": k,
    "d": d,
    "xi": math.sqrt(k),
    "W": "separated",
    "c": "gaussian",
    "c_hat": "gaussian",
    "seed": 0,
}
common = dict(
    instance=spec,
    eta=0.02 / d,
    steps=150 * d,
    runs=4,
    seed=0,
    checkpoints=40,
    joint_c=True,
)
t0 = time.perf_counter()
ft = simulate(RunConfig(learner="finetune", engine="auto", **common).validate())
lin = simulate(RunConfig(learner="linearized", **common).validate())
print(
    f"finetune ({ft.engine} engine) and linearized ({lin.engine}) in "
    f"{time.perf_counter() - t0:.0f} s"
)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
band(ax1, ft.steps, ft.loss, "fine-tuning (rank-1 LoRA)")
band(ax1, lin.steps, lin.loss, "linearized: true loss")
band(
    ax1,
    lin.steps,
    lin.extra["loss_linear"],
    "linearized: linear model's loss",
    ls=":",
)
ax1.set(xscale="symlog", yscale="log", xlabel="steps", ylabel="population loss")
ax1.legend(fontsize=8)
band(ax2, ft.steps, np.abs(ft.overlap), "fine-tuning")
band(ax2, lin.steps, np.abs(lin.overlap), "linearized")
ax2.set(xscale="symlog", xlabel="steps", ylabel="|⟨û, u⟩|")
ax2.legend(fontsize=8)
fig.tight_layout()

# %%
print(
    f"final loss: fine-tuning {np.median(ft.loss[:, -1]):.4f}, "
    f"linearized {np.median(lin.loss[:, -1]):.3f} "
    f"(base model {np.median(ft.loss[:, 0]):.2f})"
)

# %% [markdown]
# Both find the direction $u$, but only fine-tuning turns it into a small loss: the
# linearized model cannot represent a perturbation of the rows this large, so its true loss
# stays far above fine-tuning's (the full-size version of this check,
# `benchmarks/fig3a_check.py`, is one of the [measured claims](../claims.md)).
#
# ## 2. Fine-tuning vs learning from scratch (He₃)
#
# The paper's Claim 2: He₃ (information exponent 3), $k = 4$, $d = 200$, $\xi = 1$, the teacher
# rows orthonormal (`W = "claim2"`), $\hat c = c$. The `scratch` learner trains a width-$k$
# two-layer network from random unit rows on the same teacher (squared loss). Fine-tuning gets
# 6000 steps, learning from scratch five times as many.

# %%
claim2 = {
    "activation": "he3",
    "k": 4,
    "d": 200,
    "xi": 1.0,
    "W": "claim2",
    "c_hat": "teacher",
    "seed": 0,
}
t0 = time.perf_counter()
ft2 = simulate(
    RunConfig(
        instance=claim2,
        learner="finetune",
        eta=0.05 / 200,
        steps=6000,
        runs=8,
        seed=0,
        checkpoints=40,
        engine="auto",
    ).validate()
)
sc2 = simulate(
    RunConfig(
        instance=claim2,
        learner="scratch",
        eta=0.005 / 200,
        steps=30000,
        runs=4,
        seed=0,
        checkpoints=40,
    ).validate()
)
print(
    f"finetune ({ft2.engine}) and scratch ({sc2.engine}) in "
    f"{time.perf_counter() - t0:.0f} s"
)

fig, ax = plt.subplots(figsize=(6.5, 3.6))
band(ax, ft2.steps, ft2.loss, "fine-tuning, 6·10³ steps")
band(ax, sc2.steps, sc2.loss, "from scratch, 3·10⁴ steps")
ax.set(xscale="symlog", yscale="log", xlabel="steps", ylabel="population loss")
ax.legend(fontsize=8)
fig.tight_layout()

# %%
reached = ft2.first_passage(0.9)
print(
    f"fine-tuning: overlap 0.9 after a median {np.nanmedian(reached):.0f} "
    f"steps, final loss {np.median(ft2.loss[:, -1]):.3f}"
)
print(
    f"from scratch after 5× the steps: loss {np.median(sc2.loss[:, -1]):.2f} "
    f"(start {np.median(sc2.loss[:, 0]):.2f}); alignment with the teacher rows "
    f"{np.median(sc2.extra['alignment'][:, -1]):.2f}"
)

# %% [markdown]
# From scratch the rows must first find the teacher's directions from an overlap of order
# $d^{-1/2}$, which for He₃ takes of the order of $d^2$ steps (the single-index version of
# this, learner `glm`, measures $T \propto d^{2.09}$); fine-tuning starts from the pretrained
# rows and only has to find $u$. With the full budget of `benchmarks/claim2_scratch.py`
# (2·10⁶ steps) learning from scratch reaches fine-tuning's loss after a median 374 times as
# many steps ([measured claims](../claims.md)).
#
# ## 3. Rank 2: one direction after the other
#
# The `lora` learner trains a rank-$r$ update $\xi \hat C \hat U^\top$, $\hat U$ on the Stiefel
# manifold. The teacher here is $\xi C U^\top$ with $C = A\,\mathrm{diag}(s_1, s_2)B^\top$
# (`C = "spectrum"`), $s_1 = 1$, $s_2 = 1/2$, and $\hat C = C$ frozen. What it learns is measured
# by the singular values of $M = U^\top \hat U$ (the cosines of the principal angles between
# the two planes); beside them the matrix ODE
# $\dot M = \eta[A(M) - M\,\mathrm{sym}(M^\top A(M))]$ from each run's $M_0$
# ([Rank r](../theory/rank-r.md)).

# %%
rank_spec = {
    "activation": "relu",
    "k": 8,
    "d": 200,
    "xi": 1.0,
    "W": "orthonormal",
    "lam": "ones",
    "c_hat": "teacher",
    "seed": 0,
    "C": "spectrum",
    "spectrum": [1.0, 0.5],
}
t0 = time.perf_counter()
lora = simulate(
    RunConfig(
        instance=rank_spec,
        learner="lora",
        rank=2,
        eta=0.2 / 200,
        steps=14000,
        runs=8,
        seed=0,
        checkpoints=60,
        spacing="linear",
        engine="full",
    ).validate()
)
print(
    f"lora rank 2 ({lora.engine} engine) in "
    f"{time.perf_counter() - t0:.0f} s; extras:",
    sorted(lora.extra),
)

sv, ode = lora.extra["singular_values"], lora.extra["ode_singular_values"]
fig, ax = plt.subplots(figsize=(6.5, 3.6))
for a in range(2):
    line = band(ax, lora.steps, sv[:, :, a], f"σ{'₁₂'[a]}(UᵀÛ), SGD")
    ax.plot(
        lora.steps,
        np.median(ode[:, :, a], 0),
        "--",
        color=line.get_color(),
        label=f"σ{'₁₂'[a]}, matrix ODE",
    )
ax.axhline(0.5, color="0.6", lw=0.8)
ax.set(xlabel="steps", ylabel="singular values of M = UᵀÛ")
ax.legend(fontsize=8)
fig.tight_layout()


# %%
def passage(curve, level=0.5):
    """Per run, the first checkpoint step at which ``curve`` (R, C)
    reaches ``level``."""
    hit = curve >= level
    return np.where(hit.any(1), lora.steps[np.argmax(hit, 1)], np.nan)


t1, t2 = (np.nanmedian(passage(sv[:, :, a])) for a in range(2))
o1, o2 = (np.nanmedian(passage(ode[:, :, a])) for a in range(2))
print(
    f"σ₁ passes 0.5 after {t1:.0f} steps, σ₂ after {t2:.0f}: "
    f"T₂/T₁ = {t2 / t1:.2f} (matrix ODE {o2 / o1:.2f})"
)
print(f"tutorial ran in {time.perf_counter() - t_start:.0f} s")

# %% [markdown]
# The stronger direction is learned first, the weaker one only once the first is in place:
# $T_2/T_1$ grows with $s_1/s_2$ (about $1 + (s_1/s_2)^2$; at $d = 500$ the
# [measured](../claims.md) ratios are 1.92, 5.14, 10.4 and 27.4 for $s_1/s_2$ = 1, 2, 3, 5).
# Recovering all $r$ directions still takes $T \propto d$ steps
# (`examples/scaling_lora_r2.toml`).

"""One protocol test over every learner of the registry (issue 23; geoopt's
``test_manifold_basic`` is the model).

Every registered learner, in its main variants, on a small instance (k = 3, d = 12, float64,
R = 3 runs), has the same five properties:

1. its closed-form step is autograd's: ``sample_gradients`` (per example) equals the gradient
   of its ``sample_loss`` by autograd, made Riemannian as its docstring states (Π onto
   span(W)^⊥ where projected, then the sphere's or Stiefel's tangent projection; masks), and
   ``step`` equals the reference step built from that autograd gradient (mean over the batch,
   then the retraction; plain SGD for Δ, free rows and the second layers), without touching
   its input. ``moment`` has no gradient: each step adds exactly the Stein statistic of its
   examples, computed here from the dense teacher. (That ``sample_loss`` is the paper's model
   is checked in each learner's own test file, against dense k×d matrices.)
2. a batch of runs is the runs alone: run r of an R-run ``FullRun`` (per-run streams) is run
   r of the (r+1)-run one, number for number — its numbers depend on (seed, r) only;
3. the state keeps its constraint over many steps: after each of 4 chunks of the engine's
   length of closed-form steps, before the chunk-end retraction, and after an engine run:
   unit û and rows to 1e-12, ÛᵀÛ = I to 1e-12, the span-W part of û (Û, Δ's rows) exactly 0
   where projected, ⟨wⱼ, Δⱼ⟩ = 0, frozen parts bit for bit; free rows are not renormalised;
4. a run is reproducible from its seed: the same config twice gives identical arrays, another
   seed different ones;
5. its declared memory bounds what it holds: ``memory(config, d, k)`` ≥ the state, records
   and prepared numbers per run, and ``dynamics.engines.budget.estimate`` ≥ the bytes of the state
   (twice: the engine's chunk snapshot).

Item 1 runs over a grid (every variant × activations × instance shapes); items 2–5 over the
``main`` variants. A learner added to the registry must be added here
(:func:`test_every_learner_is_covered`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch
from helpers import assert_close, dense_rows

from dynamics.engines.budget import estimate
from dynamics.engines.engine import FullRun
from dynamics.geometry import sphere, stiefel
from dynamics.learners import Problem, get_learner
from dynamics.learners.registry import LEARNERS
from dynamics.randomness.chunking import MAX_CHUNK_STEPS
from dynamics.setup.config import RunConfig

F64 = torch.float64
CPU = torch.device("cpu")
R, SEED, ETA, STEPS = 3, 7, 0.05, 200
GRAD_EXAMPLES = 3  # examples per run of the gradient check
WARMUP = 5  # steps that move the state off its (special) start before the checks
# chunks × steps of the constraint check: the engine's chunks, since between retractions
# ÛᵀÛ − I of the projected b = 1 lora step grows geometrically (here ~×10 per 500 steps:
# 1e-13 after 500 steps, 4e-2 after 5000), negligible over one chunk
LONG = 4, MAX_CHUNK_STEPS

SPEC = {"activation": "relu", "k": 3, "d": 12, "xi": 1.3, "c": "gaussian", "c_hat": "gaussian",
        "lam": "random_sign", "seed": 3}
COMMITTEE = {"activation": "relu", "k": 3, "d": 12, "teacher": "committee", "W": "gaussian",
             "seed": 3}
# u ⊥ span W with orthonormal rows, or a span-W part with non-orthogonal rows
SHAPES = {"ortho": {"W": "orthonormal", "u_alpha": 0.0},
          "sep": {"W": "separated", "u_alpha": 0.4}}
ALL_ACTIVATIONS = ("relu", "abs", "sigmoid", "tanh", "erf", "quadratic", "linear", "he3")
ACTIVATIONS = {  # item 1's activations per learner
    "finetune": ALL_ACTIVATIONS,
    "linearized": ("relu", "tanh", "he3"),
    "lora": ("relu", "tanh", "he3"),
    "scratch": ("relu", "tanh", "he3", "erf"),
    "scratch-csq": ("relu", "tanh", "he3", "erf"),
    "sparse": ("relu", "tanh", "he3", "erf"),
    "glm": ("he3", "relu", "tanh", "sigmoid"),
    "moment": ("relu",),
    "pretrained-glm": ("relu", "tanh", "he3"),
    "lora-ba": ("relu", "tanh", "he3"),
}
SECOND_LAYER = ("c_hat", "lam_hat")  # fields stepped with η_c, when trained


@dataclasses.dataclass(frozen=True)
class Variant:
    """A learner and its options (config keywords), on ``base`` updated by ``spec``."""

    id: str
    learner: str
    opts: dict
    main: bool = False  # items 2–5 too
    acts: tuple | None = None  # item 1's activations (default: ACTIVATIONS[learner])
    base: dict = dataclasses.field(default_factory=lambda: SPEC)
    spec: dict = dataclasses.field(default_factory=dict)

    def activations(self):
        return self.acts or ACTIVATIONS[self.learner]

    def shapes(self):
        return tuple(SHAPES) if self.base is SPEC else ("-",)


def _name(parts) -> str:
    return "-".join(p for p in parts if p)


def _variants() -> list[Variant]:
    out = []
    # finetune: projected / not × frozen / joint ĉ × b = 1 / 4, label noise, prox, App. B
    for project, joint, b in itertools.product((True, False), (False, True), (1, 4)):
        vid = _name(["finetune", "" if project else "noproj", "joint" if joint else "",
                     "b4" if b == 4 else ""])
        out.append(Variant(vid, "finetune", dict(project=project, joint_c=joint, batch=b),
                           main=vid in ("finetune", "finetune-noproj-joint-b4")))
    out += [Variant("finetune-joint-noise", "finetune", dict(joint_c=True, label_noise=0.3),
                    main=True),
            Variant("finetune-joint-prox", "finetune", dict(joint_c=True, prox=0.2)),
            Variant("finetune-appB-joint", "finetune", dict(joint_c=True), main=True,
                    spec={"convention": "appB"}),
            Variant("finetune-appB-sqrt-noproj-b4", "finetune", dict(project=False, batch=4),
                    spec={"convention": "appB-sqrt"})]
    # linearized, rank 1: projected / not × frozen / joint × b = 1 / 4 × prox
    for project, joint, b, prox in itertools.product((True, False), (False, True), (1, 4),
                                                     (0.0, 0.2)):
        if b == 4 and not prox:
            continue
        vid = _name(["linearized", "" if project else "noproj", "joint" if joint else "",
                     "b4" if b == 4 else "", "prox" if prox else ""])
        out.append(Variant(vid, "linearized", dict(project=project, joint_c=joint, batch=b,
                                                   prox=prox),
                           main=vid in ("linearized", "linearized-noproj-joint-b4-prox")))
    out.append(Variant("linearized-joint-noise", "linearized",
                       dict(joint_c=True, label_noise=0.3)))
    # linearized, full rank: projected / not × b = 1 / 4 × prox
    for project, b, prox in itertools.product((True, False), (1, 4), (0.0, 0.2)):
        vid = _name(["linearized-full", "" if project else "noproj", "b4" if b == 4 else "",
                     "prox" if prox else ""])
        out.append(Variant(vid, "linearized", dict(full_rank=True, project=project, batch=b,
                                                   prox=prox),
                           main=vid in ("linearized-full", "linearized-full-noproj-b4-prox")))
    out.append(Variant("linearized-full-noise", "linearized",
                       dict(full_rank=True, label_noise=0.3)))
    # lora: rank 1–3 × projected / not × frozen / joint; b = 4 and the QR retraction (ReLU)
    for rank, project, joint in itertools.product((1, 2, 3), (True, False), (False, True)):
        vid = _name([f"lora-r{rank}", "" if project else "noproj", "joint" if joint else ""])
        out.append(Variant(vid, "lora", dict(rank=rank, project=project, joint_c=joint),
                           main=vid in ("lora-r2", "lora-r2-joint")))
    out.append(Variant("lora-r2-joint-noise", "lora", dict(rank=2, joint_c=True,
                                                           label_noise=0.3)))
    for rank, project, joint, b, retraction in itertools.product(
            (1, 3), (True, False), (False, True), (1, 4), ("polar", "qr")):
        if b == 1 and retraction == "polar":
            continue  # above
        vid = _name([f"lora-r{rank}", "" if project else "noproj", "joint" if joint else "",
                     "b4" if b == 4 else "", "qr" if retraction == "qr" else ""])
        out.append(Variant(vid, "lora", dict(rank=rank, project=project, joint_c=joint,
                                             batch=b, retraction=retraction),
                           main=vid == "lora-r3-noproj-joint-b4-qr", acts=("relu",)))
    # the network learners: unit / free rows, fixed / trained λ̂, k′ ≠ k, committee teacher
    # (free rows: not he3, whose cubic growth blows free rows up at this η)
    noise = dict(label_noise=0.2)
    trained = dict(train_second_layer=True, eta_c=0.03)
    free = ("relu", "tanh", "erf")
    out += [
        Variant("scratch", "scratch", {}, main=True),
        Variant("scratch-trained-w5", "scratch", dict(width=5, **trained, **noise)),
        Variant("scratch-trained-w5-b4", "scratch", dict(width=5, batch=4, **trained, **noise),
                main=True),
        Variant("scratch-free", "scratch", dict(rows="free"), main=True, acts=free),
        Variant("scratch-free-trained-w4-b4", "scratch",
                dict(rows="free", width=4, batch=4, **trained), acts=free),
        Variant("scratch-free-committee", "scratch", dict(rows="free", **noise), main=True,
                acts=free, base=COMMITTEE),
        Variant("scratch-csq", "scratch-csq", dict(noise), main=True),
        Variant("scratch-csq-b4", "scratch-csq", dict(batch=4, **noise)),
        Variant("scratch-csq-free", "scratch-csq", dict(rows="free"), main=True, acts=free),
        Variant("sparse", "sparse", dict(noise)),
        Variant("sparse-b4", "sparse", dict(batch=4, **noise)),
        Variant("sparse-random", "sparse", dict(sparse_select="random", sparse_rows=2),
                main=True),
    ]
    # glm: b = 1 / 4 × label noise
    for b, sd in itertools.product((1, 4), (0.0, 0.3)):
        vid = _name(["glm", "b4" if b == 4 else "", "noise" if sd else ""])
        out.append(Variant(vid, "glm", dict(batch=b, label_noise=sd),
                           main=vid in ("glm", "glm-b4-noise")))
    # moment: order 1 / 2 × b = 1 / 4 × label noise
    for order, b, sd in itertools.product((1, 2), (1, 4), (0.0, 0.3)):
        vid = _name([f"moment-o{order}", "b4" if b == 4 else "", "noise" if sd else ""])
        out.append(Variant(vid, "moment", dict(moment_order=order, batch=b, label_noise=sd),
                           main=vid in ("moment-o1", "moment-o2-b4-noise")))
    # pretrained-glm: b = 1 / 4 × label noise (its own base μ·u, ½·mean loss)
    for b, sd in itertools.product((1, 4), (0.0, 0.3)):
        vid = _name(["pretrained-glm", "b4" if b == 4 else "", "noise" if sd else ""])
        out.append(Variant(vid, "pretrained-glm", dict(mu=0.5, batch=b, label_noise=sd),
                           main=vid in ("pretrained-glm", "pretrained-glm-b4-noise")))
    # lora-ba: rank 1 / 3 × b = 1 / 4, B gaussian, α, kaiming A, label noise (η_B = η_A and A
    # trained: the reference step; A frozen and LoRA+ in tests/test_lora_ba.py)
    out += [Variant("lora-ba", "lora-ba", dict(rank=1), main=True),
            Variant("lora-ba-r3-b4", "lora-ba", dict(rank=3, batch=4)),
            Variant("lora-ba-r3-gaussb-alpha", "lora-ba",
                    dict(rank=3, init_b="gaussian", b_scale=0.1, alpha=6.0)),
            Variant("lora-ba-r2-kaiming-b4-noise", "lora-ba",
                    dict(rank=2, init_a="kaiming", batch=4, label_noise=0.3), main=True)]
    return out


VARIANTS = _variants()
BY_ID = {v.id: v for v in VARIANTS}
MAIN = [pytest.param(v, id=v.id) for v in VARIANTS if v.main]
GRID = [pytest.param(v, act, shape, id=f"{v.id}-{act}-{shape}")
        for v in VARIANTS for act in v.activations() for shape in v.shapes()]


@pytest.fixture(autouse=True)
def one_thread():
    """Torch on one thread, as the engine's hot loop (small r×r LAPACK calls stall on
    OpenMP teams when the cores are busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(v: Variant, activation: str | None = None, shape: str = "sep", *, runs: int = R,
            seed: int = SEED, steps: int = STEPS) -> RunConfig:
    spec = dict(v.base)
    if activation is not None:
        spec["activation"] = activation
    if v.base is SPEC:
        spec.update(SHAPES[shape])
    spec.update(v.spec)
    return RunConfig(instance=spec, learner=v.learner, eta=ETA, steps=steps, runs=runs,
                     seed=seed, checkpoints=4, streams="per_run", finite_d_theory=False,
                     eval_size=1000, **v.opts).validate()


def _build(config: RunConfig):
    """(instances, learner, initial state), as ``FullRun`` builds them."""
    instances = config.run_instances()
    problem = Problem.from_instances(instances, CPU, F64)
    learner = get_learner(config.learner).from_config(config, problem)
    state, _ = learner.initial_state(config, instances)
    return instances, learner, state


def _names(state) -> list[str]:
    """The state's run-axis tensor fields, in order (``TensorState.tensors``)."""
    return [f.name for f in dataclasses.fields(state)
            if isinstance(getattr(state, f.name), torch.Tensor)
            and getattr(state, f.name).dim() > 0]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What the config says of each state field's manifold and step (read from the config,
    not from the learner, so that a learner ignoring an option is caught)."""

    k: int
    project: bool  # Π onto span(W)^⊥ on û / Û / Δ's gradient
    free: bool  # free rows (plain SGD) instead of unit rows (spherical SGD)
    joint_c: bool  # ĉ / Ĉ trained
    train_lam: bool  # λ̂ trained
    retraction: str  # Stiefel retraction of Û
    eta: float
    eta_c: float
    mask: torch.Tensor | None  # (R, k′) trainable rows (network learners)

    @classmethod
    def of(cls, config: RunConfig, learner) -> Geometry:
        o = config.options
        return cls(k=config.run_instances()[0].k, project=getattr(o, "project", False),
                   free=getattr(o, "rows", "unit") == "free",
                   joint_c=getattr(o, "joint_c", False),
                   train_lam=getattr(o, "train_second_layer", False),
                   retraction=getattr(o, "retraction", "polar"), eta=config.eta,
                   eta_c=config.step_size_c, mask=getattr(learner, "mask", None))

    def trained(self, name: str) -> bool:
        """Whether a step moves the field (second layers only when trained)."""
        return {"c_hat": self.joint_c, "lam_hat": self.train_lam}.get(name, True)


class _Examples:
    """x (R, b, d) and label normals (R, b) (None without label noise), one generator."""

    def __init__(self, learner, seed: int = 1):
        self.learner, self.d = learner, learner.problem.d
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, b: int, *lead: int):
        x = torch.randn(R, *lead, b, self.d, generator=self.gen, dtype=F64)
        eps = None
        if self.learner.needs_label_noise:
            eps = torch.randn(R, *lead, b, generator=self.gen, dtype=F64)
        return x, eps


# ---------------------------------------------------------------- item 1: autograd
def _autograd(learner, state, x, eps):
    """Per-example Euclidean gradients of ``sample_loss`` w.r.t. every state tensor,
    name → (R, b, …), and the loss (R, b). Runs are independent, so the gradient of the sum
    over runs of example j's loss gives every run's gradient of its own."""
    leaves = {n: getattr(state, n).detach().clone().requires_grad_(True) for n in _names(state)}
    loss = learner.sample_loss(dataclasses.replace(state, **leaves), x, eps)
    assert loss.shape == x.shape[:2] and loss.requires_grad
    per_example = []
    for j in range(x.shape[1]):
        grads = torch.autograd.grad(loss[:, j].sum(), list(leaves.values()), retain_graph=True,
                                    allow_unused=True)
        per_example.append([torch.zeros_like(t) if g is None else g
                            for g, t in zip(grads, leaves.values(), strict=True)])
    assert all(t._version == 0 for t in leaves.values())  # no in-place op on a leaf
    return ({n: torch.stack([g[i] for g in per_example], 1) for i, n in enumerate(leaves)},
            loss.detach())


def _tangent(geo: Geometry, name: str, point, grad):
    """The Riemannian gradient the learner's docstring states, from the Euclidean one
    (R, b, …): Π (span-W coordinates zeroed) where projected, then the tangent projection
    of the sphere (û, unit rows) or of Stiefel (Û); frozen rows masked."""
    k = geo.k
    if geo.project and name in ("u_hat", "delta"):
        grad = grad.clone()
        if name == "u_hat" and point.dim() == 3:
            grad[..., :k, :] = 0.0
        else:
            grad[..., :k] = 0.0
    if name == "u_hat":
        proju = sphere.proju if point.dim() == 2 else stiefel.proju
        return proju(point[:, None], grad)
    if name == "rows":
        if not geo.free:
            grad = sphere.proju(point[:, None], grad)
        return grad * geo.mask.to(grad.dtype)[:, None, :, None]
    return grad


def _reference_step(geo: Geometry, name: str, point, tangent):
    """One step from the mean tangent: retraction (sphere, Stiefel with the configured
    retraction) or plain SGD (Δ, free rows, trained second layers); frozen: unchanged."""
    if not geo.trained(name):
        return point
    step = (geo.eta_c if name in SECOND_LAYER else geo.eta) * tangent.mean(1)
    if name == "u_hat" and point.dim() == 2:
        return sphere.retr(point, -step)
    if name == "u_hat":
        return stiefel.retr(point, -step, geo.retraction)
    if name == "rows" and not geo.free or name == "v":  # v: plain SGD, then v/‖v‖
        return sphere.retr(point, -step)
    return point - step


def _check_gradients_and_step(config: RunConfig) -> None:
    _, learner, state = _build(config)
    geo = Geometry.of(config, learner)
    draw = _Examples(learner)
    for _ in range(WARMUP):  # off the start: Δ₀ = 0, sparse rows at W, ...
        health = learner.step_(state, *draw(config.batch))
        assert bool((torch.isfinite(health) & (health > 0)).all()), "warm-up diverged"
    names = _names(state)

    # sample_gradients == the Riemannian autograd gradient of sample_loss
    x, eps = draw(GRAD_EXAMPLES)
    closed = learner.sample_gradients(state, x, eps)
    auto, loss = _autograd(learner, state, x, eps)
    assert len(closed) - 1 >= len(names)
    assert all(g is None for g in closed[len(names):-1])
    for name, got in zip(names, closed, strict=False):
        assert got.shape == auto[name].shape, name
        assert_close(got, _tangent(geo, name, getattr(state, name), auto[name]))
    if not getattr(config.options, "prox", 0.0):  # sample_gradients' loss: without the prox term
        assert_close(closed[-1], loss, 1e-12)

    # step == the reference step from the autograd gradient; the input is untouched
    x, eps = draw(config.batch)
    auto, _ = _autograd(learner, state, x, eps)
    before = state.clone()
    new = learner.step(state, x, eps)
    assert new.step == state.step + 1 == before.step + 1
    other = state.clone()
    health = learner.step_(other, x, eps)
    assert health.shape == (R,) and bool((torch.isfinite(health) & (health > 0)).all())
    for name in names:
        point, got = getattr(state, name), getattr(new, name)
        assert torch.equal(point, getattr(before, name)), f"step changed its input's {name}"
        assert torch.equal(got, getattr(other, name)) and not got.requires_grad
        ref = _reference_step(geo, name, point, _tangent(geo, name, point, auto[name]))
        if geo.trained(name):
            assert_close(got, ref, 1e-12)
            assert float((got - point).abs().max()) > 1e-8, f"{name} did not move"
        else:
            assert torch.equal(got, point), f"frozen {name} moved"


def _dense_teacher(inst):
    """(W (k, d), V (k, d)) rows of the base network and of the teacher (paper's eq. 3)."""
    w, v, _ = dense_rows(inst)
    return w, v


def _stein_statistic(inst, x, eps, noise_sd: float, order: int):
    """One run's Σ x r (order 1, (d,)) or Σ r Π⊥xxᵀΠ⊥ ((d−k)²), and Σ r, over examples
    x (n, d): r = f*(x) + √noise·ε − f₀(x) from the dense teacher."""
    w, v = _dense_teacher(inst)
    sig = inst.activation.fn
    r = sig(x @ v.T) @ inst.lam - sig(x @ w.T) @ inst.lam
    if eps is not None:
        r = r + noise_sd * eps
    if order == 1:
        return x.T @ r, r.sum()
    xp = x[:, inst.k:]
    return (xp * r[:, None]).T @ xp, r.sum()


def _check_statistic(config: RunConfig) -> None:
    """``moment``: every step adds exactly the Stein statistic of its b examples."""
    instances, learner, state = _build(config)
    draw = _Examples(learner)
    xs, es = [], []
    for t in range(3):
        x, eps = draw(config.batch)
        health = learner.step_(state, x, eps)
        assert torch.equal(health, torch.ones(R, dtype=F64)) and state.step == t + 1
        xs.append(x)
        es.append(eps)
        for r in range(R):
            ex = torch.cat([e[r] for e in es]).numpy() if eps is not None else None
            stat, rsum = _stein_statistic(instances[r], torch.cat([x_[r] for x_ in xs]).numpy(),
                                          ex, learner.noise_sd, learner.order)
            np.testing.assert_allclose(state.stat[r].numpy(), stat, rtol=0,
                                       atol=1e-12 * np.abs(stat).max())
            assert abs(float(state.rsum[r]) - rsum) <= 1e-12 * max(abs(rsum), 1.0)
            if learner.order == 2:  # S₂ = Σ r (Π⊥xxᵀΠ⊥ − Π⊥): the identity term on read
                stat = stat - rsum * np.eye(stat.shape[0])
            np.testing.assert_allclose(learner.statistic(state)[r].numpy(), stat, rtol=0,
                                       atol=1e-12 * np.abs(stat).max())


@pytest.mark.parametrize("v, activation, shape", GRID)
def test_the_step_is_autograd(v, activation, shape):
    """Item 1 (module docstring), over the grid of variants × activations × shapes."""
    config = _config(v, activation, shape)
    if get_learner(config.learner).family == "estimator":
        _check_statistic(config)
    else:
        _check_gradients_and_step(config)


# ---------------------------------------------------------------- items 2–4: engine runs
def _advance(v: Variant, runs: int = R, seed: int = SEED) -> dict:
    """An engine run's numbers: m₀, initial and final state, records; name → (runs, …)."""
    run = FullRun(_config(v, runs=runs, seed=seed))
    out = {"m0": np.asarray(run.m0, dtype=float)}
    out |= {f"initial {n}": getattr(run.state, n).numpy().copy() for n in _names(run.state)}
    run.advance()
    assert (run.divergence.step == -1).all(), "a run diverged"
    out |= {f"final {n}": getattr(run.state, n).numpy().copy() for n in _names(run.state)}
    out |= {f"records {n}": a for n, a in run.records.arrays().items()}
    return out


@functools.cache
def _advanced(vid: str, runs: int = R) -> dict:
    return _advance(BY_ID[vid], runs)


@pytest.mark.parametrize("v", MAIN)
def test_a_batch_of_runs_is_the_runs_alone(v):
    """Item 2: run r of R runs = run r of r + 1 runs (its numbers depend on (seed, r))."""
    many = _advanced(v.id)
    for r in range(R - 1):
        alone = _advanced(v.id, r + 1)
        assert alone.keys() == many.keys()
        for name, a in alone.items():
            np.testing.assert_array_equal(a[r], many[name][r], err_msg=f"run {r}: {name}")


@pytest.mark.parametrize("v", MAIN)
def test_a_run_is_reproducible_from_its_seed(v):
    """Item 4: the same config twice → identical arrays; another seed → other numbers."""
    first, again = _advanced(v.id), _advance(v)
    assert again.keys() == first.keys()
    for name, a in first.items():
        np.testing.assert_array_equal(again[name], a, err_msg=name)
    other = _advance(v, seed=SEED + 1)
    finals = [n for n in first if n.startswith("final")]
    for r in range(R):
        assert any(not np.array_equal(other[n][r], first[n][r]) for n in finals), r


def _check_constraints(geo: Geometry, w_factor, start, state, tol: float = 1e-12) -> None:
    k, project = geo.k, geo.project
    for name in _names(state):
        a, a0 = getattr(state, name), getattr(start, name)
        assert bool(torch.isfinite(a).all()), name
        if not geo.trained(name):
            assert torch.equal(a, a0), f"frozen {name} moved"
            continue
        assert float((a - a0).abs().max()) > 1e-6, f"{name} did not move"
        if name == "u_hat" and a.dim() == 2:  # unit û; span-W part exactly 0 if projected
            assert float((torch.linalg.vector_norm(a, dim=-1) - 1).abs().max()) < tol
            if project:
                assert float(a[:, :k].abs().max()) == 0.0
        elif name == "u_hat":  # ÛᵀÛ = I; span-W rows exactly 0 if projected
            assert float(stiefel.orthonormality_error(a).max()) < tol
            if project:
                assert float(a[:, :k].abs().max()) == 0.0
        elif name == "rows":
            mask = geo.mask
            assert torch.equal(a[~mask], a0[~mask]), "a frozen row moved"
            norms = torch.linalg.vector_norm(a, dim=-1)
            if geo.free:  # unconstrained: their norms move
                moved = norms - torch.linalg.vector_norm(a0, dim=-1)
                assert float(moved[mask].abs().min()) > 1e-8
            else:
                assert float((norms - 1).abs().max()) < tol
        elif name == "delta":  # Δ's rows: span-W part 0 if projected; ⟨wⱼ, Δⱼ⟩ = 0 always
            if project:
                assert float(a[..., :k].abs().max()) == 0.0
            w_dot = (a[..., :k] * torch.as_tensor(w_factor)).sum(-1)
            assert float(w_dot.abs().max()) < tol * float(a.abs().max())
        elif name == "stat" and a.dim() == 3:  # Σ r Π⊥xxᵀΠ⊥ is symmetric
            assert_close(a, a.transpose(1, 2), tol)


@pytest.mark.parametrize("v", MAIN)
def test_the_state_keeps_its_constraint(v):
    """Item 3: over chunks of the engine's length (``MAX_CHUNK_STEPS``) of closed-form steps
    (``step_chunk_`` where the learner has one, as the engine), checked before each
    chunk-end retraction ``renormalize_``; and after an engine run."""
    config = _config(v)
    instances, learner, state = _build(config)
    geo, w_factor = Geometry.of(config, learner), instances[0].w_factor
    start, draw = state.clone(), _Examples(learner, seed=2)
    chunks, n = LONG
    norms = torch.empty((n, R), dtype=F64)
    chunked = getattr(learner, "step_chunk_", None)
    for _ in range(chunks):
        x, eps = draw(config.batch, n)
        pre = learner.prepare(state, x, eps)
        if chunked is not None:
            chunked(state, x, pre, norms)
        else:
            for i in range(n):
                norms[i] = learner.step_prepared_(state, x[:, i], pre, i)
        assert bool((torch.isfinite(norms) & (norms > 0)).all())
        _check_constraints(geo, w_factor, start, state)
        learner.renormalize_(state)
    assert state.step == chunks * n
    _check_constraints(geo, w_factor, start, state)
    run, names = _advanced(v.id), _names(state)
    _check_constraints(geo, w_factor,
                       dataclasses.replace(start, **{n_: torch.as_tensor(run[f"initial {n_}"])
                                                     for n_ in names}),
                       dataclasses.replace(start, **{n_: torch.as_tensor(run[f"final {n_}"])
                                                     for n_ in names}))


# ---------------------------------------------------------------- item 5: memory
# declarations found short by this test (strict: an XPASS fails, so the mark goes with the fix)
MEMORY = [pytest.param(v, id=v.id) for v in VARIANTS if v.main]


@pytest.mark.parametrize("v", MEMORY)
def test_declared_memory_bounds_the_measured(v):
    """Item 5: ``memory(config, d, k)`` ≥ what a run holds, records and prepares;
    ``budget.estimate`` ≥ the state's bytes, twice (the chunk snapshot)."""
    config = _config(v)
    instances, learner, state = _build(config)
    d, k = instances[0].d, instances[0].k
    mem = get_learner(config.learner).memory(config, d, k)
    for _ in range(2):
        learner.step_(state, *_Examples(learner)(config.batch))
    tensors = state.tensors()
    assert sum(t.numel() for t in tensors) == sum(getattr(state, n).numel()
                                                  for n in _names(state))
    held = sum(t.numel() for t in tensors) / R
    assert mem.state >= held, (mem.state, held)
    recorded = sum(np.asarray(a).size for a in learner.observe(state).values()) / R
    assert mem.records >= recorded, (mem.records, recorded)
    n = 3
    x, eps = _Examples(learner)(config.batch, n)
    pre = learner.prepare(state, x, eps)
    prepared = sum(getattr(pre, f.name).numel() for f in dataclasses.fields(pre)
                   if isinstance(getattr(pre, f.name), torch.Tensor)) / (R * n * config.batch)
    assert mem.prepared >= prepared, (mem.prepared, prepared)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    est = estimate(config)
    assert est.runs == R and est.total >= est.parts["state"] >= 2 * nbytes


# ---------------------------------------------------------------- the registry
def test_every_learner_is_covered():
    """Every registered learner is in the grid, and in the main variants."""
    assert {v.learner for v in VARIANTS} == set(LEARNERS)
    assert {v.learner for v in VARIANTS if v.main} == set(LEARNERS)
    assert len(BY_ID) == len(VARIANTS)  # ids are unique

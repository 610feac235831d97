"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import numpy as np
import torch

# the small fine-tuning instance of the CLI tests (ReLU, k = 3, d = 20, ξ = 1), as TOML
TINY_SPEC_TOML = 'activation = "relu"\nk = 3\nd = 20\nxi = 1.0\nseed = 9\n'


def assert_close(ours, ref, rtol: float = 1e-10, floor: float = 1e-300) -> None:
    """max |ours − ref| ≤ rtol · max(max |ref|, floor) (arrays or tensors, any device)."""
    ours, ref = torch.as_tensor(ours), torch.as_tensor(ref)
    scale = max(float(ref.abs().max()), floor)
    err = float((ours - ref).abs().max())
    assert err <= rtol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


def dense_rows(inst):
    """(W (k, d), V (k, d), u (d,)) of an instance written out in the canonical frame from
    the paper's model (eq. 3: vᵢ = (wᵢ + ξcᵢu)/‖wᵢ + ξcᵢu‖), numpy: an independent reference
    for the tests."""
    k, d = inst.k, inst.d
    w = np.zeros((k, d))
    w[:, :k] = inst.w_factor
    u = np.zeros(d)
    u[:k], u[k] = inst.u_w, inst.u_perp
    v = w + inst.xi * inst.c[:, None] * u
    return w, v / np.linalg.norm(v, axis=1, keepdims=True), u


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


# the tiny sweep of the sweep-machinery tests (ReLU, k = 3, d = 20, two ξ; theory off)
SWEEP_BASE = {"finite_d_theory": False, "runs": 2, "eta_times_d": 0.05, "steps_per_d": 5,
              "checkpoints": 6}
SWEEP_INSTANCE = {"activation": "relu", "k": 3, "d": 20, "seed": 1}


def sweep_toml(name: str | None = None, axes: dict | None = None, instance: dict | None = None,
               **base) -> str:
    """A sweep file's text: ``SWEEP_BASE`` updated by ``base``, ``SWEEP_INSTANCE`` by
    ``instance``, ``axes`` (default ξ ∈ {0.5, 1}), one ``key = value`` per line (so tests may
    edit it with ``str.replace``)."""
    lines = ([f"[sweep]\nname = {_toml_value(name)}"] if name else []) + ["[base]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (SWEEP_BASE | base).items()]
    lines += ["[base.instance]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (SWEEP_INSTANCE | (instance or {})).items()]
    lines += ["[axes]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (axes or {"xi": [0.5, 1.0]}).items()]
    return "\n".join(lines) + "\n"


def rank1_learner(cls, inst, runs: int, batch: int, *, project: bool, **kw):
    """(learner, state, x) of a rank-1 fine-tuning-like learner ``cls`` (Finetune,
    Linearized) on ``runs`` copies of ``inst``, float64 CPU: η = 0.07, η_c = 0.05, û₀ uniform
    (⊥ span W when projected), ĉ₀ = ĉ + 0.2·N(0, I) (any ĉ, not unit), a batch of examples
    x (runs, batch, d); everything from seed 11 (projected û₀: stream 5)."""
    from dynamics.learners import Problem
    from dynamics.randomness.sampling import uniform_perp_directions

    d, k = inst.d, inst.k
    problem = Problem.from_instances([inst] * runs, torch.device("cpu"), torch.float64)
    learner = cls(problem, eta=0.07, eta_c=0.05, project=project, batch=batch, **kw)
    gen = np.random.default_rng(11)
    if project:
        u0 = uniform_perp_directions(5, runs, d, k)
    else:
        u0 = gen.standard_normal((runs, d))
        u0 /= np.linalg.norm(u0, axis=1, keepdims=True)
    state = learner.init_state(u0)
    state.c_hat += 0.2 * torch.as_tensor(gen.standard_normal((runs, k)))
    x = torch.as_tensor(gen.standard_normal((runs, batch, d)))
    return learner, state, x


def assert_sample_loss_is(learner, state, x, dense_loss) -> None:
    """``learner.sample_loss`` and the loss of ``sample_gradients`` equal ``dense_loss(r, b)``
    (the loss of explicit k×d matrices, written out independently) for every run and example."""
    _, _, loss = learner.sample_gradients(state, x)
    ours = learner.sample_loss(state, x)
    for r in range(x.shape[0]):
        for b in range(x.shape[1]):
            ref = dense_loss(r, b)
            assert_close(ours[r, b], ref)
            assert_close(loss[r, b], ref)


def shrunk_sweep(sweep, d: int = 20, k: int = 3, **base):
    """A figure recipe's ``sweep(quick)`` at a test's size: ``base`` keys (runs, steps_per_d,
    …) and the instance's d, k replaced."""

    def shrunk(quick: bool) -> dict:
        spec = sweep(quick)
        spec["base"] |= base
        spec["base"]["instance"] |= {"d": d, "k": k}
        return spec

    return shrunk


def pretrained_setup(case, batch: int, noise: float, mu: float = 0.6, eta: float = 0.3,
                     shape=(3, 9, 2)):
    """The small pretrained-glm problem of its step tests: (learner, dense u (D,), ζ (R, D) or
    None, state, x (R, B, D), eps (R, B) or None). ``case`` = (student σ, teacher σ* or None,
    labels, mixed base); ``shape`` = (R, D, K). u has a span-W part (u_alpha > 0), so that the
    teacher direction must be read from the instance."""
    from dynamics.instances.instance import build_instance
    from dynamics.learners import Problem
    from dynamics.learners.pretrained_glm import PretrainedGLM, base_directions

    act, teacher, labels, mixed = case
    runs, d, k = shape
    inst = build_instance({"activation": act, "k": k, "d": d, "u_alpha": 0.4, "seed": 2})
    problem = Problem.from_instances([inst] * runs, torch.device("cpu"), torch.float64)
    zeta = base_directions(11, runs, d) if mixed else None
    learner = PretrainedGLM(problem, mu=mu, eta=eta, batch=batch, label_noise=noise, zeta=zeta,
                            teacher_activation=teacher, labels=labels)
    u = np.zeros(d)
    u[:k], u[k] = inst.u_w, inst.u_perp
    gen = np.random.default_rng(5)
    v = gen.standard_normal((runs, d))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    state = learner.init_state(gen.normal(0.0, 0.5, runs), v)
    x = torch.as_tensor(gen.standard_normal((runs, batch, d)))
    eps = torch.as_tensor(gen.standard_normal((runs, batch))) if noise else None
    return learner, u, zeta, state, x, eps


def assert_ba_flow_within(tr, case) -> None:
    """lora-ba's population flow within max(4 SE, 0.03) of the runs' mean at every checkpoint
    after the start: overlap, loss and update overlap (``tr``: a trajectory with the flow's
    ``ode``, ``extra/ode_loss`` and ``extra/ode_update_overlap``; ``case`` names it)."""
    runs = tr.overlap.shape[0]
    for x, y in ((tr.overlap, tr.ode), (tr.loss, tr.extra["ode_loss"]),
                 (tr.extra["update_overlap"], tr.extra["ode_update_overlap"])):
        diff = (x - y)[:, 1:]
        assert np.isfinite(diff).all()
        mean, se = diff.mean(0), diff.std(0, ddof=1) / np.sqrt(runs)
        assert (np.abs(mean) <= np.maximum(4 * se, 0.03)).all(), (case, mean, se)


def ba_chain_step_example(settings, start, run: int, dims, gen):
    """One step of lora-ba's exact chain for run ``run`` from its ``start`` state on drawn
    (x_A, x_E, ε, Λ), and the same state and example written out in R^d, the chain's frame
    (``dims`` = (d, t, rank, batch)): A = [Z, C Eᵀ], x = (x_A, E x_E + Q_ρ Λ) with E, Q_ρ
    orthonormal in the rest. Returns ((B′, Z′, C′, rss), A₀ (r, d), x (b, d), draws)."""
    from dynamics.reduced.lora_ba_chain import step_given

    d, t, rank, batch = dims
    z0, c0 = (start.state[n][run].copy() for n in ("z", "c"))
    lam = np.tril(gen.standard_normal((batch, batch)), -1)
    lam[np.diag_indices(batch)] = np.sqrt(gen.chisquare(d - t - rank - np.arange(batch)))
    draws = {"xa": gen.standard_normal((batch, t)), "xe": gen.standard_normal((batch, rank)),
             "eps": gen.standard_normal(batch), "lam": lam}
    new = step_given(settings, start, run, draws)
    basis, _ = np.linalg.qr(gen.standard_normal((d - t, rank + batch)))
    e, q = basis[:, :rank], basis[:, rank:]
    a0 = np.concatenate([z0, c0 @ e.T], -1)
    x = np.concatenate([draws["xa"], draws["xe"] @ e.T + lam @ q.T], -1)
    return new, a0, x, draws


def ks_last_two(full, red, names) -> dict:
    """{name: min over the last two checkpoints of the KS p-value of ``full`` against ``red``}
    for each observable ``name`` (``overlap``, ``loss`` or an ``extra`` key); each side must
    be finite in > 99 % of its runs there."""
    from scipy.stats import ks_2samp

    def values(tr, name):
        return getattr(tr, name) if name in ("overlap", "loss") else tr.extra[name]

    out = {}
    for name in names:
        a, b = values(full, name), values(red, name)
        ps = []
        for c in (-2, -1):
            x, y = a[:, c], b[:, c]
            assert np.isfinite(x).mean() > 0.99 and np.isfinite(y).mean() > 0.99
            ps.append(ks_2samp(x[np.isfinite(x)], y[np.isfinite(y)]).pvalue)
        out[name] = min(ps)
    return out


def excursion_hessian(loss_of_delta, k: int, width: int, h: float) -> np.ndarray:
    """(k, k) central finite-difference Hessian of ``loss_of_delta(Δ)`` in the rows' excursions
    εⱼ along one direction out of the span (Δ (k, width) zero but its last column ε): the
    truth for the escape's rest Hessian M (``hermite.flows.lora_ba_escape.rest_hessian``)."""
    def loss(eps):
        delta = np.zeros((k, width))
        delta[:, -1] = eps
        return float(loss_of_delta(delta))

    num = np.empty((k, k))
    for i in range(k):
        for j in range(k):
            e_i, e_j = h * np.eye(k)[i], h * np.eye(k)[j]
            num[i, j] = (loss(e_i + e_j) - loss(e_i - e_j) - loss(-e_i + e_j)
                         + loss(-e_i - e_j)) / (4 * h * h)
    return num


def ba_step_inputs(learner, dims: tuple, seed: int, scale_b: float = 0.4):
    """(b₀ (2, k, r), a₀ (2, r, d), x (2, b, d), ε (2, b), state) of two lora-ba runs for
    a one-step check: B, A, the batch and its label noise drawn from ``seed``; ``dims`` =
    (k, r, d, b)."""
    k, r, d, batch = dims
    gen = np.random.default_rng(seed)
    b0 = scale_b * gen.standard_normal((2, k, r))
    a0 = gen.standard_normal((2, r, d)) / np.sqrt(d)
    x = gen.standard_normal((2, batch, d))
    eps = gen.standard_normal((2, batch))
    return b0, a0, x, eps, learner.init_state(b0, a0)


def assert_corrected_beats_plain(traj, factor: float) -> dict:
    """The finite-η·d line ``ode_corrected`` within max(4 SE, 0.03) of the runs' mean overlap
    at every checkpoint after the start (SE of the paired difference), the plain ``ode`` not,
    and the corrected line's largest mean gap ≤ ``factor`` × the plain one's; returns
    {line: (largest |mean gap|, within)}."""
    assert traj.engine == "reduced" and (traj.diverged_step == -1).all()
    x = np.nan_to_num(traj.overlap[:, 1:])
    gaps = {}
    for name in ("ode", "ode_corrected"):
        line = getattr(traj, name)[:, 1:]
        assert np.isfinite(line).all()
        diff = x - line
        mean, se = diff.mean(0), diff.std(0, ddof=1) / np.sqrt(diff.shape[0])
        gaps[name] = (np.abs(mean).max(), (np.abs(mean) <= np.maximum(4 * se, 0.03)).all())
    assert gaps["ode_corrected"][1] and not gaps["ode"][1], gaps
    assert gaps["ode_corrected"][0] <= factor * gaps["ode"][0], gaps
    return gaps


def saddle_jacobian(geo, dims: tuple, scale: float, ratio: float, rest: float,
                    h: float = 1e-6) -> np.ndarray:
    """((k + t), (k + t)) central-difference Jacobian of the lora-ba population flow
    (dB/dτ = −ratio·∂F/∂B, dZ/dτ = −∂F/∂Z) at B = 0, Z = 0, rank 1, A's rest √rest: the truth
    for the escape's saddle matrix L (``hermite.flows.lora_ba_escape.saddle_matrix``);
    ``dims`` = (k, t)."""
    from hermite.flows.lora_ba import lora_ba_gradient

    k, t = dims

    def rhs(y):
        a = np.concatenate([y[k:], [np.sqrt(rest)]])[None]
        gb, ga = lora_ba_gradient(geo, y[:k].reshape(k, 1), a, scale)
        return np.concatenate([-ratio * gb[:, 0], -ga[0, :t]])

    return np.stack([(rhs(h * e) - rhs(-h * e)) / (2 * h) for e in np.eye(k + t)], 1)

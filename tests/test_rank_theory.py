"""Rank-r population theory (hermite.flows.rank) against r = 1 theory, calculus and Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hermite
from dynamics.instances.instance import build_instance
from dynamics.instances.lora_instance import build_lora_instance
from dynamics.setup.config import ConfigError

K = 5


def _inst(activation="relu", rank=2, u_alpha=0.0, W="orthonormal", options=None, d=40,
          c_hat="gaussian", xi=1.2, seed=7):
    base = build_instance({"activation": activation, "k": K, "d": d, "xi": xi, "W": W,
                           "c": "gaussian", "c_hat": c_hat, "lam": "random_sign",
                           "u_alpha": u_alpha, "seed": seed})
    return build_lora_instance(base, rank, options or {})


def _random_m(r, n, scale=0.95, seed=0):
    """n matrices (n, r, r) with singular values ≤ scale."""
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, _, bt = np.linalg.svd(gen.standard_normal((r, r)))
        out.append((a * gen.uniform(-scale, scale, r)) @ bt)
    return np.array(out)


def _orthogonal(r, seed):
    q, rr = np.linalg.qr(np.random.default_rng(seed).standard_normal((r, r)))
    return q * np.sign(np.diag(rr))


# ---------------------------------------------------------------- r = 1 = the rank-1 theory
@pytest.mark.parametrize("activation", ["relu", "tanh", "he3", "erf"])
@pytest.mark.parametrize("u_alpha", [0.0, 0.35])
def test_rank_one_is_the_rank_one_theory(activation, u_alpha):
    li = _inst(activation, 1, u_alpha, W="separated" if u_alpha else "orthonormal")
    base = li.base
    m = np.linspace(-base.u_perp, base.u_perp, 13)
    drift = hermite.overlap_drift(li, m[:, None, None])[:, 0, 0]
    np.testing.assert_allclose(drift, hermite.h(base, m) * (base.u_perp**2 - m**2),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(hermite.A_matrix(li, m[:, None, None])[:, 0, 0],
                               hermite.h(base, m), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(hermite.population_loss_rank(li, m[:, None, None]),
                               hermite.population_loss(base, m), rtol=0, atol=1e-12)
    steps = [0, 1, 7, 300]
    ode = hermite.matrix_ode(li, 0.02, m[:, None, None] * 0.9, steps)[..., 0, 0]
    ref = hermite.population_ode(base, 0.02, m * 0.9, steps, method="exact")
    np.testing.assert_allclose(ode, ref, rtol=0, atol=1e-12)


def test_rank_one_instance_is_the_base_instance():
    li = _inst("relu", 1, 0.3, W="separated")
    np.testing.assert_array_equal(li.C[:, 0], li.base.c)
    np.testing.assert_array_equal(li.C_hat[:, 0], li.base.c_hat)
    np.testing.assert_array_equal(li.U_w[:, 0], li.base.u_w)
    assert li.U_perp[0, 0] == li.base.u_perp
    np.testing.assert_allclose(li.teacher_norms(), li.base.teacher_norms(), rtol=1e-15)
    np.testing.assert_allclose(li.teacher_gram(), li.base.teacher_gram(), atol=1e-15)


# ---------------------------------------------------------------- calculus
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_a_is_minus_the_m_derivative_of_the_loss(rank, activation):
    li = _inst(activation, rank)
    m = _random_m(rank, 3, 0.9, seed=rank)
    a = hermite.A_matrix(li, m)
    h = 1e-5
    for n in range(m.shape[0]):
        fd = np.zeros((rank, rank))
        for i in range(rank):
            for j in range(rank):
                e = np.zeros((rank, rank))
                e[i, j] = h
                fd[i, j] = -(hermite.population_loss_rank(li, m[n] + e)
                             - hermite.population_loss_rank(li, m[n] - e)) / (2 * h)
        np.testing.assert_allclose(fd, a[n], rtol=0, atol=1e-7 * np.abs(a[n]).max())


def _relu_kernel(rho):
    """Closed-form ReLU dual kernel, torch (autograd): (√(1−ρ²) + (π − arccos ρ)ρ)/(2π)."""
    rho = rho.clamp(-1.0, 1.0)
    return (torch.sqrt(1.0 - rho * rho) + (math.pi - torch.arccos(rho)) * rho) / (2 * math.pi)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_riemannian_gradient_of_the_loss_is_the_overlap_drift(rank):
    """Autograd of the exact loss Φ(Û) (rows normalised, everything depending on Û) gives,
    after Π and the tangent projection, −[ΠU A(M) − Û sym(MᵀA(M))]."""
    li = _inst("relu", rank)
    k, d = K, K + 2 * rank + 2
    gen = np.random.default_rng(rank)
    w = torch.zeros(k, d, dtype=torch.float64)
    w[:, :k] = torch.as_tensor(li.w_factor)
    u = torch.zeros(d, rank, dtype=torch.float64)
    u[: k + rank] = torch.as_tensor(li.U_coords)
    g = gen.standard_normal((d - k, rank))
    g, _ = np.linalg.qr(g)
    u_hat = torch.zeros(d, rank, dtype=torch.float64)
    u_hat[k:] = torch.as_tensor(g)
    c, ch = torch.as_tensor(li.C), torch.as_tensor(li.C_hat)
    lam = torch.as_tensor(li.lam)
    xi = li.xi
    v = w + xi * c @ u.T
    v = v / v.norm(dim=1, keepdim=True)
    uh = u_hat.clone().requires_grad_(True)
    vh = w + xi * ch @ uh.T
    vh = vh / vh.norm(dim=1, keepdim=True)
    lam2 = torch.outer(lam, lam)
    diag = torch.eye(k, dtype=torch.bool)  # ⟨v̂ⱼ, v̂ⱼ⟩ = 1: K(1) = 1/2 (K′ is singular there)
    k_s = torch.where(diag, 0.5, _relu_kernel(torch.where(diag, 0.0, vh @ vh.T)))
    phi = (lam2 * (_relu_kernel(v @ v.T) + k_s - 2 * _relu_kernel(v @ vh.T))).sum()
    (grad,) = torch.autograd.grad(phi, uh)
    grad[:k] = 0.0
    from dynamics.geometry import stiefel
    riem = stiefel.proju(u_hat, grad).numpy()
    m = (u.T @ u_hat).numpy()
    np.testing.assert_allclose(float(phi.detach()), hermite.population_loss_rank(li, m),
                               atol=1e-12)
    a = hermite.A_matrix(li, m)
    mta = m.T @ a
    expect = -(u.numpy() @ a - u_hat.numpy() @ (0.5 * (mta + mta.T)))
    np.testing.assert_allclose(riem, expect, rtol=0, atol=1e-12)
    np.testing.assert_allclose(u.numpy().T @ riem, -hermite.overlap_drift(li, m), atol=1e-12)


# ---------------------------------------------------------------- Monte Carlo
def _mc_frames(li, m, unprojected_omega=None):
    """Explicit U, Û (in the first k + 2r + 1 coordinates) with UᵀÛ = M."""
    k, r = li.k, li.rank
    dim = k + 2 * r + 1
    u = np.zeros((dim, r))
    u[: k + r] = li.U_coords
    # Û = Π⊥U M' + V (I − M'ᵀM')^{1/2}, V on coordinates k+r.., with U_⊥ᵀ Π⊥U M' = M
    vals, vecs = np.linalg.eigh(np.eye(r) - m.T @ m)
    root = (vecs * np.sqrt(np.clip(vals, 0, None))) @ vecs.T
    u_hat = np.zeros((dim, r))
    u_hat[k: k + r] = m
    u_hat[k + r: k + 2 * r] = root
    return u, u_hat


def _mc_terms(li, u, u_hat, x):
    """Labels, student outputs and g = Σ δⱼ ξĉⱼ/N̂ⱼ for samples x (n, dim), Û ⊥ span W."""
    k = li.k
    w = np.zeros((k, x.shape[1]))
    w[:, :k] = li.w_factor
    xi, act = li.xi, li.activation
    v = w + xi * li.C @ u.T
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    nh = li.student_norms()
    vh = (w + xi * li.C_hat @ u_hat.T) / nh[:, None]
    y = act.fn(x @ v.T) @ li.lam
    a = x @ vh.T
    f = act.fn(a) @ li.lam
    delta = -2.0 * (y - f)[:, None] * li.lam * act.deriv(a)
    g = delta @ (xi * li.C_hat / nh[:, None])
    return y, f, g


def _zscore(samples, target):
    mean = samples.mean(0)
    se = samples.std(0, ddof=1) / math.sqrt(samples.shape[0])
    return np.abs(mean - target) / np.maximum(se, 1e-300)


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_loss_drift_and_a_against_monte_carlo(activation):
    rank = 2
    li = _inst(activation, rank, options={"C": "spectrum", "spectrum": [1.5, 0.7]})
    m = _random_m(rank, 1, 0.8, seed=3)[0]
    u, u_hat = _mc_frames(li, m)
    np.testing.assert_allclose(u.T @ u_hat, m, atol=1e-14)
    np.testing.assert_allclose(u_hat.T @ u_hat, np.eye(rank), atol=1e-14)
    x = np.random.default_rng(11).standard_normal((400_000, u.shape[0]))
    y, f, g = _mc_terms(li, u, u_hat, x)
    assert _zscore((y - f) ** 2, hermite.population_loss_rank(li, m)) < 4.5
    # Riemannian sample gradient (Π x gᵀ projected on the tangent space) in U's coordinates
    px = x.copy()
    px[:, : li.k] = 0.0
    s = px @ u_hat  # Ûᵀx
    sg = s[:, :, None] * g[:, None, :]
    tangent_u = (px @ u)[:, :, None] * g[:, None, :] - m @ (0.5 * (sg + np.swapaxes(sg, 1, 2)))
    z = _zscore(tangent_u.reshape(len(x), -1), -hermite.overlap_drift(li, m).ravel())
    assert z.max() < 4.5, z
    # A itself: E[Uᵀ(I − ÛÛᵀ) Πx gᵀ] = −(I − MMᵀ) A(M) (the student-Gram terms drop out)
    comp = (px @ u - s @ m.T)[:, :, None] * g[:, None, :]
    target = -(np.eye(rank) - m @ m.T) @ hermite.A_matrix(li, m)
    z = _zscore(comp.reshape(len(x), -1), target.ravel())
    assert z.max() < 4.5, z


def test_unprojected_loss_against_monte_carlo():
    """Û with a component in span W: the exact loss with ω = WÛ against samples."""
    rank = 2
    li = _inst("relu", rank, u_alpha=0.3, W="separated")
    k, dim = K, K + 2 * rank + 1
    gen = np.random.default_rng(5)
    u = np.zeros((dim, rank))
    u[: k + rank] = li.U_coords
    u_hat, _ = np.linalg.qr(gen.standard_normal((dim, rank)))
    w = np.zeros((k, dim))
    w[:, :k] = li.w_factor
    m, omega = u.T @ u_hat, w @ u_hat
    xi, act = li.xi, li.activation
    v = w + xi * li.C @ u.T
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    vh = w + xi * li.C_hat @ u_hat.T
    vh /= np.linalg.norm(vh, axis=1, keepdims=True)
    x = gen.standard_normal((400_000, dim))
    err = (act.fn(x @ v.T) @ li.lam - act.fn(x @ vh.T) @ li.lam) ** 2
    assert _zscore(err, hermite.population_loss_rank(li, m, omega=omega)) < 4.5


# ---------------------------------------------------------------- gauge and ODE structure
@pytest.mark.parametrize("rank", [2, 3])
def test_gauge_invariance(rank):
    li = _inst("tanh", rank, options={"C": "spectrum", "spectrum": [2.0, 1.0, 0.5][:rank]})
    q, qh = _orthogonal(rank, 1), _orthogonal(rank, 2)
    lg = li.with_gauge(q, qh)
    m = _random_m(rank, 4, 0.9, seed=9)
    mg = np.swapaxes(q, 0, 1) @ m @ qh  # M = UᵀÛ ↦ QᵀM Q̂ under (U, Û) ↦ (UQ, ÛQ̂)
    np.testing.assert_allclose(hermite.population_loss_rank(lg, mg),
                               hermite.population_loss_rank(li, m), atol=1e-13)
    np.testing.assert_allclose(hermite.A_matrix(lg, mg), q.T @ hermite.A_matrix(li, m) @ qh,
                               atol=1e-13)
    np.testing.assert_allclose(hermite.overlap_drift(lg, mg),
                               q.T @ hermite.overlap_drift(li, m) @ qh, atol=1e-13)
    steps = [0, 10, 200]
    sv = hermite.singular_values(hermite.matrix_ode(li, 0.05, 0.3 * m, steps))
    svg = hermite.singular_values(hermite.matrix_ode(lg, 0.05, 0.3 * mg, steps))
    np.testing.assert_allclose(svg, sv, atol=1e-12)


def test_ode_stays_on_the_overlap_set_and_learns():
    """σ(M) ≤ 1 along the flow (the drift is tangent to the Stiefel image) and M → O(r)."""
    li = _inst("relu", 2, options={"C": "spectrum", "spectrum": [1.5, 1.0]}, c_hat="teacher")
    m0 = _random_m(2, 3, 0.05, seed=4)
    sv = hermite.singular_values(hermite.matrix_ode(li, 0.01, m0, [0, 100, 1000, 40_000]))
    assert np.all(sv <= 1.0 + 1e-9)
    assert np.all(sv[:, -1] > 0.97)
    assert np.all(sv[:, 1, 0] > sv[:, 0, 0])  # the top direction grows from the start


def test_stacked_constants_match_per_instance():
    insts = [_inst("relu", 2, seed=s) for s in (1, 2, 3)]
    m0 = _random_m(2, 3, 0.2, seed=1)
    steps = [0, 5, 50]
    stacked = hermite.matrix_ode(hermite.RankConstants.stack(insts), 0.03, m0, steps)
    for n, inst in enumerate(insts):
        np.testing.assert_allclose(stacked[n], hermite.matrix_ode(inst, 0.03, m0[n], steps),
                                   atol=1e-15)


def test_signed_smallest_and_singular_values():
    m = np.array([[[0.5, 0.0], [0.0, -0.2]], [[0.3, 0.1], [0.0, 0.4]]])
    np.testing.assert_allclose(hermite.singular_values(m)[0], [0.5, 0.2])
    np.testing.assert_allclose(hermite.signed_smallest(m)[0], -0.2)
    assert hermite.signed_smallest(m)[1] > 0
    np.testing.assert_allclose(hermite.signed_smallest(np.array([[[-0.7]]])), [-0.7])


# ---------------------------------------------------------------- instances and validation
def test_spectrum_generator_has_the_prescribed_singular_values():
    li = _inst("relu", 3, options={"C": "spectrum", "spectrum": [3.0, 1.0, 0.25]})
    np.testing.assert_allclose(np.linalg.svd(li.C, compute_uv=False), [3.0, 1.0, 0.25])
    again = _inst("relu", 3, options={"C": "spectrum", "spectrum": [3.0, 1.0, 0.25]})
    np.testing.assert_array_equal(li.C, again.C)  # seeded


def test_generators_and_u_alpha_frame():
    li = _inst("relu", 3, u_alpha=0.4, W="separated",
               options={"C": "quantized", "C_hat": "teacher"})
    assert np.all(np.abs(np.abs(li.C) - 1 / math.sqrt(K)) < 1e-15)
    np.testing.assert_array_equal(li.C_hat, li.C)
    u = li.U_coords
    np.testing.assert_allclose(u.T @ u, np.eye(3), atol=1e-14)
    np.testing.assert_allclose(li.perp_gram, (1 - 0.4**2) * np.eye(3), atol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(li.U_w, axis=0), 0.4, atol=1e-14)
    gauss = _inst("relu", 3, options={"C": "gaussian"})
    np.testing.assert_allclose(np.linalg.norm(gauss.C, axis=0), 1.0, atol=1e-14)
    np.testing.assert_array_equal(gauss.C[:, 0], gauss.base.c)


@pytest.mark.parametrize("rank, options, d, match", [
    (6, {}, 40, "rank"),
    (3, {}, 8, "d ≥ k"),
    (2, {"C": "spectrum"}, 40, "spectrum"),
    (2, {"C": "spectrum", "spectrum": [1.0]}, 40, "spectrum"),
    (2, {"C": "spectrum", "spectrum": [1.0, 2.0]}, 40, "non-increasing"),
    (2, {"C": "spectrum", "spectrum": [1.0, -1.0]}, 40, "> 0"),
    (2, {"C": "bogus"}, 40, "unknown generator"),
    (2, {"C": np.ones((K, 3))}, 40, "shape"),
    (2, {"C_hat": "spectrum"}, 40, "unknown generator"),
    (2, {"spectrum": [1.0, 1.0]}, 40, "only used"),
    (2, {"typo": 1}, 40, "unknown rank-r key"),
])
def test_bad_rank_keys_raise_config_error(rank, options, d, match):
    with pytest.raises(ConfigError, match=match):
        _inst("relu", rank, options=options, d=d)


def test_bad_overlap_matrices_raise():
    li = _inst("relu", 2)
    with pytest.raises(ValueError, match="shape"):
        hermite.A_matrix(li, np.zeros((3, 3)))
    with pytest.raises(ValueError, match="singular values"):
        hermite.overlap_drift(li, 1.1 * np.eye(2))
    with pytest.raises(ValueError, match="finite"):
        hermite.population_loss_rank(li, np.full((2, 2), np.nan))
    with pytest.raises(ValueError, match="eta"):
        hermite.matrix_ode(li, -1.0, np.zeros((2, 2)), [0, 1])


def test_matrix_flow_tracks_the_map_to_order_eta():
    """The continuous flow (used for long horizons) differs from the discrete map by O(η):
    halving η (same η·t) halves the gap."""
    import hermite
    from dynamics.instances.instance import build_instance
    from dynamics.instances.lora_instance import build_lora_instance

    inst = build_lora_instance(build_instance({"activation": "relu", "k": 4, "d": 50,
                                               "xi": 1.0, "c_hat": "teacher"}), 2,
                               {"C": "spectrum", "spectrum": [1.5, 1.0]})
    m0 = np.array([[0.1, 0.02], [-0.03, 0.08]])
    gaps = []
    for eta in (0.02, 0.01):
        steps = np.array([0, int(2 / eta), int(6 / eta)])
        a = hermite.matrix_ode(inst, eta, m0, steps, method="map")
        b = hermite.matrix_ode(inst, eta, m0, steps, method="continuous")
        gaps.append(np.abs(a - b).max())
    assert gaps[0] > 1e-6 and 1.7 < gaps[0] / gaps[1] < 2.3, gaps

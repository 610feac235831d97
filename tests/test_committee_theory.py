"""Committee-machine ODEs (hermite.committee): drifts and loss against Monte Carlo of the
sample update, closed forms against quadrature, nn2pp's erf ODE, bad input."""

import subprocess
import sys
import zlib

import numpy as np
import pytest
from scipy.optimize import fsolve
from scipy.special import ndtr

from hermite import dual_kernel
from hermite._activation import resolve_activation
from hermite.committee import (
    CommitteeIntegrals,
    CommitteeModel,
    CommitteeState,
    committee_alignment,
    committee_drift,
    committee_loss,
    committee_ode,
    committee_terms,
    scaled_erf,
)
from hermite.committee import _nested as nested

Z_MAX = 5.0


# ---------------------------------------------------------------- Monte Carlo reference
def _embed(G):
    w, U = np.linalg.eigh(G)
    return U * np.sqrt(np.clip(w, 0.0, None))  # rows with Gram matrix G


def sample_update(model, state, N, n, rng, chunk=40_000):
    """N·ΔQ, N·ΔR, N·Δv of n independent SGD steps at state (per-step arrays) and the
    squared error s(f* − f̂)² of the step's inputs.

    The inputs x ∈ R^N are drawn in the span of the K + M rows (P coordinates) plus the
    Gram matrix of their orthogonal parts (Wishart(N − P, I_b), Bartlett), which is all the
    update depends on; the update is the engine's: free rows w ← w − η G, unit rows
    w ← (w − η(G − ⟨w, G⟩w))/n, G = mean_s δ^s x^s, η = lr/N, second layer v ← v − (lr_v/N)·∂L/∂v.
    """
    act = resolve_activation(model.activation)
    K, M, b = state.Q.shape[0], model.M, model.batch
    P = K + M
    X = _embed(np.block([[state.Q, state.R], [state.R.T, model.T]]))
    Wk, Vt = X[:K], X[K:]
    v, A, s = state.v, model.A, model.loss_scale
    eta = model.lr / N
    out = {"Q": [], "R": [], "v": [], "err": []}
    done = 0
    while done < n:
        m = min(chunk, n - done)
        x = rng.standard_normal((m, b, P))
        Lw = np.zeros((m, b, b))
        for i in range(b):
            Lw[:, i, i] = np.sqrt(rng.chisquare(N - P - i, m))
            Lw[:, i, :i] = rng.standard_normal((m, i))
        gram_x = np.einsum("nsp,ntp->nst", x, x) + Lw @ Lw.transpose(0, 2, 1)
        lam, nu = x @ Wk.T, x @ Vt.T
        clean = act.fn(nu) @ A
        y = clean + np.sqrt(model.noise_var) * rng.standard_normal((m, b))
        yhat = act.fn(lam) @ v
        outer = -2.0 * s * (y - yhat) if model.loss == "squared" else -s * y
        delta = outer[..., None] * v * act.deriv(lam)  # ∂L/∂λ_k (m, b, K)
        if model.trainable is not None:
            delta = delta * np.asarray(model.trainable, dtype=float)
        Gw = np.einsum("nsk,nsl->nkl", delta, lam) / b  # ⟨G_k, w_l⟩
        Gv = np.einsum("nsk,nsj->nkj", delta, nu) / b  # ⟨G_k, v_j⟩
        GG = np.einsum("nsk,nst,ntl->nkl", delta, gram_x, delta) / b ** 2
        if model.rows == "free":
            dQ = -eta * (Gw + Gw.transpose(0, 2, 1)) + eta ** 2 * GG
            dR = -eta * Gv
        else:
            Q = state.Q[None]
            gk = np.diagonal(Gw, axis1=1, axis2=2)
            gl, gk_ = gk[:, None, :], gk[:, :, None]
            GwT = Gw.transpose(0, 2, 1)
            uu = (Q - eta * (GwT - gl * Q) - eta * (Gw - gk_ * Q)
                  + eta ** 2 * (GG - gl * Gw - gk_ * GwT + gk_ * gl * Q))
            uv = state.R[None] - eta * (Gv - gk_ * state.R[None])
            nk = np.sqrt(np.diagonal(uu, axis1=1, axis2=2))
            dQ = uu / nk[:, :, None] / nk[:, None, :] - Q
            dR = uv / nk[:, :, None] - state.R[None]
        if model.lr_v is not None:
            gl_v = np.einsum("ns,nsk->nk", -2.0 * s * (y - yhat), act.fn(lam)) / b
            dv = -(model.lr_v / N) * gl_v
        else:
            dv = np.zeros((m, K))
        out["Q"].append(N * dQ)
        out["R"].append(N * dR)
        out["v"].append(N * dv)
        out["err"].append(s * ((clean - yhat) ** 2).mean(1))
        done += m
    return {k: np.concatenate(val) for k, val in out.items()}


def random_state(K, M, rows, rng):
    """A generic state: rows in R^(K+M+3), students partly aligned with teachers."""
    D = K + M + 3
    W = rng.standard_normal((K, D))
    V = rng.standard_normal((M, D))
    W += 0.8 * V[rng.integers(0, M, K)]
    if rows == "unit":
        W /= np.linalg.norm(W, axis=1, keepdims=True)
        V /= np.linalg.norm(V, axis=1, keepdims=True)
    else:
        W /= np.sqrt(D)
        V /= np.sqrt(D)
    v = rng.normal(0.8, 0.3, K)
    return CommitteeState(W @ W.T, W @ V.T, v), V @ V.T


def z_scores(samples, theory):
    mean = samples.mean(0)
    se = samples.std(0) / np.sqrt(len(samples))
    z = np.where(se > 1e-9, (theory - mean) / np.where(se > 1e-9, se, 1.0), 0.0)
    return z, mean, se


ACTS = ("relu", "erf", "sigmoid", "he3")
KM = [(1, 1), (2, 2), (4, 4), (1, 2), (2, 4), (4, 1), (1, 4), (2, 1), (4, 2)]
CASES = []
for i, (act, rows, loss) in enumerate((a, r, lo) for a in ACTS for r in ("free", "unit")
                                      for lo in ("squared", "correlation")):
    for j in (2 * i, 2 * i + 1):
        CASES.append((act, rows, loss, *KM[j % len(KM)]))


@pytest.mark.parametrize("act,rows,loss,K,M", CASES)
def test_drift_and_loss_match_sample_update(act, rows, loss, K, M):
    """d(Q, R, v)/dα (first and second order) and the loss against the mean of N·ΔX over
    120k engine steps at N = 10⁸ (label noise 0.1, trained second layer with squared loss).
    N = 10⁸, not 10⁶: the finite-N terms O(η̄⁴ E[δ⁴]/N) are large for He₃'s heavy tails."""
    seed = zlib.crc32(f"{act}-{rows}-{loss}-{K}-{M}".encode())
    rng = np.random.default_rng(seed)
    state, T = random_state(K, M, rows, rng)
    A = rng.normal(1.0, 0.3, M)
    model = CommitteeModel(act, T, A, lr=0.7, rows=rows, loss=loss, noise_var=0.1,
                           lr_v=0.4 if loss == "squared" else None)
    drift = committee_drift(model, state)
    mc = sample_update(model, state, 10 ** 8, 120_000, rng)
    for key, th in (("Q", drift.Q), ("R", drift.R), ("v", drift.v)):
        z, mean, _ = z_scores(mc[key], th)
        assert np.abs(z).max() < Z_MAX, (key, th, mean, z)
    if rows == "unit":  # the retraction keeps unit rows: dQ_kk = 0 in theory and sample
        assert np.all(np.diag(drift.Q) == 0.0)
        assert np.abs(np.diag(mc["Q"].mean(0))).max() < 1e-6
    z, mean, _ = z_scores(mc["err"], committee_loss(model, state))
    assert abs(z) < Z_MAX, (committee_loss(model, state), mean, z)


def test_second_order_terms_are_visible_to_the_test():
    """Dropping the η² terms (or using b = 1 terms at b = 4) fails the same comparison."""
    rng = np.random.default_rng(11)
    state, T = random_state(2, 2, "unit", rng)
    model = CommitteeModel("relu", T, np.ones(2), lr=0.7, rows="unit")
    mc = sample_update(model, state, 10 ** 8, 120_000, rng)
    first = CommitteeModel("relu", T, np.ones(2), lr=0.7, rows="unit", second_order=False)
    z, _, _ = z_scores(mc["R"], committee_drift(first, state).R)
    assert np.abs(z).max() > 20
    z, _, _ = z_scores(mc["R"], committee_drift(model, state).R)
    assert np.abs(z).max() < Z_MAX
    batched = CommitteeModel("relu", T, np.ones(2), lr=0.7, rows="unit", batch=4)
    mc4 = sample_update(batched, state, 10 ** 8, 60_000, rng)
    z, _, _ = z_scores(mc4["R"], committee_drift(batched, state).R)
    assert np.abs(z).max() < Z_MAX
    z, _, _ = z_scores(mc4["R"], committee_drift(model, state).R)
    assert np.abs(z).max() > 20


def test_frozen_rows_match_sample_update():
    """``trainable`` (the sparse learner): frozen rows keep their overlaps, the others move
    as in the engine."""
    rng = np.random.default_rng(12)
    state, T = random_state(3, 3, "unit", rng)
    model = CommitteeModel("relu", T, np.ones(3), lr=0.7, rows="unit",
                           trainable=(True, False, True))
    drift = committee_drift(model, state)
    assert np.all(drift.R[1] == 0) and drift.Q[1, 1] == 0 and np.any(drift.Q[0, 1] != 0)
    mc = sample_update(model, state, 10 ** 8, 120_000, rng)
    for key, th in (("Q", drift.Q), ("R", drift.R)):
        z, _, _ = z_scores(mc[key], th)
        assert np.abs(z).max() < Z_MAX
    assert committee_alignment(state, T, diagonal=True) == pytest.approx(np.mean(np.diag(
        state.R)))


def test_unit_rows_near_specialisation_keep_relative_accuracy():
    """ReLU, unit rows, students at 1 − ρ = 5e-7 from the teachers: S = E[δ_k δ_l] (~1e-6,
    a cancellation of O(1) 4-D integrals) against Monte Carlo of the fields."""
    rng = np.random.default_rng(5)
    Vt = np.linalg.qr(rng.standard_normal((8, 2)))[0].T
    noise = rng.standard_normal((2, 8))
    noise -= noise @ Vt.T @ Vt
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    W = np.sqrt(1 - 1e-6) * Vt + 1e-3 * noise
    state = CommitteeState(W @ W.T, W @ Vt.T, np.ones(2))
    model = CommitteeModel("relu", Vt @ Vt.T, np.ones(2), lr=1.0, rows="unit")
    S = committee_terms(model, state).S
    C = np.block([[state.Q, state.R], [state.R.T, model.T]])
    z = rng.standard_normal((600_000, 4)) @ _embed(C).T
    e = np.maximum(z[:, 2:], 0).sum(1) - np.maximum(z[:, :2], 0).sum(1)
    d = -2.0 * (z[:, :2] > 0) * e[:, None]
    prod = d[:, :, None] * d[:, None, :]
    zs, mean, _ = z_scores(prod.reshape(len(z), -1), S.ravel())
    assert np.abs(zs).max() < Z_MAX and np.allclose(S.ravel(), mean, rtol=0.02)


# ---------------------------------------------------------------- closed forms vs quadrature
def _random_cov(n, B, rng, scale):
    X = rng.standard_normal((B, n, n + 2))
    return scale * X @ X.transpose(0, 2, 1) / (n + 2)


def _degenerate_cov(n, B, rng):
    """Covariances of n fields drawn (with repeats) from 3 random vectors: singular C."""
    G = _random_cov(3, 1, rng, 1.0)[0]
    idx = rng.integers(0, 3, (B, n))
    return G[idx[:, :, None], idx[:, None, :]]


@pytest.mark.parametrize("act,scale,tol2,tol4", [
    ("erf", 0.5, 1e-8, 1e-6),
    (scaled_erf(), 1.0, 1e-9, 1e-6),
    ("relu", 1.0, 1e-9, 1e-6),
    ("abs", 1.0, 1e-9, 1e-6),
    ("linear", 2.0, 1e-13, 1e-13),
    ("he3", 2.0, 1e-11, 1e-10),
])
def test_closed_forms_match_quadrature(act, scale, tol2, tol4):
    rng = np.random.default_rng(3)
    closed = CommitteeIntegrals(act)
    # erf is entire with fast growth off the real axis: Gauss–Hermite needs many nodes
    quad = CommitteeIntegrals(act, method="quadrature", quadrature={"q2": 32, "q4": 16,
                                                                     "n2": 128, "n4": 48})
    C2, C3 = _random_cov(2, 40, rng, scale), _random_cov(3, 40, rng, scale)
    C4 = np.concatenate([_random_cov(4, 12, rng, scale), _degenerate_cov(4, 8, rng)])
    for name, C in (("i2", C2), ("j2", C2), ("p2", C2), ("i3", C3)):
        ref = getattr(quad, name)(C)
        np.testing.assert_allclose(getattr(closed, name)(C), ref, rtol=0,
                                   atol=tol2 * np.abs(ref).max(), err_msg=name)
    ref = quad.i4(C4)
    np.testing.assert_allclose(closed.i4(C4), ref, rtol=0, atol=tol4 * np.abs(ref).max())


def _saad_solla_i3(C):
    """Saad & Solla's I3 for g = erf(x/√2), written out as in nn2pp's scmpp_ode.cpp."""
    lam3 = (1 + C[..., 0, 0]) * (1 + C[..., 2, 2]) - C[..., 0, 2] ** 2
    return (2 / np.pi / np.sqrt(lam3) * (C[..., 1, 2] * (1 + C[..., 0, 0])
                                          - C[..., 0, 1] * C[..., 0, 2]) / (1 + C[..., 0, 0]))


def test_stein_i3_equals_saad_solla_i3_for_erf():
    rng = np.random.default_rng(4)
    C3 = np.concatenate([_random_cov(3, 50, rng, 2.0), _degenerate_cov(3, 20, rng)])
    np.testing.assert_allclose(CommitteeIntegrals(scaled_erf()).i3(C3), _saad_solla_i3(C3),
                               rtol=1e-12, atol=1e-14)


def test_relu_and_abs_pair_moments_match_mpmath():
    """E[relu(X) relu(Y)], E|X||Y| with means (closed form, Owen's T) against 30-digit
    quadrature of the 1-D integral over X of relu(X)·E[relu(Y) | X] (resp. |·|)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    rng = np.random.default_rng(6)
    for _ in range(8):
        mx, my = rng.normal(0, 1.5, 2)
        sx, sy = rng.uniform(0.05, 2.0, 2)
        rho = rng.choice([-1, 1]) * (1 - 10 ** rng.uniform(-8, 0))
        a, b, c, d, p = (mpmath.mpf(float(t)) for t in (mx, my, sx, sy, rho))
        r = mpmath.sqrt(1 - p * p)

        def inner_relu(u, a=a, b=b, c=c, d=d, p=p, r=r):
            m, s = b + d * p * u, d * r
            return m * mpmath.ncdf(m / s) + s * mpmath.npdf(m / s)

        def f(u, a=a, c=c, inner=inner_relu):
            return max(a + c * u, 0) * inner(u) * mpmath.npdf(u)

        def g(u, a=a, c=c, inner=inner_relu, b=b, d=d, p=p):
            return abs(a + c * u) * (2 * inner(u) - (b + d * p * u)) * mpmath.npdf(u)

        pts = sorted([-14, -a / c, -b / (d * p), 14])
        ref = float(mpmath.quad(f, pts))
        assert nested.pair_relu(mx, my, sx, sy, rho) == pytest.approx(ref, rel=1e-9, abs=1e-14)
        ref_abs = float(mpmath.quad(g, pts))
        assert nested.pair_abs(mx, my, sx, sy, rho) == pytest.approx(ref_abs, rel=1e-9,
                                                                     abs=1e-14)
    # a deterministic side reduces to relu(m)·E[relu(m + s z)]
    assert nested.pair_relu(0.3, -0.2, 0.0, 1.0, 0.0) == pytest.approx(
        0.3 * (-0.2 * ndtr(-0.2) + np.exp(-0.02) / np.sqrt(2 * np.pi)))


def test_unit_rows_loss_is_the_dual_kernel_loss():
    """Unit rows: ε = λᵀK(T)λ + vᵀK(Q)v − 2 vᵀK(R)λ, the engine's exact scratch loss."""
    rng = np.random.default_rng(8)
    for act in ("relu", "erf", "sigmoid", "he3", "tanh"):
        state, T = random_state(3, 2, "unit", rng)
        A = rng.normal(size=2)
        model = CommitteeModel(act, T, A, lr=1.0, rows="unit")
        want = (A @ dual_kernel(act, T) @ A + state.v @ dual_kernel(act, state.Q) @ state.v
                - 2 * state.v @ dual_kernel(act, state.R) @ A)
        assert committee_loss(model, state) == pytest.approx(want, rel=1e-7, abs=1e-10)


# ---------------------------------------------------------------- nn2pp's erf ODE
def _nn2pp_init(K, M, seed=2019, overlap=1e-9):
    rng = np.random.default_rng(seed)
    Q = np.eye(K) + overlap * rng.standard_normal((K, K))
    Q = np.triu(Q) + np.triu(Q, 1).T
    R = overlap * rng.standard_normal((K, M))
    return CommitteeState(Q, R, np.ones(K))


def _nn2pp_model(**kw):
    # nn2pp: g = erf(x/√2), loss ½(y − ŷ)², w ← w + (lr/√N) v g′ e x: loss_scale ½, lr = lr
    return CommitteeModel(scaled_erf(), np.eye(2), np.ones(2), lr=0.5, loss_scale=0.5, **kw)


def _plateau(model):
    """The unspecialised fixed point (Q_kk = q, Q_kl = c, R_km = r for all k, m) and its ε."""
    def state(p):
        q, c, r = p
        return CommitteeState(np.array([[q, c], [c, q]]), np.full((2, 2), r), np.ones(2))

    def drift(p):
        d = committee_drift(model, state(p))
        return [d.Q[0, 0], d.Q[0, 1], d.R[0, 0]]

    p = fsolve(drift, [0.37, 0.33, 0.41], xtol=1e-13)
    assert np.abs(drift(p)).max() < 1e-12
    return committee_loss(model, state(p))


def test_nn2pp_default_plateau_and_escape():
    """K = M = 2, lr 0.5, T = I, A = v = 1, initial overlaps 1e-9 (nn2pp's defaults): the
    unspecialised plateau, then the escape to the specialised solution before α = 1000."""
    model = _nn2pp_model()
    plateau = _plateau(model)
    assert plateau == pytest.approx(0.0146448, abs=1e-7)
    alphas = [1.0, 10.0, 100.0, 300.0, 1000.0]
    traj = committee_ode(model, _nn2pp_init(2, 2), alphas, integrator="solve_ivp")
    eg = dict(zip(alphas, traj.loss, strict=True))
    assert eg[1.0] == pytest.approx(0.42148, abs=1e-4)
    assert plateau < eg[100.0] < 1.05 * plateau and abs(eg[300.0] / plateau - 1) < 0.005
    assert eg[1000.0] < 1e-4 * plateau
    assert traj.alignment[-1] > 0.999 and traj.alignment[2] < 0.8


def test_euler_map_reproduces_nn2pp_outputs():
    """The map with N = 100 is nn2pp's Euler integrator (dt = 0.01); eg from nn2pp's
    scmpp_ode.exe (sgoldt/nn2pp 8e305cc, run on the same initial conditions)."""
    traj = committee_ode(_nn2pp_model(), _nn2pp_init(2, 2), [0.99, 9.91, 100.26],
                         integrator="map", N=100)
    np.testing.assert_allclose(traj.loss, [0.423071, 0.0283838, 0.0152059], rtol=2e-6)
    # K = 3, M = 2, random T, A, v, both layers trained (lr 0.3, lr2 0.2), noise σ = 0.3
    rng = np.random.default_rng(7)
    W, V = rng.standard_normal((3, 50)), rng.standard_normal((2, 50))
    A, v = rng.standard_normal(2), rng.standard_normal(3)
    model = CommitteeModel(scaled_erf(), V @ V.T / 50, A, lr=0.3, lr_v=0.2, noise_var=0.09,
                           loss_scale=0.5)
    traj = committee_ode(model, CommitteeState.from_weights(W, V, v), [0.5, 1.0, 4.99, 9.92],
                         integrator="map", N=100)
    np.testing.assert_allclose(traj.loss, [1.7436, 1.37103, 0.254462, 0.0562805], rtol=2e-5)
    np.testing.assert_allclose(traj.v[-1], [1.50736, 0.049765, -1.27769], rtol=2e-5)


# ---------------------------------------------------------------- integrators, helpers
def test_map_flow_and_adaptive_agree():
    rng = np.random.default_rng(9)
    state, T = random_state(2, 2, "unit", rng)
    model = CommitteeModel("erf", T, np.ones(2), lr=0.5, rows="unit", lr_v=0.2)
    rk4 = committee_ode(model, state, [0.5, 2.0], dt=0.02)
    ivp = committee_ode(model, state, [0.5, 2.0], integrator="solve_ivp")
    mp = committee_ode(model, state, [0.5, 2.0], integrator="map", N=2000)
    np.testing.assert_allclose(rk4.R, ivp.R, atol=1e-7)
    np.testing.assert_allclose(mp.R, ivp.R, atol=2e-3)  # the map is Euler with dα = 1/N
    assert np.all(np.abs(np.diagonal(rk4.Q, axis1=1, axis2=2) - 1) < 1e-12)
    assert rk4.loss[-1] < committee_loss(model, state)


def test_alignment_and_from_weights():
    rng = np.random.default_rng(10)
    V = rng.standard_normal((2, 30))
    W = np.stack([V[1] + 0.1 * rng.standard_normal(30), rng.standard_normal(30)])
    free = CommitteeState.from_weights(W, V)
    Wn, Vn = (X / np.linalg.norm(X, axis=1, keepdims=True) for X in (W, V))
    unit = CommitteeState.from_weights(Wn, Vn, rows="unit")
    want = np.mean(np.abs(Wn @ Vn.T).max(0))
    assert committee_alignment(free, V @ V.T / 30) == pytest.approx(want)
    assert committee_alignment(unit, Vn @ Vn.T) == pytest.approx(want)


def test_committee_does_not_load_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, hermite.committee\n"
                          "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                          "('torch', 'dynamics', 'sims')))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kwargs,state,match", [
    ({}, CommitteeState(np.zeros((0, 0)), np.zeros((0, 2)), np.zeros(0)), "K .* ≥ 1"),
    ({"T": np.zeros((0, 0)), "A": np.zeros(0)}, None, "M .* ≥ 1"),
    ({"loss": "correlation", "lr_v": 0.1}, None, "second layer .* squared loss"),
    ({"activation": "sigmoid", "method": "closed"}, None, "no closed-form"),
    ({"activation": "relu", "method": "closed"}, None, "no closed-form I4"),
    ({"activation": "softplus"}, None, "unknown activation"),
    ({"rows": "sideways"}, None, "rows must be one of"),
    ({"T": np.diag([1.0, 0.0])}, None, "positive diagonal"),
    ({"loss": "hinge"}, None, "loss must be one of"),
    ({"lr": -1.0}, None, "lr must be"),
    ({}, CommitteeState(np.eye(2), np.full((2, 2), 0.9), np.ones(2)),
     "positive semidefinite"),
])
def test_bad_input_is_one_line_value_error(kwargs, state, match):
    args = dict(activation="erf", T=np.eye(2), A=np.ones(2), lr=0.5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match) as err:
        model = CommitteeModel(**args)
        committee_drift(model, state if state is not None else
                        CommitteeState(np.eye(2), np.zeros((2, 2)), np.ones(2)))
    assert "\n" not in str(err.value)


def test_relu_without_second_order_accepts_closed():
    model = CommitteeModel("relu", np.eye(2), np.ones(2), lr=0.5, method="closed",
                           second_order=False)
    st = CommitteeState(np.eye(2), 0.1 * np.eye(2), np.ones(2))
    assert np.all(np.isfinite(committee_drift(model, st).R))

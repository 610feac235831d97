"""The rank-r reduced chain (dynamics.reduced.rank_chain) against an explicit d-dimensional
Stiefel step, and its initial law against Haar-uniform frames (statistical)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dynamics.reduced import rank_chain
from hermite.activations_numba import act_code


def _explicit_step(U_hat, x, W, U, lam, C, C_hat, xi, act, eta, eta_c, joint, retraction,
                   eps=0.0):
    """Reference: the full Riemannian SGD step in d dimensions (projected, embedded metric)."""
    import torch

    Uh = torch.tensor(U_hat, requires_grad=True)
    Ch = torch.tensor(C_hat, requires_grad=True)
    xt = torch.tensor(x)
    Wt, Ut = torch.tensor(W), torch.tensor(U)
    fn = {"relu": torch.relu, "tanh": torch.tanh,
          "he3": lambda v: (v**3 - 3 * v) / np.sqrt(6.0)}[act]
    teacher_rows = Wt + xi * torch.tensor(C) @ Ut.T
    teacher_rows = teacher_rows / teacher_rows.norm(dim=1, keepdim=True)
    y = (torch.tensor(lam) * fn(teacher_rows @ xt)).sum() + eps
    rows = Wt + xi * Ch @ Uh.T
    rows = rows / rows.norm(dim=1, keepdim=True)
    loss = (y - (torch.tensor(lam) * fn(rows @ xt)).sum()) ** 2
    gU, gC = torch.autograd.grad(loss, (Uh, Ch))
    gU, gC = gU.numpy(), gC.numpy()
    k = W.shape[0]
    gU[:k] = 0.0  # Π onto span(W)^⊥ (span W = first k coordinates)
    sym = U_hat.T @ gU
    tang = gU - U_hat @ (0.5 * (sym + sym.T))
    Y = U_hat - eta * tang
    if retraction == "qr":
        Q, R = np.linalg.qr(Y)
        Q = Q * np.sign(np.diag(R))
    else:
        w, v = np.linalg.eigh(Y.T @ Y)
        Q = Y @ (v / np.sqrt(w)) @ v.T
    return Q, (C_hat - eta_c * gC if joint else C_hat)


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("retraction", ["qr", "polar"])
@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("act", ["relu", "he3"])
def test_chain_step_equals_explicit_step(r, retraction, joint, act):
    rng = np.random.default_rng(r + 10 * joint)
    k, d, xi, eta, eta_c = 4, 23, 1.3, 0.07, 0.05
    W = np.zeros((k, d))
    W[:, :k] = np.linalg.qr(rng.standard_normal((k, k)))[0] @ np.diag([1, 1, 1, 1.0])
    L = W[:, :k].copy()
    U = np.zeros((d, r))
    U[k:k + r] = np.eye(r)
    lam = rng.standard_normal(k)
    C = rng.standard_normal((k, r)) / np.sqrt(k)
    C_hat = rng.standard_normal((k, r)) / np.sqrt(k)
    # a student frame ⊥ span W with some overlap with U
    G = rng.standard_normal((d, r))
    G[:k] = 0.0
    G[k:k + r] += 1.5 * rng.standard_normal((r, r))
    U_hat = np.linalg.qr(G)[0]
    for _ in range(3):
        x = rng.standard_normal(d)
        eps = 0.3 * rng.standard_normal()
        M = U.T @ U_hat
        P = U_hat - U @ M
        B = rank_chain._sym_sqrt(P.T @ P, False)
        Q = P @ np.linalg.inv(B)
        a, bv = U.T @ x, Q.T @ x
        rest = x.copy()
        rest[:k] = 0.0
        rest -= U @ a + Q @ bv
        code, hp = act_code(act)
        tnorm = np.sqrt(1.0 + xi**2 * (C**2).sum(1))
        m2, b2, c2 = rank_chain.step_given(
            L, False, lam, C, tnorm, xi, C_hat, joint, code, hp, eta, eta_c,
            rank_chain.RETRACTIONS[retraction], M, B, x[:k].copy(), a, bv,
            float(np.linalg.norm(rest)), eps)
        U_hat, C_hat_new = _explicit_step(U_hat, x, W, U, lam, C, C_hat, xi, act, eta,
                                          eta_c, joint, retraction, eps)
        np.testing.assert_allclose(m2, U.T @ U_hat, atol=1e-12)
        P2 = U_hat - U @ (U.T @ U_hat)
        np.testing.assert_allclose(b2.T @ b2, P2.T @ P2, atol=1e-12)
        np.testing.assert_allclose(c2, C_hat_new, atol=1e-12)
        C_hat = C_hat_new


@pytest.mark.parametrize("r", [1, 2, 3])
def test_initial_law_is_haar(r):
    """M₀ = UᵀÛ₀ for Û₀ Haar on St(span W^⊥, r): KS on the singular values and on M₀[0, 0]
    against explicit QR-of-Gaussian frames in d − k dimensions."""
    n_perp, runs = 12, 4000
    states = np.zeros(runs, dtype=np.uint64)
    m_chain = np.empty((runs, r, r))
    b_chain = np.empty((runs, r, r))
    rank_chain.init_runs(7, n_perp, states, m_chain, b_chain)
    rng = np.random.default_rng(3)
    def haar(n):  # QR of a Gaussian with diag(R) > 0 is Haar on the Stiefel manifold
        q, rr = np.linalg.qr(rng.standard_normal((runs, n, r)))
        return q * np.sign(np.diagonal(rr, axis1=1, axis2=2))[:, None, :]

    m_ref = haar(n_perp)[:, :r, :]
    np.testing.assert_allclose(np.einsum("rij,rik->rjk", m_chain, m_chain)
                               + np.einsum("rij,rik->rjk", b_chain, b_chain),
                               np.broadcast_to(np.eye(r), (runs, r, r)), atol=1e-12)
    sv_chain = np.linalg.svd(m_chain, compute_uv=False)
    sv_ref = np.linalg.svd(m_ref, compute_uv=False)
    pvals = [stats.ks_2samp(sv_chain[:, i], sv_ref[:, i]).pvalue for i in range(r)]
    pvals.append(stats.ks_2samp(m_chain[:, 0, 0], m_ref[:, 0, 0]).pvalue)
    assert min(pvals) > 0.01 / len(pvals), pvals
    # power: a wrong dimension (n_perp + 6) is detected
    m_wrong = haar(n_perp + 6)[:, :r, :]
    sv_wrong = np.linalg.svd(m_wrong, compute_uv=False)
    assert stats.ks_2samp(sv_chain[:, 0], sv_wrong[:, 0]).pvalue < 1e-6


def _lora_config(engine, act, joint, runs, retraction="polar", d=40):
    from dynamics.setup.config import RunConfig

    spec = {"activation": act, "k": 4, "d": d, "xi": 1.0, "seed": 3, "W": "separated",
            "c": "gaussian", "c_hat": "gaussian", "C": "spectrum", "spectrum": [1.5, 1.0]}
    return RunConfig(instance=spec, learner="lora", rank=2, eta=0.6 / d, steps=1500,
                     runs=runs, seed=11, joint_c=joint, engine=engine, checkpoints=6,
                     spacing="linear", retraction=retraction).validate()


@pytest.mark.parametrize("act, joint, retraction", [("relu", False, "polar"),
                                                    ("he3", True, "qr")])
def test_reduced_rank_engine_has_the_law_of_the_full_learner(act, joint, retraction):
    """Two-sample KS (Bonferroni over checkpoints × singular values, 1%) and means within
    4 SE: reduced chain vs the full ``lora`` learner at d = 40, r = 2."""
    from dynamics.engines.engine import simulate

    runs = 384
    full = simulate(_lora_config("full", act, joint, runs, retraction))
    red = simulate(_lora_config("reduced", act, joint, runs, retraction))
    assert red.engine == "reduced" and full.engine == "full"
    sv_f, sv_r = full.extra["singular_values"], red.extra["singular_values"]
    tests = [(sv_f[:, c, a], sv_r[:, c, a]) for c in range(1, sv_f.shape[1])
             for a in range(2)]
    if joint:
        tests += [(full.c_overlap[:, c], red.c_overlap[:, c])
                  for c in range(1, full.c_overlap.shape[1])]
    pvals = [stats.ks_2samp(a, b).pvalue for a, b in tests]
    assert min(pvals) > 0.01 / len(pvals), min(pvals)
    for a, b in tests:
        se = np.sqrt(a.var() / a.size + b.var() / b.size)
        assert abs(a.mean() - b.mean()) < 4 * se + 1e-12
    # the singular values really moved (the test compares a non-trivial law)
    assert np.median(sv_f[:, -1, 0]) > np.median(sv_f[:, 0, 0]) + 0.05


def test_reduced_rank_law_test_has_power(monkeypatch):
    """The same comparison rejects a chain with a wrong χ² law (χ²_d instead of
    χ²_{d−k−2r}, at small d): the test above can fail."""
    from dynamics.engines.engine import simulate
    from dynamics.reduced import rank_simulate

    runs = 384
    full = simulate(_lora_config("full", "relu", False, runs, d=12))
    real_advance = rank_chain.advance

    def wrong_dof(*args):
        args = list(args)
        args[11] = 12  # χ²_d, d = 12
        return real_advance(*args)

    monkeypatch.setattr(rank_simulate.rank_chain, "advance", wrong_dof)
    red = simulate(_lora_config("reduced", "relu", False, runs, d=12))
    sv_f, sv_r = full.extra["singular_values"], red.extra["singular_values"]
    pvals = [stats.ks_2samp(sv_f[:, c, a], sv_r[:, c, a]).pvalue
             for c in range(1, sv_f.shape[1]) for a in range(2)]
    assert min(pvals) < 1e-4

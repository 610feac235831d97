"""Baseline for ``loradyn bench engine``: online SGD written straight from the paper.

One run at a time, the full first layer W (k × d), autograd on the sample loss
L = (f*(x) − f̂(x))², then eq. (4): Π onto span(W)^⊥, tangent projection, normalise.
This is what a user would write without the engine's closed forms and run axis.
"""

from __future__ import annotations

import time

import torch

__all__ = ["make_problem", "autograd_sgd", "rate"]


def make_problem(k: int, d: int, xi: float = 1.0, seed: int = 0, dtype=torch.float32):
    """Random unit rows W (k × d, App. B), unit u ⊥ span W, c and ĉ uniform on S^{k−1}."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(k, d, generator=gen, dtype=torch.float64)
    w /= w.norm(dim=1, keepdim=True)
    q, _ = torch.linalg.qr(w.T)  # orthonormal basis of span W (d × k)
    u = torch.randn(d, generator=gen, dtype=torch.float64)
    u -= q @ (q.T @ u)
    c, c_hat = (torch.randn(k, generator=gen, dtype=torch.float64) for _ in range(2))
    u0 = torch.randn(d, generator=gen, dtype=torch.float64)
    u0 -= q @ (q.T @ u0)
    out = {"w": w, "q": q, "u": u / u.norm(), "c": c / c.norm(), "c_hat": c_hat / c_hat.norm(),
           "lam": torch.ones(k, dtype=torch.float64), "u0": u0 / u0.norm(), "xi": xi}
    return {key: v.to(dtype) if torch.is_tensor(v) else v for key, v in out.items()}


def autograd_sgd(p: dict, eta: float, steps: int, activation=torch.relu, seed: int = 1):
    """``steps`` projected online-SGD steps of one run; returns the final û."""
    gen = torch.Generator().manual_seed(seed)
    w, q, xi, lam = p["w"], p["q"], p["xi"], p["lam"]
    v = w + xi * p["c"][:, None] * p["u"][None, :]
    v = v / v.norm(dim=1, keepdim=True)
    u_hat = p["u0"].clone()
    d = w.shape[1]
    for _ in range(steps):
        x = torch.randn(d, generator=gen, dtype=w.dtype)
        uh = u_hat.detach().requires_grad_(True)
        vh = w + xi * p["c_hat"][:, None] * uh[None, :]
        vh = vh / vh.norm(dim=1, keepdim=True)
        loss = (lam @ activation(v @ x) - lam @ activation(vh @ x)) ** 2
        (grad,) = torch.autograd.grad(loss, uh)
        with torch.no_grad():
            grad -= q @ (q.T @ grad)  # Π onto span(W)^⊥
            grad -= (grad @ u_hat) * u_hat  # (I − ûûᵀ)
            u_hat = u_hat - eta * grad
            u_hat /= u_hat.norm()
    return u_hat


def rate(p: dict, eta: float, steps: int, threads: int | None = None) -> float:
    """Run-steps per second of :func:`autograd_sgd` (optionally on ``threads`` threads)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        autograd_sgd(p, eta, max(steps // 10, 5))  # warm-up
        t0 = time.perf_counter()
        autograd_sgd(p, eta, steps)
        return steps / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)

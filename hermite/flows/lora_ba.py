"""Population flow of the ``lora-ba`` learner (LoRA as practised: W + s·B·A, plain SGD).

Model (``dynamics/learners/lora_ba.py``): student rows ĥⱼ = hⱼ/‖hⱼ‖, H = W + sBA, second
layer λ, the paper's teacher f* = Σᵢλᵢσ(⟨vᵢ, x⟩). Its population loss (no 1/2, without the
label noise's constant) is, with K the dual kernel (``network_loss``'s expansion),

    F(B, A) = λᵀK(VVᵀ)λ + λᵀK(ĤĤᵀ)λ − 2λᵀK(VĤᵀ)λ,

and its gradient, by the chain rule through the unit rows (K′ = dK/dρ = E[σ′σ′]):

    ∂F/∂ĥⱼ = 2λⱼ(Σᵢ λᵢK′(⟨ĥᵢ, ĥⱼ⟩) ĥᵢ − Σᵢ λᵢK′(⟨vᵢ, ĥⱼ⟩) vᵢ),
    ∂F/∂hⱼ = (I − ĥⱼĥⱼᵀ) ∂F/∂ĥⱼ / ‖hⱼ‖,   ∂F/∂B = s (∂F/∂H) Aᵀ,   ∂F/∂A = s Bᵀ(∂F/∂H).

The flow (d → ∞, first order in η: the SGD step's mean, no noise), in τ = η·steps, is
dB/dτ = −lr_ratio·∂F/∂B, dA/dτ = −∂F/∂A (0 when A is frozen). F depends on A only through
its order parameters — Z = A's coordinates in span(W, u) (r × (k+1)) and its Gram Q = AAᵀ
(r × r) — and ∂F/∂A's rows lie in span(W, u) ⊕ rows(A), so A stays in the (k + 1 + r)-dim
span of W, u and its initial rows: the flow is integrated on (B, A_red), A_red = [Z, R]
the coordinates of A in that span (``reduce_rows``: Q = ZZᵀ + RRᵀ), which is the flow of
(B, Z, Q) written through a square root of Q − ZZᵀ. Exact at any d for the mean of the
gradient; the SGD noise (O(η d) in Q per unit τ) is what it leaves out.

Torch-free; instances duck-typed as ``hermite.flows.linearized``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.integrate

from hermite.expansion.kernels import dual_kernel_derivative
from hermite.flows.linearized import _geometry, true_network_loss

__all__ = ["BAFlow", "lora_ba_gradient", "lora_ba_flow"]

FLOW_RTOL, FLOW_ATOL = 1e-8, 1e-11  # solve_ivp tolerances (a curve beside SGD)


def _padded(rows: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((rows.shape[0], width))
    out[:, : rows.shape[1]] = rows
    return out


def lora_ba_gradient(instance, b, a, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(∂F/∂B (…, k, r), ∂F/∂A (…, r, D)) of the population loss at B (…, k, r) and A
    (…, r, D) in a basis whose first k + 1 coordinates are the canonical ones (module
    docstring)."""
    geo = _geometry(instance)
    b, a = np.asarray(b, float), np.asarray(a, float)
    width = a.shape[-1]
    w, v = _padded(geo.w, width), _padded(geo.v, width)
    h = w + scale * b @ a
    n = np.linalg.norm(h, axis=-1)
    hh = h / n[..., None]
    lam2 = geo.lam[:, None] * geo.lam[None, :]
    rho = np.clip(hh @ np.swapaxes(hh, -1, -2), -1.0, 1.0)  # ⟨ĥᵢ, ĥⱼ⟩
    kap = np.clip(np.einsum("ia,...ja->...ij", v, hh), -1.0, 1.0)  # ⟨vᵢ, ĥⱼ⟩
    ks = lam2 * dual_kernel_derivative(geo.act, rho)
    kc = lam2 * dual_kernel_derivative(geo.act, kap)
    g_hat = 2.0 * (np.swapaxes(ks, -1, -2) @ hh - np.swapaxes(kc, -1, -2) @ v)
    g_h = (g_hat - hh * (hh * g_hat).sum(-1, keepdims=True)) / n[..., None]
    return scale * g_h @ np.swapaxes(a, -1, -2), scale * np.swapaxes(b, -1, -2) @ g_h


@dataclass(frozen=True)
class BAFlow:
    """The flow at the requested times: B (…, T, k, r), A (…, T, r, D) and the exact loss
    F (…, T) of the rows (wⱼ + s(BA)ⱼ)/‖·‖."""

    b: np.ndarray
    a: np.ndarray
    loss: np.ndarray


def lora_ba_flow(instance, b0, a0, times, *, scale: float = 1.0, lr_ratio: float = 1.0,
                 train_a: bool = True) -> BAFlow:
    """Integrate dB/dτ = −lr_ratio ∂F/∂B, dA/dτ = −∂F/∂A (module docstring) from B₀
    (n, k, r), A₀ (n, r, D) (n starts of one instance, integrated together) to the times τ
    (T,) ≥ 0 (τ = η·steps); scipy's DOP853 at rtol ``FLOW_RTOL``."""
    b0, a0 = np.asarray(b0, float), np.asarray(a0, float)
    times = np.asarray(times, float)
    nb = b0.size

    def rhs(_t, y):
        b, a = y[:nb].reshape(b0.shape), y[nb:].reshape(a0.shape)
        gb, ga = lora_ba_gradient(instance, b, a, scale)
        return np.concatenate([-lr_ratio * gb.ravel(), (-ga if train_a else 0.0 * ga).ravel()])

    y0 = np.concatenate([b0.ravel(), a0.ravel()])
    sol = scipy.integrate.solve_ivp(rhs, (0.0, float(times.max(initial=0.0))), y0,
                                    method="DOP853", t_eval=times, rtol=FLOW_RTOL,
                                    atol=FLOW_ATOL)
    ys = sol.y if sol.success else np.full((y0.size, times.size), np.nan)
    if ys.shape[1] != times.size:  # stopped early: NaN beyond
        ys = np.concatenate([ys, np.full((y0.size, times.size - ys.shape[1]), np.nan)], 1)
    b = np.moveaxis(ys[:nb].reshape(*b0.shape, times.size), -1, 1)
    a = np.moveaxis(ys[nb:].reshape(*a0.shape, times.size), -1, 1)
    ok = np.isfinite(b).all((-2, -1)) & np.isfinite(a).all((-2, -1))
    delta = scale * np.where(ok[..., None, None], b, 0.0) @ np.where(ok[..., None, None], a, 0.0)
    return BAFlow(b, a, np.where(ok, true_network_loss(instance, delta), np.nan))

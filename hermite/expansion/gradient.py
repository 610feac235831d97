"""The population-gradient factor h(m) of Prop. 4 (projected setting, û ⊥ span W).

(I − ûûᵀ) Π ∇Φ(û) = −h(m) (Π⊥u − m û),  m = ⟨u, û⟩,  −dΦ/dm = h(m), with

    h(m) = 2 Σᵢⱼ λᵢλⱼ Qᵢⱼ K′(Pᵢⱼ + Qᵢⱼ m)
         = 2 ξ² Σᵢⱼ λᵢλⱼ cᵢĉⱼ K′(ρᵢⱼ(m)) / (Nᵢ N̂ⱼ),

ρᵢⱼ(m) = ⟨vᵢ, v̂ⱼ⟩ = Pᵢⱼ + Qᵢⱼ m (``Instance.correlation_affine``), K′ the derivative dual
kernel (:mod:`hermite.expansion.kernels`). For quantized c and u ⊥ W the paper's form
2 Σ λλ ξ² cĉ Σₚ p μₚ² (1+ξ²/k)^{−p} (Gᵢⱼ + ξ² cᵢĉⱼ m)^{p−1} follows by expanding K′.
"""

from __future__ import annotations

import numpy as np

from hermite.expansion.kernels import dual_kernel_derivative
from hermite.expansion.series import HSeries, h_direct

__all__ = ["h", "h0_sign", "H_METHODS", "check_overlap"]

H_METHODS = ("exact", "series", "direct")
_CHUNK = 4_000_000


def check_overlap(m, name: str = "m", bound: float = 1.0) -> np.ndarray:
    """m as a float64 array, with a one-line ValueError unless finite and |m| ≤ ``bound``.

    ``bound`` is u⊥ = ‖Π⊥u‖ for an instance (1 when u ⊥ span W): with û ⊥ span W no overlap
    beyond it exists. Values within 1e-12 outside are clipped (round-off).
    """
    m = np.asarray(m, dtype=np.float64)
    if not np.all(np.isfinite(m)):
        raise ValueError(f"{name} must be finite")
    tol = 1e-12
    if m.size and np.max(np.abs(m)) > bound + tol:
        bad = m[np.abs(m) > bound + tol].ravel()[0]
        if bound == 1.0:
            raise ValueError(f"{name} must lie in [-1, 1] (an overlap ⟨u, û⟩), got {bad:g}")
        raise ValueError(f"{name} must lie in [-u_perp, u_perp] = [{-bound:.6g}, {bound:.6g}] "
                         f"(û ⊥ span W, ‖Π_W u‖ > 0), got {bad:g}")
    return np.clip(m, -bound, bound)


def _h_exact(instance, m: np.ndarray, c_hat, kernel_method: str = "auto") -> np.ndarray:
    p, q = instance.correlation_affine(c_hat)
    llq = (np.outer(instance.lam, instance.lam) * q).ravel()
    keep = llq != 0.0
    p, q, llq = p.ravel()[keep], q.ravel()[keep], llq[keep]
    flat = m.ravel()
    out = np.empty(flat.size)
    step = max(1, _CHUNK // max(1, p.size))
    act = instance.activation
    for a in range(0, flat.size, step):
        rho = p[None, :] + q[None, :] * flat[a:a + step, None]
        np.clip(rho, -1.0, 1.0, out=rho)
        out[a:a + step] = 2.0 * (dual_kernel_derivative(act, rho, kernel_method) @ llq)
    return out.reshape(m.shape)


def h(instance, m, method: str = "exact", pmax: int = 60, c_hat=None) -> np.ndarray:
    """h(m) for an array of overlaps m ∈ [−u⊥, u⊥] ⊆ [−1, 1] (Prop. 4).

    Parameters
    ----------
    instance : :class:`dynamics.instances.instance.Instance`.
    m : scalar or array of overlaps ⟨u, û⟩, |m| ≤ u⊥ (= 1 when u ⊥ span W).
    method : ``"exact"`` (default; via K′, closed form or certified quadrature interpolant,
        no truncation), ``"series"`` (Prop. 4 power series in m truncated at Hermite degree
        pmax, :class:`HSeries`) or ``"direct"`` (double sum over i, j, p ≤ pmax, numba).
    pmax : truncation degree for ``series``/``direct`` (ignored by ``exact``).
    c_hat : student second-layer direction ĉ (default ``instance.c_hat``).

    Returns
    -------
    float64 array shaped like m. ``series``/``direct`` carry the error bound
    :func:`hermite.expansion.series.truncation_bound`.
    """
    m = check_overlap(m, bound=instance.u_perp)
    if method == "exact":
        return _h_exact(instance, m, c_hat)
    if method == "series":
        return HSeries(instance, pmax, c_hat)(m)
    if method == "direct":
        if isinstance(pmax, bool) or int(pmax) != pmax or pmax < 0:
            raise ValueError(f"pmax must be an integer ≥ 0, got {pmax!r}")
        return h_direct(instance, m, int(pmax), c_hat)
    raise ValueError(f"method must be one of {', '.join(H_METHODS)}, got {method!r}")


def h0_sign(instance, c_hat=None) -> int:
    """sign(h(0)) ∈ {−1, 0, +1}: the side m₀ must start on (Theorems 11–13: m₀ h(0) > 0)."""
    return int(np.sign(float(h(instance, 0.0, c_hat=c_hat))))

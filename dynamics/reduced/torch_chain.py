"""The reduced chain vectorised over runs in torch (device ``cuda``, or CPU for cross-checks).

Same state and the same step (R3)–(R6) as the numba kernel (:mod:`._chain`), with a leading
run axis; variates come from one ``torch.Generator`` per batch of runs, so the two paths agree
in law, and exactly when fed the same variates (:func:`step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..activations import torch_activation
from ._chain import M_TOL
from .params import ChainParams

__all__ = ["TorchParams", "step", "advance"]

_SYNC_EVERY = 256  # steps between host syncs to test whether any run is still live


@dataclass
class TorchParams:
    """Per-run constants (leading axis R): L (R,k,k) or None when every L = I; λ, c, u_w;
    teacher coefficients t1 = 1/N, t2 = ξc/N; u⊥, ξ (R,); App. B rows: ``scale`` s and
    ``out`` o (R,) (None for unit rows)."""

    L: torch.Tensor | None
    lam: torch.Tensor
    u_w: torch.Tensor
    t1: torch.Tensor
    t2: torch.Tensor
    u_perp: torch.Tensor
    xi: torch.Tensor
    scale: torch.Tensor | None = None
    out: torch.Tensor | None = None

    @classmethod
    def from_params(cls, p: ChainParams, device, dtype) -> TorchParams:
        k, idx = p.k, p.inst_idx
        prm = p.prm[idx]

        def t(a):
            return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

        xi = prm[:, 4 * k + 1]
        norms = prm[:, 2 * k:3 * k]
        L = None if bool(p.ident.all()) else t(p.L[idx])
        appb = bool((prm[:, 4 * k + 2] > 0.0).any())
        return cls(L, t(prm[:, :k]), t(prm[:, 3 * k:4 * k]), t(1.0 / norms),
                   t(xi[:, None] * prm[:, k:2 * k] / norms), t(prm[:, 4 * k]), t(xi),
                   t(prm[:, 4 * k + 2]) if appb else None, t(prm[:, 4 * k + 3]) if appb else None)


def _wmul(L, z):
    """Wx = L z for z (R, b, k)."""
    return z if L is None else torch.einsum("rij,rbj->rbi", L, z)


def step(P: TorchParams, act, project: bool, joint: bool, eta: float, eta_c: float, mu, nu,
         pw, chat, Z, A, Bv, eps, chi=None, gram=None):
    """One step (R3)–(R6) for all runs: returns new (μ, ν, p, ĉ).

    Z (R,b,k), A, Bv, eps (R,b); ρ² from ``chi`` (R,): ‖ḡ‖²χ, or ``gram`` (R,b,b): ḡᵀGḡ.
    """
    act = torch_activation(act)
    batch = A.shape[1]
    xc = P.xi[:, None] * chat
    wu = None if project else (pw if P.L is None else torch.einsum("rij,rj->ri", P.L, pw))
    if P.scale is None:
        n2 = 1.0 + xc * xc if project else 1.0 + xc * (2.0 * wu + xc)
        sc1 = torch.rsqrt(n2)
        sc2 = xc * sc1
    else:  # App. B: fixed row factor s, no renormalisation
        sc1 = P.scale[:, None].expand_as(xc)
        sc2 = xc * sc1
    wz = _wmul(P.L, Z)
    ux = P.u_perp[:, None] * A + (Z * P.u_w[:, None]).sum(-1)
    s = mu[:, None] * A + nu[:, None] * Bv
    if not project:
        s = s + (Z * pw[:, None]).sum(-1)
    t_pre = wz * P.t1[:, None] + ux[..., None] * P.t2[:, None]
    ah = wz * sc1[:, None] + s[..., None] * sc2[:, None]
    lam = P.lam[:, None]
    if P.out is None:
        res = -2.0 * (eps + (act.fn(t_pre) * lam).sum(-1) - (act.fn(ah) * lam).sum(-1)) / batch
    else:  # output factor o: −2o(y − f̂)/b with y − f̂ = o Σ λ(σ(t) − σ(â)) + ε
        o = P.out[:, None]
        res = -2.0 * o * (eps + o * ((act.fn(t_pre) - act.fn(ah)) * lam).sum(-1)) / batch
    delta = res[..., None] * lam * act.deriv(ah)  # (R, b, k), δⱼ/b
    g = (delta * sc2[:, None]).sum(-1)  # ḡₙ
    ge = (g * A).sum(-1)
    geh = (g * Bv).sum(-1)
    if not project:
        gw = (g[..., None] * Z).sum(1)
        if P.scale is None:  # the renormalisation's gradient
            kap = (delta * ah * (sc2 * sc1)[:, None]).sum(1)  # Σₙ γ
            gw = gw - (kap if P.L is None else (kap[:, None, :] @ P.L)[:, 0])
    if joint:
        if P.scale is not None:
            vu = torch.zeros_like(sc2)
        else:
            vu = sc2 if project else (wu + xc) * sc1
        gc = (delta * (P.xi[:, None] * sc1)[:, None]
              * (s[..., None] - ah * vu[:, None])).sum(1)
    rho2 = chi * (g * g).sum(-1) if gram is None else torch.einsum("rb,rbc,rc->r", g, gram, g)
    tang = mu * ge + nu * geh
    if not project:
        tang = tang + (pw * gw).sum(-1)
    ne = mu - eta * (ge - tang * mu)
    nt = nu - eta * (geh - tang * nu)
    er = eta * torch.sqrt(rho2)
    sq_rest = nt * nt + er * er
    norm2 = ne * ne + sq_rest
    if not project:
        pw = pw - eta * (gw - tang[:, None] * pw)
        norm2 = norm2 + (pw * pw).sum(-1)
    inv = torch.rsqrt(norm2)
    if not project:
        pw = pw * inv[:, None]
    if joint:
        chat = chat - eta_c * gc
    return ne * inv, torch.sqrt(sq_rest) * inv, pw, chat


def overlap(P: TorchParams, mu, pw, project: bool):
    """m = ⟨p, u_w⟩ + μ u⊥ (R1)."""
    m = mu * P.u_perp
    return m if project else m + (pw * P.u_w).sum(-1)


def advance(P: TorchParams, act, *, project, joint, dof, eta, eta_c, batch, noise_sd, mu, nu,
            pw, chat, n_steps, cp_steps, seed, stop_level=math.inf, stop_abs=True):
    """Advance R runs ``n_steps`` (tensors μ, ν (R,), p, ĉ (R,k)); record at ``cp_steps``.

    Returns (records dict of numpy (R, C[, k]) arrays m, mu, nu, pw, chat; div_step;
    hit_step) with the conventions of :func:`._chain.run_one`. The loop never waits for the
    device except at checkpoints and every ``_SYNC_EVERY`` steps.
    """
    runs, k = chat.shape
    dev, dt = mu.device, mu.dtype
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    half_dof = torch.full((runs,), 0.5 * dof, dtype=dt, device=dev)
    live = torch.ones(runs, dtype=torch.bool, device=dev)
    div = torch.full((runs,), -1, dtype=torch.int64, device=dev)
    hit = torch.full((runs,), -1, dtype=torch.int64, device=dev)
    rec = {name: [] for name in ("m", "mu", "nu", "pw", "chat")}
    cps = list(np.asarray(cp_steps, dtype=np.int64))
    use_stop = math.isfinite(stop_level)
    for t in range(n_steps + 1):
        while cps and cps[0] == t:
            cps.pop(0)
            for name, val in (("m", overlap(P, mu, pw, project)), ("mu", mu), ("nu", nu),
                              ("pw", pw), ("chat", chat)):
                rec[name].append(val.double().cpu().numpy())
        if t == n_steps or (t % _SYNC_EVERY == 0 and not bool(live.any())):
            break
        Z = torch.randn((runs, batch, k), generator=gen, dtype=dt, device=dev)
        A = torch.randn((runs, batch), generator=gen, dtype=dt, device=dev)
        Bv = torch.randn((runs, batch), generator=gen, dtype=dt, device=dev)
        eps = (noise_sd * torch.randn((runs, batch), generator=gen, dtype=dt, device=dev)
               if noise_sd > 0 else torch.zeros_like(A))
        chi = (2.0 * torch._standard_gamma(half_dof, generator=gen) if dof > 0
               else torch.zeros_like(mu))
        new = step(P, act, project, joint, float(eta), float(eta_c), mu, nu, pw, chat,
                   Z, A, Bv, eps, chi=chi)
        keep = live[:, None]
        mu, nu = torch.where(live, new[0], mu), torch.where(live, new[1], nu)
        pw, chat = torch.where(keep, new[2], pw), torch.where(keep, new[3], chat)
        m = overlap(P, mu, pw, project)
        bad = live & ~(torch.isfinite(m) & torch.isfinite(nu) & (m.abs() <= 1.0 + M_TOL))
        div = torch.where(bad, t + 1, div)
        live &= ~bad
        if use_stop:
            reached = live & ((m.abs() if stop_abs else m) >= stop_level)
            hit = torch.where(reached, t + 1, hit)
            live &= ~reached
    for _ in cps:  # checkpoints past a global early end: repeat the frozen state
        for name in rec:
            rec[name].append(rec[name][-1])
    out = {n: np.stack(v, axis=1) if v else None for n, v in rec.items()}
    return out, div.cpu().numpy(), hit.cpu().numpy()

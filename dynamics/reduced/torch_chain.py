"""The reduced chain vectorised over runs in torch (device ``cuda``, or CPU for cross-checks).

Same state and the same step (R3)–(R6) as the numba kernel (:mod:`._chain`), with a leading
run axis; variates come from one ``torch.Generator`` per batch of runs, so the two paths agree
in law, and exactly when fed the same variates (:func:`step`).
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import torch

from dynamics.activations import torch_activation
from dynamics.reduced._chain import M_TOL, ChainState, RankOneSettings
from dynamics.reduced.params import ChainParams

__all__ = ["TorchParams", "Draws", "step", "advance"]

_SYNC_EVERY = 256  # steps between host syncs to test whether any run is still live

Draws = namedtuple("Draws", ["Z", "A", "Bv", "eps", "chi", "gram"], defaults=(None, None))
Draws.__doc__ = """One step's variates of R runs: z (R, b, k), a, b, ε (R, b); ρ² from ``chi``
(R,): ‖ḡ‖²χ, or ``gram`` (R, b, b): ḡᵀGḡ."""


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


def step(P: TorchParams, act, settings: RankOneSettings, state: ChainState,
         draws: Draws) -> ChainState:
    """One step (R3)–(R6) for all runs from ``state`` (μ, ν (R,), p, ĉ (R, k)) on ``draws``:
    the new :class:`~._chain.ChainState` (``settings``' project, joint, η and η_c)."""
    act = torch_activation(act)
    project, joint, eta, eta_c = settings.project, settings.joint, settings.eta, settings.eta_c
    mu, nu, pw, chat = state
    Z, A, Bv, eps, chi, gram = draws
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
    return ChainState(ne * inv, torch.sqrt(sq_rest) * inv, pw, chat)


def overlap(P: TorchParams, mu, pw, project: bool):
    """m = ⟨p, u_w⟩ + μ u⊥ (R1)."""
    m = mu * P.u_perp
    return m if project else m + (pw * P.u_w).sum(-1)


def advance(P: TorchParams, act, settings: RankOneSettings, state: ChainState, n_steps,
            cp_steps, seed, stop_level=math.inf, stop_abs=True):
    """Advance R runs ``n_steps`` from ``state`` (tensors μ, ν (R,), p, ĉ (R,k)); record at
    ``cp_steps``.

    Returns (records dict of numpy (R, C[, k]) arrays m, mu, nu, pw, chat; div_step;
    hit_step) with the conventions of :func:`._chain.run_one`. The loop never waits for the
    device except at checkpoints and every ``_SYNC_EVERY`` steps. One call of
    :class:`TorchRun` over the whole horizon.
    """
    run = TorchRun(P, act, settings, state, seed, stop_level, stop_abs)
    run.advance(0, n_steps, cp_steps)
    return run.results()


class TorchRun:
    """R runs of the vectorised chain between calls: state μ, ν, p, ĉ, the one generator
    of the batch, the live mask and the div/hit steps. :meth:`advance` from step t0 to t1
    in pieces gives the numbers of one call from 0 to the horizon (same draws in the same
    order; the early end once no run is live is checked at the same global steps)."""

    def __init__(self, P: TorchParams, act, settings: RankOneSettings, state: ChainState, seed,
                 stop_level=math.inf, stop_abs=True):
        runs = state.chat.shape[0]
        dev, dt = state.mu.device, state.mu.dtype
        self.P, self.act, self.settings = P, act, settings
        self.stop_level, self.stop_abs = stop_level, stop_abs
        self.mu, self.nu, self.pw, self.chat = state
        self.gen = torch.Generator(device=dev).manual_seed(int(seed))
        self.half_dof = torch.full((runs,), 0.5 * settings.dof, dtype=dt, device=dev)
        self.live = torch.ones(runs, dtype=torch.bool, device=dev)
        self.div = torch.full((runs,), -1, dtype=torch.int64, device=dev)
        self.hit = torch.full((runs,), -1, dtype=torch.int64, device=dev)
        self.rec = {name: [] for name in ("m", "mu", "nu", "pw", "chat")}
        self.ended = False  # stopped early: no run live at a sync step

    def _record(self) -> None:
        for name, val in (("m", overlap(self.P, self.mu, self.pw, self.settings.project)),
                          ("mu", self.mu), ("nu", self.nu), ("pw", self.pw),
                          ("chat", self.chat)):
            self.rec[name].append(val.double().cpu().numpy())

    def advance(self, t0: int, t1: int, cp_steps) -> None:
        """Steps t0 … t1 − 1 (global indices), recording at the global ``cp_steps`` in
        [t0, t1] not recorded yet; after an early end the checkpoints repeat the last."""
        cps = list(np.asarray(cp_steps, dtype=np.int64))
        if not self.ended:
            self._steps(int(t0), int(t1), cps)
        for _ in cps:  # checkpoints past a global early end: repeat the frozen state
            for name in self.rec:
                self.rec[name].append(self.rec[name][-1])

    def _steps(self, t0: int, t1: int, cps: list) -> None:
        P, act, settings = self.P, self.act, self.settings
        project = settings.project
        runs, k = self.chat.shape
        dev, dt = self.mu.device, self.mu.dtype
        gen, batch, dof, noise_sd = self.gen, settings.batch, settings.dof, settings.noise_sd
        mu, nu, pw, chat, live = self.mu, self.nu, self.pw, self.chat, self.live
        use_stop = math.isfinite(self.stop_level)
        for t in range(t0, t1 + 1):
            while cps and cps[0] == t:
                cps.pop(0)
                self.mu, self.nu, self.pw, self.chat = mu, nu, pw, chat
                self._record()
            if t % _SYNC_EVERY == 0 and not bool(live.any()):
                self.ended = True
                break
            if t == t1:
                break
            Z = torch.randn((runs, batch, k), generator=gen, dtype=dt, device=dev)
            A = torch.randn((runs, batch), generator=gen, dtype=dt, device=dev)
            Bv = torch.randn((runs, batch), generator=gen, dtype=dt, device=dev)
            eps = (noise_sd * torch.randn((runs, batch), generator=gen, dtype=dt, device=dev)
                   if noise_sd > 0 else torch.zeros_like(A))
            chi = (2.0 * torch._standard_gamma(self.half_dof, generator=gen) if dof > 0
                   else torch.zeros_like(mu))
            new = step(P, act, settings, ChainState(mu, nu, pw, chat),
                       Draws(Z, A, Bv, eps, chi=chi))
            keep = live[:, None]
            mu, nu = torch.where(live, new[0], mu), torch.where(live, new[1], nu)
            pw, chat = torch.where(keep, new[2], pw), torch.where(keep, new[3], chat)
            m = overlap(P, mu, pw, project)
            bad = live & ~(torch.isfinite(m) & torch.isfinite(nu) & (m.abs() <= 1.0 + M_TOL))
            self.div = torch.where(bad, t + 1, self.div)
            live &= ~bad
            if use_stop:
                reached = live & ((m.abs() if self.stop_abs else m) >= self.stop_level)
                self.hit = torch.where(reached, t + 1, self.hit)
                live &= ~reached
        self.mu, self.nu, self.pw, self.chat, self.live = mu, nu, pw, chat, live

    def results(self):
        """(records dict of numpy (R, C[, k]) arrays, or None where none was recorded;
        div_step; hit_step)."""
        out = {n: np.stack(v, axis=1) if v else None for n, v in self.rec.items()}
        return out, self.div.cpu().numpy(), self.hit.cpu().numpy()

    def state(self) -> tuple[dict, dict]:
        """(arrays, JSON values) of everything :meth:`load` needs to go on."""
        arrays = {name: t.detach().cpu().numpy().copy() for name, t in
                  (("mu", self.mu), ("nu", self.nu), ("pw", self.pw), ("chat", self.chat),
                   ("live", self.live), ("div", self.div), ("hit", self.hit))}
        arrays["generator"] = self.gen.get_state().numpy()
        arrays |= {f"rec/{n}": np.stack(v, axis=1) for n, v in self.rec.items() if v}
        return arrays, {"ended": self.ended}

    def load(self, arrays: dict, values: dict) -> None:
        """Continue from :meth:`state` of a run of the same settings."""
        dev = self.mu.device

        def like(t, a):
            return torch.as_tensor(np.asarray(a), dtype=t.dtype, device=dev).reshape(t.shape)

        self.mu, self.nu = like(self.mu, arrays["mu"]), like(self.nu, arrays["nu"])
        self.pw, self.chat = like(self.pw, arrays["pw"]), like(self.chat, arrays["chat"])
        self.live = like(self.live, arrays["live"])
        self.div, self.hit = like(self.div, arrays["div"]), like(self.hit, arrays["hit"])
        self.gen.set_state(torch.as_tensor(np.asarray(arrays["generator"], dtype=np.uint8)))
        self.rec = {n: (list(np.moveaxis(np.asarray(arrays[f"rec/{n}"]), 1, 0))
                        if f"rec/{n}" in arrays else []) for n in self.rec}
        self.ended = bool(values.get("ended", False))

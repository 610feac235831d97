"""The R runs' instances as tensors with a leading run axis, in the canonical frame.

Canonical frame (``dynamics.instances.instance``): coordinates 0..k−1 span span(W) with W = [L, 0],
coordinate k is the unit direction of u's part ⊥ span(W), so u = (u_w, u_perp, 0, …).
Then Wx = L x[:k] costs O(k²) and ⟨u, x⟩ = ⟨u_w, x[:k]⟩ + u_perp x[k] costs O(k).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamics.activations import TorchActivation, torch_activation
from dynamics.instances.instance import Instance
from dynamics.lazy import lazy_import

torch = lazy_import("torch")  # loaded at its first use

__all__ = ["Problem", "rowmat", "per_run"]


def rowmat(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x @ m over the last axis, with m (k, k) shared or (R, k, k) per run; x is (R, …, k)."""
    if m.dim() == 2:
        return x @ m
    if x.dim() == 3:
        return torch.bmm(x, m)
    flat = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), m)
    return flat.reshape(*x.shape[:-1], m.shape[-1])


@dataclass
class Problem:
    """Teacher and base-network constants of R runs (run axis first).

    Fields
    ------
    activation : σ and σ′ on tensors (one for all runs; ``.theory`` is the numpy side).
    k, d : width and input dimension.
    lt : Lᵀ, (k, k) when every run has the same W, else (R, k, k); z = x[:k] @ Lᵀ = Wx.
    l : L itself, same layout; Wᵀγ = γ @ L (first k coordinates).
    u_w : (R, k) Π_W u in the frame of span W. u_perp : (R,) u's coordinate k.
    lam, c : (R, k) second layer λ and teacher direction c. xi : (R,) scale ξ.
    t_scale, t_shift : (R, k) 1/Nᵢ and ξcᵢ/Nᵢ, so teacher pre-activations are
        (zᵢ + ξcᵢ⟨u,x⟩)/Nᵢ = zᵢ t_scaleᵢ + ⟨u,x⟩ t_shiftᵢ (eq. 3, unit rows).
    c_hat0 : (R, k) the instances' ĉ (initial / frozen value).
    any_u_w : whether some run has u_alpha > 0 (else ⟨u, x⟩ = u_perp x[k]).
    row_scale : None (unit rows) or (R,) the fixed row factor s of the App. B conventions
        (``Instance.row_scale``); ``lam`` then already carries the output factor 1/ξ.
    committee : whether the teacher is a committee machine (rows of W as they are, ξ = 0).
    """

    activation: TorchActivation
    k: int
    d: int
    lt: torch.Tensor
    l: torch.Tensor
    u_w: torch.Tensor
    u_perp: torch.Tensor
    lam: torch.Tensor
    c: torch.Tensor
    xi: torch.Tensor
    t_scale: torch.Tensor
    t_shift: torch.Tensor
    c_hat0: torch.Tensor
    any_u_w: bool
    row_scale: torch.Tensor | None = None
    committee: bool = False

    @property
    def runs(self) -> int:
        return self.lam.shape[0]

    @classmethod
    def from_instances(cls, instances: list[Instance], device, dtype) -> Problem:
        """Stack the runs' instances (they must share σ, k and d)."""
        first = instances[0]
        distinct: dict[int, int] = {}
        uniq = []
        for inst in instances:
            if id(inst) not in distinct:
                if (inst.activation.name, inst.k, inst.d) != (first.activation.name, first.k,
                                                              first.d):
                    raise ValueError("all runs of a batch must share activation, k and d")
                if (inst.convention, inst.teacher) != (first.convention, first.teacher):
                    raise ValueError("all runs of a batch must share the instance convention "
                                     "and teacher")
                distinct[id(inst)] = len(uniq)
                uniq.append(inst)
        index = np.array([distinct[id(inst)] for inst in instances])

        def stack(values):
            return np.stack([np.asarray(v, dtype=float) for v in values])[index]

        factors = np.stack([i.w_factor for i in uniq])
        shared = bool(np.all(factors == factors[0]))
        l = factors[0] if shared else factors[index]
        c, xi = stack(i.c for i in uniq), stack(i.xi for i in uniq)
        norms = stack(i.teacher_norms() for i in uniq)
        u_w = stack(i.u_w for i in uniq)

        def t(a):
            return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

        return cls(
            activation=torch_activation(first.activation), k=first.k, d=first.d,
            lt=t(np.swapaxes(l, -1, -2)), l=t(l), u_w=t(u_w),
            u_perp=t(stack(i.u_perp for i in uniq)),
            lam=t(stack(i.lam * i.output_scale for i in uniq)),
            c=t(c), xi=t(xi), t_scale=t(1.0 / norms), t_shift=t(xi[:, None] * c / norms),
            c_hat0=t(stack(i.c_hat for i in uniq)), any_u_w=bool(np.any(u_w != 0)),
            row_scale=None if first.unit_rows else t(stack(i.row_scale for i in uniq)),
            committee=first.committee,
        )

    def u_dot(self, x: torch.Tensor) -> torch.Tensor:
        """⟨u, x⟩ for examples x (R, …, d) → (R, …)."""
        out = x[..., self.k] * per_run(self.u_perp, x.dim() - 1)
        if self.any_u_w:
            out = out + (x[..., : self.k] * per_run(self.u_w, x.dim())).sum(-1)
        return out

    def teacher(self, x: torch.Tensor, z: torch.Tensor, activation=None) -> torch.Tensor:
        """f*(x) = Σᵢ λᵢ σ(⟨vᵢ, x⟩) given z = Wx; x (R, …, d), z (R, …, k) → (R, …);
        ``activation``: another σ* for the teacher (None: the instance's σ)."""
        nd = z.dim()
        pre = torch.addcmul(z * per_run(self.t_scale, nd), self.u_dot(x)[..., None],
                            per_run(self.t_shift, nd))
        act = self.activation if activation is None else activation
        return (act.fn(pre) * per_run(self.lam, nd)).sum(-1)

    def overlap(self, u_hat: torch.Tensor) -> torch.Tensor:
        """m = ⟨û, u⟩ for û (R, d) → (R,)."""
        return (u_hat[:, : self.k] * self.u_w).sum(-1) + u_hat[:, self.k] * self.u_perp


def per_run(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """View a per-run tensor (R,) or (R, k) so it broadcasts against (R, …) of ``ndim`` axes."""
    if v.dim() == 1:
        return v.reshape(v.shape[0], *([1] * (ndim - 1)))
    return v.reshape(v.shape[0], *([1] * (ndim - 2)), v.shape[-1])

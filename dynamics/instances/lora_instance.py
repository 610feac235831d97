"""Rank-r teachers: ΔW = ξ C Uᵀ on top of an :class:`~dynamics.instances.instance.Instance`.

Teacher rows vᵢ = (wᵢ + ξ (CUᵀ)ᵢ)/Nᵢ = (wᵢ + ξ U cᵢ)/Nᵢ, Nᵢ = ‖wᵢ + ξ U cᵢ‖, with
U ∈ R^{d×r} orthonormal columns and C ∈ R^{k×r} (row cᵢ); the student replaces (C, U) by
(Ĉ, Û). At r = 1, (C, U) = (c, u) of the base instance, number for number.

Canonical frame (extends ``dynamics.instances.instance``'s): coordinates 0..k−1 span span(W) (W =
[L, 0]), coordinates k..k+r−1 span Π⊥U (U's part ⊥ span W), the rest is the complement. There
U = [U_w; U_⊥; 0] with U_w = u_alpha·Q_w (k×r, Q_w orthonormal columns, first column the base
instance's u_w direction) and U_⊥ = √(1 − u_alpha²)·I_r, so UᵀU = I and UᵀΠU = U_⊥ᵀU_⊥.
By default (u_alpha = 0) U ⊥ span W.

Rank-r keys (read by :func:`lora_options` from ``RunConfig.extra`` or, once the instance spec
accepts them, from the instance spec dict):

* ``C``: ``quantized`` (entries ±1/√k), ``gaussian`` (columns uniform on S^{k−1}: N(0, I/k)
  up to each column's normalisation, as the rank-1 ``gaussian`` c), ``spectrum``
  (C = A diag(s) Bᵀ, A Haar on St(k, r), B Haar on O(r)) or an explicit k×r array.
  Default: the base instance's ``c`` generator. For quantized/gaussian, column 0 is the rank-1
  draw of that generator (so it equals the base instance's c when the generators agree);
  further columns come from the stream ``C``.
* ``spectrum``: the singular values s₁ ≥ … ≥ s_r > 0 of C (required by ``C = spectrum``).
* ``C_hat``: ``teacher`` (Ĉ = C), ``quantized``, ``gaussian`` or an explicit k×r array.
  Default: follow the base instance's ``c_hat`` (``teacher`` → Ĉ = C; a generator → built as
  C with column 0 = the base ĉ), which keeps r = 1 identical to the ``finetune`` learner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dynamics.errors import ConfigError
from dynamics.geometry.stiefel import uniform_frames
from dynamics.instances.instance import C_GENERATORS, Instance, _rng, _vector

__all__ = ["LoraInstance", "LORA_KEYS", "C_RANK_GENERATORS", "C_HAT_RANK_GENERATORS",
           "build_lora_instance", "lora_options", "run_lora_instances"]

LORA_KEYS = ("C", "spectrum", "C_hat")
C_RANK_GENERATORS = ("quantized", "gaussian", "spectrum")
C_HAT_RANK_GENERATORS = ("teacher", "quantized", "gaussian")


@dataclass(frozen=True)
class LoraInstance:
    """A rank-r teacher/student pair in the canonical frame (see module docstring).

    Fields: ``base`` (the rank-1 :class:`Instance`: σ, k, d, ξ, W, λ, seed), ``rank`` r,
    ``C`` and ``C_hat`` (k, r), ``U_w`` (k, r) and ``U_perp`` (r, r) (U's canonical
    coordinates), ``spec`` (the resolved rank-r keys).
    """

    base: Instance
    rank: int
    C: np.ndarray
    C_hat: np.ndarray
    U_w: np.ndarray
    U_perp: np.ndarray
    spec: dict = field(default_factory=dict, compare=False)

    # ---- delegated to the base instance ------------------------------------------------
    @property
    def activation(self):
        return self.base.activation

    @property
    def k(self) -> int:
        return self.base.k

    @property
    def d(self) -> int | None:
        return self.base.d

    @property
    def xi(self) -> float:
        return self.base.xi

    @property
    def lam(self) -> np.ndarray:
        return self.base.lam

    @property
    def gram(self) -> np.ndarray:
        return self.base.gram

    @property
    def w_factor(self) -> np.ndarray:
        return self.base.w_factor

    @property
    def seed(self) -> int:
        return self.base.seed

    # ---- geometry ------------------------------------------------------------------------
    @property
    def U_coords(self) -> np.ndarray:
        """(k + r, r): U's coordinates 0..k+r−1 (all others are 0)."""
        return np.concatenate([self.U_w, self.U_perp], axis=0)

    @property
    def perp_gram(self) -> np.ndarray:
        """UᵀΠU = U_⊥ᵀU_⊥ (r×r; = (1 − u_alpha²) I for generated instances)."""
        return self.U_perp.T @ self.U_perp

    @property
    def w_dot_U(self) -> np.ndarray:
        """(k, r): ⟨wᵢ, U_a⟩ = (W U)ᵢₐ = (L U_w)ᵢₐ."""
        return self.w_factor @ self.U_w

    def teacher_norms(self) -> np.ndarray:
        """Nᵢ = ‖wᵢ + ξ U cᵢ‖ = √(1 + 2ξ⟨WU)ᵢ, cᵢ⟩ + ξ²‖cᵢ‖²)."""
        xi, c = self.xi, self.C
        return np.sqrt(1.0 + 2.0 * xi * (self.w_dot_U * c).sum(1) + xi**2 * (c * c).sum(1))

    def student_norms(self, C_hat=None) -> np.ndarray:
        """N̂ⱼ = ‖wⱼ + ξ Û ĉⱼ‖ = √(1 + ξ²‖ĉⱼ‖²) for Û ⊥ span W, ÛᵀÛ = I; (..., k)."""
        ch = self.C_hat if C_hat is None else np.asarray(C_hat, dtype=float)
        return np.sqrt(1.0 + self.xi**2 * (ch * ch).sum(-1))

    def teacher_gram(self) -> np.ndarray:
        """⟨vᵢ, vⱼ⟩ = (G + ξ(WU)Cᵀ + ξC(WU)ᵀ + ξ²CCᵀ)ᵢⱼ/(NᵢNⱼ)."""
        xi, c, wu = self.xi, self.C, self.w_dot_U
        raw = self.gram + xi * (wu @ c.T + c @ wu.T) + xi**2 * (c @ c.T)
        n = self.teacher_norms()
        return raw / np.outer(n, n)

    def student_gram(self, C_hat=None) -> np.ndarray:
        """⟨v̂ᵢ, v̂ⱼ⟩ = (G + ξ²ĈĈᵀ)ᵢⱼ/(N̂ᵢN̂ⱼ) for Û ⊥ span W (independent of Û); (..., k, k)."""
        ch = self.C_hat if C_hat is None else np.asarray(C_hat, dtype=float)
        nh = self.student_norms(ch)
        raw = self.gram + self.xi**2 * (ch @ np.swapaxes(ch, -1, -2))
        return raw / (nh[..., :, None] * nh[..., None, :])

    def correlation_parts(self, C_hat=None):
        """(P, Q) with ρᵢⱼ(M) = ⟨vᵢ, v̂ⱼ⟩ = Pᵢⱼ + Qᵢⱼ·(C M Ĉᵀ)ᵢⱼ for Û ⊥ span W, M = UᵀÛ.

        Pᵢⱼ = (Gᵢⱼ + ξ⟨cᵢ, (WU)ⱼ⟩)/(NᵢN̂ⱼ), Qᵢⱼ = ξ²/(NᵢN̂ⱼ); shapes (..., k, k).
        """
        ch = self.C_hat if C_hat is None else np.asarray(C_hat, dtype=float)
        denom = self.teacher_norms()[:, None] * self.student_norms(ch)[..., None, :]
        p = (self.gram + self.xi * self.C @ self.w_dot_U.T) / denom
        return p, self.xi**2 / denom

    def with_gauge(self, q, q_hat=None) -> LoraInstance:
        """(C, U) ↦ (CQ, UQ) (the same teacher) and Ĉ ↦ ĈQ̂ (Q, Q̂ ∈ O(r))."""
        q = np.asarray(q, dtype=float)
        qh = np.eye(self.rank) if q_hat is None else np.asarray(q_hat, dtype=float)
        return LoraInstance(self.base, self.rank, self.C @ q, self.C_hat @ qh, self.U_w @ q,
                            self.U_perp @ q, dict(self.spec, gauge=True))


# ---------------------------------------------------------------- construction
def _err(key: str, problem: str) -> ConfigError:
    return ConfigError(key, problem)


def _matrix(key, val, k, r) -> np.ndarray:
    try:
        arr = np.asarray(val, dtype=float)
    except (TypeError, ValueError):
        raise _err(key, f"must be a generator name or a numeric k×r array, got {val!r}") \
            from None
    if arr.ndim == 1 and r == 1:
        arr = arr[:, None]
    if arr.shape != (k, r):
        raise _err(key, f"must have shape ({k}, {r}) (k × rank), got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise _err(key, "contains NaN or Inf")
    return arr


def _columns(name: str, key1: str, key_r: str, k: int, r: int, seed: int) -> np.ndarray:
    """k×r matrix of generator ``name``: column 0 = the rank-1 draw of stream ``key1``
    (``dynamics.instances.instance``'s generator), further columns from stream ``key_r``."""
    col0, _ = _vector({key1: name}, key1, k, name, C_GENERATORS, seed)
    if r == 1:
        return col0[:, None]
    rng = _rng(seed, key_r)
    if name == "quantized":
        rest = rng.choice([-1.0, 1.0], size=(k, r - 1)) / math.sqrt(k)
    else:
        g = rng.standard_normal((k, r - 1))
        rest = g / np.linalg.norm(g, axis=0, keepdims=True)
    return np.concatenate([col0[:, None], rest], axis=1)


def _spectrum(values, k: int, r: int, seed: int) -> np.ndarray:
    if values is None:
        raise _err("spectrum", "is required by C = 'spectrum' (the r singular values of C)")
    s = np.asarray(values, dtype=float).reshape(-1)
    if s.shape != (r,):
        raise _err("spectrum", f"needs rank = {r} values, got {s.size}")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise _err("spectrum", f"values must be finite and > 0, got {s.tolist()}")
    if np.any(np.diff(s) > 0):
        raise _err("spectrum", f"must be non-increasing (s₁ ≥ … ≥ s_r), got {s.tolist()}")
    rng = _rng(seed, "C")
    a = uniform_frames(rng.standard_normal((k, r)))
    b = uniform_frames(rng.standard_normal((r, r)))
    return (a * s) @ b.T


def _build_c(opts, base: Instance, r: int) -> tuple[np.ndarray, str]:
    k, seed = base.k, base.seed
    val = opts.get("C", base.spec.get("c", "quantized"))
    if isinstance(val, str):
        name = val.lower()
        if name == "explicit":  # the base instance's explicit c
            if r != 1:
                raise _err("C", f"the instance's c is an explicit vector; rank {r} needs an "
                                "explicit k×r C or a generator")
            return base.c[:, None].copy(), "explicit"
        if name not in C_RANK_GENERATORS:
            raise _err("C", f"unknown generator {val!r}; valid: {', '.join(C_RANK_GENERATORS)}"
                            " or a k×r array")
        if name == "spectrum":
            return _spectrum(opts.get("spectrum"), k, r, seed), name
        return _columns(name, "c", "C", k, r, seed), name
    return _matrix("C", val, k, r), "explicit"


def _build_c_hat(opts, base: Instance, c: np.ndarray, r: int) -> tuple[np.ndarray, str]:
    k, seed = base.k, base.seed
    val = opts.get("C_hat", base.spec.get("c_hat", "quantized"))
    if isinstance(val, str):
        name = val.lower()
        if name == "teacher":
            return c.copy(), name
        if name == "explicit":
            if r != 1:
                raise _err("C_hat", f"the instance's c_hat is an explicit vector; rank {r} "
                                    "needs an explicit k×r C_hat or a generator")
            return base.c_hat[:, None].copy(), "explicit"
        if name not in C_HAT_RANK_GENERATORS:
            raise _err("C_hat", f"unknown generator {val!r}; valid: "
                                f"{', '.join(C_HAT_RANK_GENERATORS)} or a k×r array")
        return _columns(name, "c_hat", "C_hat", k, r, seed), name
    return _matrix("C_hat", val, k, r), "explicit"


def _build_u(base: Instance, r: int) -> tuple[np.ndarray, np.ndarray]:
    alpha = base.u_alpha
    if alpha == 0.0:
        return np.zeros((base.k, r)), np.eye(r)
    first = base.u_w / alpha
    g = np.concatenate([first[:, None], _rng(base.seed, "U_w").standard_normal((base.k, r - 1))],
                       axis=1)
    q, rr = np.linalg.qr(g)
    u_w = alpha * q * np.sign(np.diag(rr))  # column 0 = +u_w
    u_w[:, 0] = base.u_w
    return u_w, base.u_perp * np.eye(r)


def build_lora_instance(base: Instance, rank: int, options: dict | None = None) -> LoraInstance:
    """The rank-r instance on ``base`` with the rank-r keys ``options`` (see module doc)."""
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(LORA_KEYS))
    if unknown:
        raise _err(unknown[0], f"unknown rank-r key; valid: {', '.join(LORA_KEYS)}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise _err("rank", f"must be a positive integer, got {rank!r}")
    r, k = int(rank), base.k
    if r > k:
        raise _err("rank", f"must be ≤ k = {k} (ξCUᵀ has rank ≤ k), got {r}")
    if base.d is not None and base.d < k + r + 1:
        raise _err("rank", f"needs d ≥ k + rank + 1 = {k + r + 1} (span W, U and a free "
                           f"direction), got d = {base.d}")
    if "spectrum" in opts and str(opts.get("C", "")).lower() != "spectrum":
        raise _err("spectrum", "is only used with C = 'spectrum'")
    c, c_name = _build_c(opts, base, r)
    c_hat, ch_name = _build_c_hat(opts, base, c, r)
    u_w, u_perp = _build_u(base, r)
    spec = {"rank": r, "C": c_name, "C_hat": ch_name,
            "spectrum": None if opts.get("spectrum") is None else
            [float(v) for v in np.ravel(opts["spectrum"])],
            "values": {"C": c.tolist(), "C_hat": c_hat.tolist(), "U_w": u_w.tolist(),
                       "U_perp": u_perp.tolist()}}
    return LoraInstance(base, r, c, c_hat, u_w, u_perp, spec)


def lora_options(config) -> dict:
    """The rank-r keys of a run config: from ``config.extra`` and the instance spec dict
    (a key given in both places is an error)."""
    extra = {k: v for k, v in (config.extra or {}).items() if k in LORA_KEYS}
    inst = {k: v for k, v in config.instance.items() if k in LORA_KEYS}
    both = sorted(set(extra) & set(inst))
    if both:
        raise _err(both[0], "is given both in the instance spec and in extra")
    return {**inst, **extra}


def run_lora_instances(config, instances=None) -> list[LoraInstance]:
    """The rank-r instance of every run (length R), on ``config.run_instances()``."""
    instances = config.run_instances() if instances is None else instances
    opts = lora_options(config)
    cache: dict[int, LoraInstance] = {}
    out = []
    for inst in instances:
        if id(inst) not in cache:
            cache[id(inst)] = build_lora_instance(inst, config.options.rank, opts)
        out.append(cache[id(inst)])
    return out

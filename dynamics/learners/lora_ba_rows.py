"""Base and target rows of ``lora-ba`` beyond the paper's teacher (issue 39, item 1).

Options (``LoRABAOptions``): the base W ∈ R^{k×d} is the instance's (default), the rows of a
file (``base_rows``: .npy or text, a k×d array, any norms) or drawn with Gram
G = diag(n)((1 − ρ)I + ρ11ᵀ)diag(n) (``base_norms`` n: one number or k comma-separated ones,
``base_corr`` ρ ∈ (−1/(k − 1), 1)), placed as W = [L, 0], L = chol(G). The target W* is
W + ξcuᵀ from the instance's ξ, c, u (default) or the rows of a file (``target_rows``, k×d, in
the base's coordinates: the file's own for a ``base_rows`` file, else the canonical frame
W = [L, 0]). ``normalize_rows`` (default true) divides student and teacher rows by their
norms (the unit convention); false uses them as they are: f(x) = Σλⱼσ(⟨hⱼ, x⟩), H = W + sBA.
With every option at its default the learner runs the paper's teacher exactly as before
(:func:`is_general` false, :func:`ba_rows` unused).

Frame (rotation invariance, x ~ N(0, I_d)): span(W, W*) is put in the first t ≤ 2k
coordinates: Wᵀ = QR̃ (QR, diag R̃ ≥ 0), W ↦ R̃ᵀ (k×k, first k coordinates); a file target's
part orthogonal to span W, P = W* − W*QQᵀ, goes to the next m coordinates by an SVD
P = UΣVᵀ (coordinates UΣ, the m singular values above ``RANK_TOL`` of the largest row norm),
t = k + m; the default target W + ξcuᵀ has u = (u_w, u⊥) in the instance's canonical frame,
t = k + 1. Every inner product among the rows of W and W* is kept, so the law of a run is
the one it has in the file's coordinates (A₀ gaussian; a kaiming A₀ is drawn in the frame).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamics.errors import ConfigError

__all__ = ["BARows", "is_general", "base_matrix", "ba_rows", "ba_rows_of_instances",
           "check_rows", "rows_observables", "rows_loss", "rows_files", "RANK_TOL"]

RANK_TOL = 1e-12  # a singular value of W*'s part ⊥ span W below this × max row norm is zero
ROW_OPTIONS = ("base_rows", "target_rows", "base_norms", "base_corr")


@dataclass(frozen=True)
class BARows:
    """The runs' rows in the t-dim frame (module docstring): ``w`` (R, k, t) base, ``v``
    (R, k, t) teacher rows as the loss uses them (divided by their norms where
    ``normalize``), ``u`` (R, t) the overlap's direction (the instance's u, or W* − W's top
    right singular vector for a file target), ``target`` (R, k, t) the update direction of
    ``update_overlap`` (cuᵀ, or W* − W), ``lam`` (R, k) the second layer."""

    w: np.ndarray
    v: np.ndarray
    u: np.ndarray
    target: np.ndarray
    lam: np.ndarray
    normalize: bool

    @property
    def t(self) -> int:
        """The frame's dimension t = dim span(W, W*) (at most 2k)."""
        return int(self.w.shape[-1])


def is_general(options) -> bool:
    """Whether ``options`` leave the paper's teacher (a row option set, or unnormalised rows)."""
    return (not options.normalize_rows) or any(getattr(options, n) is not None
                                               for n in ROW_OPTIONS)


def _given(path: str, key: str):
    """``given_rows.given_rows(path)`` with its errors naming ``key``."""
    from dynamics.learners.given_rows import given_rows

    try:
        return given_rows(path)
    except ConfigError as exc:
        raise ConfigError(key, str(exc).partition("'init_rows': ")[2]) from None


def rows_files(options):
    """The ``base_rows``/``target_rows`` files as one ``GivenRows`` (both: their entries in one
    1×n array, the sha256 of their sha256s), or None: a sweep cell's hash then covers their
    content and the memory estimate their bytes."""
    import hashlib

    from dynamics.learners.given_rows import GivenRows

    given = [_given(getattr(options, key), key) for key in ("base_rows", "target_rows")
             if getattr(options, key) is not None]
    if len(given) < 2:
        return given[0] if given else None
    flat = np.concatenate([g.array.ravel() for g in given])[None]  # 1 × (all entries)
    digest = hashlib.sha256((given[0].sha256 + given[1].sha256).encode()).hexdigest()
    return GivenRows(f"{given[0].path} + {given[1].path}", flat, digest)


def _read(path: str, key: str) -> np.ndarray:
    """A k×d array from a rows file (``given_rows``' reader), errors naming ``key``."""
    arr = _given(path, key).array
    if arr.ndim != 2:
        raise ConfigError(key, f"{path}: must hold a k×d array, got shape {arr.shape}")
    return arr


def _norms(options, k: int) -> np.ndarray:
    """The base's row norms n (k,) from ``base_norms`` (one number or k, comma-separated)."""
    text = options.base_norms
    if text is None:
        return np.ones(k)
    try:
        vals = np.array([float(v) for v in str(text).replace(",", " ").split()])
    except ValueError:
        raise ConfigError("base_norms", f"must be numbers separated by commas, got {text!r}")\
            from None
    if vals.size == 1:
        vals = np.full(k, vals[0])
    if vals.size != k:
        raise ConfigError("base_norms", f"needs 1 or k = {k} numbers, got {vals.size}")
    if not (np.isfinite(vals).all() and (vals > 0).all()):
        raise ConfigError("base_norms", f"norms must be finite and > 0, got {text!r}")
    return vals


def base_matrix(options, k: int, d: int) -> np.ndarray | None:
    """W (k×d) of a ``base_rows`` file, or [L, 0] drawn from ``base_norms``/``base_corr``, or
    None (the instance's W); ConfigError for a wrong shape, norms or ρ."""
    if options.base_rows is not None:
        if options.base_norms is not None or options.base_corr is not None:
            raise ConfigError("base_rows", "give the base either as a file or by base_norms/"
                                           "base_corr, not both")
        w = _read(options.base_rows, "base_rows")
        if w.shape != (k, d):
            raise ConfigError("base_rows", f"{options.base_rows}: must be k×d = {k}×{d}, got "
                                           f"{w.shape[0]}×{w.shape[1]}")
        return w
    if options.base_norms is None and options.base_corr is None:
        return None
    n = _norms(options, k)
    rho = 0.0 if options.base_corr is None else float(options.base_corr)
    lo = -1.0 / (k - 1) if k > 1 else -np.inf
    if not lo < rho < 1.0:
        raise ConfigError("base_corr", f"must lie in (−1/(k − 1), 1) = ({lo:.4g}, 1) for "
                                       f"k = {k}, got {rho!r}")
    gram = np.outer(n, n) * ((1.0 - rho) * np.eye(k) + rho)
    w = np.zeros((k, d))
    w[:, :k] = np.linalg.cholesky(gram)
    return w


def _frame(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q (d×k), R̃ᵀ (k×k)) with W = R̃ᵀQᵀ, diag R̃ ≥ 0."""
    q, rt = np.linalg.qr(w.T)
    sign = np.where(np.diag(rt) < 0, -1.0, 1.0)
    return q * sign, (rt * sign[:, None]).T


def _target_coords(w_star: np.ndarray, q: np.ndarray) -> np.ndarray:
    """W* (k×d) in the frame: (W*Q, UΣ) with P = W* − W*QQᵀ = UΣVᵀ (module docstring)."""
    inside = w_star @ q
    u, s, _ = np.linalg.svd(w_star - inside @ q.T, full_matrices=False)
    scale = max(float(np.linalg.norm(w_star, axis=1).max()), 1.0)
    m = int((s > RANK_TOL * scale).sum())
    return np.concatenate([inside, u[:, :m] * s[:m]], -1)


def _pad(a: np.ndarray, t: int) -> np.ndarray:
    out = np.zeros(a.shape[:-1] + (t,))
    out[..., : a.shape[-1]] = a
    return out


def check_rows(rows: np.ndarray, key: str) -> None:
    """No zero row where rows are normalised (ConfigError naming ``key``)."""
    zero = np.flatnonzero((np.linalg.norm(rows, axis=-1) == 0).reshape(-1, rows.shape[-2])
                          .any(0))
    if zero.size:
        raise ConfigError(key, f"row {int(zero[0])} is zero and cannot be normalised "
                               "(normalize_rows on)")


def ba_rows(options, d: int, inst: dict) -> BARows:
    """The runs' :class:`BARows` from ``options`` and the instances' arrays ``inst`` (per
    run, run axis first): ``l`` (R, k, k) W's factor, ``u_w`` (R, k), ``u_perp`` (R,),
    ``c`` (R, k), ``xi`` (R,), ``lam`` (R, k)."""
    l, lam = np.asarray(inst["l"], float), np.asarray(inst["lam"], float)
    runs, k = lam.shape
    l = np.broadcast_to(l, (runs, k, k))
    given = base_matrix(options, k, d)
    target_file = None
    if options.target_rows is not None:
        target_file = _read(options.target_rows, "target_rows")
        if target_file.shape != (k, d):
            raise ConfigError("target_rows", f"{options.target_rows}: must have the base's "
                                             f"shape k×d = {k}×{d}, got "
                                             f"{target_file.shape[0]}×{target_file.shape[1]}")
    ws, stars, us, targets = [], [], [], []
    for i in range(runs):
        w_d = given if given is not None else _pad(l[i], d)
        q, wk = _frame(w_d)
        if target_file is None:
            u = np.concatenate([inst["u_w"][i], [inst["u_perp"][i]]])
            cu = np.outer(inst["c"][i], u)
            star = _pad(wk, k + 1) + inst["xi"][i] * cu
        else:
            star = _target_coords(target_file, q)
            cu = star - _pad(wk, star.shape[-1])
            _, _, vt = np.linalg.svd(cu)
            u = vt[0]
        ws.append(wk)
        stars.append(star)
        us.append(u)
        targets.append(cu)
    t = max(s.shape[-1] for s in stars)
    w, star, u, target = (np.stack([_pad(a, t) for a in arrs])
                          for arrs in (ws, stars, us, targets))
    if options.normalize_rows:
        check_rows(w, "base_rows")
        check_rows(star, "target_rows")
        star = star / np.linalg.norm(star, axis=-1, keepdims=True)
    return BARows(w, star, u, target, lam, bool(options.normalize_rows))


def ba_rows_of_instances(options, instances) -> BARows:
    """:func:`ba_rows` of a list of instances (one per run)."""
    inst = {"l": np.stack([i.w_factor for i in instances]),
            "u_w": np.stack([i.u_w for i in instances]),
            "u_perp": np.array([i.u_perp for i in instances]),
            "c": np.stack([i.c for i in instances]), "xi": np.array([i.xi for i in instances]),
            "lam": np.stack([i.lam * i.output_scale for i in instances])}
    return ba_rows(options, int(instances[0].d), inst)


def rows_observables(rows: BARows, b: np.ndarray, a_red: np.ndarray,
                     scale: float) -> tuple[np.ndarray, dict]:
    """(overlap (R, C), extras) of B (R, C, k, r) and A (R, C, r, D) in a reduced basis whose
    first t coordinates are the frame's: |⟨v₁(BA), u⟩|, update_overlap ⟨BA, T⟩_F/(‖BA‖_F‖T‖_F)
    (T = ``rows.target``; NaN where BA = 0), b_norm, a_norm, delta_norm = ‖sBA‖_F."""
    from dynamics.learners.linearized import top_overlap

    ba = b @ a_red
    width = ba.shape[-1]
    u = _pad(rows.u, width)[:, None]
    tgt = _pad(rows.target, width)[:, None]
    norm = np.linalg.norm(ba, axis=(-2, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        signed = (ba * tgt).sum((-2, -1))
        update = np.where(norm > 0, signed / (norm * np.linalg.norm(tgt, axis=(-2, -1))),
                          np.nan)
    extra = {"update_overlap": update, "b_norm": np.linalg.norm(b, axis=(-2, -1)),
             "a_norm": np.linalg.norm(a_red, axis=(-2, -1)), "delta_norm": abs(scale) * norm}
    return top_overlap(ba, u), extra


def rows_loss(activation, rows: BARows, delta: np.ndarray) -> np.ndarray:
    """(R, C) exact E(f* − f̂)² of the students with rows H = W + Δ (Δ (R, C, k, D) in a basis
    whose first t coordinates are the frame's), divided by their norms where
    ``rows.normalize``: dual kernels of unit rows, else the Gaussian pair integrals of rows
    of any norm (``network_loss_from_overlaps``). NaN where Δ is not finite."""
    from dynamics.measures.network_loss import network_loss_from_grams, network_loss_from_overlaps

    runs, cps = delta.shape[:2]
    width = max(delta.shape[-1], rows.t)
    ok = np.isfinite(delta).all((2, 3))
    h = _pad(rows.w, width)[:, None] + _pad(np.where(ok[..., None, None], delta, 0.0), width)
    v = _pad(rows.v, width)
    if rows.normalize:
        h = h / np.linalg.norm(h, axis=-1, keepdims=True)
    loss_of = network_loss_from_grams if rows.normalize else network_loss_from_overlaps
    out = np.empty((runs, cps))
    for i in range(runs):
        gram = h[i] @ np.swapaxes(h[i], -1, -2)
        cross = np.einsum("id,cjd->cij", v[i], h[i])
        lam_hat = np.broadcast_to(rows.lam[i], (cps, rows.lam.shape[-1]))
        out[i] = loss_of(activation, rows.lam[i], v[i] @ v[i].T, lam_hat, gram, cross)
    return np.where(ok, out, np.nan)

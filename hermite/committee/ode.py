"""Order-parameter ODEs of the soft committee machine (Saad & Solla 1995; Goldt et al. 2019).

Fields and order parameters (derivation: docs/theory/committee.md). Student
ŷ(x) = Σ_k v_k g(λ_k), teacher y = Σ_m A_m g(ν_m) + ζ (label noise, variance σ²), x ~ N(0, I_N).

* ``rows="free"``: λ_k = ŵ_k·x/√N with O(1) weights, Q = ŴŴᵀ/N, R = ŴVᵀ/N, T = VVᵀ/N;
  online SGD ŵ_k ← ŵ_k − (η̄/√N) δ_k x, δ_k = ∂L/∂λ_k (equivalently, with w = ŵ/√N and
  λ = ⟨w, x⟩, the engine's plain SGD w ← w − η ∇_w L at η = η̄/N).
* ``rows="unit"`` (loradyn's ``scratch`` learners): λ_k = ⟨ŵ_k, x⟩ with ‖ŵ_k‖ = 1, T the
  teacher rows' Gram (unit diagonal for a fine-tuned teacher; any for a committee teacher:
  only the student's rows are normalised); the engine's spherical step
  ŵ_k ← (ŵ_k − η δ_k (x − λ_k ŵ_k))/n_k, n_k² = 1 + η² δ_k² (‖x‖² − λ_k²), with η = η̄/N.
* second layer (``lr_v``, squared loss only): v_k ← v_k − (η̄_v/N) ∂L/∂v_k.

Losses (``loss_scale`` s; the engine's is s = 1, nn2pp's ½(y − ŷ)² is s = ½):
squared L = s(y − ŷ)²: δ_k = −2s e v_k g′(λ_k), ∂L/∂v_k = −2s e g(λ_k), e = y − ŷ;
correlation (CSQ) L = −s y ŷ: δ_k = −s y v_k g′(λ_k).

With D_kb = E[δ_k b] (b any field) and S_kl = E[δ_k δ_l], by Stein's lemma (integrals.py)

    D_kb = −γ s v_k Σ_c c_c I3(λ_k, b, c),
    S_kl = γ² s² v_k v_l (Σ_{c,d} c_c c_d I4(λ_k, λ_l, c, d) + σ² J2(λ_k, λ_l)),

γ = 2, c = (−v, A) (squared); γ = 1, c = (0, A) (correlation). In α = steps/N, to first order in
η̄ and second order in η̄ (the η² N terms; batch b divides them):

    free:  dQ_kl/dα = −η̄ (D_kl + D_lk) + (η̄²/b) S_kl
           dR_km/dα = −η̄ D_km
    unit:  dR_km/dα = −η̄ (D_km − D_kk R_km) − (η̄²/2b) S_kk R_km
           dQ_kl/dα = −η̄ (D_kl − D_kk Q_kl + D_lk − D_ll Q_kl)
                      + (η̄²/b)(S_kl − ½(S_kk + S_ll) Q_kl)          (dQ_kk = 0)
    dv_k/dα = 2 s η̄_v Σ_c c_c I2(λ_k, c).

The generalisation error ε = s E[(f* − f̂)²] = s Σ_{ab} c_a c_b I2(a, b) over all K + M fields
(with c = (−v, A), noise excluded), computed as s cᵀG₊c from the PSD part G₊ of the feature
Gram G_ab = I2(a, b), so that it never goes below 0 where an integrated state near ε = 0 left
the PSD cone by the integrator's tolerance (:func:`committee_loss_batch`); the alignment is
the mean over teacher neurons m of max_k |R_km|/√(Q_kk T_mm) (the ``scratch`` learner's
``overlap``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.integrate

from hermite.committee.integrals import CommitteeIntegrals, stein_i3

__all__ = ["CommitteeState", "CommitteeModel", "CommitteeTrajectory", "DriftTerms",
           "committee_drift", "committee_terms", "committee_terms_batch", "committee_step",
           "committee_ode", "committee_ode_batch",
           "committee_loss", "committee_alignment", "committee_loss_batch",
           "committee_loss_terms",
           "committee_alignment_batch", "drift_from_terms", "joint_cov_batch",
           "ROWS", "LOSSES", "INTEGRATORS"]

ROWS = ("free", "unit")
LOSSES = ("squared", "correlation")
INTEGRATORS = ("rk4", "map", "solve_ivp")


@dataclass(frozen=True)
class CommitteeState:
    """Student order parameters: Q (K, K), R (K, M), v (K,) (second layer)."""

    Q: np.ndarray
    R: np.ndarray
    v: np.ndarray

    @classmethod
    def from_arrays(cls, Q, R, v=None) -> CommitteeState:
        Q = np.array(Q, dtype=np.float64, ndmin=2)
        R = np.array(R, dtype=np.float64, ndmin=2)
        v = np.ones(Q.shape[0]) if v is None else np.array(v, dtype=np.float64, ndmin=1)
        return cls(Q, R, v)

    @classmethod
    def from_weights(cls, W, V, v=None, rows: str = "free") -> CommitteeState:
        """From first-layer weights W (K, N) and teacher rows V (M, N): Q = WWᵀ/N,
        R = WVᵀ/N (``free``) or the Grams themselves (``unit``)."""
        W, V = np.asarray(W, dtype=np.float64), np.asarray(V, dtype=np.float64)
        n = W.shape[1] if rows == "free" else 1.0
        return cls.from_arrays(W @ W.T / n, W @ V.T / n, v)

    @property
    def K(self) -> int:
        return self.Q.shape[0]

    @property
    def M(self) -> int:
        return self.R.shape[1]

    def pack(self) -> np.ndarray:
        return np.concatenate([self.Q.ravel(), self.R.ravel(), self.v])

    def unpack(self, y: np.ndarray) -> CommitteeState:
        K, M = self.K, self.M
        return CommitteeState(y[:K * K].reshape(K, K), y[K * K:K * K + K * M].reshape(K, M),
                              y[K * K + K * M:])

    def __add__(self, other: CommitteeState) -> CommitteeState:
        return CommitteeState(self.Q + other.Q, self.R + other.R, self.v + other.v)

    def scaled(self, c: float) -> CommitteeState:
        return CommitteeState(c * self.Q, c * self.R, c * self.v)


@dataclass(frozen=True)
class CommitteeModel:
    """Everything but the student state: activation g, teacher (T (M, M), A (M,)), the row
    convention, the loss, step sizes η̄ = η·N (``lr``) and η̄_v (``lr_v``; ``None``: the
    second layer is frozen), label-noise variance, mini-batch size, whether the η² terms are
    kept (``second_order``), how the Gaussian integrals are computed (``method``,
    ``quadrature``: see :class:`~hermite.committee.integrals.CommitteeIntegrals`) and which
    first-layer rows move (``trainable``: K booleans, ``None`` = all; a frozen row has
    δ_k = 0, as in the ``sparse`` learner)."""

    activation: object
    T: np.ndarray
    A: np.ndarray
    lr: float
    rows: str = "free"
    loss: str = "squared"
    loss_scale: float = 1.0
    lr_v: float | None = None
    noise_var: float = 0.0
    batch: int = 1
    second_order: bool = True
    method: str = "auto"
    quadrature: dict | None = None
    trainable: tuple | None = None
    integrals: CommitteeIntegrals = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        T = np.array(self.T, dtype=np.float64, ndmin=2)
        A = np.array(self.A, dtype=np.float64, ndmin=1)
        if T.ndim != 2 or T.shape[0] != T.shape[1]:
            raise ValueError(f"T must be a square (M, M) matrix, got shape {T.shape}")
        if T.shape[0] < 1:
            raise ValueError("M (teacher width) must be ≥ 1, got 0")
        if A.shape != (T.shape[0],):
            raise ValueError(f"A must have shape ({T.shape[0]},) to match T, got {A.shape}")
        _check_psd("T", T)
        if np.any(np.diag(T) <= 0):
            raise ValueError("T must have a positive diagonal (teacher rows of zero norm)")
        if self.rows not in ROWS:
            raise ValueError(f"rows must be one of {', '.join(ROWS)}, got {self.rows!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        for name in ("lr", "loss_scale"):
            val = float(getattr(self, name))
            if not math.isfinite(val) or val <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {val:g}")
        if self.lr_v is not None:
            if self.loss != "squared":
                raise ValueError("a trained second layer (lr_v) needs the squared loss: the "
                                 "correlation loss is unbounded in v")
            if not math.isfinite(float(self.lr_v)) or float(self.lr_v) <= 0:
                raise ValueError(f"lr_v must be a finite number > 0 or None, got {self.lr_v}")
        if not math.isfinite(float(self.noise_var)) or float(self.noise_var) < 0:
            raise ValueError(f"noise_var must be ≥ 0, got {self.noise_var}")
        if int(self.batch) != self.batch or self.batch < 1:
            raise ValueError(f"batch must be an integer ≥ 1, got {self.batch}")
        object.__setattr__(self, "T", T)
        object.__setattr__(self, "A", A)
        integ = CommitteeIntegrals(self.activation, self.method, self.quadrature)
        if self.method == "closed":  # fail now, not in the middle of an integration
            for which in ("i2", "j2", "p2") + (("i4",) if self.second_order else ()):
                integ._use_closed(which)
        object.__setattr__(self, "integrals", integ)

    @property
    def M(self) -> int:
        return self.T.shape[0]

    @property
    def gamma(self) -> float:
        return 2.0 if self.loss == "squared" else 1.0

    def check_state(self, state: CommitteeState) -> CommitteeState:
        """Validate shapes, symmetry, positive semidefiniteness of [[Q, R], [Rᵀ, T]]."""
        Q, R, v = (np.asarray(a, dtype=np.float64) for a in (state.Q, state.R, state.v))
        if Q.ndim != 2 or Q.shape[0] != Q.shape[1]:
            raise ValueError(f"Q must be a square (K, K) matrix, got shape {Q.shape}")
        K = Q.shape[0]
        if K < 1:
            raise ValueError("K (student width) must be ≥ 1, got 0")
        if R.shape != (K, self.M):
            raise ValueError(f"R must have shape (K, M) = ({K}, {self.M}), got {R.shape}")
        if v.shape != (K,):
            raise ValueError(f"v must have shape (K,) = ({K},), got {v.shape}")
        if not (np.all(np.isfinite(Q)) and np.all(np.isfinite(R)) and np.all(np.isfinite(v))):
            raise ValueError("Q, R, v must be finite")
        if not np.allclose(Q, Q.T, rtol=0, atol=1e-12 * max(1.0, np.abs(Q).max())):
            raise ValueError("Q must be symmetric")
        if np.any(np.diag(Q) <= 0):
            raise ValueError("Q must have a positive diagonal (student rows of zero norm)")
        if self.rows == "unit" and not np.allclose(np.diag(Q), 1.0, rtol=0, atol=1e-8):
            raise ValueError("unit rows need diag(Q) = 1")
        if self.trainable is not None and np.shape(self.trainable) != (K,):
            raise ValueError(f"trainable must hold K = {K} booleans, got shape "
                             f"{np.shape(self.trainable)}")
        _check_psd("[[Q, R], [Rᵀ, T]]", joint_cov_batch(self, Q[None], R[None])[0])
        return CommitteeState(0.5 * (Q + Q.T), R, v)


def _check_psd(name, C):
    w = np.linalg.eigvalsh(C)
    if w[0] < -1e-9 * max(1.0, abs(w[-1])):
        raise ValueError(f"{name} must be positive semidefinite (smallest eigenvalue "
                         f"{w[0]:.3g}): not the Gram matrix of any rows")


@dataclass(frozen=True)
class DriftTerms:
    """The expectations behind the drift: D (K, K+M) = E[δ_k b] over the fields b (students
    then teachers), S (K, K) = E[δ_k δ_l], Gv (K,) = E[∂L/∂v_k] (zeros when the second layer
    is frozen), and the drift d(Q, R, v)/dα (``drift``)."""

    D: np.ndarray
    S: np.ndarray
    Gv: np.ndarray
    drift: CommitteeState


class _Plan:
    """Index pairs of one (K, M): (student, field) for the first order, all field pairs for
    the loss."""

    def __init__(self, K, M):
        P = K + M
        self.K, self.M, self.P = K, M, P
        kk, cc = np.meshgrid(np.arange(K), np.arange(P), indexing="ij")
        self.pairs = np.stack([kk.ravel(), cc.ravel()], axis=1)  # (K·P, 2) (student, field)
        self.all_pairs = np.stack(np.triu_indices(P), axis=1)  # (P(P+1)/2, 2)


_PLANS: dict = {}


def _plan(K, M) -> _Plan:
    if (K, M) not in _PLANS:
        _PLANS[(K, M)] = _Plan(K, M)
    return _PLANS[(K, M)]


def joint_cov_batch(model: CommitteeModel, Q, R) -> np.ndarray:
    """The fields' covariance [[Q, R], [Rᵀ, T]] of B states (B, K+M, K+M)."""
    B, M = Q.shape[0], model.M
    T = np.broadcast_to(model.T, (B, M, M))
    return np.concatenate([np.concatenate([Q, R], axis=2),
                           np.concatenate([np.swapaxes(R, 1, 2), T], axis=2)], axis=1)


def committee_terms(model: CommitteeModel, state: CommitteeState, *,
                    check: bool = True) -> DriftTerms:
    """D, S, E[∂L/∂v] and the drift d(Q, R, v)/dα at ``state`` (module docstring)."""
    if check:
        state = model.check_state(state)
    D, S, Gv, (dQ, dR, dv) = _terms_batch(model, state.Q[None], state.R[None], state.v[None])
    return DriftTerms(D[0], S[0], Gv[0], CommitteeState(dQ[0], dR[0], dv[0]))


def committee_terms_batch(model: CommitteeModel, Q, R, v) -> DriftTerms:
    """:func:`committee_terms` of B states at once (no check): Q (B, K, K), R (B, K, M),
    v (B, K); every field of the result carries the leading B axis. One call per integral for
    the whole batch (the η² terms of relu/abs: one compiled call per group of fields)."""
    Q, R, v = (np.asarray(a, dtype=np.float64) for a in (Q, R, v))
    D, S, Gv, (dQ, dR, dv) = _terms_batch(model, Q, R, v)
    return DriftTerms(D, S, Gv, CommitteeState(dQ, dR, dv))


def _terms_batch(model: CommitteeModel, Q, R, v):
    """(D, S, Gv, (dQ, dR, dv)) with a leading batch axis (module docstring)."""
    B, K = Q.shape[:2]
    M = model.M
    pl = _plan(K, M)
    ig = model.integrals
    C = joint_cov_batch(model, Q, R)
    s, gam = float(model.loss_scale), model.gamma
    A = np.broadcast_to(model.A, (B, M))
    coef = np.concatenate([-v, A], axis=1) if model.loss == "squared" else \
        np.concatenate([np.zeros((B, K)), A], axis=1)

    # first order: I3[k, b, c] = E[g′(λ_k) b g(c)] by Stein from P2, J2 on (λ_k, c)
    C2 = C[:, pl.pairs[:, :, None], pl.pairs[:, None, :]]  # (B, K·P, 2, 2)
    P2 = ig.p2(C2).reshape(B, K, pl.P)
    J2 = ig.j2(C2).reshape(B, K, pl.P)
    ck = C[:, :K]  # (B, K, P) = C_{k, ·}
    caa = np.diagonal(C, axis1=1, axis2=2)[:, :K, None, None]
    I3 = stein_i3(caa, ck[:, :, :, None], ck[:, :, None, :], C[:, None, :, :],
                  P2[:, :, None, :], J2[:, :, None, :])  # (B, K, b, c)
    vd = v if model.trainable is None else v * np.asarray(model.trainable, dtype=float)
    D = -gam * s * vd[:, :, None] * np.einsum("nkbc,nc->nkb", I3, coef)

    # second order: S_kl = γ² s² v_k v_l (E[g′(λ_k) g′(λ_l) e²] + σ² J2(λ_k, λ_l))
    S = np.zeros((B, K, K))
    if model.second_order:
        ku = np.triu_indices(K)
        tot = ig.gprime_e2_batch(C, coef, np.stack(ku, axis=1))
        if model.noise_var > 0:
            tot = tot + model.noise_var * J2[:, ku[0], ku[1]]
        S[:, ku[0], ku[1]] = tot
        S = S + np.swapaxes(np.triu(S, 1), 1, 2)
        S *= gam * gam * s * s * vd[:, :, None] * vd[:, None, :]

    # second layer
    Gv = np.zeros((B, K))
    if model.lr_v is not None:
        I2 = ig.i2(C2).reshape(B, K, pl.P)
        Gv = -2.0 * s * np.einsum("nkc,nc->nk", I2, coef)
    return D, S, Gv, drift_from_terms(model, D, S, Gv, Q, R)


def drift_from_terms(model: CommitteeModel, D, S, Gv, Q, R):
    """(dQ, dR, dv)/dα (batched, module docstring) from D (B, K, K+M), S (B, K, K) and
    Gv (B, K): the ODE's drift, or the diffusion's (:mod:`.diffusion`) with a sampled S."""
    K = Q.shape[1]
    dv = np.zeros_like(Gv) if model.lr_v is None else -float(model.lr_v) * Gv
    lr, b = float(model.lr), float(model.batch)
    Dq = D[:, :, :K]
    if model.rows == "free":
        dQ = -lr * (Dq + np.swapaxes(Dq, 1, 2)) + lr * lr / b * S
        dR = -lr * D[:, :, K:]
    else:
        dkk = np.diagonal(Dq, axis1=1, axis2=2)
        skk = np.diagonal(S, axis1=1, axis2=2)
        dR = -lr * (D[:, :, K:] - dkk[:, :, None] * R) - 0.5 * lr * lr / b * skk[:, :, None] * R
        first = Dq - dkk[:, :, None] * Q
        dQ = -lr * (first + np.swapaxes(first, 1, 2)) + lr * lr / b * (
            S - 0.5 * (skk[:, :, None] + skk[:, None, :]) * Q)
        dQ[:, np.arange(K), np.arange(K)] = 0.0
    return dQ, dR, dv


def committee_drift(model: CommitteeModel, state: CommitteeState) -> CommitteeState:
    """d(Q, R, v)/dα at ``state`` (α = steps/N)."""
    return committee_terms(model, state).drift


def committee_step(model: CommitteeModel, state: CommitteeState, N: float) -> CommitteeState:
    """The expected one-step map of one SGD step in dimension N: X + (dX/dα)/N (step
    η = η̄/N; the η² N terms with ‖x‖² ≈ N, error O((K+M)/N) relative in them)."""
    return state + committee_drift(model, state).scaled(1.0 / float(N))


def committee_loss(model: CommitteeModel, state: CommitteeState, *,
                   check: bool = True) -> float:
    """ε = s E[(f* − f̂)²] = s cᵀ G c ≥ 0, G_ab = I2(a, b), c = (−v, A),
    s = ``model.loss_scale`` (:func:`committee_loss_batch`: G's PSD part).

    ``check=False`` skips :meth:`CommitteeModel.check_state` (an integrated state at the
    R = T fixed point is PSD only up to the integrator's error)."""
    if check:
        state = model.check_state(state)
    return float(committee_loss_batch(model, state.Q[None], state.R[None], state.v[None])[0])


def committee_loss_batch(model: CommitteeModel, Q, R, v) -> np.ndarray:
    """:func:`committee_loss` of B states (no check): Q (B, K, K), R (B, K, M), v (B, K).

    ε = s cᵀ G₊ c = s Σ_i max(γ_i, 0) ⟨e_i, c⟩², with G = (I2(a, b)) the fields' feature Gram
    E[g(λ_a) g(λ_b)] (PSD for a valid state) and γ_i, e_i its eigenpairs: never below 0.
    The plain sum s Σ_ab c_a c_b I2(a, b) (:func:`committee_loss_terms`) is the same number
    to rounding for a valid state, but an integrated state near ε = 0 lies outside the PSD
    cone by the integrator's tolerance (its joint covariance has an eigenvalue ≈ −10⁻⁶ at
    rtol 10⁻⁶), and the sum then goes below 0 (−1.6·10⁻⁸ in nn2pp's setting at N = 10⁴)."""
    return committee_loss_terms(model, Q, R, v)[0]


def committee_loss_terms(model: CommitteeModel, Q, R, v) -> tuple[np.ndarray, np.ndarray]:
    """(ε ≥ 0 of :func:`committee_loss_batch`, the plain sum s Σ_ab c_a c_b I2(a, b)) of B
    states: where the second is below 0 the state is outside the PSD cone (counted by
    :func:`committee_ode` as ``below_zero``)."""
    Q, R, v = (np.asarray(a, dtype=np.float64) for a in (Q, R, v))
    B, K = Q.shape[:2]
    M = model.M
    pl = _plan(K, M)
    C = joint_cov_batch(model, Q, R)
    I2 = model.integrals.i2(C[:, pl.all_pairs[:, :, None], pl.all_pairs[:, None, :]])
    coef = np.concatenate([-v, np.broadcast_to(model.A, (B, M))], axis=1)
    a, b = pl.all_pairs[:, 0], pl.all_pairs[:, 1]
    mult = np.where(a == b, 1.0, 2.0)
    plain = model.loss_scale * np.sum(mult * coef[:, a] * coef[:, b] * I2, axis=1)
    G = np.zeros((B, K + M, K + M))
    G[:, a, b] = I2
    G[:, b, a] = I2
    if not np.all(np.isfinite(G)):
        return plain, plain
    gam, vec = np.linalg.eigh(G)
    proj = np.einsum("bji,bj->bi", vec, coef)
    psd = model.loss_scale * np.sum(np.maximum(gam, 0.0) * proj * proj, axis=1)
    return psd, plain


def committee_alignment(state: CommitteeState, T, diagonal: bool = False) -> float:
    """Mean over teacher neurons m of max_k |R_km|/√(Q_kk T_mm) (``scratch``'s overlap), or
    with ``diagonal`` of R_mm/√(Q_mm T_mm) (``sparse``'s, K = M)."""
    return float(committee_alignment_batch(np.asarray(state.Q)[None],
                                           np.asarray(state.R)[None], T, diagonal)[0])


def committee_alignment_batch(Q, R, T, diagonal: bool = False) -> np.ndarray:
    """:func:`committee_alignment` of B states: Q (B, K, K), R (B, K, M)."""
    T = np.array(T, dtype=np.float64, ndmin=2)
    qd = np.diagonal(np.asarray(Q, dtype=np.float64), axis1=1, axis2=2)
    cos = np.asarray(R, dtype=np.float64) / np.sqrt(qd[:, :, None] * np.diag(T)[None, None])
    if diagonal:
        return np.diagonal(cos, axis1=1, axis2=2).mean(-1)
    return np.abs(cos).max(axis=1).mean(-1)


@dataclass(frozen=True)
class CommitteeTrajectory:
    """Order parameters at the requested α: Q (n, K, K), R (n, K, M), v (n, K), the
    generalisation error ``loss`` (n,) and ``alignment`` (n,); ``steps`` = α·N for the map."""

    alpha: np.ndarray
    Q: np.ndarray
    R: np.ndarray
    v: np.ndarray
    loss: np.ndarray
    alignment: np.ndarray
    integrator: str
    evaluations: int
    below_zero: int = 0  # checkpoints whose plain loss sum was < 0 (committee_loss_terms)

    def state(self, i: int) -> CommitteeState:
        return CommitteeState(self.Q[i], self.R[i], self.v[i])


def _check_alphas(alphas):
    a = np.atleast_1d(np.asarray(alphas, dtype=np.float64))
    if a.ndim != 1 or a.size == 0 or not np.all(np.isfinite(a)) or a.min() < 0:
        raise ValueError("alphas must be a non-empty 1-D array of finite times ≥ 0")
    if np.any(np.diff(a) < 0):
        raise ValueError("alphas must be sorted in increasing order")
    return a


def committee_ode(model: CommitteeModel, state0: CommitteeState, alphas, *,
                  integrator: str = "rk4", dt: float = 0.01, N: float | None = None,
                  rtol: float = 1e-8, atol: float = 1e-10) -> CommitteeTrajectory:
    """Integrate the order parameters from ``state0`` to every α in ``alphas``.

    ``integrator``: ``"rk4"`` (fixed step ``dt`` in α, last step shortened to hit each α),
    ``"map"`` (the expected one-step map :func:`committee_step` in dimension ``N``, one
    iteration per SGD step: α·N steps, rounded), ``"solve_ivp"`` (scipy's adaptive DOP853
    with ``rtol``, ``atol``).
    """
    if integrator not in INTEGRATORS:
        raise ValueError(f"integrator must be one of {', '.join(INTEGRATORS)}, "
                         f"got {integrator!r}")
    alphas = _check_alphas(alphas)
    st = model.check_state(state0)
    count = [0]

    def rhs(y):
        count[0] += 1
        return committee_terms(model, st.unpack(y), check=False).drift.pack()

    y = st.pack()
    out = np.empty((alphas.size, y.size))
    if integrator == "solve_ivp":
        sol = scipy.integrate.solve_ivp(lambda t, yy: rhs(yy), (0.0, float(alphas[-1])), y,
                                        method="DOP853", t_eval=alphas, rtol=rtol, atol=atol)
        if not sol.success:
            raise RuntimeError(f"solve_ivp failed: {sol.message}")
        out[:] = sol.y.T
    elif integrator == "map":
        if N is None or not (float(N) >= 1):
            raise ValueError("the map integrator needs the dimension N ≥ 1")
        steps = np.rint(alphas * float(N)).astype(np.int64)
        t = 0
        for i, target in enumerate(steps):
            while t < target:
                y = y + rhs(y) / float(N)
                t += 1
            out[i] = y
    else:
        if not (float(dt) > 0):
            raise ValueError(f"dt must be > 0, got {dt}")
        t = 0.0
        for i, target in enumerate(alphas):
            while t < target - 1e-12:
                h = min(float(dt), target - t)
                k1 = rhs(y)
                k2 = rhs(y + 0.5 * h * k1)
                k3 = rhs(y + 0.5 * h * k2)
                k4 = rhs(y + h * k3)
                y = y + h / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
                t += h
            out[i] = y
    return _trajectory(model, [st.unpack(row) for row in out], alphas, integrator, count[0])


def _trajectory(model, states, alphas, integrator, evaluations) -> CommitteeTrajectory:
    """The :class:`CommitteeTrajectory` of integrated states (RuntimeError if one is not
    finite: the ODE diverged)."""
    for s_ in states:
        if not (np.all(np.isfinite(s_.Q)) and np.all(np.isfinite(s_.R))):
            raise RuntimeError("the ODE diverged (non-finite order parameters): lower lr")
    Qs = np.stack([0.5 * (s_.Q + s_.Q.T) for s_ in states])
    loss, plain = committee_loss_terms(model, Qs, np.stack([s_.R for s_ in states]),
                                       np.stack([s_.v for s_ in states]))
    align = np.array([committee_alignment(s_, model.T) for s_ in states])
    return CommitteeTrajectory(alphas, np.stack([s_.Q for s_ in states]),
                               np.stack([s_.R for s_ in states]),
                               np.stack([s_.v for s_ in states]), loss, align, integrator,
                               evaluations, int(np.sum(plain < 0)))


def committee_ode_batch(model: CommitteeModel, states, alphas, *, rtol: float = 1e-8,
                        atol: float = 1e-10) -> list[CommitteeTrajectory]:
    """:func:`committee_ode` (``solve_ivp``) from B starts as one stacked system: one adaptive
    DOP853 over all of them, its drift one :func:`committee_terms_batch` call (the η² terms of
    the whole batch in one compiled call per group of fields instead of B Python-level
    evaluations). The step follows the fastest-moving start, so the whole batch takes about
    as many drift evaluations as its hardest member alone (16 ReLU starts at d = 1000: 479
    against 7349 one by one, the losses within 1.6e-6 of theirs at rtol 1e-6); scipy's error
    norm is the RMS over all B·n components. One trajectory per start, with the batch's
    evaluation count."""
    alphas = _check_alphas(alphas)
    sts = [model.check_state(st) for st in states]
    B = len(sts)
    if B == 0:
        return []
    K, M = sts[0].K, sts[0].M
    n = sts[0].pack().size
    count = [0]

    def rhs(_t, y):
        count[0] += 1
        Y = y.reshape(B, n)
        Q = Y[:, :K * K].reshape(B, K, K)
        R = Y[:, K * K:K * K + K * M].reshape(B, K, M)
        _, _, _, (dQ, dR, dv) = _terms_batch(model, Q, R, Y[:, K * K + K * M:])
        return np.concatenate([dQ.reshape(B, -1), dR.reshape(B, -1), dv], axis=1).ravel()

    y0 = np.concatenate([st.pack() for st in sts])
    root = math.sqrt(B)  # scipy's RMS norm over B starts: a start's own error at tol
    sol = scipy.integrate.solve_ivp(rhs, (0.0, float(alphas[-1])), y0, method="DOP853",
                                    t_eval=alphas, rtol=rtol / root, atol=atol / root)
    if not sol.success:
        raise RuntimeError(f"solve_ivp failed: {sol.message}")
    ys = sol.y.T.reshape(alphas.size, B, n)
    return [_trajectory(model, [sts[b].unpack(y) for y in ys[:, b]], alphas, "solve_ivp",
                        count[0]) for b in range(B)]

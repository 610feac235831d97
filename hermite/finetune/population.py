r"""The population ODE of fine-tuning in every regime: joint ĉ, unprojected û, u_alpha > 0,
the App. B conventions (issue 25).

Model (docs/model.md): rows of the teacher rᵢ = wᵢ + ξcᵢu and of the student r̂ⱼ = wⱼ + ξĉⱼû,
û on the unit sphere; ``unit`` rows use rᵢ/‖rᵢ‖, the App. B conventions s·rᵢ with the fixed
factor s and the output scaled by 1/ξ. The population loss L(û, ĉ) = E(f* − f̂)² is

    L = o² [ Σᵢᵢ′ λᵢλᵢ′ κ(Tᵢᵢ, Tᵢ′ᵢ′, Tᵢᵢ′) + Σⱼⱼ′ λⱼλⱼ′ κ(Qⱼ, Qⱼ′, Sⱼⱼ′)
             − 2 Σᵢⱼ λᵢλⱼ κ(Tᵢᵢ, Qⱼ, Cᵢⱼ) ],

with o = 1 (unit) or 1/ξ (App. B), κ(q, q′, c) = E σ(a)σ(b) for the pre-activations of two
rows with raw Gram entries (q, q′, c) (unit: κ = K(c/√(qq′)), the dual kernel of
:mod:`hermite.expansion.kernels`; App. B: E σ(a)σ(b) of a centred pair with covariance
s²[[q, c], [c, q′]], :class:`PairKernel`), and the raw Gram entries, in the canonical frame
(û = (p, μ e, ν ê), ω = Lp = (⟨wⱼ, û⟩)ⱼ, m = ⟨û, u⟩ = ⟨p, u_w⟩ + μu⊥, (wu)ⱼ = ⟨wⱼ, u⟩):

    Qⱼ   = 1 + 2ξĉⱼωⱼ + ξ²ĉⱼ²                       (student row norms²)
    Sⱼⱼ′ = Gⱼⱼ′ + ξ(ĉⱼ′ωⱼ + ĉⱼωⱼ′) + ξ²ĉⱼĉⱼ′           (student Gram; Sⱼⱼ = Qⱼ)
    Cᵢⱼ  = Gᵢⱼ + ξĉⱼωᵢ + ξcᵢ(wu)ⱼ + ξ²cᵢĉⱼ m            (teacher–student)
    Tᵢᵢ′ = Gᵢᵢ′ + ξ(cᵢ′(wu)ᵢ + cᵢ(wu)ᵢ′) + ξ²cᵢcᵢ′       (teacher, constant).

So L depends on û only through (p, μ) (ν = √(1 − ‖p‖² − μ²) does not enter) and on ĉ.

Gradient (Price's theorem, ∂κ/∂c = E σ′(a)σ′(b), and the chain rule). With
M = o²λλᵀ ⊙ ∂_cκ(S) and N = −2o²λλᵀ ⊙ ∂_cκ(C), g_Q the o²-weighted sum of ∂κ/∂q over both
blocks (each row's norm appears in its row and column of the student block and in the
student column of the cross block):

    a = ∂L/∂ω  = ξ(M + Mᵀ)ĉ + 2ξ ĉ ⊙ g_Q + ξ N ĉ
    b = ∂L/∂m  = ξ² cᵀNĉ
    ∂L/∂ĉ      = ξ(M + Mᵀ)ω + ξ²(M + Mᵀ)ĉ + 2ξ(ω + ξĉ) ⊙ g_Q + Nᵀ(ξω + ξ²m c)

(+ 2·prox·ξ²ĉ, the proximal term). The Euclidean gradient of L in R^d is
(Lᵀa + b u_w, b u⊥, 0, …) plus a multiple of û (from ‖û‖², which the tangent projection
removes); with S = ⟨û, ·⟩ = ωᵀa + b m its tangent part has coordinates
(Lᵀa + b u_w − Sp, b u⊥ − Sμ, −Sν). The O(η) drift of the exact chain's state (p, μ, ν, ĉ)
(docs/theory/exact-reductions.md, (R0)–(R6)) is minus this mean gradient:

    unprojected:  Δp = −η(Lᵀa + b u_w − S p),   Δμ = −η(b u⊥ − S μ)
    projected:    Δp = 0,                       Δμ = −η b u⊥ (1 − μ²)
    joint ĉ:      Δĉ = −η_c (∂L/∂ĉ + 2·prox·ξ²ĉ);   frozen: Δĉ = 0.

Projected, frozen ĉ and unit rows this is Prop. 4's m̄′ = m̄ + ηh(m̄)(u⊥² − m̄²) (b = −h).
Mini-batches average b sample gradients and label noise enters y only with mean 0: the mean
gradient, hence the O(η) drift, is the same for every b and σ_ε² (they change the O(η²)
terms only). The ODE dX/dt = drift(X) is integrated in SGD steps in the coordinates
(p, μ, ĉ) by scipy's ``solve_ivp`` (BDF with the runs' block-diagonal Jacobian pattern: near
the teacher ρᵢᵢ → 1, where a kinked σ's K″ diverges, the flow is stiff; hitting times: DOP853
with an event).

Finite-d correction (``corrected=True``): the next order of the chain's step. From (R5),
X′ = (X − ηG_X)/n with n² = 1 + η²‖Ḡ_T‖² (Ḡ_T the tangent mini-batch gradient), so for
X = p, μ the complete O(η²) drift is −(η²/2) X E‖Ḡ_T‖²; ĉ's step is plain SGD and has none.
E‖Ḡ_T‖² = (1/b)E‖G_T‖² + (1 − 1/b)‖E G_T‖², and E‖G_T‖² = (d − k − 2)E g² + (the k+2
coordinates of H ⊕ ê), a Gaussian average over (z, a, b, ε) with ‖r‖² replaced by its mean
d − k − 2 (it enters linearly) — randomised quasi-Monte Carlo on fixed scrambled Sobol′
points (common random numbers, so the corrected drift is a smooth function of the state).
It is the renormalisation drift of docs/theory/finite-d.md (its ``second_order`` method) in
every regime; the projected/frozen/unit path keeps the exact-drift corrected map of
:mod:`hermite.finite_d.corrected_ode`. With ĉ joint and û unprojected,
``finetune_ode(corrected=True)``
returns the line E|m| of :mod:`hermite.finetune.escape` instead of the flow alone: from
|m₀| ~ d^{−1/2} the step noise of m (η² Var⟨Ḡ_T, u⟩ per step,
:meth:`SecondMoment.overlap_variance`) is of the same order as the renormalisation drift, and
the flow without it falls short of the runs' mean where η·d·ξ²·k is not small
(docs/theory/finite-d.md, "The corrected flow with ĉ joint and û unprojected").
The QMC average jumps where a kinked σ′ does, which defeats
step-size control: the corrected ODE is integrated by RK4 (:class:`CorrectedFlow`) with
steps η·Δt ≤ ``FLOW_STEP`` and Δt·ρ ≤ ``FLOW_RATE``, ρ the largest |eigenvalue| of the
drift's Jacobian. The O(η) drift is stiff where ξ²k is large: ĉ's Hessian scales with ξ²
(ĉⱼ moves row j by ξĉⱼû), and along ≈ λ/N³ (N the student rows' norms) the k rows add up
through the mean of σ′, ρ ≈ 2ξ²k E[σ′]² η/N² — for ReLU at ξ = √k 0.25–0.35 k²η (k = 8, 20,
50: 14, 100–190, 700–900 η). RK4 at a fixed η·Δt = 0.04 is stable only for ρΔt < 2.79: beyond,
that mode grows by |R(−ρΔt)| per step (k = 50: 2·10⁴–6·10⁴) until the kernels overflow
(Fig. 3 at full size) or, where the rows' normalisation caps it, the flow lands elsewhere
without a warning (Fig. 3 quick, k = 20).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.integrate
import scipy.sparse
import scipy.stats.qmc

from hermite._activation import resolve_activation
from hermite._quadrature import gauss_hermite
from hermite.activations import hermite_normalized
from hermite.expansion.kernels import dual_kernel, dual_kernel_derivative
from hermite.flows.regime import (
    FinetuneRegime,
    FinetuneStart,
    SolverSettings,
    _nonnegative,
    _positive,
    from_keywords,
)

__all__ = ["PairKernel", "FinetuneModel", "FinetuneODE", "finetune_ode",
           "finetune_steps_to_reach", "finetune_ode_kind", "HOMOGENEOUS_DEGREE", "MEHLER_TERMS",
           "MEHLER_NODES", "CorrectedFlow", "drift_rate", "rk4_step"]

HOMOGENEOUS_DEGREE = {"relu": 1, "abs": 1, "linear": 1, "quadratic": 2}
MEHLER_TERMS = 160  # Hermite degrees kept for a smooth σ without a closed form (non-unit rows)
MEHLER_NODES = 240  # Gauss–Hermite nodes of the 1-D coefficients βₙ(q) (see PairKernel)
QMC_POINTS = 2**11  # scrambled Sobol′ points of the finite-d second moment
_QMC_BLOCK = 4_000_000  # elements (runs × points × k) per vectorised block
STILL = 1e-11  # |drift|/η below which the flow counts as settled (hitting times: inf)
FLOW_STEP = 0.04  # largest η·Δt of one RK4 step of the corrected ODE; its O(η²d) coefficient is
# held at the step's predicted midpoint (measured, ReLU, k = 8, d = 2000, joint ĉ, η·d = 1, 12/η
# steps: 6.7e-5 in ⟨û, u⟩, 6e-6 in ⟨ĉ, c⟩ from the η·Δt = 0.0025 solution; held at the
# step's start, as before, 0.04 was 9e-4 from 0.01)
FLOW_RATE = 0.5  # and Δt·ρ ≤ FLOW_RATE, ρ the largest |eigenvalue| of the drift's Jacobian:
# a factor 5.6 inside RK4's stability limit 2.79, and short enough for the held coefficient to
# follow ĉ's fast relaxation (measured, ReLU, ξ = √k, joint ĉ, projected, m₀ = ±0.3: k = 20,
# η·d = 0.01: 2.2e-4 in ⟨û, u⟩ from the Δt·ρ ≤ 0.125 solution; k = 50, η·d = 0.004: 4e-5 in
# ⟨û, u⟩, 2.4e-3 in ⟨ĉ, c⟩ from RK4 with the coefficient at every stage; at Δt·ρ ≤ 1 five
# times that, at 2 the k = 50 flow is 0.3 off)
FLOW_MAX_STEPS = 100_000  # RK4 steps of one corrected integration: more is a stiff stretch
RATE_ITERATIONS = 12  # power iterations for ρ at the first step (then one per step, warm)
JV_STEP = 1e-6  # finite-difference width of a Jacobian–vector product (unit directions)
SPHERE_TOL = 1e-5  # ‖p‖² + μ² ≤ 1 + tol (a float32 start); renormalised onto the sphere


# ---------------------------------------------------------------- E σ(a)σ(b), any covariance
class PairKernel:
    r"""κ(qa, qb, c) = E σ(a)σ(b) for a centred Gaussian pair, Var a = qa, Var b = qb,
    Cov(a, b) = c, with its three partial derivatives.

    ``unit_rows=True``: the rows are normalised first, κ = K(ρ), ρ = c/√(qa qb), K the dual
    kernel (:func:`hermite.dual_kernel`: closed form, or the certified Chebyshev interpolant).
    Otherwise the pair's own covariance:

    * positively homogeneous σ of degree h (relu, abs, linear, quadratic, and σ(a·x) of
      them): κ = (qa qb)^{h/2} K(ρ) (closed form);
    * erf(a·x): κ = (2/π) arcsin(2a²c/√((1 + 2a²qa)(1 + 2a²qb))) (closed form);
    * any other σ without breakpoints (polynomials hₚ; sigmoid, tanh): Mehler's expansion
      κ = Σₙ βₙ(qa) βₙ(qb) ρⁿ with βₙ(q) = E[σ(√q z) hₙ(z)] by Gauss–Hermite quadrature
      (``MEHLER_NODES`` nodes). A polynomial of degree P needs n ≤ P and P + 1 nodes: exact.
      Otherwise ``MEHLER_TERMS`` terms; for σ analytic in a strip |Im z| < w the βₙ fall like
      exp(−w√(2n/q)); the measured error against a composite 2-D Gauss–Legendre reference
      is in :attr:`error_note` (tests/test_finetune_ode.py checks ≤ 1e-10 at variances
      0.3–2). Equal rows (ρ = 1: a row's own E σ(a)²) are evaluated directly in 1-D by
      :meth:`diagonal`.

    Derivatives: ∂κ/∂c = E σ′(a)σ′(b) (Price) and ∂κ/∂qa from the same closed forms or
    series; homogeneous: ∂κ/∂qa = (hκ − ρ(qa qb)^{h/2}K′(ρ))/(2qa) (h = 0 for unit rows).
    """

    error_note = ("Mehler series (160 terms, 240 Gauss–Hermite nodes) against composite 2-D "
                  "Gauss–Legendre: sigmoid ≤ 2e-16; tanh ≤ 5e-16 at variance ≤ 1, 2e-13 "
                  "(κ) / 2.5e-11 (∂κ/∂c) at 2, 4e-10 / 4e-8 at 4, 2e-7 / 4e-6 at 8 "
                  "(docs/theory/joint-c.md)")

    def __init__(self, activation, unit_rows: bool = True, terms: int = MEHLER_TERMS,
                 nodes: int = MEHLER_NODES):
        act = resolve_activation(activation)
        self.act = act
        base, scale = act.base_and_scale
        self.degree = 0
        if unit_rows:
            self.method = "unit"
        elif base in HOMOGENEOUS_DEGREE and act.kernel is not None:
            self.method, self.degree = "homogeneous", HOMOGENEOUS_DEGREE[base]
        elif base == "erf":
            self.method, self.alpha = "erf", 2.0 * scale * scale
        elif act.breakpoints:
            raise ValueError(f"no Gaussian pair kernel of activation {act.name!r} for rows that "
                             "are not unit vectors (piecewise σ other than relu/abs)")
        else:
            self.method = "mehler"
            if act.polynomial_degree is not None:
                self.terms = int(act.polynomial_degree)
                self.nodes = self.terms + 2
            else:
                self.terms, self.nodes = int(terms), int(nodes)
            x, w = gauss_hermite(self.nodes)
            self._x, self._w = np.asarray(x), np.asarray(w)
            self._h = np.stack([hermite_normalized(n, self._x) for n in range(self.terms + 1)])

    # -- Mehler pieces
    def coefficients(self, q):
        """(βₙ(q), dβₙ/dq) for n = 0..terms, shapes q.shape + (terms + 1,) (Mehler only)."""
        q = np.asarray(q, dtype=float)
        r = np.sqrt(q)[..., None]
        arg = r * self._x
        f = self.act.fn(arg) * self._w
        fp = self.act.deriv(arg) * (self._x * self._w)
        beta = f @ self._h.T
        dbeta = (fp @ self._h.T) / (2.0 * r)
        return beta, dbeta

    def diagonal(self, q):
        """(E σ(√q z)², its derivative in q): a row with itself, any method."""
        q = np.asarray(q, dtype=float)
        if self.method == "unit":
            k1 = float(dual_kernel(self.act, 1.0))
            return np.full(q.shape, k1), np.zeros(q.shape)
        if self.method == "homogeneous":
            h, k1 = self.degree, float(dual_kernel(self.act, 1.0))
            return q**h * k1, h * q ** (h - 1) * k1
        x, w = gauss_hermite(max(getattr(self, "nodes", 0), MEHLER_NODES))
        r = np.sqrt(q)[..., None]
        f = self.act.fn(r * x)
        val = (f * f) @ w
        der = (f * self.act.deriv(r * x) * x) @ w / r[..., 0]
        return val, der

    def value(self, qa, qb, c):
        """κ alone (what the loss needs): Mehler's series on βₙ only, the βₙ(q) of all q in
        one matrix product; every other method is :meth:`__call__`'s value."""
        if self.method != "mehler":
            return self(qa, qb, c, value=True)[0]
        qa, qb, c = (np.asarray(v, dtype=float) for v in (qa, qb, c))
        ba, bb = (self.coefficients(q.reshape(-1))[0].reshape(q.shape + (-1,))
                  for q in (qa, qb))
        rho = np.clip(c / np.sqrt(qa * qb), -1.0, 1.0)
        val = np.zeros(np.broadcast_shapes(qa.shape, qb.shape, c.shape))
        for n in range(self.terms, -1, -1):
            val = val * rho + ba[..., n] * bb[..., n]
        return val

    def __call__(self, qa, qb, c, value: bool = True):
        """(κ or None, ∂κ/∂qa, ∂κ/∂qb, ∂κ/∂c), broadcast over qa, qb, c."""
        qa, qb, c = (np.asarray(v, dtype=float) for v in (qa, qb, c))
        if self.method in ("unit", "homogeneous"):
            root = np.sqrt(qa * qb)
            rho = np.clip(c / root, -1.0, 1.0)
            kp = dual_kernel_derivative(self.act, rho)
            h = self.degree
            g = root**h if h else 1.0
            val = g * dual_kernel(self.act, rho) if (value or h) else None
            dc = g * kp / root
            dqa = ((h * val if h else 0.0) - rho * g * kp) / (2.0 * qa)
            dqb = ((h * val if h else 0.0) - rho * g * kp) / (2.0 * qb)
            return val, dqa, dqb, dc
        if self.method == "erf":
            al = self.alpha
            da, db = 1.0 + al * qa, 1.0 + al * qb
            root = np.sqrt(da * db)
            u = np.clip(al * c / root, -1.0, 1.0)
            wgt = (2.0 / math.pi) / np.sqrt(1.0 - u * u)
            val = (2.0 / math.pi) * np.arcsin(u) if value else None
            return val, -wgt * u * al / (2.0 * da), -wgt * u * al / (2.0 * db), wgt * al / root
        # Mehler: Σ βₙ(qa)βₙ(qb)ρⁿ by Horner in ρ
        ba, dba = self.coefficients(qa)
        bb, dbb = self.coefficients(qb)
        root = np.sqrt(qa * qb)
        rho = np.clip(c / root, -1.0, 1.0)
        shape = np.broadcast_shapes(qa.shape, qb.shape, c.shape)
        val, s1, sa, sb = (np.zeros(shape) for _ in range(4))
        for n in range(self.terms, -1, -1):
            prod = ba[..., n] * bb[..., n]
            if n >= 1:
                s1 = s1 * rho + n * prod
            val = val * rho + prod
            sa = sa * rho + dba[..., n] * bb[..., n]
            sb = sb * rho + ba[..., n] * dbb[..., n]
        dc = s1 / root
        return val, sa - s1 * rho / (2.0 * qa), sb - s1 * rho / (2.0 * qb), dc


# ---------------------------------------------------------------- the model
def _check_instance(instance) -> None:
    if getattr(instance, "teacher", "finetune") != "finetune":
        raise ValueError("the population ODE of fine-tuning needs a fine-tuned teacher "
                         f"(teacher = {instance.teacher!r} has no perturbation ξcuᵀ)")
    if instance.k < 1:
        raise ValueError("the population ODE of fine-tuning needs k ≥ 1")


@dataclass
class FinetuneModel:
    """The population loss of fine-tuning, its gradient and the O(η) drift of the chain's
    state (module docstring), for one instance and one learner setting.

    State arrays carry a leading run axis: p (R, k) (zeros when projected), μ (R,), ĉ (R, k).
    """

    instance: object
    eta: float
    project: bool = True
    joint_c: bool = False
    eta_c: float | None = None
    prox: float = 0.0
    kernel: PairKernel | None = field(default=None, repr=False)

    def __post_init__(self):
        inst = self.instance
        _check_instance(inst)
        self.eta = _positive("eta", self.eta)
        self.eta_c = self.eta if self.eta_c is None else _positive("eta_c", self.eta_c)
        self.prox = _nonnegative("prox", self.prox)
        self.k, self.xi = int(inst.k), float(inst.xi)
        self.L = np.asarray(inst.w_factor, dtype=float)
        self.G = np.asarray(inst.gram, dtype=float)
        self.u_w = np.asarray(inst.u_w, dtype=float)
        self.u_perp = float(inst.u_perp)
        self.wu = self.L @ self.u_w
        self.lam = np.asarray(inst.lam, dtype=float)
        self.c = np.asarray(inst.c, dtype=float)
        self.unit = inst.convention == "unit"
        self.s2 = 1.0 if self.unit else float(inst.row_scale) ** 2
        self.o2 = 1.0 if self.unit else 1.0 / self.xi**2
        if self.kernel is None:
            self.kernel = PairKernel(inst.activation, unit_rows=self.unit)
        xi, c, wu = self.xi, self.c, self.wu
        self.T = self.G + xi * (np.outer(wu, c) + np.outer(c, wu)) + xi**2 * np.outer(c, c)
        self.P = np.diag(self.T).copy()
        self.lam2 = np.outer(self.lam, self.lam)

    @classmethod
    def of(cls, instance, regime: FinetuneRegime, kernel: PairKernel | None = None):
        """The model of ``instance`` under the learner's ``regime``."""
        return cls(instance, regime.eta, project=regime.project, joint_c=regime.joint_c,
                   eta_c=regime.eta_c, prox=regime.prox, kernel=kernel)

    # -- geometry
    def raw_grams(self, p, mu, ch):
        """(ω, m, Q, S, C) of the module docstring for states (R, ·)."""
        xi = self.xi
        omega = p @ self.L.T
        m = p @ self.u_w + mu * self.u_perp
        xc = xi * ch
        q = 1.0 + 2.0 * xc * omega + xc * xc
        s = (self.G + xc[:, None, :] * omega[:, :, None] + xc[:, :, None] * omega[:, None, :]
             + xc[:, :, None] * xc[:, None, :])
        cross = (self.G + xc[:, None, :] * omega[:, :, None] + xi * np.outer(self.c, self.wu)
                 + xi * self.c[None, :, None] * xc[:, None, :] * m[:, None, None])
        return omega, m, q, s, cross

    def _kappa_derivatives(self, qa, qb, c):
        """(∂κ/∂qa, ∂κ/∂qb, ∂κ/∂c) of the rows' raw Gram entries (scaled by s²)."""
        s2 = self.s2
        _, dqa, dqb, dc = self.kernel(s2 * qa, s2 * qb, s2 * c, value=False)
        return s2 * dqa, s2 * dqb, s2 * dc

    def loss(self, p, mu, ch):
        """(R,) population loss L(û, ĉ) = E(f* − f̂)² (no label noise, no proximal term)."""
        p, mu, ch = _as_state(p, mu, ch, self.k)
        _, _, q, s, cross = self.raw_grams(p, mu, ch)
        k = self.k
        idx = np.arange(k)
        s2, kappa = self.s2, self.kernel.value
        tt = np.array(kappa(s2 * self.P[:, None], s2 * self.P[None, :], s2 * self.T),
                      dtype=float)
        tt[idx, idx] = self._diag(self.P)[0]
        ss = np.array(kappa(s2 * q[:, :, None], s2 * q[:, None, :], s2 * s), dtype=float)
        ss[:, idx, idx] = self._diag(q)[0]
        ts = kappa(s2 * self.P[None, :, None], s2 * q[:, None, :], s2 * cross)
        lam2 = self.lam2
        return self.o2 * (np.sum(lam2 * tt) + np.einsum("ij,rij->r", lam2, ss)
                          - 2.0 * np.einsum("ij,rij->r", lam2, ts))

    def _diag(self, q):
        val, der = self.kernel.diagonal(self.s2 * np.asarray(q, dtype=float))
        return val, self.s2 * der

    def gradient(self, p, mu, ch):
        """(a = ∂L/∂ω (R, k), b = ∂L/∂m (R,), ∂L/∂ĉ (R, k)) (module docstring; no prox)."""
        p, mu, ch = _as_state(p, mu, ch, self.k)
        xi, k = self.xi, self.k
        omega, m, q, s, cross = self.raw_grams(p, mu, ch)
        idx = np.arange(k)
        sqa, sqb, sc = self._kappa_derivatives(q[:, :, None], q[:, None, :], s)
        sqa, sqb, sc = (np.array(np.broadcast_to(a, s.shape)) for a in (sqa, sqb, sc))
        sqa[:, idx, idx] = self._diag(q)[1]  # a row with itself: the total derivative
        sqb[:, idx, idx] = 0.0
        sc[:, idx, idx] = 0.0
        _, cqb, cc = self._kappa_derivatives(self.P[None, :, None], q[:, None, :], cross)
        lam2 = self.o2 * self.lam2
        mm = lam2 * sc
        nn = -2.0 * lam2 * cc
        g_q = (np.einsum("rjl,jl->rj", sqa, lam2) + np.einsum("rlj,lj->rj", sqb, lam2)
               - 2.0 * np.einsum("rij,ij->rj", np.broadcast_to(cqb, cross.shape), lam2))
        msym = mm + np.swapaxes(mm, 1, 2)
        a = (xi * np.einsum("rjl,rl->rj", msym, ch) + 2.0 * xi * ch * g_q
             + xi * np.einsum("rjl,rl->rj", nn, ch))
        b = xi**2 * np.einsum("i,rij,rj->r", self.c, nn, ch)
        gc = (xi * np.einsum("rjl,rl->rj", msym, omega) + xi**2 * np.einsum("rjl,rl->rj", msym, ch)
              + 2.0 * xi * (omega + xi * ch) * g_q
              + np.einsum("rij,ri->rj", nn, xi * omega + xi**2 * m[:, None] * self.c[None, :]))
        return a, b, gc

    def tangent_gradient(self, p, mu, ch):
        """Mean tangent gradient E[(I − ûûᵀ)Π∇L] in û's coordinates (p (R, k), μ (R,),
        ν (R,)) and E ∂L/∂ĉ (R, k) with the proximal term: what the sample step averages to."""
        p, mu, ch = _as_state(p, mu, ch, self.k)
        nu = _nu(p, mu)
        a, b, gc = self.gradient(p, mu, ch)
        gc = gc + 2.0 * self.prox * self.xi**2 * ch
        if self.project:
            ge = b * self.u_perp
            sdot = mu * ge
            return np.zeros_like(p), ge - sdot * mu, -sdot * nu, gc
        gw = a @ self.L + b[:, None] * self.u_w[None, :]
        ge = b * self.u_perp
        sdot = np.einsum("rk,rk->r", p, gw) + mu * ge
        return gw - sdot[:, None] * p, ge - sdot * mu, -sdot * nu, gc

    def drift(self, p, mu, ch):
        """(Δp, Δμ, Δĉ) per SGD step at O(η): minus η (η_c) times the mean gradient; Δĉ = 0
        when ĉ is frozen, Δp = 0 when projected."""
        gp, gmu, _, gc = self.tangent_gradient(p, mu, ch)
        dc = -self.eta_c * gc if self.joint_c else np.zeros_like(gc)
        return -self.eta * gp, -self.eta * gmu, dc

    def c_cosine(self, ch):
        """cos(ĉ, c) of states ĉ (N, k)."""
        return (ch @ self.c) / (np.linalg.norm(ch, axis=-1) * np.linalg.norm(self.c))

    @property
    def rate(self) -> float:
        """The fastest step size of the state: max(η, η_c if ĉ is trained)."""
        return max(self.eta, self.eta_c if self.joint_c else 0.0)

    # -- packing of the ODE state y = (p if unprojected, μ, ĉ if joint)
    @property
    def dim(self) -> int:
        return (0 if self.project else self.k) + 1 + (self.k if self.joint_c else 0)

    def pack(self, p, mu, ch):
        parts = ([] if self.project else [p]) + [mu[:, None]] + ([ch] if self.joint_c else [])
        return np.concatenate(parts, axis=1)

    def unpack(self, y, ch0):
        k, i = self.k, 0
        y = y.reshape(ch0.shape[0], self.dim)
        if self.project:
            p = np.zeros((y.shape[0], k))
        else:
            p, i = y[:, :k], k
        mu = y[:, i]
        ch = y[:, i + 1:] if self.joint_c else ch0
        return p, mu, ch


def _as_state(p, mu, ch, k):
    mu = np.atleast_1d(np.asarray(mu, dtype=float))
    p = np.zeros((mu.size, k)) if p is None else np.atleast_2d(np.asarray(p, dtype=float))
    ch = np.atleast_2d(np.asarray(ch, dtype=float))
    if ch.shape[0] == 1 and mu.size > 1:
        ch = np.repeat(ch, mu.size, axis=0)
    return p, mu, ch


def _nu(p, mu):
    return np.sqrt(np.maximum(0.0, 1.0 - np.sum(p * p, axis=-1) - mu * mu))


def finetune_ode_kind(corrected: bool = False, escape: bool = False) -> str:
    """The note recorded beside a curve of this module (which ODE it is)."""
    if corrected and escape:
        return ("finite-d corrected line of fine-tuning (hermite.finetune_ode: the O(η) drift "
                "plus the O(η²d) renormalisation drift −(η²/2)X E‖Ḡ_T‖², and the diffusion of "
                "m = ⟨û, u⟩ during the escape from |m₀| ~ d^(−1/2): E|m| of eq. (E2), "
                "docs/theory/finite-d.md)")
    if corrected:
        return ("finite-d corrected population ODE of fine-tuning (hermite.finetune_ode: O(η) "
                "drift plus the O(η²d) renormalisation drift −(η²/2)X E‖Ḡ_T‖²)")
    return ("plain population ODE of fine-tuning (hermite.finetune_ode: the O(η) drift, minus "
            "the Riemannian gradient of the exact population loss L(û, ĉ))")


# ---------------------------------------------------------------- finite-d second moment
class SecondMoment:
    """E‖Ḡ_T‖² of the tangent mini-batch gradient at a state (module docstring), by
    randomised QMC over (z, a, b, ε) with fixed points (common random numbers)."""

    def __init__(self, model: FinetuneModel, d: int, batch: int = 1, label_noise: float = 0.0,
                 points: int = QMC_POINTS, seed: int = 0, extra_dims: int = 0):
        """``extra_dims``: further uniform coordinates of the same points, kept as
        ``self.extra`` (N, extra_dims) for a caller's own variates."""
        self.model, self.d, self.batch = model, int(d), int(batch)
        k = model.k
        if self.d < k + 2:
            raise ValueError(f"d must be ≥ k + 2 = {k + 2}, got {d}")
        self.noise_sd = math.sqrt(float(label_noise))
        sob = scipy.stats.qmc.Sobol(k + 3 + extra_dims, scramble=True, seed=seed)
        u = sob.random(points)
        self.extra = np.clip(u[:, k + 3:], 1e-16, 1 - 1e-16)
        z = scipy.stats.norm.ppf(np.clip(u[:, :k + 3], 1e-16, 1 - 1e-16))
        self.z, self.a, self.b, self.eps = (np.ascontiguousarray(v) for v in (
            z[:, :k], z[:, k], z[:, k + 1], z[:, k + 2]))
        self.lz = self.z @ model.L.T  # (n, k) Wx in span W
        self.ux = self.z @ model.u_w + model.u_perp * self.a  # ⟨u, x⟩
        inst = model.instance
        act = resolve_activation(inst.activation)
        self.fn, self.deriv = act.fn, act.deriv
        xi = model.xi
        tscale = (1.0 / np.sqrt(model.P)) if model.unit else np.full(k, math.sqrt(model.s2))
        out = 1.0 if model.unit else 1.0 / xi
        self.out = out
        self.y = out * (self.fn((self.lz + xi * model.c[None, :] * self.ux[:, None]) * tscale)
                        @ model.lam) + self.noise_sd * self.eps
        from hermite.activations_numba import act_code  # numba loads with the corrected ODE only

        self.code = act_code(act.name)  # compiled average where σ has a numba code

    def __call__(self, p, mu, ch):
        m = self.model
        p, mu, ch = _as_state(p, mu, ch, m.k)
        runs, n, k = mu.size, self.a.size, m.k
        res = np.empty(runs)
        step = max(1, _QMC_BLOCK // (n * k))
        for r0 in range(0, runs, step):
            sl = slice(r0, min(runs, r0 + step))
            res[sl] = self._block(p[sl], mu[sl], ch[sl]) if self.code is None else \
                self._compiled(p[sl], mu[sl], ch[sl])
        if self.batch > 1:
            gp, gmu, gnu, _ = m.tangent_gradient(p, mu, ch)
            mean2 = np.sum(gp * gp, axis=1) + gmu * gmu + gnu * gnu
            res = res / self.batch + (1.0 - 1.0 / self.batch) * mean2
        return res

    def overlap_variance(self, p, mu, ch):
        """(R,) Var⟨Ḡ_T, u⟩ of the tangent mini-batch gradient along u (unprojected û; the
        batch mean of b independent examples: 1/b of one example's), over the same points;
        the noise of m = ⟨û, u⟩ per step is η² times it (docs/theory/finite-d.md, "The
        corrected flow with ĉ joint and û unprojected")."""
        m = self.model
        if m.project:
            raise ValueError("overlap_variance: the unprojected learner's (û ⊥ span W has "
                             "the projected band of hermite.finetune.band)")
        p, mu, ch = _as_state(p, mu, ch, m.k)
        runs, n, k = mu.size, self.a.size, m.k
        mom = np.empty((runs, 2))
        step = max(1, _QMC_BLOCK // (n * k))
        for r0 in range(0, runs, step):
            sl = slice(r0, min(runs, r0 + step))
            mom[sl] = self._overlap_block(p[sl], mu[sl], ch[sl]) if self.code is None else \
                self._overlap_compiled(p[sl], mu[sl], ch[sl])
        return np.maximum(mom[:, 1] - mom[:, 0] ** 2, 0.0) / self.batch

    def _overlap_compiled(self, p, mu, ch):
        from hermite.finetune._second_moment_numba import overlap_moments_block

        m = self.model
        return overlap_moments_block(
            np.ascontiguousarray(p, dtype=float), np.ascontiguousarray(mu, dtype=float),
            np.ascontiguousarray(ch, dtype=float), self.z, self.a, self.b, self.lz, self.y,
            m.L, m.lam, m.xi, m.unit, math.sqrt(m.s2), self.out, m.u_w, m.u_perp, *self.code)

    def _overlap_block(self, p, mu, ch):
        """(R, 2) means of x and x², x = ⟨G_T, u⟩ per point (numpy reference of
        :func:`hermite.finetune._second_moment_numba.overlap_moments_block`)."""
        m = self.model
        nu, g, delta, pre, xc, scale = self._sample_terms(p, mu, ch)
        gw = self._span_w_gradient(g, delta, pre, xc, scale)
        ge = g * self.a
        sdot = np.einsum("rnk,rk->rn", gw, p) + mu[:, None] * ge + nu[:, None] * g * self.b
        mm = p @ m.u_w + mu * m.u_perp
        x = gw @ m.u_w + ge * m.u_perp - sdot * mm[:, None]
        return np.stack([x.mean(axis=1), (x * x).mean(axis=1)], axis=1)

    def _sample_terms(self, p, mu, ch):
        """The sample gradient at the QMC points for a block of runs: ν (R,), its scalar g
        along x (R, N), the per-neuron δ and pre-activations (R, N, k), ξĉ and the rows'
        normalisation (R, k) (shared by :meth:`_block` and :meth:`_overlap_block`)."""
        m, out = self.model, self.out
        nu = _nu(p, mu)
        s = p @ self.z.T + mu[:, None] * self.a + nu[:, None] * self.b  # (R, N) ⟨û, x⟩
        xc = m.xi * ch
        if m.unit:
            scale = 1.0 / np.sqrt(1.0 + 2.0 * xc * (p @ m.L.T) + xc * xc)
        else:
            scale = np.full(ch.shape, math.sqrt(m.s2))
        pre = (self.lz[None] + xc[:, None, :] * s[:, :, None]) * scale[:, None, :]
        resid = self.y[None] - out * (self.fn(pre) @ m.lam)
        delta = ((-2.0 * out) * resid)[:, :, None] * m.lam * self.deriv(pre)
        g = np.einsum("rnk,rk->rn", delta, xc * scale)
        return nu, g, delta, pre, xc, scale

    def _span_w_gradient(self, g, delta, pre, xc, scale):
        """(R, N, k) the gradient's part in span W (unprojected û)."""
        m = self.model
        gw = g[:, :, None] * self.z[None]
        if m.unit:
            gw = gw - (delta * pre * (xc * scale * scale)[:, None, :]) @ m.L
        return gw

    def _compiled(self, p, mu, ch):
        """:meth:`_block` by :func:`hermite.finetune._second_moment_numba.second_moment_block`."""
        from hermite.finetune._second_moment_numba import second_moment_block

        m = self.model
        return second_moment_block(
            np.ascontiguousarray(p, dtype=float), np.ascontiguousarray(mu, dtype=float),
            np.ascontiguousarray(ch, dtype=float), self.z, self.a, self.b, self.lz, self.y,
            m.L, m.lam, m.xi, m.unit, math.sqrt(m.s2), self.out, m.project, self.d,
            *self.code)

    def _block(self, p, mu, ch):
        """E‖G_T‖² (b = 1) for a block of runs, (R, N, k) arrays (numpy: the reference of
        the compiled path, and σ without a numba code)."""
        m, k = self.model, self.model.k
        nu, g, delta, pre, xc, scale = self._sample_terms(p, mu, ch)
        ge, gb = g * self.a, g * self.b
        base = ge * ge + gb * gb + (self.d - k - 2) * g * g
        if m.project:
            sdot = mu[:, None] * ge + nu[:, None] * gb
            return np.mean(base - sdot * sdot, axis=1)
        gw = self._span_w_gradient(g, delta, pre, xc, scale)
        sdot = np.einsum("rnk,rk->rn", gw, p) + mu[:, None] * ge + nu[:, None] * gb
        return np.mean(np.sum(gw * gw, axis=2) + base - sdot * sdot, axis=1)


# ---------------------------------------------------------------- integration
@dataclass
class FinetuneODE:
    """Solution of the population ODE of fine-tuning at the checkpoints.

    steps (C,); m, c_overlap (R, C): ⟨û, u⟩ and ⟨ĉ, c⟩/(‖ĉ‖‖c‖); p (R, C, k), mu (R, C),
    c_hat (R, C, k): the state; ``kind``: which ODE (:func:`finetune_ode_kind`).
    """

    steps: np.ndarray
    m: np.ndarray
    c_overlap: np.ndarray
    p: np.ndarray
    mu: np.ndarray
    c_hat: np.ndarray
    kind: str


def _start(model, start: FinetuneStart | None):
    """(p0 (R, k), μ0 (R,), ĉ0 (R, k)) from the given start (one-line ValueError if invalid)."""
    if start is None:
        raise ValueError("give the start: m0, or mu0 (and p0)")
    m0, mu0, p0, c_hat0 = start.m0, start.mu0, start.p0, start.c_hat0
    k, up = model.k, model.u_perp
    if mu0 is None:
        if m0 is None:
            raise ValueError("give the start: m0, or mu0 (and p0)")
        m0 = np.atleast_1d(np.asarray(m0, dtype=float))
        if not np.all(np.isfinite(m0)) or np.any(np.abs(m0) > up * (1 + 1e-12)):
            raise ValueError(f"m0 must be finite and lie in [-u_perp, u_perp] = [{-up:.6g}, "
                             f"{up:.6g}] (a start with p = 0)")
        mu0 = np.clip(m0 / up, -1.0, 1.0)
    mu0 = np.atleast_1d(np.asarray(mu0, dtype=float))
    runs = mu0.size
    p0 = np.zeros((runs, k)) if p0 is None else np.asarray(p0, dtype=float).reshape(runs, k)
    ch = model.instance.c_hat if c_hat0 is None else c_hat0
    ch = np.asarray(ch, dtype=float)
    ch = np.repeat(ch[None, :], runs, axis=0) if ch.ndim == 1 else ch.reshape(runs, k)
    if not (np.all(np.isfinite(mu0)) and np.all(np.isfinite(p0)) and np.all(np.isfinite(ch))):
        raise ValueError("the ODE's start must be finite (p0, mu0, c_hat0)")
    if model.project and np.any(p0 != 0.0):
        raise ValueError("a projected learner has û ⊥ span W: its start needs p0 = 0")
    n2 = np.sum(p0 * p0, axis=1) + mu0 * mu0
    if np.any(n2 > 1.0 + SPHERE_TOL):
        raise ValueError(f"the start is off the unit sphere: ‖p‖² + μ² = {n2.max():.6g} > 1")
    over = n2 > 1.0
    if over.any():  # round-off of a float32 run: back onto the sphere
        f = 1.0 / np.sqrt(n2[over])
        p0, mu0 = p0.copy(), mu0.copy()
        p0[over] *= f[:, None]
        mu0[over] *= f
    return p0, mu0, ch


def _setup(instance, regime: FinetuneRegime, start: FinetuneStart | None, corrected: bool,
           model: FinetuneModel | None):
    """(model, (p₀, μ₀, ĉ₀), the second moment of the corrected drift or None) of
    :func:`finetune_ode` and :func:`finetune_steps_to_reach` (``model``: a prebuilt one of
    ``regime``, else built)."""
    if model is None:
        model = FinetuneModel.of(instance, regime)
    start = _start(model, start)
    second = None
    if corrected:
        if regime.d is None:
            raise ValueError("the finite-d corrected ODE needs the dimension d")
        second = SecondMoment(model, regime.d, regime.batch, regime.label_noise)
    return model, start, second


def finetune_ode(instance, regime: FinetuneRegime | float, steps,
                 start: FinetuneStart | None = None, *, corrected: bool = False,
                 solver: SolverSettings | None = None, model: FinetuneModel | None = None,
                 escape: bool | None = None, **keywords) -> FinetuneODE:
    """Integrate the population ODE of fine-tuning from each run's start (module docstring).

    Parameters
    ----------
    instance : a fine-tuning :class:`dynamics.instances.instance.Instance` (any
        convention, u_alpha).
    regime : the learner's :class:`~hermite.flows.regime.FinetuneRegime` (η, η_c, project,
        joint_c, prox; d, batch, label_noise for the corrected drift), or the step size η
        with the regime's other fields as keywords.
    steps : (C,) sorted checkpoint steps (times of the flow, in SGD steps).
    start : the runs' :class:`~hermite.flows.regime.FinetuneStart` (m0 (R,) with p = 0, or
        mu0 (R,) and p0 (R, k); c_hat0 (k,) or (R, k), default the instance's ĉ), or its
        fields as keywords.
    corrected : add the O(η²d) renormalisation drift (needs the regime's ``d``; ``batch`` and
        ``label_noise`` enter it); otherwise the plain O(η) drift (``batch`` and
        ``label_noise`` do not change it).
    solver : :class:`~hermite.flows.regime.SolverSettings` (or rtol, atol, method, chunk as
        keywords): ``solve_ivp``'s (default BDF with the runs' block-diagonal Jacobian
        pattern: near the teacher a kinked σ makes the flow stiff; "DOP853" for a reference)
        and the runs per call (about chunk / k²). The corrected ODE uses RK4
        (:class:`CorrectedFlow`: η·Δt ≤ ``FLOW_STEP``, Δt·ρ ≤ ``FLOW_RATE``).
    escape : with ``corrected``, the line E|m| of :func:`hermite.finetune.escape.escape_line`
        (the corrected flow plus the diffusion of the escape from |m₀| ~ d^{−1/2}, eq. (E2)
        of docs/theory/finite-d.md); default (None): where ĉ is joint and û unprojected.
        ``m`` is then signed by the run's corrected path, |m| the line, and p, μ, ĉ the
        mixture's mean states.

    Raises
    ------
    ArithmeticError
        A flow that leaves the finite numbers, a solver failure or a stiff stretch the
        corrected flow cannot cross (``FLOW_MAX_STEPS``).
    """
    from hermite.flows.ode import check_steps

    regime, start, solver = from_keywords("finetune_ode", regime, keywords, start, solver)
    ck = check_steps(steps, integer=False)
    model, (p0, mu0, ch0), second = _setup(instance, regime, start, corrected, model)
    runs, k, cps = mu0.size, model.k, ck.size
    if escape is None:
        escape = model.joint_c and not model.project
    if corrected and escape and ck[-1] > 0.0:
        from hermite.finetune.escape import escape_line

        line = escape_line(model, second, p0, mu0, ch0, ck, CorrectedFlow)
        if not (np.all(np.isfinite(line.m)) and np.all(np.isfinite(line.c_overlap))):
            raise ArithmeticError("finetune_ode: the corrected line left the finite numbers")
        return FinetuneODE(ck, line.m, line.c_overlap, line.p, line.mu, line.c_hat,
                           finetune_ode_kind(corrected, escape=True))
    out_p, out_mu = np.empty((runs, cps, k)), np.empty((runs, cps))
    out_c = np.empty((runs, cps, k))
    step = max(1, int(solver.chunk // max(1, k * k)))
    for a in range(0, runs, step):
        sl = slice(a, min(runs, a + step))
        P, MU, CH = _integrate(model, p0[sl], mu0[sl], ch0[sl], ck, second, solver)
        out_p[sl], out_mu[sl], out_c[sl] = P, MU, CH
    m = np.einsum("rck,k->rc", out_p, model.u_w) + out_mu * model.u_perp
    c = model.c
    c_ov = np.einsum("rck,k->rc", out_c, c) / (np.linalg.norm(out_c, axis=-1)
                                                * np.linalg.norm(c))
    return FinetuneODE(ck, m, c_ov, out_p, out_mu, out_c, finetune_ode_kind(corrected))


def _rhs(model, ch0, second, frozen=None):
    """The ODE's right-hand side on packed states; with ``second``, the renormalisation drift
    −(η²/2)X E‖Ḡ_T‖², its coefficient read from ``frozen[0]`` when set (held over an RK4
    step: it is a small, slowly varying correction)."""
    def fun(_t, y):
        p, mu, ch = model.unpack(y, ch0)
        dp, dmu, dc = model.drift(p, mu, ch)
        if second is not None:
            coef = frozen[0] if frozen is not None and frozen[0] is not None \
                else second(p, mu, ch)
            f = -0.5 * model.eta**2 * coef
            dp = dp + f[:, None] * p
            dmu = dmu + f * mu
        return model.pack(dp, dmu, dc).ravel()
    return fun


def _block_sparsity(runs: int, dim: int) -> scipy.sparse.csr_matrix:
    """The Jacobian's sparsity: ``runs`` dense ``dim`` × ``dim`` blocks on the diagonal (built
    from indices: ``scipy.sparse.block_diag`` warns of its change of return type from 1.18)."""
    idx = np.arange(runs * dim).reshape(runs, dim)
    rows = np.repeat(idx, dim, axis=1).ravel()
    cols = np.tile(idx, (1, dim)).ravel()
    return scipy.sparse.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(runs * dim,) * 2)


def _integrate(model, p0, mu0, ch0, ck, second, solver: SolverSettings):
    runs, cps = mu0.size, ck.size
    y0 = model.pack(p0, mu0, ch0).ravel()
    if ck[-1] == 0.0:
        ys = np.repeat(y0[:, None], cps, axis=1)
    elif second is not None:  # a QMC drift is piecewise constant for kinked σ: RK4 (ρ's steps)
        ys = CorrectedFlow(model, ch0, second).solve(y0, ck)
    else:  # BDF: near the teacher ρᵢᵢ → 1 and a kinked σ's K″ blows up (stiff); the
        # Jacobian is block-diagonal over runs, so it costs `dim` evaluations
        block = _block_sparsity(runs, model.dim)
        method = solver.method
        sol = scipy.integrate.solve_ivp(_rhs(model, ch0, second), (0.0, float(ck[-1])), y0,
                                        method=method, t_eval=ck, rtol=solver.rtol,
                                        atol=solver.atol,
                                        **({"jac_sparsity": block} if method in (
                                            "BDF", "Radau") else {}))
        if not sol.success:
            raise ArithmeticError(f"finetune_ode: the solver failed ({sol.message})")
        ys = sol.y
    if not np.all(np.isfinite(ys)):
        raise ArithmeticError("finetune_ode: the flow left the finite numbers")
    ys = ys.reshape(runs, model.dim, cps).transpose(0, 2, 1)  # (R, C, dim)
    flat = ys.reshape(runs * cps, model.dim)
    p, mu, ch = model.unpack(flat, np.repeat(ch0, cps, axis=0))
    return p.reshape(runs, cps, -1), mu.reshape(runs, cps), ch.reshape(runs, cps, -1)


def _power_rate(fun, y, f0, vec, iterations):
    """(ρ, vec): the largest |eigenvalue| of the Jacobian J of ``fun`` at the packed states
    ``y`` over the runs' blocks, by ``iterations`` power iterations on the finite-difference
    products Jv ≈ (fun(y + εv) − f0)/ε (ε = ``JV_STEP``) from the unit rows ``vec`` (R, dim)
    (J is block-diagonal over runs: one evaluation per iteration); vec: the last iterates."""
    runs = vec.shape[0]
    norm = np.zeros(runs)
    for _ in range(iterations):
        jv = ((fun(0.0, y + JV_STEP * vec.ravel()) - f0) / JV_STEP).reshape(runs, -1)
        norm = np.linalg.norm(jv, axis=1)
        vec = np.where(norm[:, None] > 0.0, jv / np.maximum(norm, 1e-300)[:, None], vec)
    return float(np.max(norm)), vec


def _unit_rows(runs, dim):
    """Fixed pseudo-random unit vectors (R, dim): the power iteration's start."""
    vec = np.random.default_rng(0).standard_normal((runs, dim))
    return vec / np.linalg.norm(vec, axis=1, keepdims=True)


def drift_rate(model: FinetuneModel, p, mu, ch) -> float:
    """ρ per SGD step: the largest |eigenvalue| of the O(η) drift's Jacobian at the states
    (R, ·) over the runs (``RATE_ITERATIONS`` power iterations); the corrected ODE's RK4
    takes Δt ≤ ``FLOW_RATE``/ρ (:class:`CorrectedFlow`)."""
    p, mu, ch = _as_state(p, mu, ch, model.k)
    y = model.pack(p, mu, ch).ravel()
    fun = _rhs(model, ch, None)
    return _power_rate(fun, y, fun(0.0, y), _unit_rows(mu.size, model.dim),
                       RATE_ITERATIONS)[0]


class CorrectedFlow:
    r"""The corrected ODE's RK4, step by step (packed states of the runs of ``ch0``).

    The O(η²d) coefficient E‖Ḡ_T‖² is held over each step at its value at the step's midpoint,
    predicted by an Euler half step with the previous coefficient (the first step: at y), so
    the flow is second order in the step with one QMC average per step. The step is
    η·Δt ≤ ``FLOW_STEP`` and Δt·ρ ≤ ``FLOW_RATE``, ρ the largest |eigenvalue| of the drift's
    Jacobian over the runs (:func:`_power_rate`, one iteration per step from the last
    step's vectors): the O(η) drift is stiff where ξ²k is large (ĉ's stiffest direction,
    ≈ λ/N³, relaxes at ρ ≈ 0.25–0.35k²η for ReLU at ξ = √k), and a fixed η·Δt beyond RK4's
    stability limit ρΔt = 2.79 amplifies it by |R(−ρΔt)| > 1 per step until the kernels
    overflow (module docstring, docs/theory/joint-c.md). More than ``FLOW_MAX_STEPS`` steps,
    or a state that is not finite, is an ArithmeticError (a stiff stretch the explicit flow
    cannot cross).
    """

    def __init__(self, model: FinetuneModel, ch0, second, share: int | None = None):
        """``share``: the first ``share`` runs' E‖Ḡ_T‖² serves all runs (tiled: kicked copies
        of them, whose difference must not read the QMC average's jumps)."""
        self.model, self.ch0, self.second, self.share = model, ch0, second, share
        self.frozen = [None]
        self.fun = _rhs(model, ch0, second, self.frozen)
        self.h_max = FLOW_STEP / model.rate
        self.vec, self.taken = None, 0

    def _held(self, y):
        """E‖Ḡ_T‖² (R,) at the packed states y, the first ``share`` runs' tiled if set."""
        model, ch0, share = self.model, self.ch0, self.share
        if share is None:
            return self.second(*model.unpack(y, ch0))
        yy = y.reshape(ch0.shape[0], model.dim)[:share]
        coef = self.second(*model.unpack(yy, ch0[:share]))
        return np.tile(coef, ch0.shape[0] // share)

    def step(self, t, y, dt_max):
        """One RK4 step from (t, y) of at most ``dt_max`` SGD steps: (y after it, its length
        Δt, the midpoint y + (Δt/2)k₁ with k₁ the slope at y)."""
        model, ch0 = self.model, self.ch0
        if self.frozen[0] is None:
            self.frozen[0] = self._held(y)
        f0 = self.fun(t, y)
        if self.vec is None:
            rho, self.vec = _power_rate(self.fun, y, f0, _unit_rows(ch0.shape[0], model.dim),
                                        RATE_ITERATIONS)
        else:
            rho, self.vec = _power_rate(self.fun, y, f0, self.vec, 1)
        dt = min(dt_max, self.h_max, FLOW_RATE / rho if rho > 0.0 else math.inf)
        self.frozen[0] = self._held(y + 0.5 * dt * f0)
        new, k1 = rk4_step(self.fun, t, y, dt)
        self.taken += 1
        if not np.all(np.isfinite(new)):
            raise ArithmeticError(f"the corrected ODE left the finite numbers at η·t = "
                                  f"{model.eta * t:.3g}")
        if self.taken > FLOW_MAX_STEPS:
            raise ArithmeticError(
                f"the corrected ODE is too stiff to follow: over {FLOW_MAX_STEPS} RK4 steps "
                f"by η·t = {model.eta * t:.3g} (largest |eigenvalue| of the drift's Jacobian "
                f"ρ = {rho / model.eta:.3g}·η)")
        return new, dt, y + 0.5 * dt * k1

    def solve(self, y0, ck):
        """(y.size, C) states at the checkpoints ``ck`` (every step lands on them)."""
        out = np.empty((y0.size, ck.size))
        y, t = y0.copy(), 0.0
        for j, target in enumerate(ck):
            while t < target:
                y, dt, _ = self.step(t, y, target - t)
                t = float(target) if dt >= target - t else t + dt
            out[:, j] = y
        return out


def rk4_step(fun, t, y, dt):
    """One classical RK4 step of dy/dt = fun(t, y): (y after dt, the slope k1 at y)."""
    k1 = fun(t, y)
    k2 = fun(t, y + 0.5 * dt * k1)
    k3 = fun(t, y + 0.5 * dt * k2)
    k4 = fun(t, y + dt * k3)
    return y + dt * (k1 + 2.0 * k2 + 2.0 * k3 + k4) / 6.0, k1


def finetune_steps_to_reach(instance, regime: FinetuneRegime | float, level,
                            start: FinetuneStart | None = None, *, max_steps: float = 1e12,
                            corrected: bool = False, rtol: float = 1e-9,
                            model: FinetuneModel | None = None, **keywords) -> np.ndarray:
    """(R,) steps of the flow for |⟨û, u⟩| to reach ``level`` (0 if |m₀| ≥ level; inf if not
    within ``max_steps``: a fixed point short of the level, or a level ≥ what û can reach).
    ``regime`` and ``start`` as in :func:`finetune_ode` (or their fields as keywords).
    Plain ODE: DOP853 with an event (``rtol``); ``corrected``: the fixed-step RK4 of
    :func:`finetune_ode`, the crossing interpolated linearly within its step."""
    regime, start = from_keywords("finetune_steps_to_reach", regime, keywords, start)
    level = float(level)
    if not math.isfinite(level) or level <= 0.0:
        raise ValueError(f"level must be a number > 0, got {level:g}")
    model, (p0, mu0, ch0), second = _setup(instance, regime, start, corrected, model)
    out = np.empty(mu0.size)
    for r in range(mu0.size):
        p, mu, ch = p0[r:r + 1], mu0[r:r + 1], ch0[r:r + 1]

        def overlap(y, _ch=ch):
            pp, mm, _ = model.unpack(y, _ch)
            return abs(float(pp[0] @ model.u_w + mm[0] * model.u_perp))

        y0 = model.pack(p, mu, ch).ravel()
        if overlap(y0) >= level:
            out[r] = 0.0
            continue
        if second is not None:
            out[r] = _rk4_crossing(model, ch, second, y0, overlap, level, float(max_steps))
            continue

        if model.project and level >= model.u_perp:
            out[r] = math.inf  # a projected û never gets beyond u_perp
            continue
        fun = _rhs(model, ch, None)
        rate = model.rate

        def event(_t, y):
            return overlap(y) - level

        def settled(t, y, fun=fun, rate=rate):  # at a fixed point short of the level
            return float(np.max(np.abs(fun(t, y)))) / rate - STILL

        event.terminal = settled.terminal = True
        event.direction, settled.direction = 1.0, -1.0
        sol = scipy.integrate.solve_ivp(fun, (0.0, float(max_steps)), y0, method="DOP853",
                                        events=(event, settled), rtol=rtol, atol=1e-12)
        if not sol.success:
            raise ArithmeticError(f"finetune_steps_to_reach: the solver failed ({sol.message})")
        out[r] = float(sol.t_events[0][0]) if sol.t_events[0].size else math.inf
    return out


def _rk4_crossing(model, ch, second, y0, overlap, level, max_steps) -> float:
    """First time the corrected flow's |m| reaches ``level`` (:class:`CorrectedFlow`, the
    crossing interpolated linearly within its step); inf after no progress over 100/rate
    steps (a fixed point short of the level)."""
    flow = CorrectedFlow(model, ch, second)
    y, t, prev, still = y0.copy(), 0.0, overlap(y0), 0.0
    while t < max_steps:
        new, dt, _ = flow.step(t, y, max_steps - t)
        cur = overlap(new)
        if cur >= level:
            return t + dt * (level - prev) / (cur - prev)
        still = still + dt if cur - prev < 1e-12 else 0.0
        if still * model.rate > 100.0:
            return math.inf
        y, t, prev = new, t + dt, cur
    return math.inf

"""Gaussian integrals of the committee-machine ODEs, for any activation g.

For a centred Gaussian vector with covariance C (2×2, 3×3 or 4×4; any variances, singular
allowed), with g′ the derivative:

    I2(a, c)       = E[g(a) g(c)]                 (loss, second-layer drift)
    J2(a, c)       = E[g′(a) g′(c)]               (label-noise term)
    P2(a, c)       = E[a g′(a) g(c)]              (building block of I3)
    I3(a, b, c)    = E[g′(a) b g(c)]              (first-order drift)
    I4(a, b, c, d) = E[g′(a) g′(b) g(c) g(d)]     (second-order, η², term)

I3 is reduced to 2-D integrals by Stein's lemma (E[b F(a, c)] = C_ab E[∂_a F] + C_bc E[∂_c F],
applied to F = g′(a)g(c) and, to eliminate g″, to E[a F]):

    I3(a, b, c) = (C_ab/C_aa) (P2(a, c) − C_ac J2(a, c)) + C_bc J2(a, c).

Closed forms (``family``):

* ``erf``: g(x) = erf(c x) (the registry's ``erf`` is c = 1; :func:`scaled_erf` makes any c,
  c = 1/√2 is Saad & Solla's g). With t² = 2c², C′ = t² C and Λ = (1 + C′_aa)(1 + C′_cc) − C′_ac²:
  I2 = (2/π) arcsin(C′_ac/√((1+C′_aa)(1+C′_cc))), J2 = t² (2/π)/√Λ,
  P2 = (2/π) C′_ac/((1 + C′_aa)√Λ), I3 by Stein (equal to Saad–Solla's I3), and Saad–Solla's
  I4 = t² (4/π²)/√Λ₄ · arcsin(Λ₀/√(Λ₁Λ₂)) on C′.
* ``linear``: I2 = P2 = C_ac, J2 = 1, I3 = C_bc, I4 = C_cd.
* ``relu``, ``abs`` (homogeneous of degree 1, so P2 = I2): with ρ the correlation,
  I2 = √(C_aa C_cc) K(ρ), J2 = K′(ρ) (arc-cosine / arcsine kernels); I4 and the
  second-order E[g′g′e²] (:meth:`CommitteeIntegrals.gprime_e2`) by a 2-D nested quadrature
  with the inner pair E[g(c)g(d) | a, b] in closed form (Owen's T); E[g′g′e²] compiled
  (:mod:`hermite.committee._fast`: the same rule, ≈ 50× faster).
* ``polynomial`` (``quadratic``, ``he<p>``…): Gauss–Hermite with 2p + 1 nodes per level,
  exact up to rounding for every integral.
* ``quadrature`` (sigmoid, tanh, user callables): nested conditional quadrature
  (:mod:`hermite.committee._nested`); for smooth g and K + M ≤ 4, E[g′g′e²] as one
  (K + M)-dimensional quadrature per pair instead of a sum of I4's (as for polynomials up
  to K + M = 5: :data:`DIRECT_MARGIN`).
"""

from __future__ import annotations

import math

import numpy as np

from hermite._activation import resolve_activation
from hermite.activations import Activation, get_activation, scaled_activation
from hermite.committee import _nested as nested
from hermite.committee._fast import gprime_e2_compiled

__all__ = ["CommitteeIntegrals", "scaled_erf", "INTEGRAL_METHODS", "QUADRATURE_DEFAULTS"]

INTEGRAL_METHODS = ("auto", "closed", "quadrature")
#: default nodes: Gauss–Hermite per smooth level (2-D, 4-D integrals), Gauss–Legendre per
#: panel of a kinked level (2-D, 4-D); errors in docs/theory/committee.md
QUADRATURE_DEFAULTS = {"n2": 96, "n4": 16, "q2": 24, "q4": 12}
#: the direct (K + M)-dimensional E[g′g′e²] of smooth non-closed activations is used while
#: its nodes are at most this many times those of the I4 sum (n4 = 16: 10× fewer at
#: K + M = 4; at K + M = 5 about equal, and the sum, whose nodes are cheaper, was faster)
DIRECT_MARGIN = 1.0


def scaled_erf(scale: float = 1.0 / math.sqrt(2.0)) -> Activation:
    """g(x) = erf(scale·x): the registry's ``erf(x*scale)`` (:func:`scaled_activation`, with
    its closed-form unit-variance kernels). ``scaled_erf()`` is Saad & Solla's / nn2pp's
    erf(x/√2), registry name ``erf(x/sqrt2)``."""
    try:
        return scaled_activation("erf", scale)
    except ValueError:
        raise ValueError(f"erf scale must be a finite number > 0, got {scale!r}") from None


def _family(act: Activation) -> tuple[str, float]:
    base, scale = act.base_and_scale
    if base == "erf":
        return "erf", scale
    for name in ("erf", "linear", "relu", "abs"):
        if act == get_activation(name):
            return name, 1.0
    if act.polynomial_degree is not None:
        return "polynomial", float(act.polynomial_degree)
    return "quadrature", 0.0


def _corr(C):
    va, vc = C[..., 0, 0], C[..., 1, 1]
    norm = np.sqrt(va * vc)
    return np.clip(C[..., 0, 1] / norm, -1.0, 1.0), norm



def _pair_groups(pairs, nz) -> dict:
    """The pairs (k, l) of the η² integral grouped by (outer fields, other fields with e ≠ 0):
    (n_outer, n_rest) → [(pair index, the fields in order: outer, then the rest)]."""
    groups: dict = {}
    for i, (k, l) in enumerate(pairs):
        outer = (int(k),) if k == l else (int(k), int(l))
        rest = tuple(int(c) for c in nz if c not in outer)
        groups.setdefault((len(outer), len(rest)), []).append((i, outer + rest))
    return groups

class CommitteeIntegrals:
    """I2, J2, P2, I3, I4 of one activation on batches of covariance matrices (…, n, n).

    ``method``: ``"auto"`` (closed form where the family has one, quadrature otherwise),
    ``"closed"`` (ValueError for an integral without a closed form) or ``"quadrature"``
    (always the nested quadrature: the reference the closed forms are tested against).
    ``quadrature`` overrides :data:`QUADRATURE_DEFAULTS` entries.
    """

    def __init__(self, activation, method: str = "auto", quadrature: dict | None = None):
        if method not in INTEGRAL_METHODS:
            raise ValueError(f"method must be one of {', '.join(INTEGRAL_METHODS)}, "
                             f"got {method!r}")
        act = resolve_activation(activation)
        self.activation, self.method = act, method
        self.family, self.param = _family(act)
        self.q = dict(QUADRATURE_DEFAULTS, **(quadrature or {}))
        smooth_g = smooth_d = None
        if self.family == "erf":
            smooth_g = nested.smooth_erf(self.param)
            smooth_d = nested.smooth_erf_deriv(self.param)
        elif self.family == "relu":
            smooth_g, smooth_d = nested.smooth_relu, nested.smooth_step
        elif self.family == "abs":
            smooth_g, smooth_d = nested.smooth_abs, nested.smooth_sign
        elif self.family == "linear":
            smooth_g, smooth_d = nested.smooth_linear, nested.smooth_one
        br = tuple(act.breakpoints)
        self._g = nested.Factor(act.fn, br, smooth_g)
        self._dg = nested.Factor(act.deriv, br, smooth_d)
        self._xdg = nested.Factor(lambda x, f=act.deriv: x * f(x), br)
        self._pair = {"relu": nested.pair_relu, "abs": nested.pair_abs}.get(self.family)
        self._square = {"relu": nested.square_relu, "abs": nested.square_abs}.get(self.family)
        self._dg2 = nested.Factor(lambda x, f=act.deriv: f(x) ** 2, br)
        if self.family == "polynomial" and method != "quadrature":
            n = 2 * int(self.param) + 1  # exact: degree ≤ 4p − 2 per variable
            self.q.update(n2=n, n4=n)

    # ------------------------------------------------------------------ helpers
    def closed(self, which: str) -> bool:
        """Whether integral ``which`` (i2, j2, p2, i3, i4) has a closed form here (for
        polynomials: Gauss–Hermite with 2p + 1 nodes, exact)."""
        if self.family in ("erf", "linear", "polynomial"):
            return True
        if self.family in ("relu", "abs"):
            return which != "i4"
        return False

    def _use_closed(self, which: str) -> bool:
        """True: use the explicit formula; False: the nested quadrature (exact for
        polynomials); raises for ``method="closed"`` without a closed form."""
        if self.method == "quadrature":
            return False
        if self.closed(which):
            return self.family != "polynomial"
        if self.method == "closed":
            raise ValueError(f"activation {self.activation.name!r} has no closed-form "
                             f"{which.upper()} (use method='auto' or 'quadrature')")
        return False

    def _quad(self, C, factors, dim, inner=None, n_outer=None, inner_args=None):
        """Nested quadrature on C (…, n, n) with the node counts of ``dim``-D integrals."""
        C = np.asarray(C, dtype=np.float64)
        shape = C.shape[:-2]
        flat = C.reshape(-1, *C.shape[-2:])
        if flat.shape[0] == 0:
            return np.zeros(shape)
        n = self.q["n2"] if dim <= 3 else self.q["n4"]
        q = self.q["q2"] if dim <= 3 else self.q["q4"]
        return nested.nested_expectation(flat, factors, n_gh=n, q=q, inner=inner,
                                         n_outer=n_outer, inner_args=inner_args).reshape(shape)

    # ------------------------------------------------------------------ 2-D
    def i2(self, C) -> np.ndarray:
        """E[g(a) g(c)] for C (…, 2, 2)."""
        C = np.asarray(C, dtype=np.float64)
        if self._use_closed("i2"):
            f = self.family
            if f == "erf":
                Cp = 2.0 * self.param ** 2 * C
                return (2.0 / np.pi) * np.arcsin(np.clip(
                    Cp[..., 0, 1] / np.sqrt((1 + Cp[..., 0, 0]) * (1 + Cp[..., 1, 1])), -1, 1))
            if f == "linear":
                return C[..., 0, 1].copy()
            rho, norm = _corr(C)
            return norm * self.activation.kernel(rho)
        return self._quad(C, (self._g, self._g), 2)

    def j2(self, C) -> np.ndarray:
        """E[g′(a) g′(c)] for C (…, 2, 2)."""
        C = np.asarray(C, dtype=np.float64)
        if self._use_closed("j2"):
            f = self.family
            if f == "erf":
                t2 = 2.0 * self.param ** 2
                Cp = t2 * C
                lam = (1 + Cp[..., 0, 0]) * (1 + Cp[..., 1, 1]) - Cp[..., 0, 1] ** 2
                return t2 * (2.0 / np.pi) / np.sqrt(lam)
            if f == "linear":
                return np.ones(C.shape[:-2])
            rho, _ = _corr(C)
            return self.activation.kprime(rho) + np.zeros(C.shape[:-2])
        return self._quad(C, (self._dg, self._dg), 2)

    def p2(self, C) -> np.ndarray:
        """E[a g′(a) g(c)] for C (…, 2, 2)."""
        C = np.asarray(C, dtype=np.float64)
        if self._use_closed("p2"):
            f = self.family
            if f == "erf":
                Cp = 2.0 * self.param ** 2 * C
                a1 = 1 + Cp[..., 0, 0]
                lam = a1 * (1 + Cp[..., 1, 1]) - Cp[..., 0, 1] ** 2
                return (2.0 / np.pi) * Cp[..., 0, 1] / (a1 * np.sqrt(lam))
            if f == "linear":
                return C[..., 0, 1].copy()
            return self.i2(C)  # relu, abs: x g′(x) = g(x)
        return self._quad(C, (self._xdg, self._g), 2)

    # ------------------------------------------------------------------ 3-D, 4-D
    def i3(self, C) -> np.ndarray:
        """E[g′(a) b g(c)] for C (…, 3, 3), coordinates in the order (a, b, c) (Stein)."""
        C = np.asarray(C, dtype=np.float64)
        if self.family == "linear" and self._use_closed("i3"):
            return C[..., 1, 2].copy()
        ac = C[..., [0, 2], :][..., :, [0, 2]]
        return stein_i3(C[..., 0, 0], C[..., 0, 1], C[..., 0, 2], C[..., 1, 2],
                        self.p2(ac), self.j2(ac))

    def i4(self, C) -> np.ndarray:
        """E[g′(a) g′(b) g(c) g(d)] for C (…, 4, 4), coordinates in the order (a, b, c, d)."""
        C = np.asarray(C, dtype=np.float64)
        if self._use_closed("i4"):
            if self.family == "linear":
                return C[..., 2, 3].copy()
            t2 = 2.0 * self.param ** 2
            return t2 * _saad_solla_i4(t2 * C)
        if self._pair is not None and self.method != "quadrature":
            return self._quad(C, (self._dg, self._dg, self._g, self._g), 4,
                              nested.pair_inner(self._pair), 2)
        return self._quad(C, (self._dg, self._dg, self._g, self._g), 4)


    def gprime_e2(self, C, coef, pairs, *, reference: bool = False) -> np.ndarray:
        """E[g′(x_k) g′(x_l) e²], e = Σ_c coef_c g(x_c), for each (k, l) in ``pairs``; C (P, P)
        the covariance of the P fields, coef (P,).

        Saad–Solla's second-order term. ``relu``/``abs`` (method auto/closed): one nested
        quadrature over (x_k, x_l) per pair, with E[e² | x_k, x_l] in closed form (pair moments
        of the conditional Gaussian law) inside it, compiled (:mod:`._fast`); smooth
        activations of the quadrature and polynomial families, where it has fewer nodes than
        the I4 sum: one nested quadrature over all fields of e per pair
        (:func:`._nested.nested_e2_smooth`); otherwise Σ_cd coef_c coef_d I4(k, l, c, d).
        ``reference``: the previous, slower path (numpy nested quadrature for relu/abs, the
        I4 sum otherwise), kept for the tests.
        """
        C = np.asarray(C, dtype=np.float64)
        coef = np.asarray(coef, dtype=np.float64)
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        nz = np.flatnonzero(coef)
        if len(pairs) == 0 or len(nz) == 0:
            return np.zeros(len(pairs))
        if self._pair is not None and self.method != "quadrature":
            return self._gprime_e2_nested(C, coef, pairs, nz, compiled=not reference)
        width = max(len(set(nz.tolist()) | {int(k), int(l)}) for k, l in pairs)
        if not reference and self._direct_e2(width, len(nz)):
            return self._gprime_e2_direct(C, coef, pairs, nz)
        return self._gprime_e2_i4_sum(C, coef, pairs, nz)

    def gprime_e2_batch(self, C, coef, pairs) -> np.ndarray:
        """(B, len(pairs)) :meth:`gprime_e2` for a batch of states, C (B, P, P), coef (B, P).

        The compiled relu/abs path evaluates every state's pair in one call per group of
        fields (fields with e ≠ 0 in any state of the batch: a zero coefficient adds nothing);
        the other paths state by state."""
        C = np.asarray(C, dtype=np.float64)
        coef = np.asarray(coef, dtype=np.float64)
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        B = C.shape[0]
        out = np.zeros((B, len(pairs)))
        nz = np.flatnonzero(np.any(coef != 0.0, axis=0))
        if len(pairs) == 0 or len(nz) == 0:
            return out
        if self._pair is None or self.method == "quadrature":
            for b in range(B):
                out[b] = self.gprime_e2(C[b], coef[b], pairs)
            return out
        return self._gprime_e2_compiled(C, coef, pairs, nz)

    def _gprime_e2_compiled(self, C, coef, pairs, nz) -> np.ndarray:
        """(B, len(pairs)) compiled relu/abs E[g′g′e²] for states C (B, P, P), coef (B, P):
        one call per group of fields (``nz``: the fields with a coefficient ≠ 0)."""
        out = np.empty((C.shape[0], len(pairs)))
        for (n_outer, _), members in _pair_groups(pairs, nz).items():
            idx = np.array([m[1] for m in members])  # (G, n) fields of each pair in the group
            sub = C[:, idx[:, :, None], idx[:, None, :]]  # (B, G, n, n)
            vals = gprime_e2_compiled(self.family, sub.reshape(-1, *sub.shape[2:]),
                                      coef[:, idx].reshape(-1, idx.shape[1]), n_outer,
                                      self.q["q4"])
            out[:, [m[0] for m in members]] = vals.reshape(C.shape[0], len(members))
        return out

    def _direct_e2(self, width: int, n_coef: int) -> bool:
        """Whether E[g′g′e²] is cheaper as one ``width``-dimensional quadrature per pair
        (the fields of e and the pair) than as the sum of n_coef(n_coef + 1)/2 4-D I4's, with
        a margin (:data:`DIRECT_MARGIN`) for the direct form, which does not cancel near
        e = 0. Smooth activations of the quadrature and polynomial families only (for
        polynomials both are exact: Gauss–Hermite with 2p + 1 nodes per level)."""
        if self.family not in ("quadrature", "polynomial") or self.activation.breakpoints:
            return False
        n = float(self.q["n4"])
        return n ** width <= DIRECT_MARGIN * (n_coef * (n_coef + 1) // 2) * n ** 4

    def _gprime_e2_direct(self, C, coef, pairs, nz):
        """One nested quadrature over all fields with e ≠ 0 (and x_k, x_l) per pair: factors
        g′(x_k)g′(x_l) (g′² for k = l) times (Σ_c coef_c g(x_c))² at the node."""
        out = np.empty(len(pairs))
        groups = _pair_groups(pairs, nz)
        for (n_outer, _), members in groups.items():
            idx = np.array([m[1] for m in members])
            outer = (self._dg2.fn,) if n_outer == 1 else (self._dg.fn, self._dg.fn)
            out[[m[0] for m in members]] = nested.nested_e2_smooth(
                C[idx[:, :, None], idx[:, None, :]], outer, self.activation.fn, coef[idx],
                self.q["n4"])
        return out

    def _gprime_e2_i4_sum(self, C, coef, pairs, nz):
        iu = np.triu_indices(len(nz))
        c, d = nz[iu[0]], nz[iu[1]]
        w = np.where(c == d, 1.0, 2.0) * coef[c] * coef[d]
        quads = np.concatenate([np.repeat(pairs, len(c), axis=0),
                                np.tile(np.stack([c, d], 1), (len(pairs), 1))], axis=1)
        vals = self.i4(C[quads[:, :, None], quads[:, None, :]])
        return (vals * np.tile(w, len(pairs))).reshape(len(pairs), -1).sum(axis=1)

    def _gprime_e2_nested(self, C, coef, pairs, nz, compiled=True):
        if compiled:
            return self._gprime_e2_compiled(C[None], coef[None], pairs, nz)[0]
        out = np.empty(len(pairs))
        inner = nested.e2_inner(self._pair, self._square)
        for (n_outer, _), members in _pair_groups(pairs, nz).items():
            idx = np.array([m[1] for m in members])
            factors = ((self._dg2,) if n_outer == 1 else (self._dg, self._dg)) + \
                (self._g,) * (idx.shape[1] - n_outer)
            out[[m[0] for m in members]] = self._quad(
                C[idx[:, :, None], idx[:, None, :]], factors, 4, inner, n_outer, coef[idx])
        return out


def stein_i3(caa, cab, cac, cbc, p2, j2):
    """I3(a, b, c) = (C_ab/C_aa)(P2(a, c) − C_ac J2(a, c)) + C_bc J2(a, c)."""
    return cab / caa * (p2 - cac * j2) + cbc * j2


def _saad_solla_i4(C):
    """Saad & Solla's I4 for g = erf(x/√2), C (…, 4, 4) in the order (a, b, c, d)."""
    c = lambda i, j: C[..., i, j]  # noqa: E731
    lam4 = (1 + c(0, 0)) * (1 + c(1, 1)) - c(0, 1) ** 2
    lam0 = (lam4 * c(2, 3) - c(1, 2) * c(1, 3) * (1 + c(0, 0))
            - c(0, 2) * c(0, 3) * (1 + c(1, 1)) + c(0, 1) * c(0, 2) * c(1, 3)
            + c(0, 1) * c(0, 3) * c(1, 2))
    lam1 = (lam4 * (1 + c(2, 2)) - c(1, 2) ** 2 * (1 + c(0, 0))
            - c(0, 2) ** 2 * (1 + c(1, 1)) + 2 * c(0, 1) * c(0, 2) * c(1, 2))
    lam2 = (lam4 * (1 + c(3, 3)) - c(1, 3) ** 2 * (1 + c(0, 0))
            - c(0, 3) ** 2 * (1 + c(1, 1)) + 2 * c(0, 1) * c(0, 3) * c(1, 3))
    arg = np.clip(lam0 / np.sqrt(lam1 * lam2), -1.0, 1.0)
    return 4.0 / np.pi ** 2 / np.sqrt(lam4) * np.arcsin(arg)

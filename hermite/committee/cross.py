"""Cross pair integrals of a student σ and a teacher σ* on batches of 2×2 covariances.

For (a, b) ~ N(0, Σ), a the student's field and b the teacher's (any variances, any
correlation, singular Σ allowed):

    I2×(Σ) = E[σ(a) σ*(b)],   J2×(Σ) = E[σ′(a) σ*′(b)],   P2×(Σ) = E[a σ′(a) σ*(b)],

the pair integrals I2, J2, P2 of :class:`~hermite.committee.integrals.CommitteeIntegrals` with
the second factor the teacher's. Where σ* = σ they are those of ``CommitteeIntegrals`` (closed
forms where it has them); otherwise the nested quadrature of :mod:`hermite.committee._nested`
on the pair. The last level is a factor with a closed-form smoothing E[f(m + s z)] (ReLU, step,
erf, erf′, linear; x σ′(x) = σ(x) for ReLU and abs, and for σ = erf(cx)

    E[x σ′(x)] = (2c/√π) m D^{−3/2} exp(−c²m²/D),   x = m + s z,  D = 1 + 2c²s²),       (X)

preferring a smooth one there (a kinked factor's kinks are then fixed panel edges of the outer
level, and an erf of any variance is integrated in closed form). The outer level is always the
composite Gauss–Legendre rule of a kinked one, split at 0 where its factor is smooth (Gauss–
Hermite's 96 nodes leave 6·10⁻⁶ on E[tanh′(a)] at deviation 2, the poles of tanh(2z) ±iπ/4
from the real axis; polynomial pairs keep their exact 2p + 1 Gauss–Hermite nodes). Used by
Stein's identity (S×) of ``hermite.flows.lora_ba`` for rows as they are with a teacher σ* ≠ σ.
"""

from __future__ import annotations

import numpy as np

from hermite._activation import resolve_activation
from hermite.committee import _nested as nested
from hermite.committee.integrals import CommitteeIntegrals

__all__ = ["CrossIntegrals"]


class CrossIntegrals:
    """I2×, J2×, P2× of a student σ (``activation``) and a teacher σ* (``teacher``) on batches
    of covariances (…, 2, 2), coordinates in the order (student's a, teacher's b).

    ``method`` and ``quadrature`` as :class:`CommitteeIntegrals` (``"quadrature"``: the nested
    quadrature also where σ* = σ, the reference the closed forms are tested against;
    ``"closed"``: ValueError where σ* ≠ σ)."""

    def __init__(self, activation, teacher, method: str = "auto",
                 quadrature: dict | None = None):
        self.student = CommitteeIntegrals(activation, method, quadrature)
        self.teacher = CommitteeIntegrals(teacher, method, quadrature)
        self.activation = self.student.activation
        self.same = resolve_activation(teacher) == self.activation and method != "quadrature"
        self._xdg = _x_deriv_factor(self.student)
        # the node counts: a polynomial's 2p + 1 Gauss–Hermite nodes only if both are
        self._driver = max(self.student, self.teacher, key=lambda ci: ci.q["n2"])

    def _pair(self, C, first, second) -> np.ndarray:
        """E[first(a) second(b)] on C (…, 2, 2) by the nested quadrature; the pair reversed
        where the first factor suits the last level better, the outer level split at 0
        (module docstring)."""
        if self.student.method == "closed":
            raise ValueError(f"no closed-form cross pair integrals of {self.activation.name!r} "
                             f"and {self.teacher.activation.name!r} (use method='auto')")
        C = np.asarray(C, dtype=np.float64)
        if first.smooth is not None and (second.smooth is None
                                         or (second.breaks and not first.breaks)):
            C, first, second = C[..., ::-1, ::-1], second, first
        if not first.breaks and self._driver.family != "polynomial":
            first = nested.Factor(first.fn, (0.0,), first.smooth)
        return self._driver._quad(C, (first, second), 2)

    def i2(self, C) -> np.ndarray:
        """I2× = E[σ(a) σ*(b)] for C (…, 2, 2)."""
        if self.same:
            return self.student.i2(C)
        return self._pair(C, self.student._g, self.teacher._g)

    def j2(self, C) -> np.ndarray:
        """J2× = E[σ′(a) σ*′(b)] for C (…, 2, 2)."""
        if self.same:
            return self.student.j2(C)
        return self._pair(C, self.student._dg, self.teacher._dg)

    def p2(self, C) -> np.ndarray:
        """P2× = E[a σ′(a) σ*(b)] for C (…, 2, 2)."""
        if self.same:
            return self.student.p2(C)
        return self._pair(C, self._xdg, self.teacher._g)


def _smooth_x_erf_deriv(c: float):
    """(X) of the module docstring: E[x σ′(x)], σ = erf(cx), x = m + s z."""
    def f(m, s):
        den = 1.0 + 2.0 * c * c * s * s
        return 2.0 * c / np.sqrt(np.pi) * m * np.exp(-c * c * m * m / den) / den**1.5
    return f


def _x_deriv_factor(ci: CommitteeIntegrals) -> nested.Factor:
    """The factor x σ′(x) of P2× with its closed-form smoothing where one is known: σ(x)'s
    (ReLU, abs: x σ′(x) = σ(x)), m (linear) or (X) (erf); none otherwise."""
    if ci.family in ("relu", "abs"):
        return ci._g
    smooth = None
    if ci.family == "linear":
        smooth = nested.smooth_linear
    elif ci.family == "erf":
        smooth = _smooth_x_erf_deriv(ci.param)
    return nested.Factor(ci._xdg.fn, ci._xdg.breaks, smooth)

r"""The corrected line of fine-tuning with ĉ joint and û unprojected: the corrected flow plus
the escape's diffusion (docs/theory/finite-d.md, "The corrected flow with ĉ joint and û
unprojected").

The corrected flow (:class:`hermite.finetune.population.CorrectedFlow`) is the mean of one
step to O(η²d): the O(η) drift and the renormalisation drift −(η²/2)X E‖Ḡ_T‖². Followed from
a run's start it is the run's mean path while m = ⟨û, u⟩ is large against the step noise. At
the learner's start |m₀| ~ d^{−1/2}, and there the noise of m, η²V per step with
V = Var⟨Ḡ_T, u⟩ ≈ E‖Ḡ_T‖²/d, is of the same order as the renormalisation drift's pull
(η²/2)E‖Ḡ_T‖²m (on the uniform law they cancel exactly: E m² = 1/d is invariant). So the
mean of |m| over runs escapes from a wider start than the runs' own m₀: linearising about
the run's corrected path ȳ(t), with Φ(t) = ∂m(t)/∂m(0) the response to a kick of m,

    m(t) ≈ m̄(t) + Φ(t) ζ(t),    Var ζ(t) = σ²(t) = ∫₀ᵗ η² V(ȳ(τ)) / Φ(τ)² dτ,     (E1)

σ² accumulated while the kick grows (up to the largest |Φ|: after the escape the noise is
an O(η) fluctuation, not O(η²d)). E|m(t)| of (E1) is the folded-normal mean
F(m̄, S) = S√(2/π) e^{−m̄²/2S²} + m̄(1 − 2Φ_N(−m̄/S)), S = |Φ|σ. Beyond the linear phase the
spread of starts is carried by the flow itself: corrected flows from m₀ + σ∞xᵩ
(Gauss–Hermite nodes xᵩ, weights wᵩ, σ∞ = σ at the end of the escape), each blended as
m̄ + (σ(t)/σ∞)(mᵩ(t) − m̄(t)), and the line is

    E|m(t)| ≈ F(m̄, S) + Σᵩ wᵩ|m̄ + (σ/σ∞)(mᵩ − m̄)| − Σᵩ wᵩ|m̄ + S xᵩ|                (E2)

(the quadrature of the linear part subtracted and replaced by its exact value: exact in the
linear phase, the node mixture after it). Φ is the finite difference of the base flow and a
kicked copy that shares its E‖Ḡ_T‖² (``CorrectedFlow(share=…)``: the QMC average jumps with a
kinked σ). Cost: 2 + ``NODES`` corrected flows per start. Not in it: the drift the noise of ĉ
induces through the drift's curvature, O(η_c) — the dominant finite-step effect at Fig. 1's He₃
cell (docs/theory/finite-d.md).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.stats

__all__ = ["escape_line", "EscapeLine", "folded_mean", "NODES", "GRID", "KICK",
           "COST_FLOWS"]

NODES = 4  # Gauss–Hermite nodes of the start's spread (symmetric pairs)
GRID = 160  # points of the base path on which σ²(t) (E1) is integrated (trapezoid)
KICK = 1e-3  # the kick of m for Φ, in units of d^{−1/2}
COST_FLOWS = 2 + NODES  # corrected flows per start (base, kicked, nodes): the cost factor


class EscapeLine:
    """(E2) at the checkpoints: ``m`` (R, C) signed (the sign of the run's corrected path;
    |m| the line), ``c_overlap`` (R, C), the mixture's mean states ``p``, ``mu``, ``c_hat``,
    and per run ``sigma`` = σ∞ and ``phi`` = Φ at the checkpoints."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def folded_mean(mean, sd):
    """E|N(mean, sd²)| (sd ≥ 0; |mean| where sd = 0)."""
    mean, sd = np.asarray(mean, dtype=float), np.asarray(sd, dtype=float)
    safe = np.where(sd > 0.0, sd, 1.0)
    r = mean / safe
    val = safe * math.sqrt(2.0 / math.pi) * np.exp(-0.5 * r * r) + mean * (
        1.0 - 2.0 * scipy.stats.norm.cdf(-r))
    return np.where(sd > 0.0, val, np.abs(mean))


def _direction(model, runs):
    """The packed state direction of a kick of m alone: (u_w, u⊥) in (p, μ), 0 in ĉ."""
    e = model.pack(np.repeat(model.u_w[None, :], runs, axis=0), np.full(runs, model.u_perp),
                   np.zeros((runs, model.k)))
    return e


def escape_line(model, second, p0, mu0, ch0, ck, flow, nodes: int = NODES,
                grid: int = GRID) -> EscapeLine:
    """(E2) from the starts (p₀ (R, k), μ₀ (R,), ĉ₀ (R, k)) at the checkpoints ``ck`` (C,);
    ``model`` unprojected (joint ĉ or frozen), ``second`` its :class:`SecondMoment`, ``flow``
    the corrected flow's class (:class:`hermite.finetune.population.CorrectedFlow`, passed
    in by its caller so that this module sits below it)."""
    if model.project:
        raise ValueError("escape_line: û unprojected only")
    runs, k, d = mu0.size, model.k, second.d
    fine = np.unique(np.concatenate([np.linspace(0.0, float(ck[-1]), grid), ck]))
    y0 = model.pack(p0, mu0, ch0)
    e = _direction(model, runs)
    kick = KICK / math.sqrt(d)
    ys = flow(model, np.concatenate([ch0, ch0]), second, share=runs).solve(
        np.concatenate([y0, y0 + kick * e]).ravel(), fine)
    ys = ys.reshape(2 * runs, model.dim, fine.size).transpose(0, 2, 1)  # (2R, G, dim)
    chs = np.repeat(np.concatenate([ch0, ch0]), fine.size, axis=0)
    p, mu, ch = model.unpack(ys.reshape(-1, model.dim), chs)
    m = (p @ model.u_w + mu * model.u_perp).reshape(2 * runs, fine.size)
    base, phi = m[:runs], (m[runs:] - m[:runs]) / kick
    g = slice(0, runs * fine.size)
    var = second.overlap_variance(p[g], mu[g], ch[g]).reshape(runs, fine.size)
    integrand = model.eta**2 * var / np.maximum(phi * phi, 1e-300)
    stop = np.argmax(np.abs(phi), axis=1)  # the kick's largest response: the escape's end
    integrand[np.arange(fine.size)[None, :] > stop[:, None]] = 0.0
    sig2 = np.concatenate([np.zeros((runs, 1)), np.cumsum(
        0.5 * (integrand[:, 1:] + integrand[:, :-1]) * np.diff(fine), axis=1)], axis=1)
    sig_inf = np.sqrt(sig2[:, -1])
    # node starts y₀ + σ∞xᵩ e (a kick of m, in the state's units), kept on the sphere
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    starts = y0[None] + (sig_inf[None, :, None] * x[:, None, None]) * e[None]
    starts = starts.reshape(nodes * runs, model.dim)
    ps, ms, _ = model.unpack(starts, np.tile(ch0, (nodes, 1)))
    n2 = np.sum(ps * ps, axis=1) + ms * ms
    over = n2 > 1.0
    if over.any():  # a start within σ of the pole: back onto the sphere ((p, μ) first)
        starts[over, :k + 1] /= np.sqrt(n2[over])[:, None]
    yq = flow(model, np.tile(ch0, (nodes, 1)), second).solve(starts.ravel(), ck)
    yq = yq.reshape(nodes, runs, model.dim, ck.size).transpose(0, 1, 3, 2)  # (Q, R, C, dim)
    idx = np.searchsorted(fine, ck)
    yb = ys[:runs, idx]  # (R, C, dim)
    ratio = np.where(sig_inf[:, None] > 0.0,
                     np.sqrt(sig2[:, idx]) / np.where(sig_inf > 0.0, sig_inf, 1.0)[:, None],
                     0.0)  # σ(t)/σ∞ (R, C)
    blend = yb[None] + ratio[None, :, :, None] * (yq - yb[None])  # (Q, R, C, dim)
    chc = np.repeat(ch0, ck.size, axis=0)
    pq, muq, chq = model.unpack(blend.reshape(-1, model.dim), np.tile(chc, (nodes, 1)))
    mq = (pq @ model.u_w + muq * model.u_perp).reshape(nodes, runs, ck.size)
    mb, ph = base[:, idx], phi[:, idx]
    spread = np.abs(ph) * np.sqrt(sig2[:, idx])
    quad = np.einsum("q,qrc->rc", w, np.abs(mb[None] + spread[None] * x[:, None, None]))
    line = folded_mean(mb, spread) + np.einsum("q,qrc->rc", w, np.abs(mq)) - quad
    mean_state = np.einsum("q,qrcd->rcd", w, blend)
    pm, mum, chm = model.unpack(mean_state.reshape(-1, model.dim), chc)
    chq = chq.reshape(nodes, runs, ck.size, k)
    cos = np.einsum("q,qrc->rc", w, model.c_cosine(chq.reshape(-1, k)).reshape(
        nodes, runs, ck.size))
    sign = np.where(mb < 0.0, -1.0, 1.0)
    return EscapeLine(m=sign * np.maximum(line, 0.0), c_overlap=cos,
                      p=pm.reshape(runs, ck.size, k), mu=mum.reshape(runs, ck.size),
                      c_hat=chm.reshape(runs, ck.size, k), sigma=sig_inf, phi=ph)

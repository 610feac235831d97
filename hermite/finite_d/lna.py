r"""Theory band for the overlap: linear-noise approximation (LNA) around the corrected ODE.

Derivation. Write the exact chain (``hermite.finite_d.noise``, ★) as μ_{t+1} = μ_t + D(μ_t) + ζ_t
with D = E[μ′ − μ | μ] (``hermite.finite_d.corrected_ode``) and ζ_t a martingale increment of
conditional
variance V(μ_t) = Var(μ′ − μ | μ_t) (to leading order η²(1−μ²)Var(g t) = η² Var⟨u, ∇̂L⟩/u⊥²;
the exact V also contains the normalisation's fluctuation, O(η⁴d²Var g²), which is of the same
order when ηd = O(1)). Linearising D about the mean path μ̄_t,

    Var_{t+1} = (1 + D′(μ̄_t))² Var_t + V(μ̄_t),
    μ̄_{t+1} = μ̄_t + D(μ̄_t) [+ ½ D″(μ̄_t) Var_t with ``closure=True``, the Gaussian closure
               of E D(μ_t); it shifts the stationary mean by ≈ −D″Var/(2D′)].

Initial law: û₀ uniform on the unit sphere of span(W)^⊥ (dimension p = d − k) makes
μ₀ = ⟨e, û₀⟩ the coordinate of a uniform point of S^{p−1}: (μ₀ + 1)/2 ~ Beta((p−1)/2, (p−1)/2),
E μ₀ = 0, Var μ₀ = 1/(d − k). ``init="aligned"`` flips it to sign(h(0))·|μ₀|.

Two bands (10–90% by default):

* ``method="gaussian"`` (the plain LNA): one mean path from E μ₀ with Var₀ = Var μ₀; the band
  is μ̄ ± 1.2816·sd. It is valid while D is close to linear across the spread of the runs
  (ReLU, ĉ = c, d = 200: it works, h(0) = 0.34 is large). It fails during the escape from
  m ≈ 0 when h(0) is small: there D(μ) ≈ D′(0)μ, the runs leave 0 in both directions, the law
  is bimodal and the linearised variance (1 + D′(0))^{2t}Var₀ explodes. Measured on He₃, k = 4,
  d = 50, ĉ with ⟨c, ĉ⟩ = 0 (h(0) = 0), η = 1e-4, uniform m₀: at t = 24000 the empirical
  10/90% quantiles are ∓0.86, the Gaussian band was ∓3.2 (∓125 at t = 60000). A variance of
  μ ∈ [−1, 1] above 1 is impossible, so such a band is now flagged as a blow-up
  (``TheoryBand.blowup_step``) and reads NaN from that step (issue 16).
* ``method="mixture"`` (default): each initial value — the runs' own m₀, or J quantile nodes of
  the initial law — is carried by the corrected ODE with its own LNA variance started at 0;
  the predicted law is the equal-weight mixture of N(μ̄_j(t), Var_j(t)), whose quantiles are
  solved for. This keeps the exact nonlinear transport of the initial spread (the dominant
  early-time effect) and uses the LNA only for the SGD noise accumulated along each path.
  Its remaining failure is the same escape: a path keeps the sign of its m₀, whereas SGD noise
  near the unstable point m = 0 re-mixes runs (20% of the runs above ended with the other
  sign), so the mixture escapes too fast: quantiles ∓0.68/∓0.88/∓0.98 at t = 12k/18k/24k
  against ∓0.64/∓0.79/∓0.86 measured (late band edges 0.916 vs 0.907). When the noise term
  beats the signal at 0 (η²(d−k−2)E[S²]/2 > η h′(0)·u⊥², same instance at d = 200) m = 0 is
  stable: no escape at all, and both bands then agree with the simulation (±0.23 at t = 40k).
  Wherever h(0) is not small (checked: ReLU ĉ = c and frozen ĉ ≠ c, erf, label noise,
  u_alpha = 0.4) the mixture band's late-time 10%/90% edges are within 0.1 sd of the empirical
  quantiles of 4096 runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.special
import scipy.stats

from hermite.finite_d.corrected_ode import _ckpts, _lna, _mu0, _table, flow_block
from hermite.finite_d.noise import h_tilde

__all__ = ["TheoryBand", "BandForm", "theory_band", "initial_law", "drift_table_sign", "Z90"]

Z90 = float(scipy.stats.norm.ppf(0.9))  # 1.2816


def initial_law(instance, d=None, init="uniform", nodes=64):
    """(nodes of m₀ at equal-probability quantiles, E m₀, Var m₀) for the engine's init law."""
    d = instance.d if d is None else int(d)
    p = d - instance.k
    a = (p - 1) / 2.0
    q = (np.arange(nodes) + 0.5) / nodes
    up = instance.u_perp
    if init == "uniform":
        mu = 2.0 * scipy.stats.beta.ppf(q, a, a) - 1.0
        return up * mu, 0.0, up**2 / p
    if init == "aligned":
        # μ₀² ~ Beta(1/2, (p−1)/2) and E|μ₀| = Γ(p/2)/(√π Γ((p+1)/2))
        sign = drift_table_sign(instance)
        absmu = np.sqrt(scipy.stats.beta.ppf(q, 0.5, a))
        mean = math.exp(scipy.special.gammaln(p / 2) - scipy.special.gammaln((p + 1) / 2))
        mean /= math.sqrt(math.pi)
        return sign * up * absmu, sign * up * mean, up**2 * (1.0 / p - mean**2)
    raise ValueError(f"init must be 'uniform' or 'aligned', got {init!r}")


def drift_table_sign(instance) -> int:
    """sign h(0) (+1 when h(0) = 0): the direction ``init="aligned"`` flips m₀ to."""
    return 1 if h_tilde(instance, [0.0])[0] >= 0 else -1


@dataclass(frozen=True)
class TheoryBand:
    """Predicted mean, sd and quantile band of m_t at the checkpoints ``steps``.

    ``blowup_step``: the first step at which a path's LNA blew up (its variance of μ left
    [0, 1], or its mean went non-finite), −1 if none; the band is NaN from there on.
    """

    steps: np.ndarray
    mean: np.ndarray
    sd: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    quantiles: tuple
    method: str
    blowup_step: int = -1


def _mixture_quantile(means, sds, prob, iters=80):
    """Quantile of the equal-weight Gaussian mixture, per column (bisection)."""
    sds = np.maximum(sds, 1e-300)
    lo = (means - 12 * sds).min(axis=0) - 1e-12
    hi = (means + 12 * sds).max(axis=0) + 1e-12
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        cdf = scipy.special.ndtr((mid[None, :] - means) / sds).mean(axis=0)
        below = cdf < prob
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class BandForm:
    """What :func:`theory_band` draws: ``method`` "mixture" or "gaussian" (module
    docstring), the band's ``quantiles``, and ``nodes`` quantile nodes of the initial law
    where the runs' m₀ are not given."""

    method: str = "mixture"
    quantiles: tuple = (0.1, 0.9)
    nodes: int = 64

    def __post_init__(self):
        if self.method not in ("mixture", "gaussian"):
            raise ValueError(f"method must be 'mixture' or 'gaussian', got {self.method!r}")
        if int(self.nodes) != self.nodes or self.nodes < 1:
            raise ValueError(f"nodes must be an integer ≥ 1, got {self.nodes!r}")


def theory_band(instance, eta, d, steps, *, m0=None, init="uniform", closure=False,
                form: BandForm | None = None, table=None, **keywords) -> TheoryBand:
    """Theory mean and band of m_t (see the module docstring for both methods).

    m0 : the runs' initial overlaps (mixture over them), or None for ``form.nodes`` quantile
    nodes of the ``init`` law. Gaussian method: mean/variance of m0 (or of the law) start the
    path. ``form`` (:class:`BandForm`) or its fields method, quantiles, nodes as keywords.
    The drift: ``table``, or :func:`drift_table`'s from the other keywords (c_hat,
    label_noise, ``ode_method`` its method, grid, samples, seed).
    """
    picked = {key: keywords.pop(key) for key in ("method", "quantiles", "nodes")
              if key in keywords}
    if form is None:
        form = BandForm(**picked)
    elif picked:
        raise TypeError(f"theory_band() got a BandForm and its keyword(s) {', '.join(picked)}")
    if "ode_method" in keywords:
        keywords["method"] = keywords.pop("ode_method")
    tab = _table(instance, eta, d, table, keywords)
    method, quantiles, nodes = form.method, form.quantiles, form.nodes
    ck = _ckpts(steps)
    up = instance.u_perp
    if m0 is None:
        m_nodes, mean0, var0 = initial_law(instance, d, init, nodes)
    else:
        m_nodes = np.atleast_1d(np.asarray(m0, dtype=float))
        mean0, var0 = float(m_nodes.mean()), float(m_nodes.var())
    if method == "gaussian":
        mu0 = _mu0(instance, [mean0])
        mean, var, blow = _lna(mu0, np.array([var0 / up**2]), ck, tab.fine_drift,
                               tab.fine_dprime, tab.fine_dsecond, tab.fine_var, tab.dth,
                               closure, flow_block(tab, ck))
        mean, sd = up * mean[0], up * np.sqrt(var[0])
        z = scipy.stats.norm.ppf(quantiles)
        return TheoryBand(ck, mean, sd, mean + z[0] * sd, mean + z[1] * sd, tuple(quantiles),
                          method, int(blow[0]))
    mu0 = _mu0(instance, m_nodes)
    means, var, blow = _lna(mu0, np.zeros(mu0.size), ck, tab.fine_drift, tab.fine_dprime,
                            tab.fine_dsecond, tab.fine_var, tab.dth, closure,
                            flow_block(tab, ck))
    means, sds = up * means, up * np.sqrt(var)
    mean = means.mean(axis=0)
    sd = np.sqrt((sds**2).mean(axis=0) + means.var(axis=0))
    lower = _mixture_quantile(means, sds, quantiles[0])
    upper = _mixture_quantile(means, sds, quantiles[1])
    hit = blow[blow >= 0]
    return TheoryBand(ck, mean, sd, lower, upper, tuple(quantiles), method,
                      int(hit.min()) if hit.size else -1)

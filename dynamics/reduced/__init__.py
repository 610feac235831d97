r"""The reduced engine: the exact law of the ``finetune`` dynamics at O(k) cost per step, any d.

Derivation (from the full engine's step, ``dynamics.learners.finetune``; no approximation)
------------------------------------------------------------------------------------------
Canonical frame (``dynamics.instances.instance``): x ~ N(0, I_d); coordinates 0..k−1 span W (wᵢ =
row i of L), coordinate k is e, the unit direction of u's part ⊥ W, so u = (u_w, u⊥, 0, …). Let
H = span(W, e). Write û = (p, μ, ν ê) with p ∈ R^k (û in span W), μ = ⟨û, e⟩, ν ≥ 0 and ê the
unit direction of û's part ⊥ H. Projected learner (eq. 4): p ≡ 0.

*Why (p, μ, ν) is a Markov chain.* The law of x is invariant under every rotation Q fixing H
pointwise; W, u, Π, f* and f̂ are too, so the step map satisfies F(Qû, Qx) = Q F(û, x). Hence
the law of the next state given û depends only on û's orbit under those rotations, i.e. on
(p, μ, ν). In a basis whose (k+1)-th vector is ê, one example is x = (z, a, b, r):
z ~ N(0, I_k), a, b ~ N(0, 1), r ~ N(0, I_{d−k−2}), all independent.

(R0) Initial law: û₀ uniform on the sphere of span(W)^⊥ (R^{d−k}): μ₀ = g/√(g² + Q),
     ν₀ = √Q/√(g² + Q), g ~ N(0, 1), Q ~ χ²_{d−k−1}; p₀ = 0. ``aligned`` flips μ₀ so m₀h(0) > 0.
(R1) m = ⟨û, u⟩ = ⟨p, u_w⟩ + μ u⊥.
(R2) N̂ⱼ = ‖wⱼ + ξĉⱼû‖ = √(1 + 2ξĉⱼ⟨wⱼ,û⟩ + ξ²ĉⱼ²), ⟨wⱼ,û⟩ = (Lp)ⱼ; ⟨v̂ⱼ,û⟩ = (⟨wⱼ,û⟩ + ξĉⱼ)/N̂ⱼ.
     s = ⟨û,x⟩ = p·z + μa + νb, âⱼ = ((Lz)ⱼ + ξĉⱼ s)/N̂ⱼ; teacher tᵢ = ((Lz)ᵢ + ξcᵢ⟨u,x⟩)/Nᵢ,
     ⟨u,x⟩ = u_w·z + u⊥a; y = Σλᵢσ(tᵢ) + ε (label noise), f̂ = Σλⱼσ(âⱼ).
(R3) L = (y − f̂)², δⱼ = −2(y − f̂)λⱼσ′(âⱼ), ∂âⱼ/∂û = (ξĉⱼ/N̂ⱼ)(x − âⱼv̂ⱼ), so
     ∇_û L = g x − Σⱼ γⱼ wⱼ − (Σⱼ γⱼξĉⱼ) û,  g = Σⱼ δⱼξĉⱼ/N̂ⱼ,  γⱼ = δⱼ âⱼ ξĉⱼ/N̂ⱼ².
     The û term dies under (I − ûûᵀ) and is dropped. Projected: Πwⱼ = 0, so Π∇L = g Πx.
(R4) ∂L/∂ĉⱼ = δⱼ (ξ/N̂ⱼ)(s − âⱼ⟨v̂ⱼ,û⟩)  (projected: δⱼ ξ(s − ξĉⱼ(Lz)ⱼ)/N̂ⱼ³).
     A mini-batch of b examples averages: ḡₙ = gₙ/b, γ̄ = Σₙ γₙ/b.
(R5) G = Σₙ ḡₙ xₙ − Wᵀγ̄ (projected: Σₙ ḡₙ Πxₙ) has components G_W = Σḡₙzₙ − Lᵀγ̄ (0 when
     projected), G_e = Σḡₙaₙ, G_ê = Σḡₙbₙ, and Σḡₙrₙ ⊥ û. With S = ⟨û,G⟩ = p·G_W + μG_e + νG_ê,
     û − η(I − ûûᵀ)G has components p − η(G_W − Sp), μ − η(G_e − Sμ), ν − η(G_ê − Sν) and
     −ηΣḡₙrₙ, so after normalising by n (the root of the sum of squares)
       μ′ = (μ − η(G_e − Sμ))/n,  p′ = (p − η(G_W − Sp))/n,
       ν′ = √((ν − η(G_ê − Sν))² + η²ρ²)/n,  ρ² = ‖Σₙ ḡₙ rₙ‖²,
     and the new ê is the unit vector along the last two parts. As ḡ depends on (z, a, b, ε)
     only, Σₙḡₙrₙ ~ N(0, ‖ḡ‖² I_{d−k−2}) given ḡ: ρ² = ‖ḡ‖² χ²_{d−k−2}, one χ² per step
     whatever b (same law as ḡᵀ Gram(r) ḡ with a Bartlett-sampled Wishart Gram, at O(1)).
     For b = 1, projected: μ′ = ((1 + ηgs)μ − ηga)/√(1 + η²g²(a² + b² + ‖r‖² − s²))
     (docs/theory/exact-reductions.md).
(R6) ĉ′ = ĉ − η_c ∂L/∂ĉ, evaluated at the pre-step state (simultaneous with û, as the full
     engine does).

Cost per step: b(k + 2) normals (+ b for label noise) and one χ², O(bk) flops (O(bk²) when
W is not orthonormal), independent of d. Divergence (non-finite state or |m| > 1 + 1e-12)
marks and freezes a run; its overlaps read NaN from then on, as in the full engine.

The ``glm`` learner (single index on the full sphere) has its own exact scalar chain in m,
derived in :mod:`.glm_chain` (numba only); ``simulate_reduced``/``first_passage_reduced``
dispatch to it.

Every chain advances in segments of many steps (:mod:`.segments`), one kernel call each, the
runs' state and streams carried between them: the numbers of one call over the whole horizon,
with progress lines, signals and resume files between segments.

Backends: ``numba`` (CPU; runs in blocks on numba's threads, per-run SplitMix64 streams seeded from
(seed, r), so results do not depend on the thread count; float64 always), ``numba-cuda``
(the default on CUDA: the same compiled step loop as a CUDA kernel, one thread per run and
every step of a segment in one launch, same streams, float64; :mod:`.cuda_kernel`) and ``torch``
(vectorised over runs, one launch per step, CUDA or CPU; honours float32; also the fallback
for activations without a compiled version).

Modules: ``simulate`` (the public entry points), ``exact_chain`` (what a learner's chain
offers), ``segments`` (runs advanced in segments), ``params`` (instances packed for the
kernels); the chains ``rank_chain``/``rank_simulate`` (rank-r), ``glm_chain``, ``linear_chain``,
``network_chain``/``network_simulate``, ``pretrained_chain``,
``lora_ba_chain``/``lora_ba_kernel`` (``lora-ba``); the backends ``torch_chain``,
``cuda_kernel`` and ``network_cuda``. Imports ``setup``, ``learners`` and the rooms below them.
"""

from pathlib import Path as _Path

from dynamics.runtime.numba_cache import SIGMA_SOURCE, drop_stale_cache

_HERE = _Path(__file__).parent
# every module of this package, compiled or not, and σ's numba source
drop_stale_cache(_HERE / "__pycache__", [*_HERE.glob("*.py"), SIGMA_SOURCE])

from dynamics.reduced.simulate import (  # noqa: E402
    BACKENDS,
    ENGINE,
    first_passage_reduced,
    first_passages_reduced,
    initial_trajectory,
    reduced_supported,
    simulate_reduced,
    simulate_resolved,
    start_resolved,
)

__all__ = ["ENGINE", "BACKENDS", "reduced_supported", "simulate_reduced", "simulate_resolved",
           "start_resolved", "first_passage_reduced", "first_passages_reduced",
           "initial_trajectory"]

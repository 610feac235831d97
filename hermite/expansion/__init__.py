"""Hermite analysis of an activation.

- ``coefficients``: orthonormal Hermite coefficients μ_p(σ) (§1.4);
- ``kernels``: dual kernels K(ρ), K′(ρ) and their interpolants;
- ``gradient``: the population-gradient factor h(m) of Prop. 4;
- ``series``: truncated Hermite series of h(m);
- ``table``: an error-checked interpolation table of h(m);
- ``loss``: the population loss Φ(m).

Imports only the ``hermite`` root.
"""

"""Theory lines drawn beside a run (fine-tuning: ODE, corrected map, band, escape; committee:
ODE and diffusion), the assembly of a rank-1 trajectory from either engine's records, and the
theory audit (each line against the SGD mean from the same starts). Imports ``measures`` and
the rooms below it, and ``hermite``.
"""

"""Finite-d corrections to the flows: one-step noise moments, the noise-corrected mean map,
the LNA band, the largest stable step size and stability. Imports ``flows``, ``expansion``
and the root.
"""

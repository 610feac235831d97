"""Hermite analysis of an activation: coefficients μ_p(σ), dual kernels and their
interpolants, h(m) (by quadrature or series), the population loss Φ(m) and the tables the
flows read. Imports only the ``hermite`` root.
"""

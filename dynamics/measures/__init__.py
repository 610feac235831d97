"""What a run measures.

- ``observables``: per-run overlaps, reduced coordinates, runs grouped by instance;
- ``losses``: the population loss of rank-1 students, exact in every regime that has one;
- ``network_loss``: the exact loss of two-layer networks of unit rows (dual kernels);
- ``refit``: the second layer refit on a learned û's features (App. F.2).

Imports ``instances``, ``randomness``, the root and ``hermite``.
"""

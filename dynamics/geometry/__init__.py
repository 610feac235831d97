"""Geometry of the student's directions, geoopt-style.

- ``sphere``: the unit sphere (û: projection, retraction);
- ``stiefel``: the Stiefel manifold St(n, r) (rank-r frames Û).

Imports only the ``dynamics`` root.
"""

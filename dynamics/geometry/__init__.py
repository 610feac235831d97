"""Geometry of the student's directions: the unit sphere (û) and the Stiefel manifold (rank-r
frames). Imports only the ``dynamics`` root.
"""

"""A run's records and machinery, shared by both engines and every learner: the Trajectory
(what engines return and files store), resume files, progress lines, thread pools over runs,
and the guard against stale numba caches. Imports only the ``dynamics`` root.
"""

"""A run's records and machinery, shared by both engines and every learner.

- ``trajectory``: the :class:`Trajectory` every engine returns and HDF5 files store;
- ``resume``: a run's durable state between two processes (``OUT.resume``);
- ``progress``: progress lines of long jobs on stderr;
- ``run_threads``: a chain's runs over a pool of threads;
- ``numba_cache``: the guard against stale numba caches.

Imports only the ``dynamics`` root (and ``hermite``'s activations).
"""

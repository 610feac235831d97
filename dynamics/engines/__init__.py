"""Running a config; the top room (nothing else in ``dynamics`` imports it).

- ``choice``: which engine runs a config (``full``, ``reduced``, ``auto``);
- ``budget``: what a run will cost in memory, before anything is allocated;
- ``resolve``: a run resolved once (instances, engine, checks) before any compute;
- ``engine``: ``simulate(config) -> Trajectory`` and the full batched engine.

Imports ``reduced``, ``setup`` and every room below them.
"""

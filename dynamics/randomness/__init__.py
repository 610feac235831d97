"""The example streams of the engines.

- ``sampling``: one explicitly seeded stream per run (per-run, shared or counter streams);
- ``counter_stream``: counter-based standard normals (``streams = "counter"``);
- ``ziggurat``: the ziggurat of N(0, 1) the samplers share;
- ``chunking``: the full engine's example chunks (torch-free, for the memory budget).

Imports only the ``dynamics`` root.
"""

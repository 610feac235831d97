"""The example streams: Gaussian chunks of the full engine (per-run, shared or counter-based),
the counter stream and the ziggurat sampler the chains share, and the chunk sizes. Imports
only the ``dynamics`` root.
"""

"""What a run measures: overlaps and reduced coordinates, exact losses of any state, the
network loss and the refit second layer. Imports the root, ``randomness``, ``instances``
and ``hermite``.
"""

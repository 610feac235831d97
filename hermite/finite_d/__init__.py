"""Finite-d corrections to the flows.

- ``noise``: one-step noise moments of the projected overlap chain;
- ``corrected_ode``: the noise-corrected map, its noise floor and hitting times;
- ``lna``: the linear-noise-approximation band around it;
- ``stepsize``: the largest η whose noise floor still reaches a target overlap;
- ``stability``: step sizes beyond which the dynamics mean nothing.
- ``linearized_corrected``: the finite-η corrected flow of the rank-1 linearized learner
  (projected û): its O(η²) one-step mean and linear-noise spread.

Imports ``flows``, ``expansion`` and the root.
"""

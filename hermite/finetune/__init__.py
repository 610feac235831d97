"""The joint (û, ĉ) fine-tuning model in every regime (joint ĉ, unprojected û, App. B).

- ``population``: its population ODE and noise-corrected flow;
- ``band``: the linear-noise band with ĉ joint;
- ``escape``: the corrected line's escape from the start (diffusion plus drift);
- ``finite_xi``: fluctuation-corrected flows at finite ξ/√d.

Imports ``finite_d``, ``flows``, ``expansion`` and the root.
"""

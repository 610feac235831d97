"""The joint (û, ĉ) fine-tuning model: its population flow and noise-corrected flow (App. B),
second moments of the sample gradient, bands, the escape line and the finite-ξ ensemble.
Imports ``finite_d``, ``flows``, ``expansion`` and the root.
"""

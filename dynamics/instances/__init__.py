"""The problem instances.

- ``instance``: the rank-1 fine-tuning instance (W, λ, c, ĉ, u, ξ, σ) and its spec file;
- ``lora_instance``: rank-r teachers ΔW = ξ C Uᵀ on top of an instance.

Imports the ``dynamics`` root and ``geometry``.
"""

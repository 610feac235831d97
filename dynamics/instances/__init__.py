"""The problem instances: the rank-1 fine-tuning instance (pre-trained rows W, teacher
W + ξ c uᵀ, its spec file) and the LoRA instance. Imports the root, ``geometry``.
"""

"""The d → ∞ population flows: the overlap ODE of the rank-1 fine-tuning model (§3.1,
Prop. 4), the step-size schedules of Theorems 11–13 and 16, the rank-r matrix ODE and the
linearized (NTK) model. Imports ``expansion`` and the root.
"""

"""The d → ∞ population flows.

- ``ode``: the overlap ODE of rank-1 fine-tuning (§3.1, eq. 6 without noise);
- ``theorems``: the step sizes and horizons of Theorems 11–13 and 16 (App. A.2, C.2);
- ``rank``: rank-r fine-tuning, the r×r overlap's matrix ODE;
- ``linearized``: the linearized (NTK) learner's exact population theory;
- ``regime``: the fine-tuning learner's regime, start and solver settings (frozen objects).
- ``pretrained``: fine-tuning from a pre-trained base w₀ = μu: flow, escape time (issue 39).
- ``lora_ba``: LoRA as practised (W + s·B·A, plain SGD): the population flow of (B, A) (issue 39).
- ``lora_ba_squared``: lora-ba's loss and gradient with labels y = f*² (three-field integrals).
- ``lora_ba_escape``: lora-ba's escape from B = 0: rate, B's noise kick, steps T(d) (issue 39).

Imports ``expansion`` and the root.
"""

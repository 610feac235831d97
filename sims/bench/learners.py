"""Per-learner rows of ``loradyn bench engine``: full-engine run-steps/s of every learner.

Every learner runs the same instance (ReLU, separated W, ξ = 1) at the bench sizes on the
full engine (``FullRun.advance``, sampling included), so the rates compare the learners'
per-step costs: O(d + k²) for rank-1 learners, O(k′d) for networks of rows (scratch,
sparse) and for a full-rank Δ (on CPU a compiled kernel, ``network_kernel``), O(rd) for
rank r. The ``counter streams`` row draws the examples with the counter-based ziggurat
(``dynamics.randomness.counter_stream``) instead of torch's per-run generators.
"""

from __future__ import annotations

from dataclasses import replace

from dynamics.setup.config import RunConfig
from sims.bench.rates import engine_rate

__all__ = ["LEARNER_CASES", "learner_rows"]

# row label → RunConfig overrides (learner and its options)
LEARNER_CASES = {
    "finetune": {"learner": "finetune"},
    "finetune, joint ĉ": {"learner": "finetune", "joint_c": True},
    "linearized (rank 1)": {"learner": "linearized"},
    "linearized (full rank)": {"learner": "linearized", "full_rank": True},
    "scratch": {"learner": "scratch"},
    "scratch, counter streams": {"learner": "scratch", "streams": "counter"},
    "scratch-csq": {"learner": "scratch-csq"},
    "sparse": {"learner": "sparse"},
    "glm": {"learner": "glm"},
    "moment (order 1)": {"learner": "moment"},
    "lora (r = 4)": {"learner": "lora", "rank": 4},
    "lora-ba (r = 4)": {"learner": "lora-ba", "rank": 4},
    "pretrained-glm": {"learner": "pretrained-glm"},
}


def learner_rows(d: int, k: int, runs: int, steps: int, dtype: str, device: str,
                 repeats: int = 1) -> dict:
    """label → best-of-``repeats`` run-steps/s (or the one-line reason a case cannot run)."""
    spec = {"activation": "relu", "k": k, "d": d, "xi": 1.0, "W": "separated", "seed": 0}
    base = RunConfig(instance=spec, eta=0.05 / d, steps=steps, runs=runs, seed=0,
                     checkpoints=2, dtype=dtype, device=device, finite_d_theory=False)
    out: dict[str, float | str] = {}
    for label, overrides in LEARNER_CASES.items():
        config = replace(base, **overrides)
        try:
            config.validate()
            out[label] = max(engine_rate(config) for _ in range(repeats))
        except (ValueError, ImportError, MemoryError, RuntimeError) as exc:
            out[label] = f"not run: {str(exc).splitlines()[0]}"
    return out

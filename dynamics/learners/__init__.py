"""Learners: a state dataclass plus a step (state, examples) → state for R runs at once.

Registry ``LEARNERS`` maps the CLI/config name to the learner class; every learner offers
``from_config(config, problem)``, ``init_state``, ``step``/``step_``, ``sample_gradients``,
``renormalize_`` and the per-run step sizes ``eta_r``/``eta_c_r`` (zeroed to freeze a run).
"""

from .finetune import ExampleTerms, Finetune, FinetuneState
from .problem import Problem, rowmat

LEARNERS = {"finetune": Finetune}


def get_learner(name: str):
    """The learner class registered under ``name`` (ValueError naming the valid ones)."""
    try:
        return LEARNERS[name]
    except KeyError:
        raise ValueError(f"unknown learner {name!r}; valid: {', '.join(LEARNERS)}") from None


__all__ = ["LEARNERS", "get_learner", "Finetune", "FinetuneState", "ExampleTerms", "Problem",
           "rowmat"]

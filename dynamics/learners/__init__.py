"""Learners: a state plus a step (state, examples) → state for R runs at once.

Registry ``LEARNERS`` maps the CLI/config name to the learner class; the protocol the engine
uses is documented in :mod:`.base`.
"""

import importlib

from .base import Learner, RunResult, TensorState, make_trajectory, mask_dead
from .finetune import ExampleTerms, Finetune, FinetuneState
from .problem import Problem, rowmat

# name → (module in this package, class): imported on first use
LEARNERS = {
    "finetune": ("finetune", "Finetune"),
    "linearized": ("linearized", "Linearized"),
    "scratch": ("network", "Scratch"),
    "scratch-csq": ("network", "ScratchCSQ"),
    "sparse": ("network", "Sparse"),
    "glm": ("glm", "GLM"),
    "moment": ("moment", "Moment"),
    "lora": ("lora", "LoRA"),
}


def get_learner(name: str):
    """The learner class registered under ``name`` (ValueError naming the valid ones)."""
    try:
        module, cls = LEARNERS[name]
    except KeyError:
        raise ValueError(f"unknown learner {name!r}; valid: {', '.join(LEARNERS)}") from None
    return getattr(importlib.import_module(f".{module}", __name__), cls)


__all__ = ["LEARNERS", "get_learner", "Learner", "RunResult", "TensorState", "mask_dead",
           "make_trajectory",
           "Finetune", "FinetuneState", "ExampleTerms", "Problem", "rowmat"]

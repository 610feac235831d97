"""Learners: a state plus a step (state, examples) → state for R runs at once.

Registry ``LEARNERS`` maps the CLI/config name to the learner class; the protocol the engine
uses is documented in :mod:`.base`.
"""

from dynamics.learners.base import Learner, RunResult, TensorState, make_trajectory, mask_dead
from dynamics.learners.finetune import ExampleTerms, Finetune, FinetuneState
from dynamics.learners.problem import Problem, rowmat
from dynamics.learners.registry import LEARNERS, get_learner

__all__ = ["LEARNERS", "get_learner", "Learner", "RunResult", "TensorState", "mask_dead",
           "make_trajectory",
           "Finetune", "FinetuneState", "ExampleTerms", "Problem", "rowmat"]

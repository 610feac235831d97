"""Learners: a state plus a step (state, examples) → state for R runs at once.

Registry ``LEARNERS`` maps the CLI/config name to the learner class; the protocol the engine
uses is documented in :mod:`.base`.

Modules: ``base`` (the protocol), ``registry`` (learners by name), ``options`` (each
learner's options), ``problem`` (instances as tensors), ``directions`` (initial û₀),
``given_rows`` (user-given rows); one file per learner: ``finetune``, ``glm`` (with
``glm_map``), ``linearized``, ``lora``, ``lora_ba`` (with ``lora_ba_rows``: given base and
target rows), ``moment``, ``network`` (with its compiled
``network_kernel``), ``pretrained_glm``. Imports ``overlays`` and the rooms below it.
"""

from dynamics.learners.base import Learner, RunResult, TensorState, make_trajectory, mask_dead
from dynamics.learners.finetune import ExampleTerms, Finetune, FinetuneState
from dynamics.learners.problem import Problem, rowmat
from dynamics.learners.registry import LEARNERS, get_learner

__all__ = ["LEARNERS", "get_learner", "Learner", "RunResult", "TensorState", "mask_dead",
           "make_trajectory",
           "Finetune", "FinetuneState", "ExampleTerms", "Problem", "rowmat"]

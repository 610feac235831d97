"""The learners by name: ``LEARNERS`` maps a CLI/config name to (module, class), imported on
first use."""

import importlib

__all__ = ["LEARNERS", "get_learner"]

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
    return getattr(importlib.import_module(f"dynamics.learners.{module}"), cls)

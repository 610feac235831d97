"""The learners by name: ``LEARNERS`` maps a CLI/config name to (module, class), imported on
first use. Adding a learner is its own file in this package plus one line here
(docs/learners.md, "Adding a learner")."""

import importlib

__all__ = ["LEARNERS", "get_learner", "learner_classes", "default_learner", "learns_teacher",
           "runs_convention"]

# name → (module in this package, class): imported on first use. The first learner that
# learns a teacher is the default for it (``default_learner``).
LEARNERS = {
    "finetune": ("finetune", "Finetune"),
    "linearized": ("linearized", "Linearized"),
    "scratch": ("network", "Scratch"),
    "scratch-csq": ("network", "ScratchCSQ"),
    "sparse": ("network", "Sparse"),
    "glm": ("glm", "GLM"),
    "moment": ("moment", "Moment"),
    "lora": ("lora", "LoRA"),
    "pretrained-glm": ("pretrained_glm", "PretrainedGLM"),
    "lora-ba": ("lora_ba", "LoRABA"),
}


def get_learner(name: str):
    """The learner class registered under ``name`` (ValueError naming the valid ones)."""
    try:
        module, cls = LEARNERS[name]
    except KeyError:
        raise ValueError(f"unknown learner {name!r}; valid: {', '.join(LEARNERS)}") from None
    return getattr(importlib.import_module(f"dynamics.learners.{module}"), cls)


def learner_classes() -> list:
    """Every registered learner class, in registry order."""
    return [get_learner(name) for name in LEARNERS]


def learns_teacher(instance) -> list[str]:
    """The learners that learn ``instance``'s teacher (``Learner.teachers``), in order."""
    return [cls.name for cls in learner_classes() if instance.teacher in cls.teachers]


def runs_convention(instance) -> list[str]:
    """The learners that run ``instance``'s row convention (``Learner.conventions``)."""
    return [cls.name for cls in learner_classes() if instance.convention in cls.conventions]


def default_learner(teacher: str = "finetune") -> str:
    """The learner a run of a ``teacher`` instance gets without ``--learner``: the first
    registered that learns it (``finetune``; ``scratch`` for a committee teacher)."""
    for cls in learner_classes():
        if teacher in cls.teachers:
            return cls.name
    raise ValueError(f"no learner learns a {teacher!r} teacher")

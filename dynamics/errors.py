"""Errors of run configurations: one line that names the field (or learner and option)."""

__all__ = ["ConfigError", "ForeignOptionError"]


class ConfigError(ValueError):
    """An invalid run configuration; the message names the field."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"run config: '{field_name}': {problem}")
        self.field = field_name


class ForeignOptionError(ConfigError):
    """An option given to a learner that does not take it."""

    def __init__(self, learner: str, option: str, valid: tuple):
        ValueError.__init__(self, f"run config: learner {learner!r} takes no option {option!r} "
                                  f"(its options: {', '.join(valid) or 'none'})")
        self.field, self.learner = option, learner

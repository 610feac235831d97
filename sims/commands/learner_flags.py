"""``loradyn run``'s learner flags: one per learner option, made from the declarations.

Every option of every learner (``dynamics.learners.options.all_options``) becomes a flag
named after it (``sparse_rows`` → ``--sparse-rows``) whose help is the option's help and the
learners that take it. A bool option is a switch: ``--joint-c`` where it is off by default,
``--project/--no-project`` where it is on. Only the flags typed on the command line reach the
config (:func:`given_options`); one the learner does not take is a one-line error, even at
its default value (``--rank 1`` with ``finetune``).
"""

from __future__ import annotations

import click
from click.core import ParameterSource

from dynamics.learners.options import OptionSpec, all_options

__all__ = ["learner_flags", "option_flags", "given_options", "flag_name"]


def flag_name(name: str) -> str:
    """The flag of option ``name``."""
    return "--" + name.replace("_", "-")


def learner_flags(command):
    """Decorator: add a click option per learner option, in the registry's order."""
    return option_flags(*all_options())(command)


def option_flags(*names: str):
    """Decorator: the flags of the named learner options, as :func:`learner_flags` makes
    them (for commands that take a few of them, e.g. ``loradyn hermite committee``)."""
    specs = [all_options()[name] for name in names]

    def add(command):
        for spec in reversed(specs):  # decorators apply bottom-up
            command = _flag(spec)(command)
        return command

    return add


def _flag(spec: OptionSpec):
    who = "learner" if len(spec.learners) == 1 else "learners"
    flag, help_ = flag_name(spec.name), f"{spec.help} ({who}: {', '.join(spec.learners)})"
    if spec.kind is bool:
        decl = f"{flag}/--no-{flag[2:]}" if spec.default else flag
        return click.option(decl, spec.name, is_flag=True, default=spec.default, help=help_)
    kind = {int: int, float: float, str: str}[spec.kind]
    if spec.choices is not None and kind is str:
        kind = click.Choice(spec.choices)
    elif spec.choices is not None:  # integers: a range
        lo, hi = min(spec.choices), max(spec.choices)
        assert set(spec.choices) == set(range(lo, hi + 1)), spec
        kind = click.IntRange(lo, hi)
    return click.option(flag, spec.name, type=kind, default=spec.default, help=help_,
                        show_default=spec.default is not None)


def given_options(ctx: click.Context, params: dict, learner: str,
                  table: dict | None = None) -> dict:
    """The learner options among ``params`` set on the command line (or by the environment),
    not left at their defaults, over those of ``table`` (a spec's ``[run]`` table); each must
    be one ``learner`` takes, whatever its value."""
    from dynamics.learners.options import option_specs, options_of
    from dynamics.setup.config import LEARNERS, ForeignOptionError

    given = dict(table or {}) | {
        name: value for name, value in params.items() if name in all_options()
        and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)}
    if given and learner in LEARNERS:  # an unknown learner: the config names it
        own = tuple(spec.name for spec in option_specs(options_of(learner)))
        foreign = [name for name in given if name not in own]
        if foreign:
            raise ForeignOptionError(learner, foreign[0], own)
    return given

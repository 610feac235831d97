"""The ``loradyn`` click group. Commands parse options and delegate to library functions."""

from __future__ import annotations

import click

from . import __version__


class LoradynGroup(click.Group):
    """A click group that turns library errors (ValueError, OSError) into one-line errors."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (ValueError, OSError, ArithmeticError) as exc:
            message = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise click.ClickException(message) from None


CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


@click.group(cls=LoradynGroup, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="loradyn")
def cli():
    """loradyn: gradient dynamics of low-rank (LoRA-style) fine-tuning."""


COMMANDS = (
    ("hermite_cmd", "hermite"),
    ("run_cmd", "run"),
    ("show_cmd", "show"),
    ("bench", "bench"),
    ("sweep_cmd", "sweep"),
    ("plot_cmd", "plot"),
    ("scaling_cmd", "scaling"),
    ("reproduce_cmd", "reproduce"),
)


def _register():
    import importlib

    for module, attr in COMMANDS:
        try:  # TEMPORARY during parallel development; made explicit at integration
            mod = importlib.import_module(f"sims.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"sims.{module}":
                raise
            continue
        cli.add_command(getattr(mod, attr))


_register()


def main():  # console-script entry point
    cli()

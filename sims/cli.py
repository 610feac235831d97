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
            raise click.ClickException(str(exc).splitlines()[0] if str(exc) else repr(exc)) from None


CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


@click.group(cls=LoradynGroup, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="loradyn")
def cli():
    """loradyn: gradient dynamics of low-rank (LoRA-style) fine-tuning."""


def _register():
    from .hermite_cmd import hermite

    cli.add_command(hermite)


_register()


def main():  # console-script entry point
    cli()

"""The ``loradyn`` click group. Commands parse options and delegate to library functions."""

from __future__ import annotations

import click

from sims import __version__


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


def _register():
    from sims.commands.bench import bench
    from sims.commands.hermite import hermite
    from sims.commands.plot import plot
    from sims.commands.reproduce import reproduce
    from sims.commands.run import run
    from sims.commands.scaling import scaling
    from sims.commands.show import show
    from sims.commands.sweep import sweep

    for command in (run, show, hermite, sweep, plot, scaling, reproduce, bench):
        cli.add_command(command)


_register()


def main():  # console-script entry point
    cli()

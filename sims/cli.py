"""The ``loradyn`` click group. Commands parse options and delegate to library functions.

Subcommands are imported when they run (``loradyn --help`` imports none of them, so it does
not pay for torch and numba); :data:`COMMANDS` names each one's module and the one-line help
that ``loradyn --help`` lists (tested equal to the command's own short help).
"""

from __future__ import annotations

import importlib

import click

from sims import __version__

COMMANDS = {  # name → (module, attribute, one-line help)
    "bench": ("sims.commands.bench", "bench",
              "Benchmarks (ratios measured within one run; no timing is asserted in tests)."),
    "hermite": ("sims.commands.hermite", "hermite",
                "Exact population theory: μ_p(σ), h(m), the population and committee ODEs."),
    "plot": ("sims.commands.plot", "plot",
             "Plot trajectory files (loradyn run) and sweep files (loradyn sweep)."),
    "reproduce": ("sims.commands.reproduce", "reproduce",
                  "Reproduce the paper's App. B figures (fig1 … fig6), its separation "
                  "and pretraining-hurts."),
    "run": ("sims.commands.run", "run",
            "Simulate online SGD on the instance SPEC (JSON/TOML) and write --out."),
    "scaling": ("sims.commands.scaling", "scaling",
                "Measure hitting times over the d grid of SPEC and fit T ∝ d^b."),
    "show": ("sims.commands.show", "show",
             "Describe FILE: a trajectory file (`loradyn run`), a sweep file (`loradyn "
             "sweep`, `scaling`, `reproduce`) or a separation file (`reproduce "
             "separation`)."),
    "sweep": ("sims.commands.sweep", "sweep",
              "Run (or resume) the sweep described by SPEC (TOML; see docs/sweeps.md)."),
}


class LoradynGroup(click.Group):
    """A click group whose subcommands load on first use, and that turns library errors
    (ValueError, OSError, ArithmeticError) into one-line errors."""

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attribute, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attribute)

    def format_commands(self, ctx, formatter):
        """The command list from :data:`COMMANDS` (no subcommand is imported)."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [(n, _shorten(COMMANDS[n][2], limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (ValueError, OSError, ArithmeticError) as exc:
            message = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise click.ClickException(message) from None


def _shorten(text: str, limit: int) -> str:
    """``text`` cut at a word boundary to at most ``limit`` characters, "..." marking a cut."""
    if len(text) <= limit:
        return text
    return text[: max(limit - 3, 1)].rsplit(" ", 1)[0].rstrip(" ,;:") + "..."


CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


@click.group(cls=LoradynGroup, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="loradyn")
def cli():
    """loradyn: gradient dynamics of low-rank (LoRA-style) fine-tuning."""


def main():  # console-script entry point
    cli()

"""The `dit-accel` command line: one click group, one module per command under `commands/`."""
from __future__ import annotations

import sys

import click

from .errors import UserError


class _Group(click.Group):
    """Turns the errors a user can cause into one line and exit status 2, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dit-accel")
def main() -> None:
    """Profile and accelerate video diffusion-transformer inference."""


def _register_commands() -> None:
    from .commands.bench_attention import bench_attention
    from .commands.generate import generate, make_tiny_pipeline
    from .commands.profile_block import profile_block

    main.add_command(profile_block)
    main.add_command(bench_attention)
    main.add_command(generate)
    main.add_command(make_tiny_pipeline)


_register_commands()

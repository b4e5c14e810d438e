"""The `dit-accel` command line: one click group, one module per command under `commands/`."""
from __future__ import annotations

import sys

import click

from .errors import UserError


def _one_line(exc: click.UsageError) -> str:
    """click's usage errors as one line: `--frames must be at least 1, got 0`."""
    if isinstance(exc, click.BadParameter) and exc.param is not None:
        name = exc.param.opts[0] if getattr(exc.param, "opts", None) else exc.param.human_readable_name
        from .commands.options import OptionError

        if isinstance(exc, OptionError):
            return f"{name} {exc.message}"
        return f"invalid value for {name}: {exc.message}"
    return exc.format_message()


class _Group(click.Group):
    """Turns the errors a user can cause (ours, and click's bad options inside a command) into one
    line and exit status 2, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except click.UsageError as exc:
            click.echo(f"error: {_one_line(exc)}", err=True)
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

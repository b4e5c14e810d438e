"""The `dit-accel` command line: one click group, one module per command under `commands/`.

The group is lazy: `dit-accel --help` lists the commands from their modules' source (the docstring of
each command's function, read with `ast`), and a command's module is imported only when that command
runs or shows its own help. So `--help` costs click and nothing else, and torch and diffusers load
for the command that needs them, through `quiet.quiet_import` (their import-time noise dropped).

Everything a user can cause ends as one line on stderr and an exit status, never a traceback: our
`UserError` and click's usage errors (`error: ...`, status 2), Ctrl-C (`interrupted`, 130) and SIGTERM
(`terminated`, 143). Both signals unwind the command as an exception, so a staged run folder is removed
(`run_dir.StagedRun`).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import click

from .errors import Terminated, UserError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


@dataclass(frozen=True)
class LazyCommand:
    """Where a command lives: `dit_accel.commands.<module>.<function>` (a click command), the noisy
    third-party modules it uses later on, imported quietly before it runs (`quiet`), and `precheck`: a
    function of the same module called with the command's arguments before those imports, for the
    mistakes a user makes most that need no torch (a wrong path), so they cost a second, not the imports."""

    module: str
    function: str
    preload: tuple[str, ...] = ()
    precheck: str | None = None

    @property
    def module_path(self) -> str:
        return f"{__package__}.commands.{self.module}"

    def exists(self) -> bool:
        """False while the module is not written yet (a command listed ahead of its file)."""
        return importlib.util.find_spec(self.module_path) is not None


# diffusers' package import is lazy: its models (and with them torchao, when installed) load on first use.
_DIFFUSERS = ("diffusers.models.modeling_utils",)
_PLOTS = ("matplotlib.pyplot",)  # imported at plot time, by the library; its font-cache notice is noise
COMMANDS: dict[str, LazyCommand] = {
    "bench-attention": LazyCommand("bench_attention", "bench_attention", preload=_PLOTS),
    "compare": LazyCommand("compare", "compare"),
    "generate": LazyCommand("generate", "generate", preload=_DIFFUSERS, precheck="precheck"),
    "make-tiny-pipeline": LazyCommand("generate", "make_tiny_pipeline", preload=_DIFFUSERS),
    "models": LazyCommand("models", "models", preload=_DIFFUSERS),
    "plan": LazyCommand("plan", "plan", precheck="precheck"),
    "profile-block": LazyCommand("profile_block", "profile_block", preload=(*_DIFFUSERS, *_PLOTS),
                                 precheck="precheck"),
}


def _one_line(exc: click.UsageError) -> str:
    """click's usage errors as one line: `--frames must be at least 1, got 0`."""
    if isinstance(exc, click.BadParameter) and exc.param is not None:
        name = exc.param.opts[0] if getattr(exc.param, "opts", None) else exc.param.human_readable_name
        from .commands.options import OptionError

        if isinstance(exc, OptionError):
            return f"{name} {exc.message}"
        return f"invalid value for {name}: {exc.message}"
    return exc.format_message()


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread while a command runs (Ctrl-C already raises
    KeyboardInterrupt); the previous handler comes back afterwards (a test runner's, say)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _short_help_from_source(entry: LazyCommand, limit: int) -> str:
    """What click would show for the command in `dit-accel --help`, read from the module's source
    without importing it: the `short_help=` or `help=` of its `@click.command(...)`, else its docstring."""
    try:
        tree = ast.parse(Path(importlib.util.find_spec(entry.module_path).origin).read_text())
    except (OSError, SyntaxError, ValueError):
        return ""  # the module will say what is wrong with it when the command is used
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == entry.function:
            texts = {"help": ast.get_docstring(node, clean=False)}
            for decorator in node.decorator_list:
                called = getattr(decorator, "func", None)
                if getattr(called, "attr", getattr(called, "id", None)) not in ("command", "group"):
                    continue  # an option's help= is not the command's
                for keyword in decorator.keywords:
                    if keyword.arg in ("help", "short_help") and isinstance(keyword.value, ast.Constant):
                        texts[keyword.arg] = keyword.value.value
            return click.Command(entry.function, help=texts["help"],
                                 short_help=texts.get("short_help")).get_short_help_str(limit)
    return ""


class _Group(click.Group):
    """The lazy group (see the module docstring). Turns the errors a user can cause (ours, and click's
    bad options inside a command) into one line and exit status 2, never a traceback; Ctrl-C into
    `interrupted` and 130, SIGTERM into `terminated` and 143."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name, entry in COMMANDS.items() if entry.exists())

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        entry = COMMANDS.get(name)
        if entry is None or not entry.exists():
            return None
        from .quiet import quiet_imports

        with quiet_imports():
            module = importlib.import_module(entry.module_path)
        command = getattr(module, entry.function)
        if not getattr(command.callback, "_dit_accel_quiet", False):
            precheck = getattr(module, entry.precheck) if entry.precheck else None
            command.callback = _quietly(command.callback, entry.preload, precheck)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, _short_help_from_source(COMMANDS[name], limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            with _sigterm_unwinds():
                return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USER_ERROR)
        except click.UsageError as exc:
            click.echo(f"error: {_one_line(exc)}", err=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)  # after the terminal's ^C
            sys.exit(EXIT_INTERRUPTED)
        except Terminated:
            click.echo("terminated", err=True)
            sys.exit(EXIT_TERMINATED)


def _quietly(callback, preload: tuple[str, ...], precheck=None):
    """The command's callback as the CLI runs it: its `precheck` first, then the `preload` modules imported
    quietly (when the command runs, not for its --help), and the run inside `quiet.quiet_run`."""
    from .quiet import quiet_import, quiet_run

    @functools.wraps(callback)
    def run(*args, **kwargs):
        if precheck is not None:
            precheck(**kwargs)
        quiet_import(*preload)
        with quiet_run():
            return callback(*args, **kwargs)

    run._dit_accel_quiet = True
    return run


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dit-accel")
def main() -> None:
    """Profile and accelerate video diffusion-transformer inference."""

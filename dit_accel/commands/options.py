"""Click parameter types the commands share. A bad value fails with `OptionError`, whose message is
written to follow the option's name: the CLI prints `error: --frames must be at least 1, got 0`,
one line, exit status 2 (see `cli._Group`)."""
from __future__ import annotations

from dataclasses import dataclass

import click
import torch

from ..patching.recipe import Recipe, parse_recipe, parse_recipe_list, vocabulary_help
from ..device import parse_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class OptionError(click.BadParameter):
    """A bad option value; the message reads after the option's name ("must be at least 1, got 0")."""


class AtLeast(click.IntRange):
    """An integer >= minimum."""

    def __init__(self, minimum: int):
        super().__init__(min=minimum)

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            raise OptionError(f"must be at least {self.min}, got {value}", ctx=ctx, param=param) from None


class DtypeChoice(click.Choice):
    """bf16 | fp16 | fp32 (or a subset), converted to the torch dtype."""

    name = "dtype"

    def __init__(self, names: tuple[str, ...] = tuple(DTYPES)):
        super().__init__(list(names))

    def convert(self, value, param, ctx):
        if isinstance(value, torch.dtype):
            return value
        if value not in self.choices:
            raise OptionError(f"has an unsupported dtype {value!r}; use {', '.join(self.choices)}", ctx=ctx, param=param)
        return DTYPES[value]


@dataclass(frozen=True)
class MemoryBudget:
    text: str  # as written, for messages: "16GiB"
    nbytes: int


class MemorySize(click.ParamType):
    """'16GiB', '800MB', '1.5 GiB' -> MemoryBudget (device.parse_bytes says what it reads)."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, MemoryBudget):
            return value
        return MemoryBudget(value, parse_bytes(value))


class RecipeParam(click.ParamType):
    """One attention name of the shared vocabulary (`attention.names`), or a comma-separated list."""

    name = "attention"

    def __init__(self, *, many: bool = False, allow_options: bool = True):
        self.many = many
        self.allow_options = allow_options

    def convert(self, value, param, ctx):
        if isinstance(value, (Recipe, list)):
            return value
        if self.many:
            return parse_recipe_list(value, allow_options=self.allow_options)
        return parse_recipe(value, allow_options=self.allow_options)


ATTENTION_HELP = vocabulary_help()


def linear_option():
    return click.option("--linear", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
                        help="fp8: the large linear layers in FP8 through torchao (dynamic per-row activation "
                             "scales; needs an sm_89+ GPU, bf16 and pip install 'dit-accel[fp8]'); the same as "
                             "adding +fp8-linear to every attention name.")


def compile_option():
    return click.option("--compile", "compile_mode", type=click.Choice(["default", "max-autotune"]), default=None,
                        is_flag=False, flag_value="default",
                        help="torch.compile (inductor) the block / the pipeline's transformers: --compile for mode "
                             "default, --compile max-autotune; the same as adding +compile / +max-autotune to every "
                             "attention name. Compile time is reported apart from the timings.")

"""Click parameter types the commands share. A bad value fails with `OptionError`, whose message is
written to follow the option's name: the CLI prints `error: --frames must be at least 1, got 0`,
one line, exit status 2 (see `cli._Group`).

This module imports neither torch nor the registries: every command's --help reads it, and
`dit-accel CMD --help` must not pay for torch. The names of the families, attention backends and stages are read
from the registries' source (`declared`); values are converted (and torch imported) when a command runs.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import click

from ..declared import backend_names, family_names, stage_keys
from ..patching.recipe import vocabulary_help
from ..patching.step_cache import CACHE_METHODS

DTYPE_CHOICES = ("bf16", "fp16", "fp32")
MODEL_FAMILIES = family_names()  # adapters.FAMILIES', in its order
DEFAULT_FAMILY = MODEL_FAMILIES[0]


def _library(name: str) -> ModuleType:
    """`name` imported inside `quiet.quiet_imports` (its noise dropped, a Ctrl-C held until it ends):
    click converts option values before the command runs, so this is where torch is first imported."""
    from ..quiet import quiet_imports

    with quiet_imports():
        return importlib.import_module(name)


def torch_dtype(name: str):
    """'bf16' -> torch.bfloat16 (torch imported on use)."""
    torch = _library("torch")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def __getattr__(name: str):
    """DTYPES (name -> torch dtype) and DTYPE_NAMES (its inverse), built on first use (torch is imported then)."""
    if name == "DTYPES":
        return {choice: torch_dtype(choice) for choice in DTYPE_CHOICES}
    if name == "DTYPE_NAMES":
        return {torch_dtype(choice): choice for choice in DTYPE_CHOICES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class OptionError(click.BadParameter):
    """A bad option value; the message reads after the option's name ("must be at least 1, got 0")."""


class AtLeast(click.IntRange):
    """An integer >= minimum (and <= maximum, given one; `bounds` says both in the error, e.g. "at least 1")."""

    def __init__(self, minimum: int, maximum: int | None = None, bounds: str | None = None):
        super().__init__(min=minimum, max=maximum)
        self.bounds = bounds or f"at least {minimum}"

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            raise OptionError(f"must be {self.bounds}, got {value}", ctx=ctx, param=param) from None


class Seed(AtLeast):
    """A seed torch's generators take: an integer from 0 to 2^64 - 1 (a larger one overflows inside torch)."""

    name = "seed"

    def __init__(self):
        super().__init__(0, 2**64 - 1, "an integer from 0 to 2^64 - 1")


class FiniteFloat(click.ParamType):
    """A finite number >= minimum (nan and inf refused: they would reach the arithmetic unnoticed)."""

    name = "number"

    def __init__(self, minimum: float):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        import math

        try:
            number = float(value)
        except (TypeError, ValueError):
            raise OptionError(f"must be a number, got {value!r}", ctx=ctx, param=param) from None
        if not math.isfinite(number) or number < self.minimum:
            raise OptionError(f"must be a finite number of at least {self.minimum:g}, got {value}", ctx=ctx,
                              param=param)
        return number


class DtypeChoice(click.Choice):
    """bf16 | fp16 | fp32 (or a subset), converted to the torch dtype."""

    name = "dtype"

    def __init__(self, names: tuple[str, ...] = DTYPE_CHOICES):
        super().__init__(list(names))

    def convert(self, value, param, ctx):
        torch = _library("torch")
        if isinstance(value, torch.dtype):
            return value
        if value not in self.choices:
            raise OptionError(f"has an unsupported dtype {value!r}; use {', '.join(self.choices)}", ctx=ctx,
                              param=param)
        return torch_dtype(value)


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
        return MemoryBudget(value, _library("dit_accel.device").parse_bytes(value))


class RecipeParam(click.ParamType):
    """One attention name of the shared vocabulary (`patching.recipe`), or a comma-separated list."""

    name = "attention"

    def __init__(self, *, many: bool = False, allow_options: bool = True):
        self.many = many
        self.allow_options = allow_options

    def convert(self, value, param, ctx):
        recipe = _library("dit_accel.patching.recipe")
        if isinstance(value, (recipe.Recipe, list)):
            return value
        if self.many:
            return recipe.parse_recipe_list(value, allow_options=self.allow_options)
        return recipe.parse_recipe(value, allow_options=self.allow_options)


class CacheParam(click.ParamType):
    """A step cache as a recipe's cache= part writes it (`patching.step_cache.parse_cache`): METHOD[:PARAMS]."""

    name = "cache"

    def convert(self, value, param, ctx):
        step_cache = _library("dit_accel.patching.step_cache")
        return value if isinstance(value, step_cache.CacheSpec) else step_cache.parse_cache(value)


ATTENTION_BACKENDS = backend_names()  # attention.backends.BACKENDS', in its order
ATTENTION_HELP = vocabulary_help()
# The step caches a transformer's passes run by themselves, no pipeline (profile-block --validate model --cache).
MODEL_CACHE_HELP = "; ".join(f"{m.usage} ({m.title})" for m in CACHE_METHODS.values() if m.runs_on_a_model)


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


def skip_crossover_option():
    return click.option("--skip-crossover", is_flag=True,
                        help="On a GPU with no attention crossover data for our FP8 kernel (none shipped for it, none "
                             "measured on this machine), do not measure it (about 30 s, once per GPU, torch, cuDNN and "
                             "kernel version, then cached): the router then follows the conservative rule (our kernel "
                             "serves long calls only) and `plan` estimates FP8 attention.")


STAGE_CHOICES = stage_keys()  # adapters.stage_specs.STAGE_KEYS


class StageList(click.ParamType):
    """'vae,audio', 'all' -> ("vae", "audio") in pipeline order (text, vae, audio)."""

    name = "stages"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        names = [n.strip() for n in value.split(",") if n.strip()]
        if names == ["all"]:
            return STAGE_CHOICES
        unknown = [n for n in names if n not in STAGE_CHOICES]
        if unknown or not names:
            raise OptionError(f"takes a comma-separated list of {', '.join(STAGE_CHOICES)} or all, got {value!r}",
                              ctx=ctx, param=param)
        return tuple(n for n in STAGE_CHOICES if n in names)

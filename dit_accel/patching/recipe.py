"""The one vocabulary of what to run a model with: the names `--attn` / `--compare-attn` take in
profile-block and generate, and `--backends` in bench-attention.

    NAME[+rope | +prologue][+fp8-linear][+compile | +max-autotune][+cache=METHOD[:PARAMS]]

NAME is an attention backend of `attention.backends.BACKENDS` (`vocabulary_help()` lists them, as every command's
--help does) or an alias:
  - `bf16`: generate's historic name for the model's own attention, left as it is; it means
    `native` (diffusers' default: torch SDPA, which picks its kernel) and is reported as typed.
Options (in any order; they apply to models, so bench-attention, which times attention alone,
takes none):
  - `+rope`: the fused RoPE Triton kernel swapped into MiniMax-H3's attention (`patching.rope`);
  - `+prologue` (with fp8 or fp8-v1): MiniMax-H3's QK-norm and RoPE computed inside the FP8
    attention's prep (`patching.prologue`), which then reads the raw projections;
  - `+fp8-linear`: the block's large linear layers in FP8 through torchao (`patching.fp8_linear`);
  - `+compile` / `+max-autotune`: the block (or the pipeline's transformers) compiled by
    torch.compile with inductor, mode "default" or "max-autotune";
  - `+cache=METHOD[:PARAMS]`: a step cache of diffusers on the pipeline's transformers (`patching.step_cache`:
    fbc, taylorseer, mag, pab, faster), which reuses work across denoising steps; generate only.
`--linear fp8` and `--compile [MODE]` add the same options to every name of a run.

Kernel variants behind the fp8 names: `fp8` picks the sm_90 wgmma kernel on sm_90 and the v1
mma.sync kernel elsewhere; `fp8-v1` forces v1 (the kernels' own names are "sm90" and "mma_sync").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..declared import backend_names
from ..errors import UserError
from .step_cache import CacheSpec, cache_help, parse_cache

ALIASES = {"bf16": "native"}
COMPILE_MODES = {"compile": "default", "max-autotune": "max-autotune"}  # option -> torch.compile mode
OPTIONS = ("rope", "prologue", "fp8-linear", *COMPILE_MODES)
CACHE_PREFIX = "cache="  # +cache=METHOD[:PARAMS]: a step cache (`step_cache.parse_cache` reads what follows)
PROLOGUE_BACKENDS = ("fp8", "fp8-v1")  # the backends whose op takes the fused prologue


@dataclass(frozen=True)
class Recipe:
    """One parsed name. label: as written, options in canonical order (reports and file names use
    it); backend: the attention registry name it resolves to; the options as fields."""

    label: str
    backend: str
    fused_rope: bool = False
    fp8_linear: bool = False
    compile_mode: str | None = None  # torch.compile mode, None for eager
    fused_prologue: bool = False
    cache: CacheSpec | None = None  # a step cache (`+cache=...`), None for none

    @property
    def is_default(self) -> bool:
        """The model's own attention, nothing swapped in (generate leaves such a model unpatched)."""
        return self.backend == "native" and not (self.fused_rope or self.fused_prologue or self.fp8_linear
                                                 or self.compile_mode or self.cache)

    def with_options(self, *, fp8_linear: bool = False, compile_mode: str | None = None) -> "Recipe":
        """This recipe with the run-wide `--linear fp8` / `--compile MODE` added (the label says so); a UserError
        when `--compile MODE` would change the mode the recipe names."""
        if compile_mode and self.compile_mode and compile_mode != self.compile_mode:
            written = next(o for o, mode in COMPILE_MODES.items() if mode == compile_mode)
            raise UserError(f"{self.label} compiles already, in mode {self.compile_mode}, and --compile asks for "
                            f"{compile_mode}: keep one (+{written} in the recipe instead, or drop --compile)")
        recipe = dataclasses.replace(self, fp8_linear=self.fp8_linear or fp8_linear,
                                     compile_mode=self.compile_mode or compile_mode)
        return recipe if recipe == self else dataclasses.replace(recipe, label=_label(recipe, self.label))


def _label(recipe: Recipe, written: str) -> str:
    name = written.partition("+")[0]
    options = [option for option, on in (("rope", recipe.fused_rope), ("prologue", recipe.fused_prologue),
                                         ("fp8-linear", recipe.fp8_linear)) if on]
    if recipe.compile_mode:
        options.append(next(o for o, mode in COMPILE_MODES.items() if mode == recipe.compile_mode))
    if recipe.cache:
        options.append(recipe.cache.label)
    return "+".join([name, *options])


def parse_recipe(text: str, *, allow_options: bool = True) -> Recipe:
    """'fp8+rope' -> Recipe('fp8+rope', 'fp8', fused_rope=True); a UserError naming what is known."""
    if not isinstance(text, str):
        raise UserError(f"a recipe is a name such as 'fp8+fp8-linear+compile', not {type(text).__name__} {text!r}")
    written = text.strip()
    name, *options = written.split("+")
    caches = [parse_cache(option.removeprefix(CACHE_PREFIX)) for option in options if option.startswith(CACHE_PREFIX)]
    options = [option for option in options if not option.startswith(CACHE_PREFIX)]
    for option in options:
        if option not in OPTIONS:
            raise UserError(f"unknown option '+{option}' in {written!r}: the options are +rope (fused RoPE), +prologue "
                            "(QK-norm and RoPE in the FP8 prep), +fp8-linear (FP8 linears), +compile and +max-autotune "
                            "(torch.compile), +cache=METHOD (a step cache)")
    if len(caches) > 1:
        raise UserError(f"{written!r} names {len(caches)} step caches; keep one +cache=...")
    repeated = sorted({option for option in options if options.count(option) > 1})
    if repeated:
        raise UserError(f"{written!r} names {', '.join('+' + o for o in repeated)} more than once; name each option "
                        f"once")
    if (options or caches) and not allow_options:
        raise UserError(f"{written!r}: options swap things into a model; bench-attention times attention alone, "
                        f"so name the backend without them ({name})")
    modes = [COMPILE_MODES[o] for o in options if o in COMPILE_MODES]
    if len(modes) > 1:
        raise UserError(f"{written!r} names two compile modes; keep one of +compile, +max-autotune")
    backend = ALIASES.get(name, name)
    from ..attention.backends import get_backend  # torch: the vocabulary and its help load without it

    get_backend(backend)  # unknown names: one line listing the known ones
    if "prologue" in options and "rope" in options:
        raise UserError(f"{written!r}: +prologue already computes the RoPE inside the FP8 prep; drop +rope")
    if "prologue" in options and backend not in PROLOGUE_BACKENDS:
        raise UserError(f"{written!r}: +prologue feeds QK-norm and RoPE to our FP8 attention's prep, so it needs "
                        f"{' or '.join(PROLOGUE_BACKENDS)}, not {backend}")
    recipe = Recipe(written, backend, "rope" in options, "fp8-linear" in options, modes[0] if modes else None,
                    fused_prologue="prologue" in options, cache=caches[0] if caches else None)
    return dataclasses.replace(recipe, label=_label(recipe, written))


def parse_recipe_list(text: str, *, allow_options: bool = True) -> list[Recipe]:
    """'cudnn, fp8,fp8+rope' -> three recipes, in order; empty entries are skipped."""
    recipes = [parse_recipe(part, allow_options=allow_options) for part in text.split(",") if part.strip()]
    if not recipes:
        raise UserError("no attention backend named; write e.g. cudnn,fp8")
    return recipes


def vocabulary_help() -> str:
    """One line for --help: the names and the options."""
    aliases = ", ".join(f"{alias} (= {name})" for alias, name in ALIASES.items())
    return (f"{', '.join(backend_names())}; alias {aliases}; options {', '.join('+' + o for o in OPTIONS)} "
            f"(fused RoPE or QK-norm + RoPE in the FP8 prep for MiniMax-H3, torchao FP8 linears, torch.compile), "
            f"+cache=METHOD (generate: a step cache, {cache_help()})")


def check_recipes(recipes, device, dtype, adapter=None) -> None:
    """A UserError before anything is loaded when a recipe cannot run on `device` in `dtype` (or, given
    the model family's `adapter`, on its blocks: the fused RoPE and prologue serve MiniMax-H3 only)."""
    from ..attention.backends import get_backend

    for recipe in recipes:
        if recipe.cache is not None and adapter is not None:
            raise UserError(f"{recipe.label}: +{recipe.cache.label} reuses work across the denoising steps of a whole "
                            f"pipeline; profile-block times one block of one pass, so run it with dit-accel generate "
                            f"(and predict it with dit-accel plan RUN --cache {recipe.cache.written})")
        for option, on in (("rope", recipe.fused_rope), ("prologue", recipe.fused_prologue)):
            if on and adapter is not None and not adapter.fused_rope_supported:
                raise UserError(f"{recipe.label}: +{option} serves MiniMax-H3's attention processor, which "
                                f"{adapter.display_name} blocks do not use; drop +{option}")
        backend = get_backend(recipe.backend)
        reason = backend.unavailable_reason(device)
        if reason is not None and not recipe.is_default:
            raise UserError(f"attention backend {recipe.backend!r} is unavailable here: {reason}")
        if recipe.fp8_linear:
            from .fp8_linear import fp8_linear_unavailable_reason

            reason = fp8_linear_unavailable_reason(device, dtype)
            if reason is not None:
                raise UserError(f"{recipe.label}: {reason}")

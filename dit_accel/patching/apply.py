"""`apply_recipe`: what a recipe (`patching.recipe`) swaps into a block, a model or a pipeline, undone together.

    with apply_recipe(pipe, parse_recipe("fp8+rope+fp8-linear")) as applied:
        video = pipe(prompt, callback_on_step_end=applied.step_callback).frames
    print(applied.summary(), applied.notes())

The one place a recipe is applied: profile-block runs its blocks under it, generate its pipelines. In order:
the attention backend (`patch_attention`; the model's own attention, `native` with no option, is left
alone), the fused RoPE (`+rope`) or the fused prologue (`+prologue`), FP8 linears (`+fp8-linear`: torchao,
the bf16 weights kept and put back on exit), a step cache (`+cache=...`: diffusers' hooks on each transformer,
`step_cache`; a pipeline's only, since it works across denoising steps), torch.compile (`+compile`,
`+max-autotune`: last, so the compiled code holds the cache's hooks). On exit, even
by an exception, every swap is undone in reverse order; a model compiled here is uncompiled (and dynamo's
caches, which hold the compiled graphs and with them their weights, are dropped) unless `keep_compiled`,
which generate asks for so that its warm-up call's compile serves the timed call. A block stack (an
nn.ModuleList, what profile-block's --validate pass patches) is compiled block by block, and streamed blocks in
their own forward, inside diffusers' offload hooks (`_compile`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from ..errors import UserError
from .attention_patch import AttentionPatch, denoisers, patch_attention
from .fp8_linear import Fp8LinearSwap, quantize_linears
from .prologue import FusedPrologue, fused_prologue
from .recipe import Recipe, parse_recipe
from .rope import FusedRope, fused_rope
from .step_cache import AppliedCache, apply_step_cache

if TYPE_CHECKING:
    from ..adapters import BlockAdapter


@dataclass(eq=False)
class AppliedRecipe:
    """A recipe live on its target: each swap's handle (None where the recipe has no such option), the
    models it went into, and what a report says of it."""

    recipe: Recipe
    models: list[nn.Module]  # the target itself, or a pipeline's transformer(s)
    attention: AttentionPatch | None = None
    rope: FusedRope | None = None
    prologue: FusedPrologue | None = None
    linears: list[Fp8LinearSwap] = field(default_factory=list)  # one per model and block stack
    caches: list[AppliedCache] = field(default_factory=list)  # one per transformer of the pipeline
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def step_callback(self, pipeline: Any, step_index: int, timestep: Any, callback_kwargs: dict) -> dict:
        """diffusers `callback_on_step_end`: advances the attention patch's step (kept steps) and records what the
        step cache ran in the step."""
        for cache in self.caches:
            cache.step_done()
        if self.attention is None:
            return callback_kwargs
        return self.attention.step_callback(pipeline, step_index, timestep, callback_kwargs)

    def summary(self) -> dict[str, Any]:
        """Where the calls went: the attention patch's summary, with the RoPE, prologue and FP8-linear swaps'."""
        summary = self.attention.summary() if self.attention is not None else {"backend": self.recipe.backend,
                                                                               "counted": False}
        if self.rope is not None:
            summary["rope"] = self.rope.summary()
        if self.prologue is not None:
            summary["prologue"] = self.prologue.summary()
        if self.linears:
            summary["fp8_linears"] = [swap.as_dict() for swap in self.linears]
        if self.caches:
            summary["step_cache"] = [cache.summary() for cache in self.caches]
        return summary

    def notes(self) -> list[str]:
        """What a user should know of the calls so far: attention calls routed by the measured crossover or
        fallen back (by reason), RoPE or prologue calls that ran diffusers' own code, and the fused RoPE
        under compile (inductor fuses diffusers' own RoPE there)."""
        label, notes = self.recipe.label, []
        if self.attention is not None and self.attention.routed:
            calls = self.attention.summary()["fallback_calls"]
            routed_away = {r: n for r, n in calls.items() if r.startswith("routed:")}
            fell_back = {r: n for r, n in calls.items() if r not in routed_away}
            if routed_away:
                notes.append(f"{sum(routed_away.values())} attention call(s) of {label} went to the backend the "
                             f"measured crossover found faster at their shape "
                             f"({'; '.join(self.attention.summary()['crossover'])}): {routed_away}")
            if fell_back:
                notes.append(f"{sum(fell_back.values())} attention call(s) fell back from {self.recipe.backend}: "
                             f"{fell_back}")
        for swap, what in ((self.rope, "RoPE call(s) of {} ran diffusers' own function, not the fused kernel"),
                           (self.prologue, "attention call(s) of {} ran diffusers' own processor, not the fused "
                                           "prologue")):
            declined = {} if swap is None else {r: n for r, n in swap.fallback_calls.items()
                                                if not r.startswith("routed:")}  # those are the attention's note
            if declined:
                notes.append(f"{sum(declined.values())} {what.format(label)}: {declined}")
        if self.recipe.fused_rope and self.recipe.compile_mode is not None:
            notes.append(f"{label}: inside the compiled graph RoPE is diffusers' own function, fused by inductor "
                         f"into its neighbours, not our RoPE kernel")
        return notes

    def unpatch(self) -> None:
        """Undo every swap, last first; a second call does nothing."""
        while self._undo:
            self._undo.pop()()


@contextlib.contextmanager
def apply_recipe(target: Any, recipe: Recipe | str, *, adapter: BlockAdapter | None = None,
                 keep_compiled: bool = False, steps: int | None = None,
                 mag_ratios: list[float] | None = None) -> Iterator[AppliedRecipe]:
    """`recipe` (a Recipe, or its name: "fp8+fp8-linear+compile") live on `target` (a block, a model or a pipeline;
    a pipeline's transformers are patched) for the `with` body. `adapter`: the model family, needed for FP8 linears
    on a block (a whole diffusers model names its own family in its config). For a step cache: `steps`, the
    denoising steps the call runs (MagCache interpolates its ratios to them), and `mag_ratios` (MagCache's,
    measured with `+cache=mag:calibrate`)."""
    recipe = recipe if isinstance(recipe, Recipe) else parse_recipe(recipe)
    applied = AppliedRecipe(recipe, denoisers(target))
    try:
        if not recipe.is_default:
            applied.attention = patch_attention(target, recipe.backend)
            applied._undo.append(applied.attention.unpatch)
        if recipe.fused_rope:
            applied.rope = fused_rope(target)
            applied._undo.append(applied.rope.unpatch)
        if recipe.fused_prologue:
            applied.prologue = fused_prologue(target)
            applied._undo.append(applied.prologue.unpatch)
        if recipe.fp8_linear:
            for model in applied.models:
                for swap in _quantize(model, adapter):
                    applied.linears.append(swap)
                    applied._undo.append(swap.restore)
        if recipe.cache is not None:
            timestep = (lambda: target.current_timestep) if hasattr(type(target), "current_timestep") else None
            for model in applied.models:
                try:
                    family = _family_of(model)
                except UserError:  # a diffusers transformer of no family we serve: the cache derives what it needs
                    family = None
                cache = apply_step_cache(model, recipe.cache, steps=steps, timestep=timestep, mag_ratios=mag_ratios,
                                         what=family.display_name if family else type(model).__name__,
                                         passes_per_step=family.passes_per_step if family else None,
                                         pipeline=None if isinstance(target, nn.Module) else target)
                applied.caches.append(cache)
                applied._undo.append(cache.undo)
        if recipe.compile_mode is not None:
            compiled, own = _compile(applied.models, recipe.compile_mode)
            if (compiled or own) and not keep_compiled:
                applied._undo.append(lambda: _uncompile(compiled, own))
        yield applied
    finally:
        applied.unpatch()


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process, from dynamo's counters (process-wide: count a
    stretch of work as the difference)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def compile_failures_as_user_errors(what: str, hint: str) -> Iterator[None]:
    """torch.compile failing in the body (dynamo or inductor: e.g. a library's tensor subclass this torch cannot
    trace) as one UserError line: what failed, the error's first line, and `hint`."""
    from torch._dynamo.exc import TorchDynamoException

    from ..errors import first_line

    try:
        yield
    except TorchDynamoException as exc:
        cause = getattr(exc, "inner_exception", None) or exc  # a backend's failure: what the backend raised
        raise UserError(f"{what}: torch {torch.__version__} could not compile it ({type(cause).__name__}: "
                        f"{first_line(cause)}); {hint}") from exc


def _quantize(model: nn.Module, adapter: BlockAdapter | None) -> list[Fp8LinearSwap]:
    """The model's large linears in FP8 by its family's rule, the bf16 weights kept to be put back: a block's
    (with `adapter`), or a whole diffusers model's block linears, stack by stack (its family from its config)."""
    from diffusers import ModelMixin

    if isinstance(model, ModelMixin):
        adapter = adapter or _family_of(model)
        return [quantize_linears(model, adapter.for_stack(stack), keep_original=True,
                                 prefix=adapter.for_stack(stack).block_key_template.format(index="*"))
                for stack, _ in adapter.stacks]
    if adapter is None:
        raise ValueError("FP8 linears on a bare block need its family's adapter")
    return [quantize_linears(model, adapter, keep_original=True)]


def _family_of(model: nn.Module) -> BlockAdapter | None:
    """The family adapter of a whole diffusers transformer, from its config (None for anything else). UserError for a
    diffusers model of no served family."""
    from diffusers import ModelMixin

    if not isinstance(model, ModelMixin):
        return None
    from ..adapters import adapter_for_config

    name = type(model).__name__  # a model built in code has no `_class_name` in its config
    return adapter_for_config({**model.config, "_class_name": name}, name)


def _compile(models: list[nn.Module], mode: str) -> tuple[list[nn.Module], list]:
    """torch.compile on `models`, what is not compiled yet (what generate compiled on an earlier call stays so): a
    block stack (an nn.ModuleList) block by block, as diffusers' regional compilation does (blocks of one class
    share their compiled code); streamed blocks (inside a model or a stack) in their own forward, inside diffusers'
    offload hooks (`offload.OwnForward` says why), and the rest of a model with streamed blocks eager; any other
    model whole. Returns (the modules compiled whole, the `OwnForward`s compiled)."""
    from ..loading.offload import own_forwards

    whole, own = [], []
    for target in (module for model in models for module in (model if isinstance(model, nn.ModuleList) else [model])):
        streamed = own_forwards(target)
        if streamed:
            own += [forward for forward in streamed if not forward.compiled]
        elif target._compiled_call_impl is None:
            whole.append(target)
    for module in whole:
        module._compiled_call_impl = _compiled(module._call_impl, mode)  # what nn.Module.compile sets
    for forward in own:
        forward.call = _compiled(forward.eager, mode)
    return whole, own


def _compiled(fn, mode: str):
    """torch.compile(fn), traced with data-dependent output shapes in the graph. Mochi's processor finds each
    sample's text rows with torch.nonzero in a loop: a graph break there makes dynamo run the processor eager and
    trace its linears as frames of their own, where torch 2.11 cannot trace torchao's FP8 weights
    (`InternalTorchDynamoError: Polyfill handler ... __eq__`; 2.13 can), and leaves its norms and RoPE uncompiled."""
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)(torch.compile(fn, mode=mode))


def drop_compiled(target: Any) -> None:
    """What an earlier `keep_compiled` left compiled on `target` (a model or a pipeline) taken off, dynamo's caches
    with it: the next recipe compiles afresh, as in a process of its own (generate runs several recipes in one;
    kept, each would recompile the same frames under new guards, toward dynamo's recompile limit)."""
    from ..loading.offload import own_forwards

    modules = [m for model in denoisers(target) for m in (model if isinstance(model, nn.ModuleList) else [model])]
    _uncompile([m for m in modules if m._compiled_call_impl is not None],
               [forward for m in modules for forward in own_forwards(m) if forward.compiled])


def _uncompile(modules: list[nn.Module], own: list) -> None:
    """Back to the eager modules and forwards; dynamo's caches hold the compiled graphs (and with them the weights):
    dropped."""
    for module in modules:
        module._compiled_call_impl = None
    for forward in own:
        forward.call = forward.eager
    torch._dynamo.reset()

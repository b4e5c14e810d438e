"""Step caches: diffusers' hooks that reuse a transformer's work across denoising steps, as one part of a recipe.

    fp8+fp8-linear+compile+cache=fbc:0.12          First Block Cache, threshold 0.12
    native+cache=taylorseer:interval=3:warmup=2    TaylorSeer, a full pass every 3 steps after 2 full ones
    fp8+cache=pab                                  Pyramid Attention Broadcast, diffusers' defaults
    fp8+cache=mag:calibrate, then fp8+cache=mag    MagCache: its ratios measured once, then used

`apply_step_cache` puts one on a diffusers transformer the way diffusers does (`ModelMixin.enable_cache` with the
method's config class) and takes it off again (`disable_cache`), so the model is as it was: bit-identical outputs.
Each method is one entry of `CACHE_METHODS`: its config class, the parameters a recipe may set (name, the config's
field, type, default, lower bound), and what it needs from the run (the pipeline's current timestep, the number of
steps). Every list a user sees (`--help`, the docs' table) is read from it.

Every family: diffusers' block caches (First Block Cache, MagCache) find a model's blocks under the stack names it
knows (`blocks`, `transformer_blocks`, `single_transformer_blocks`, `visual_transformer_blocks`, ...) and need each
block class in its `TransformerBlockRegistry`: what the block's forward returns. diffusers registers seven video
families; `register_blocks` describes the others from their own forward (`block_metadata`: the names its `return`
statements give back, read from its source), registers them for the time the cache is on and unregisters them after.
A block whose returns cannot be described (several forms, or a value that is not one of its arguments) is refused
in one line, naming the family and the block.

What ran: before the cache goes on, every module it hooks gets an innermost counter of its real forwards
(`CallCounts`: 0-d tensors bumped in place, so compiled blocks count without recompiling), and the transformer one
of its passes; `AppliedCache.step_done()` reads them once a step (one sync), so a report can say per step how many
passes ran and how much of their work the cache skipped.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import functools
import hashlib
import inspect
import json
import logging
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..cache import cache_root
from ..errors import UserError, first_line

if TYPE_CHECKING:  # torch and diffusers load when a cache is applied: the vocabulary (--help) needs neither
    from torch import nn

    from ..seams.counts import CallCounts

COUNT_HOOK = "dit_accel_step_cache_count"  # the counters' hook name in diffusers' HookRegistry
CONTEXT_HOOK = "dit_accel_step_cache_context"  # the per-pass cache context, where the pipeline sets none


@dataclass(frozen=True)
class Param:
    """One parameter a recipe may set: `name` as written, the config's `field`, its type, default and lower bound."""

    name: str
    field: str
    kind: type
    default: Any
    minimum: float
    help: str


@dataclass(frozen=True)
class CacheMethod:
    """A step cache of diffusers, as a recipe names it. fixed_schedule: which passes it skips is known before the
    run (from the step count alone); needs_timestep: its hooks ask the pipeline's current timestep."""

    name: str
    title: str
    config_class: str  # in diffusers.hooks
    apply: str  # diffusers.hooks' function that puts it on a model
    hooks: tuple[str, ...]  # the names its hooks are registered under ("module.CONSTANT" of diffusers.hooks)
    params: tuple[Param, ...]
    fixed_schedule: bool
    needs_timestep: bool = False
    needs_steps: bool = False
    block_cache: bool = False  # hooks whole blocks, which TransformerBlockRegistry must describe
    extra: tuple[tuple[str, Any], ...] = ()  # fields set for every use
    engine: str = "diffusers"  # diffusers' hooks, or cache-dit's (`apply` and `config_class` then name its own)

    @property
    def runs_on_a_model(self) -> bool:
        """Its skips fixed by the step count alone, no pipeline's timesteps needed: it runs on a transformer's passes
        by themselves (profile-block --validate model --cache, plan --cache --verify)."""
        return self.fixed_schedule and not self.needs_timestep and self.engine == "diffusers"

    @property
    def usage(self) -> str:
        """'fbc[:threshold]' ... for --help."""
        if not self.params:
            return self.name
        first, *rest = self.params
        return self.name + f"[:{first.name}]" + "".join(f"[:{p.name}=V]" for p in rest)


CACHE_METHODS = {method.name: method for method in (
    CacheMethod("fbc", "First Block Cache", "FirstBlockCacheConfig", "apply_first_block_cache",
                ("first_block_cache._FBC_LEADER_BLOCK_HOOK", "first_block_cache._FBC_BLOCK_HOOK"), (
        Param("threshold", "threshold", float, 0.05, 0.0,
              "skip the rest of a pass while the first block's residual changed by less than this (relative)"),
    ), fixed_schedule=False, block_cache=True),
    CacheMethod("taylorseer", "TaylorSeer", "TaylorSeerCacheConfig", "apply_taylorseer_cache",
                ("taylorseer_cache._TAYLORSEER_CACHE_HOOK",), (
        Param("interval", "cache_interval", int, 5, 1, "a full pass every this many steps; the others predicted"),
        # at least 1: diffusers predicts step `warmup` itself, from the passes before it
        Param("warmup", "disable_cache_before_step", int, 3, 1, "full passes first"),
        Param("order", "max_order", int, 1, 0, "the Taylor series' order"),
    ), fixed_schedule=True),
    CacheMethod("mag", "MagCache", "MagCacheConfig", "apply_mag_cache",
                ("mag_cache._MAG_CACHE_LEADER_BLOCK_HOOK", "mag_cache._MAG_CACHE_BLOCK_HOOK"), (
        Param("threshold", "threshold", float, 0.06, 0.0, "accumulated error below which a pass is skipped"),
        Param("max_skip", "max_skip_steps", int, 3, 1, "at most this many passes skipped in a row"),
        Param("retention", "retention_ratio", float, 0.2, 0.0, "the first fraction of the steps never skipped"),
    ), fixed_schedule=False, needs_steps=True, block_cache=True),
    CacheMethod("pab", "Pyramid Attention Broadcast", "PyramidAttentionBroadcastConfig",
                "apply_pyramid_attention_broadcast",
                ("pyramid_attention_broadcast._PYRAMID_ATTENTION_BROADCAST_HOOK",), (
        Param("skip", "spatial_attention_block_skip_range", int, 2, 1,
              "self-attention recomputed every this many passes inside the timestep range"),
    ), fixed_schedule=True, needs_timestep=True),
    CacheMethod("faster", "FasterCache", "FasterCacheConfig", "apply_faster_cache",
                ("faster_cache._FASTER_CACHE_DENOISER_HOOK", "faster_cache._FASTER_CACHE_BLOCK_HOOK"), (
        Param("skip", "spatial_attention_block_skip_range", int, 2, 1,
              "self-attention recomputed every this many passes inside the timestep range"),
    ), fixed_schedule=True, needs_timestep=True, extra=(("is_guidance_distilled", True),)),
    # the peer users install: cache-dit's Dual Block Cache, on the pipeline (pip install 'dit-accel[cache-dit]')
    CacheMethod("dbcache", "cache-dit DBCache", "DBCacheConfig", "enable_cache", (), (
        Param("threshold", "residual_diff_threshold", float, 0.08, 0.0,
              "skip the middle blocks while the first blocks' residual changed by less than this (relative)"),
        Param("fn", "Fn_compute_blocks", int, 8, 1, "first blocks always computed"),
        Param("bn", "Bn_compute_blocks", int, 0, 0, "last blocks always computed"),
        Param("warmup", "max_warmup_steps", int, 8, 0, "steps never skipped first"),
    ), fixed_schedule=False, needs_steps=True, engine="cache-dit"),
)}


def cache_help() -> str:
    """One line for --help: the methods and their parameters."""
    return "; ".join(f"{m.usage} ({m.title})" for m in CACHE_METHODS.values()) + "; mag also takes :calibrate"


@dataclass(frozen=True)
class CacheSpec:
    """A parsed `cache=...` part: the method and the parameters given (the others take their defaults);
    `calibrate` (MagCache): measure its ratios in this run, skipping nothing."""

    method: str
    values: tuple[tuple[str, Any], ...] = ()
    calibrate: bool = False

    @property
    def label(self) -> str:
        """'cache=fbc:0.12', 'cache=taylorseer:interval=3': as a recipe's label shows it."""
        return "cache=" + self.written

    @property
    def written(self) -> str:
        """'fbc:0.12', 'taylorseer:interval=3': what follows `cache=`, as `--cache` takes it."""
        method = CACHE_METHODS[self.method]
        parts = [self.method]
        for param in method.params:
            value = dict(self.values).get(param.name)
            if value is None:
                continue
            parts.append(f"{value:g}" if param is method.params[0] and param.kind is float else f"{param.name}={value}")
        if self.calibrate:
            parts.append("calibrate")
        return ":".join(parts)

    def value(self, name: str) -> Any:
        param = next(p for p in CACHE_METHODS[self.method].params if p.name == name)
        return dict(self.values).get(name, param.default)


def parse_cache(text: str) -> CacheSpec:
    """'fbc:0.12' / 'taylorseer:interval=3:warmup=2' / 'mag:calibrate' (what follows `cache=`) -> a CacheSpec;
    a UserError naming what is known."""
    name, *parts = text.split(":")
    method = CACHE_METHODS.get(name)
    if method is None:
        raise UserError(f"unknown step cache {name!r} in cache={text}; the caches are {cache_help()}")
    values: dict[str, Any] = {}
    calibrate = False
    for index, part in enumerate(parts):
        if part == "calibrate" and method.name == "mag":
            calibrate = True
            continue
        key, sep, raw = part.partition("=")
        if not sep:  # the first parameter may be written bare: fbc:0.12
            if index != 0 or not method.params:
                raise UserError(f"cache={text}: write parameters as NAME=VALUE after the first; {method.name} takes "
                                f"{method.usage}")
            key, raw = method.params[0].name, part
        param = next((p for p in method.params if p.name == key), None)
        if param is None:
            raise UserError(f"cache={text}: {method.name} has no parameter {key!r}; it takes {method.usage}"
                            + ("[:calibrate]" if method.name == "mag" else ""))
        if key in values:
            raise UserError(f"cache={text} sets {key} twice; set it once")
        try:
            value = param.kind(raw)
        except ValueError:
            raise UserError(f"cache={text}: {key} takes {'an integer' if param.kind is int else 'a number'}, "
                            f"not {raw!r}") from None
        if not value >= param.minimum or value != value or value in (float("inf"),):
            raise UserError(f"cache={text}: {key} must be at least {param.minimum:g}, got {raw}")
        values[key] = value
    return CacheSpec(method.name, tuple(values.items()), calibrate)


# --- the blocks diffusers' block caches walk, described from their own forward ----------------------

def _registry():
    from diffusers.hooks._helpers import TransformerBlockRegistry

    TransformerBlockRegistry._register()  # diffusers' own entries first
    return TransformerBlockRegistry


def cached_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The block stacks diffusers' block caches walk: the model's ModuleList children under the names they know."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from torch import nn

    return [(name, child) for name, child in model.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList) and len(child)]


def _named_metadata(hidden: str, other: str | None, hidden_index: int, other_index: int | None):
    """diffusers' TransformerBlockMetadata whose lookups by the generic names `hidden_states` and
    `encoder_hidden_states` read the block's own arguments: First Block Cache asks for those literal names whatever
    the metadata says (diffusers 0.42.1), so a block whose arguments are named otherwise (Kandinsky 5's
    `visual_embed`, LTX-2's `audio_hidden_states` as the stream passed through) would get the wrong one or none."""
    from diffusers.hooks._helpers import TransformerBlockMetadata

    class NamedMetadata(TransformerBlockMetadata):
        def _get_parameter_from_args_kwargs(self, identifier, args=(), kwargs=None):
            names = {"hidden_states": self.hidden_states_argument_name,
                     "encoder_hidden_states": self.encoder_hidden_states_argument_name}
            return super()._get_parameter_from_args_kwargs(names.get(identifier, identifier), args, kwargs)

    return NamedMetadata(return_hidden_states_index=hidden_index, return_encoder_hidden_states_index=other_index,
                         hidden_states_argument_name=hidden,
                         encoder_hidden_states_argument_name=other or "encoder_hidden_states")


@functools.lru_cache(maxsize=None)
def block_metadata(block_class: type):
    """How a block cache reads `block_class`: the first argument of its forward is the stream the block transforms;
    a forward that returns that argument alone returns a tensor, one that returns a pair of its arguments returns
    the stream and another passed through (text, audio) by those names. Read from the forward's source; returns the
    metadata, or why there is none (a string)."""
    forward = block_class.forward
    arguments = list(inspect.signature(forward).parameters)[1:]
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    returns = {ast.unparse(node.value) for node in ast.walk(tree) if isinstance(node, ast.Return) and node.value}
    if len(returns) != 1:
        return f"its forward returns {' or '.join(sorted(returns)) or 'nothing'}, by the case"
    value = ast.parse(returns.pop(), mode="eval").body
    names = [value.id] if isinstance(value, ast.Name) else (
        [e.id for e in value.elts] if isinstance(value, ast.Tuple) and all(isinstance(e, ast.Name) for e in value.elts)
        else None)
    if names is None or not 1 <= len(names) <= 2 or arguments[0] not in names or any(n not in arguments for n in names):
        return f"its forward returns {ast.unparse(value)}, not its arguments {arguments[0]} and one other"
    if len(names) == 1:
        return _named_metadata(arguments[0], None, 0, None)
    other = next(n for n in names if n != arguments[0])
    return _named_metadata(arguments[0], other, names.index(arguments[0]), names.index(other))


def register_blocks(model: nn.Module, what: str) -> Callable[[], None]:
    """Describe to diffusers' TransformerBlockRegistry the block classes of `model`'s cached stacks, from their own
    forward (`block_metadata`), diffusers' own entries included (their lookups by name are replaced as said there);
    returns the undo, which puts the registry back. UserError, one line, where a model has no such stack or a block's
    forward cannot be described."""
    stacks = cached_stacks(model)
    if not stacks:
        raise UserError(f"a block cache cannot serve {what}: it has no block stack under a name diffusers' block "
                        f"caches look for ({', '.join(n for n, _ in model.named_children())}); use cache=pab or "
                        f"cache=taylorseer")
    registry, before = _registry()._registry, {}
    for name, stack in stacks:
        block_class = type(stack[0])
        metadata = block_metadata(block_class)
        if isinstance(metadata, str):
            raise UserError(f"a block cache cannot serve {what}: its {name} block ({block_class.__name__}): "
                            f"{metadata}; use cache=pab or cache=taylorseer (they hook its attention)")
        before.setdefault(block_class, registry.get(block_class))
    for block_class in before:
        _registry().register(block_class, block_metadata(block_class))

    def undo() -> None:
        for block_class, metadata in before.items():
            if metadata is None:
                registry.pop(block_class, None)
            else:
                registry[block_class] = metadata

    return undo


def attention_modules(model: nn.Module, *, self_only: bool = False) -> list[str]:
    """The names of the attention modules of `model`'s cached stacks (diffusers' attention classes), with
    `self_only` the self-attention ones: what TaylorSeer and FasterCache hook here, by exact name (their default
    patterns, `blocks.*attn` and `blocks.*attn1`, miss Wan's `attn1`/`attn2` or Kandinsky's `self_attention`)."""
    from diffusers.hooks._common import _ATTENTION_CLASSES

    return [f"{stack}.{name}" for stack, blocks in cached_stacks(model) for name, module in blocks.named_modules()
            if isinstance(module, _ATTENTION_CLASSES) and not (self_only and getattr(module, "is_cross_attention",
                                                                                    False))]


# --- counting what ran, and the contexts a pipeline without diffusers' cache support does not set ----------

class _CountHook:
    """An innermost diffusers hook: counts each real forward of its module (the cache's hooks, outside it, call it
    only when they compute)."""

    _is_stateful = False

    def __init__(self, counts: CallCounts, key: str):
        self.counts, self.key, self.fn_ref = counts, key, None

    def initialize_hook(self, module):
        return module

    def deinitalize_hook(self, module):  # diffusers' spelling
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.counts.count(self.key)
        return args, kwargs

    def post_forward(self, module, output):
        return output

    def reset_state(self, module):
        return module


class _ContextHook(_CountHook):
    """Names each pass's cache context where the pipeline names none: diffusers' cache hooks keep their state per
    context, which pipelines set with `transformer.cache_context("cond")` / `("uncond")`, and half of the families'
    pipelines do not (MiniMax-H3's, Kandinsky 5's, Allegro's, the Cosmos ones, ...; some transformers lack the
    method). The passes of a step are numbered from 0 ("pass 0", "pass 1": a guided step's conditional and
    unconditional passes keep their states apart, as the pipelines' contexts do), restarting at each step: at the
    step callback (`AppliedCache.step_done`), or every `passes_per_step` passes where no callback tells."""

    def __init__(self, managers: list, passes_per_step: int | None):
        super().__init__(None, "")
        self.managers, self.passes_per_step, self.pass_in_step, self.named = managers, passes_per_step, 0, False

    def pre_forward(self, module, *args, **kwargs):
        from diffusers.hooks.hooks import CacheContext

        self.named = all(manager._context is None for manager in self.managers)
        if self.named:
            index = self.pass_in_step % self.passes_per_step if self.passes_per_step else self.pass_in_step
            for manager in self.managers:
                manager.set_context(CacheContext(f"pass {index}"))
        self.pass_in_step += 1
        return args, kwargs

    def post_forward(self, module, output):
        if self.named:
            for manager in self.managers:
                manager.set_context(None)
        return output


def _state_managers(model: nn.Module) -> list:
    """The StateManagers of the stateful hooks under `model`: where cache contexts are set."""
    from diffusers.hooks.hooks import StateManager

    return [value for m in model.modules() if hasattr(m, "_diffusers_hook")
            for hook in m._diffusers_hook.hooks.values() if hook._is_stateful
            for value in vars(hook).values() if isinstance(value, StateManager)]


@dataclass(eq=False)
class AppliedCache:
    """A step cache on a model: its spec, what it hooks, and per step what ran (`steps`: one entry per step_done:
    passes, the hooked modules' real forwards ("computed") and those a run without the cache makes ("full"))."""

    spec: CacheSpec
    model: nn.Module
    hooked: int  # modules the cache hooks (blocks, or attention modules), the count a full pass runs
    counts: CallCounts
    steps: list[dict[str, int]] = field(default_factory=list)
    calibration: list[float] | None = None
    changes: Callable[[], list[float]] | None = None  # a threshold cache's: what each of its comparisons measured
    _seen: tuple[int, int] = (0, 0)
    _context: _ContextHook | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def step_done(self) -> None:
        """Record the step just finished (reads the counters: one sync)."""
        passes, computed = self.counts.declined["pass"], self.counts.declined["computed"]
        self.steps.append({"passes": passes - self._seen[0], "computed": computed - self._seen[1],
                           "full": (passes - self._seen[0]) * self.hooked})
        self._seen = (passes, computed)
        if self._context is not None:
            self._context.pass_in_step = 0

    def summary(self) -> dict[str, Any]:
        """The cache, what it hooked, and what ran: passes, and the share of the hooked modules' work computed (1.0:
        the cache skipped nothing), over the run (read from the counters: one sync) and per step where steps were
        recorded; MagCache's calibrated ratios; a threshold cache's measured changes, their spread (`changes`)."""
        passes, computed = self.counts.declined["pass"], self.counts.declined["computed"]
        return {"cache": self.spec.label, "method": CACHE_METHODS[self.spec.method].title,
                "hooked_modules": self.hooked, "passes": passes,
                "work_computed": round(computed / (passes * self.hooked), 4) if passes and self.hooked else None,
                "per_step": list(self.steps), "calibration": self.calibration,
                "changes": _spread(self.changes()) if self.changes is not None else None}

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _spread(values: list[float]) -> dict[str, Any] | None:
    """How many comparisons, and the least, median and largest change they measured (None: none compared)."""
    if not values:
        return None
    ordered = sorted(values)
    return {"compared": len(ordered), "min": round(ordered[0], 4), "median": round(statistics.median(ordered), 4),
            "max": round(ordered[-1], 4)}


def _hook_names(method: CacheMethod) -> list[str]:
    import diffusers.hooks as hooks

    names = []
    for path in method.hooks:
        module, constant = path.split(".")
        names.append(getattr(getattr(hooks, module), constant))
    return names


def timestep_on_host(read: Callable[[], Any]) -> Callable[[], Any]:
    """`read` (the pipeline's current timestep, a tensor on its device) as PAB's and FasterCache's hooks take it (a
    number: diffusers types their callback `-> int`), read off the device once per timestep. Each hooked forward
    compares the timestep with its range: given the tensor, that is a device sync per forward, 60 a step on
    Wan 2.1 1.3B, whose steps the hooks computed in full ran 7.8% slower than the uncached ones on the H100
    (docs/benchmarks.md#step-caches-on-the-h100). While dynamo traces, the tensor goes through as diffusers' hooks
    get it without us: the memo traced recompiled the compiled blocks at every step (6 graphs in 6 steps, the tiny
    Wan pipeline compiled)."""
    import torch

    last: list = [None, None]  # the tensor last read, its value

    def timestep() -> Any:
        t = read()
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or torch.compiler.is_compiling():
            return t
        if t is not last[0]:
            last[:] = [t, t.item()]
        return last[1]

    return timestep


def make_config(spec: CacheSpec, model: nn.Module, *, steps: int | None, timestep: Callable[[], Any] | None,
                mag_ratios: list[float] | None = None):
    """The diffusers config of `spec` for `model`, with what the run gives it."""
    import re

    import diffusers.hooks as hooks

    method = CACHE_METHODS[spec.method]
    fields = {p.field: spec.value(p.name) for p in method.params}
    fields.update(method.extra)
    if method.engine == "cache-dit":
        return getattr(_cache_dit(spec), method.config_class)(**fields, num_inference_steps=steps)
    if method.name == "taylorseer":
        fields["cache_identifiers"] = [re.escape(name) for name in attention_modules(model)]
    if method.name == "faster":
        fields["spatial_attention_block_identifiers"] = tuple(
            f"^{re.escape(name)}$" for name in attention_modules(model, self_only=True))
    if method.needs_timestep:
        if timestep is None:
            raise UserError(f"{spec.label} follows the pipeline's timestep: it runs with a pipeline (dit-accel "
                            f"generate), not on a model alone")
        fields["current_timestep_callback"] = timestep_on_host(timestep)
    if method.needs_steps:
        if steps is None:
            raise UserError(f"{spec.label} needs the run's step count: it runs with a pipeline (dit-accel generate)")
        fields["num_inference_steps"] = steps
        if spec.calibrate:
            fields["calibrate"] = True
        elif mag_ratios is None:
            raise UserError(f"{spec.label} needs this model's MagCache ratios, measured once: run the same pipeline "
                            f"with cache=mag:calibrate first")
        else:
            fields["mag_ratios"] = mag_ratios
    return getattr(hooks, method.config_class)(**fields)


def apply_step_cache(model: nn.Module, spec: CacheSpec, *, what: str, steps: int | None = None,
                     timestep: Callable[[], Any] | None = None, mag_ratios: list[float] | None = None,
                     passes_per_step: int | None = None, pipeline: Any = None) -> AppliedCache:
    """Put the cache `spec` on the diffusers transformer `model` with diffusers' own function (`apply_*`), with
    counters of what runs under it; `AppliedCache.undo()` takes every hook and registration off again (the model's
    outputs are then bit-identical to before). `what`: the model's name for messages; `passes_per_step`: the
    pipeline's transformer passes a step (numbers the passes' cache contexts where no step callback comes).
    cache-dit's DBCache goes on the whole `pipeline` (`_apply_cache_dit`)."""
    import diffusers.hooks as hooks
    from diffusers.hooks import HookRegistry

    from ..seams.counts import CallCounts
    from ..seams.placement import module_device

    method = CACHE_METHODS[spec.method]
    if method.engine == "cache-dit":
        return _apply_cache_dit(pipeline, model, spec, what=what, steps=steps)
    if any(m._diffusers_hook.get_hook(name) is not None for m in model.modules() if hasattr(m, "_diffusers_hook")
           for name in (*_hook_names(method), COUNT_HOOK)):
        raise UserError(f"{what} has a step cache on already; one at a time")
    config = make_config(spec, model, steps=steps, timestep=timestep, mag_ratios=mag_ratios)
    names = _hook_names(method)
    apply = getattr(hooks, method.apply)
    root = HookRegistry.check_if_exists_or_initialize(model)
    applied = AppliedCache(spec, model, 0, CallCounts(module_device(model)))

    def enable() -> None:
        with _quiet_diffusers():
            apply(model, copy.copy(config))
        root.invalidate_child_registries_cache()

    def disable() -> None:
        for name in names:
            root.remove_hook(name, recurse=True)
        root.invalidate_child_registries_cache()

    try:
        if method.block_cache:
            applied._undo.append(register_blocks(model, what))
        enable()  # once to find what it hooks, then again outside the counters
        hooked = [m for m in model.modules() if m is not model and hasattr(m, "_diffusers_hook")
                  and any(m._diffusers_hook.get_hook(name) is not None for name in names)]
        disable()
        if not hooked:
            found = attention_modules(model)
            listed = ", ".join(found[:2]) + (", ..." if len(found) > 2 else "")
            raise UserError(f"{method.title} cannot serve {what}: it hooks nothing there (its attention modules, "
                            f"{listed or 'none'}, are not under the names diffusers' {method.title} looks for); use "
                            f"another cache")
        _count_under(applied, model, hooked)
        enable()
        applied._undo.append(disable)
        if method.name == "fbc":
            applied.changes = _watch_first_block(model, names[0])
        applied._context = _ContextHook(_state_managers(model), passes_per_step)
        root.register_hook(applied._context, CONTEXT_HOOK)
        applied._undo.append(lambda: root.remove_hook(CONTEXT_HOOK, recurse=False))
        if spec.calibrate:
            applied.calibration = []
            applied._undo.append(_catch_calibration(applied.calibration))
    except BaseException:
        applied.undo()
        raise
    return applied


def _watch_first_block(model: nn.Module, leader_hook: str) -> Callable[[], list[float]]:
    """First Block Cache's comparisons, kept: each the first block's residual's mean absolute change from the last pass
    it computed, relative to that pass's (diffusers' formula, computed again beside its hook, which keeps only its
    verdict). Kept on the device; the returned reader brings them to the host (one sync). The hook, and this with
    it, goes when the cache is taken off."""
    import torch

    hook = next(m._diffusers_hook.get_hook(leader_hook) for m in model.modules()
                if hasattr(m, "_diffusers_hook") and m._diffusers_hook.get_hook(leader_hook) is not None)
    decide, measured = hook._should_compute_remaining_blocks, []

    @torch.compiler.disable  # as diffusers' own decision is: outside any compiled graph
    def compare(residual):
        last = hook.state_manager.get_state().head_block_residual
        if last is not None:
            measured.append(((residual - last).abs().mean() / last.abs().mean()).detach().float())
        return decide(residual)

    hook._should_compute_remaining_blocks = compare
    return lambda: torch.stack(measured).tolist() if measured else []


def _cache_dit_changes(cache_dit, pipeline: Any) -> list[float]:
    """DBCache's comparisons, what each measured (cache-dit's own summary of the last call: its residual diffs at the
    steps after its warm-up, a guided pipeline's separate passes too)."""
    for stats in cache_dit.summary(pipeline, logging=False):
        values = [*stats.residual_diffs.values(), *stats.cfg_residual_diffs.values()]
        if values:
            return [float(x) for v in values for x in (v if isinstance(v, list) else [v])]
    return []


def _cache_dit(spec: CacheSpec):
    """The cache_dit module (its INFO lines off unless the user set CACHE_DIT_LOG_LEVEL: the report says what ran),
    or a UserError naming the extra that installs it."""
    import os

    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    try:
        import cache_dit
    except ImportError:
        raise UserError(f"{spec.label} is cache-dit's DBCache, and cache-dit is not installed: "
                        f"pip install 'dit-accel[cache-dit]'") from None
    return cache_dit


def _count_under(applied: AppliedCache, root: nn.Module, hooked: list) -> None:
    """The counters: each of `hooked`'s real forwards (innermost) and each pass of `root`, undone with `applied`."""
    from diffusers.hooks import HookRegistry

    applied.hooked = len(hooked)
    applied.counts.expect("pass", "computed")
    applied._undo.append(lambda: HookRegistry.check_if_exists_or_initialize(root).remove_hook(COUNT_HOOK,
                                                                                              recurse=True))
    for module in hooked:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(_CountHook(applied.counts, "computed"),
                                                                        COUNT_HOOK)
    HookRegistry.check_if_exists_or_initialize(root).register_hook(_CountHook(applied.counts, "pass"), COUNT_HOOK)


def _apply_cache_dit(pipeline: Any, model: nn.Module, spec: CacheSpec, *, what: str, steps: int | None
                     ) -> AppliedCache:
    """cache-dit's DBCache on `pipeline` (`cache_dit.enable_cache`, taken off by `cache_dit.disable_cache`), the
    blocks of `model`'s stacks counted as the other caches' hooked modules are."""
    from ..seams.counts import CallCounts
    from ..seams.placement import module_device

    if pipeline is None:
        raise UserError(f"{spec.label} (cache-dit) goes on a whole pipeline: run it with dit-accel generate")
    cache_dit = _cache_dit(spec)
    applied = AppliedCache(spec, model, 0, CallCounts(module_device(model)))
    try:
        if model is getattr(pipeline, "transformer", model):  # cache-dit caches all of a pipeline's transformers
            cache_dit.enable_cache(pipeline, cache_config=make_config(spec, model, steps=steps, timestep=None))
            applied._undo.append(lambda: cache_dit.disable_cache(pipeline))
            kept: list[list[float]] = []  # read as the cache comes off, before cache-dit drops its record
            applied._undo.append(lambda: kept.append(_cache_dit_changes(cache_dit, pipeline)))
            applied.changes = lambda: kept[0] if kept else _cache_dit_changes(cache_dit, pipeline)
        # after cache-dit, which keeps the forward it replaces as a bound method, and off again before it
        _count_under(applied, model, [block for _, stack in cached_stacks(model) for block in stack])
    except UserError:
        applied.undo()
        raise
    except Exception as exc:  # noqa: BLE001 (cache-dit's refusal of a pipeline it has no adapter for)
        applied.undo()
        raise UserError(f"cache-dit's DBCache cannot serve {what}: {type(exc).__name__}: "
                        f"{first_line(exc) or 'no reason given'}") from exc
    return applied


@contextlib.contextmanager
def _quiet_diffusers():
    """diffusers' caches log a warning per use (FasterCache: experimental; defaults filled in): the run's report
    says what ran, so they are kept off the terminal."""
    logger = logging.getLogger("diffusers.hooks")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _catch_calibration(ratios: list[float]) -> Callable[[], None]:
    """MagCache's calibration reports its ratios through its logger at the end of each context's run (a guided
    pipeline: the conditional's, then the unconditional's): keep the first; returns the undo."""
    logger = logging.getLogger("diffusers.hooks.mag_cache")
    prefix = "MagCache Calibration Results: "

    class Catch(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith(prefix) and not ratios:  # the first context's (a guided pipeline's conditional)
                ratios[:] = [float(x) for x in ast.literal_eval(message[len(prefix):])]

    handler = Catch(logging.INFO)
    previous = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # kept here, not printed by diffusers' handler

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]

    return undo


# --- MagCache's ratios, measured once per pipeline ----------------------------------------------------------

def mag_ratios_file(pipeline_folder: Path) -> Path:
    """Where `+cache=mag:calibrate` keeps the ratios it measured for the pipeline in `pipeline_folder` (its weights:
    the ratios are the checkpoint's), for later `+cache=mag` runs: beside the other measurements of this machine."""
    key = hashlib.sha1(str(Path(pipeline_folder).resolve()).encode()).hexdigest()[:12]
    return cache_root() / "magcache" / f"{Path(pipeline_folder).resolve().name}_{key}.json"


def load_mag_ratios(pipeline_folder: Path) -> list[float] | None:
    """The ratios a calibration kept for this pipeline, or None (none yet, or a file that cannot be read)."""
    try:
        ratios = json.loads(mag_ratios_file(pipeline_folder).read_text())["mag_ratios"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [float(r) for r in ratios] if isinstance(ratios, list) and ratios else None


def save_mag_ratios(pipeline_folder: Path, ratios: list[float], steps: int) -> Path:
    path = mag_ratios_file(pipeline_folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pipeline": str(Path(pipeline_folder).resolve()), "steps": steps,
                                "mag_ratios": ratios}, indent=1) + "\n")
    return path

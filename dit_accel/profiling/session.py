"""One profile-block session: for each block stack of the model (HunyuanVideo's dual- and single-stream blocks
are two), load one block once, profile it with each recipe asked for (attention backend, fused RoPE, FP8
linears, torch.compile), measure each backend's error on the block's own q/k/v; extrapolate each recipe to the
whole model over every stack; optionally validate the extrapolation with a chain of N blocks or the whole
transformer. `ProfileSettings` holds
every choice the command line made; `run_session` returns the results (`results`) that
`report.build_report` turns into the report."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..adapters import BlockAdapter, Workload
from ..adapters.stage_specs import StageSkip, StageSpec
from ..errors import UserError
from ..loading.block import LoadedBlock, load_block_from_checkpoint, synthetic_block
from ..patching.apply import apply_recipe, compile_failures_as_user_errors, dynamo_counts
from ..patching.recipe import Recipe
from ..patching.step_cache import CacheSpec
from ..timing import wall_seconds
from .attention_error import attention_errors, capture_attention_inputs, output_error
from .extrapolate import Extrapolation, StackTime, Validation
from .outside import OutsideMeasurement, measure_outside
from .profiler import profile_block
from .progress import NO_PROGRESS, SessionProgress
from .results import COMPILED_CPU_NOTE, BackendRun, CompileStats
from .stage_profile import StageMeasurement, measure_stage
from .validate import validate_chain


@dataclass(frozen=True)
class ProfileSettings:
    """What to profile and how, as the command line resolved it."""

    adapter: BlockAdapter
    workload: Workload
    dtype: torch.dtype
    device: torch.device
    recipes: tuple[Recipe, ...]  # profiled in this order; the first is the reference
    checkpoint: Path | None = None  # None: synthetic weights
    block_index: int = 0
    warmup: int = 3
    runs: int = 10
    steps: int | None = None  # None: the family's own (adapter.default_steps)
    guidance_passes: int | None = None  # None: the family's own (adapter.passes_per_step)
    outside_ms: float | None = None  # per pass, outside the block stack, if the user measured it
    measure_outside: bool = False  # --outside measure: time the transformer without its blocks, once
    validate_blocks: int = 0
    validate_model: bool = False  # --validate model: the validate_blocks blocks inside the whole transformer
    validate_cache: CacheSpec | None = None  # --validate model --cache: the whole video under this step cache
    offload: str = "resident"
    memory_budget: str | None = None  # as written, e.g. "16GiB"
    trace: bool = False
    seed: int = 0
    scaled_down: bool = False  # a CPU run of the family's scaled-down config
    stages: tuple[StageSpec | StageSkip, ...] = ()  # --stages: those to measure and those skipped, in pipeline order
    stacks: tuple[str, ...] = ()  # the block stacks profiled (a block of each); empty: every stack of the model
    rerun_options: tuple[str, ...] = ()  # the command's options that rebuild this block and its inputs
    rerun: dict[str, Any] = field(default_factory=dict)  # the same as `request.ProfileRequest` fields
    keep_going: bool = False  # a recipe torch cannot compile on a block is left out (`SessionResult.skipped`)

    def stack_names(self) -> tuple[str, ...]:
        return self.stacks or tuple(name for name, _ in self.adapter.stacks)

    def denoising_steps(self) -> tuple[int, str]:
        """(denoising steps of a video, where that number comes from): a sectioned pipeline's steps for each of
        its sections."""
        steps, source = ((self.steps, "stated with --steps") if self.steps is not None
                         else (self.adapter.default_steps, self.adapter.default_steps_source))
        sections = self.workload.sections
        if sections == 1:
            return steps, source
        return steps * sections, f"{steps} ({source}) for each of the video's {sections} sections"

    def passes_per_step(self) -> tuple[int, str]:
        """(transformer passes per denoising step, where that number comes from)."""
        if self.guidance_passes is not None:
            return self.guidance_passes, "stated with --guidance-passes"
        return self.adapter.passes_per_step, self.adapter.passes_per_step_source

    def trace_name(self, recipe: Recipe, stack: str | None = None) -> str:
        where = f"_{stack}" if stack is not None and len(self.stack_names()) > 1 else ""
        return f"trace_{recipe.label.replace('+', '-')}{where}.json"


@dataclass
class SessionResult:
    loaded: list[LoadedBlock]  # the profiled block of each stack, in stack order
    runs: list[BackendRun]  # stack by stack, each stack's recipes in order
    attention_reference: str  # the dtype the attention errors were measured against
    validation: Validation | None
    notes: list[str] = field(default_factory=list)  # things the user should know (fallbacks)
    outside: OutsideMeasurement | None = None  # --outside measure
    stages: list[StageMeasurement] = field(default_factory=list)  # --stages, measured
    skipped: dict[str, str] = field(default_factory=dict)  # keep_going: recipe label -> why torch could not compile it


def _first_compiled_call(block: torch.nn.Module, inputs: dict[str, Any], mode: str, device: torch.device,
                         label: str) -> CompileStats:
    """The first call of a block `apply_recipe` compiled (tracing, inductor, autotuning, the run), timed apart
    from the runs, with the graphs it compiled and the graph breaks it met; a compile that fails is one line."""
    breaks_before, graphs_before = dynamo_counts()
    with torch.no_grad(), compile_failures_as_user_errors(f"{label} on this block", "run the recipe without +compile"):
        seconds = wall_seconds(lambda: block(**inputs), device=device)
    breaks, graphs = dynamo_counts()
    return CompileStats(mode, seconds, breaks - breaks_before, graphs - graphs_before)


def run_session(settings: ProfileSettings, run_dir: Path, progress: SessionProgress = NO_PROGRESS) -> SessionResult:
    """Every recipe profiled on one block of each stack asked for, then each stack's attention check, the
    --stages and the --validate pass; `progress` is told each stage as it starts and each unit of it as it ends."""
    s = settings
    outside = None
    if s.measure_outside:  # first, and freed before the block exists: the two are never resident together
        with progress.stage("outside the blocks: the transformer without its blocks (synthetic weights), "
                            "warm-up and timed runs"):
            outside = measure_outside(s.adapter, s.workload, s.device, s.dtype, warmup=s.warmup, runs=s.runs,
                                      seed=s.seed)
    if outside is not None:
        outside_ms, outside_source = outside.median_ms, outside.source
    elif s.outside_ms is not None:
        outside_ms, outside_source = s.outside_ms, "stated with --outside-ms"
    else:
        outside_ms, outside_source = 0.0, "not measured: pass --outside measure or --outside-ms to add it"

    stacks = [_profile_stack(s, s.adapter.for_stack(name), run_dir, progress) for name in s.stack_names()]
    skipped = {label: why for stack in stacks for label, why in stack.skipped.items()}
    recipes = [recipe for recipe in s.recipes if recipe.label not in skipped]  # a recipe left out of one stack: of all
    (steps, steps_source), (passes, passes_source) = s.denoising_steps(), s.passes_per_step()
    runs: list[BackendRun] = []
    for recipe in recipes:  # one extrapolation per recipe, over every stack's block
        times = tuple(StackTime(stack.adapter.stack, stack.adapter.num_blocks, stack.measured[recipe.label]["profile"]
                                .timing.median_ms) for stack in stacks)
        extrapolation = Extrapolation(times, outside_ms, outside_source, steps, passes, passes_source, steps_source)
        runs += [BackendRun(extrapolation=extrapolation, **stack.measured[recipe.label]) for stack in stacks]
    runs.sort(key=lambda run: [stack.adapter.stack for stack in stacks].index(run.stack))  # stack by stack

    backends = list(dict.fromkeys(recipe.backend for recipe in recipes))
    stage_results = [measure_stage(spec, backends, device=s.device, dtype=s.dtype, warmup=s.warmup, runs=s.runs,
                                   seed=s.seed, progress=progress)
                     for spec in s.stages if isinstance(spec, StageSpec)]

    validation = None
    if s.validate_blocks:
        first, recipe = stacks[0], s.recipes[0]
        profile = first.measured[recipe.label]["profile"]
        activation_bytes = (profile.peak_memory_bytes or 0) - profile.weights_bytes
        pass_runs = [run for run in runs if run.backend == recipe.label]
        validation = validate_chain(first.adapter, first.loaded.block, first.inputs, s.validate_blocks,
                                    recipe=recipe, device=s.device, dtype=s.dtype,
                                    block_ms=pass_runs[0].extrapolation.blocks_ms / s.validate_blocks,
                                    activation_bytes=max(0, activation_bytes), offload=s.offload,
                                    whole_model=s.workload if s.validate_model else None,
                                    outside_ms=outside_ms if s.validate_model else 0.0,
                                    outside_source=outside_source if s.validate_model else None,
                                    cache=s.validate_cache, steps=steps, passes_per_step=passes,
                                    seed=s.seed, progress=progress)
    notes = [note for stack in stacks for note in stack.notes]
    notes += [f"{label} left out (--keep-going): {why}" for label, why in skipped.items()]
    return SessionResult([stack.loaded for stack in stacks], runs, stacks[0].attention_reference, validation, notes,
                         outside=outside, stages=stage_results, skipped=skipped)


@dataclass
class _StackProfile:
    """One stack's block, its inputs, and per recipe label what `BackendRun` holds but the extrapolation."""

    adapter: BlockAdapter
    loaded: LoadedBlock
    inputs: dict[str, Any]
    measured: dict[str, dict[str, Any]]
    attention_reference: str
    notes: list[str]
    skipped: dict[str, str]  # recipe label -> why torch could not compile it on this block (keep_going)


def _attention_calls(applied) -> dict[str, Any] | None:
    """The routed backend's counts so far ({"served": n, "fallback": {reason: n}}), None when nothing is routed."""
    if applied.attention is None or not applied.attention.routed:
        return None
    summary = applied.attention.summary()
    return {"served": summary["served_calls"], "fallback": dict(summary["fallback_calls"])}


def _calls_since(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The calls counted between two `_attention_calls` (one block call's)."""
    if before is None or after is None:
        return None
    fallback = {reason: n - before["fallback"].get(reason, 0) for reason, n in after["fallback"].items()}
    return {"served": after["served"] - before["served"], "fallback": {r: n for r, n in fallback.items() if n}}


def _profile_stack(s: ProfileSettings, adapter: BlockAdapter, run_dir: Path,
                   progress: SessionProgress) -> _StackProfile:
    """Every recipe on block `s.block_index` of `adapter`'s stack, then the attention error of each backend on
    the q/k/v the block feeds its attention."""
    where = f" of {adapter.stack}" if len(s.stack_names()) > 1 else ""
    # The block's inputs from the model's own forward (one block per stack, synthetic weights), freed before
    # the profiled block exists.
    with progress.stage("the block's inputs: the transformer's own forward, one block per stack "
                        "(synthetic weights)"):
        generator = torch.Generator(device=s.device).manual_seed(s.seed)
        inputs = adapter.make_inputs(s.workload, s.device, s.dtype, generator)
    if s.checkpoint is not None:
        with progress.stage(f"loading block {s.block_index}{where} from {s.checkpoint}"):
            loaded = load_block_from_checkpoint(adapter, s.checkpoint, s.block_index, s.device, s.dtype)
    else:
        with progress.stage(f"building block {s.block_index}{where} (synthetic weights)"):
            loaded = synthetic_block(adapter, s.block_index, s.device, s.dtype, seed=s.seed)

    attention_flops = sum(call.flops for call in adapter.attention_calls(s.workload))
    flops_per_linear = adapter.flops_per_linear(loaded.block, s.workload)
    linear_flops = sum(flops_per_linear.values())
    measured: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    skipped: dict[str, str] = {}
    reference_output = None
    for recipe in s.recipes:
        label = recipe.label + where
        block = loaded.block
        with apply_recipe(block, recipe, adapter=adapter) as applied:
            linears = applied.linears[0] if applied.linears else None
            linear_summary = None if linears is None else {**linears.as_dict(), "line": linears.summary_lines()[0]}
            compile_stats = None
            if recipe.compile_mode is not None:
                with progress.stage(f"{label}: torch.compile and its first call"):
                    try:
                        compile_stats = _first_compiled_call(block, inputs, recipe.compile_mode, s.device, label)
                    except UserError as exc:
                        if not s.keep_going or reference_output is None:  # the first recipe is the reference
                            raise
                        skipped[recipe.label] = str(exc)
                if recipe.label in skipped:
                    continue
                graphs_after_compile = dynamo_counts()[1]  # dynamo's counters are process-wide
            profile = profile_block(block, inputs, adapter, device=s.device, warmup=s.warmup, runs=s.runs,
                                    trace_path=run_dir / s.trace_name(recipe, adapter.stack) if s.trace else None,
                                    named_ranges=recipe.compile_mode is None, progress=progress, label=label)
            if compile_stats is not None:
                compile_stats.graphs_after_first_call = dynamo_counts()[1] - graphs_after_compile
            calls_before = _attention_calls(applied)
            with torch.no_grad():
                output = block(**inputs)
                output = (output[0] if isinstance(output, tuple) else output).clone()  # a CUDA-graph replay
                # would overwrite its own output buffer
            attention_calls = _calls_since(calls_before, _attention_calls(applied))
            notes += applied.notes()
            if compile_stats is not None and s.device.type == "cpu":
                notes.append(f"{label}: {COMPILED_CPU_NOTE}")
            if compile_stats is not None and compile_stats.graphs_after_first_call:
                notes.append(f"{label}: {compile_stats.graphs_after_first_call} graph(s) recompiled after the "
                             f"first call, during warm-up or the timed runs (the timings may include compiling)")
        if (recipe.fp8_linear or recipe.compile_mode) and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the FP8 weights and the compiled graph's buffers went with the recipe
        error = None if reference_output is None else output_error(output, reference_output)
        reference_output = output if reference_output is None else reference_output
        fp8_names = [linear["name"] for linear in linear_summary["quantized"]] if linear_summary else []
        measured[recipe.label] = dict(
            backend=recipe.label, stack=adapter.stack, profile=profile, attention_flops=attention_flops,
            linear_flops=linear_flops, output_vs_reference=error, compile_stats=compile_stats,
            fp8_linears=linear_summary, fp8_linear_flops=sum(flops_per_linear[name] for name in fp8_names),
            attention_calls=attention_calls)

    backends = list(dict.fromkeys(recipe.backend for recipe in s.recipes if recipe.label in measured))
    with progress.stage(f"attention error on the block's own q/k/v{where} ({len(backends)} backend(s))"):
        attention_inputs = capture_attention_inputs(loaded.block, inputs, adapter)
        attention_rel_err, attention_reference = attention_errors(*attention_inputs, backends)
        del attention_inputs
    for recipe in s.recipes:
        if recipe.label in measured:
            measured[recipe.label]["attention_rel_err"] = attention_rel_err[recipe.backend]
    return _StackProfile(adapter, loaded, inputs, measured, attention_reference, notes, skipped)

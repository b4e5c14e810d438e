"""One profile-block session: load the block once, profile it with each recipe asked for (attention
backend, fused RoPE, FP8 linears, torch.compile), measure each backend's error on the block's own
q/k/v, and optionally validate the extrapolation with a chain of N blocks. `ProfileSettings` holds
every choice the command line made; `run_session` returns what `report.build_report` turns into the
report."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..adapters import BlockAdapter, Workload
from ..adapters.stages import StageSpec
from ..attention.routing import use_attention_backend
from ..loading.block import LoadedBlock, load_block_from_checkpoint, synthetic_block
from ..patching.recipe import Recipe
from ..timing import wall_seconds
from .attention_error import attention_errors, capture_attention_inputs, output_error
from .extrapolate import Extrapolation, Validation
from .outside import OutsideMeasurement, measure_outside
from .profiler import profile_block
from .progress import NO_PROGRESS, SessionProgress
from .report import BackendRun, CompileStats
from .stages import StageMeasurement, measure_stage
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
    offload: str = "resident"
    memory_budget: str | None = None  # as written, e.g. "16GiB"
    trace: bool = False
    seed: int = 0
    scaled_down: bool = False  # a CPU run of the family's scaled-down config
    stages: tuple[Any, ...] = ()  # --stages: `adapters.stages.StageSpec`s to measure and `StageSkip`s, in pipeline order

    def denoising_steps(self) -> tuple[int, str]:
        """(denoising steps of a video, where that number comes from)."""
        if self.steps is not None:
            return self.steps, "stated with --steps"
        return self.adapter.default_steps, self.adapter.default_steps_source

    def passes_per_step(self) -> tuple[int, str]:
        """(transformer passes per denoising step, where that number comes from)."""
        if self.guidance_passes is not None:
            return self.guidance_passes, "stated with --guidance-passes"
        return self.adapter.passes_per_step, self.adapter.passes_per_step_source

    def trace_name(self, recipe: Recipe) -> str:
        return f"trace_{recipe.label.replace('+', '-')}.json"


@dataclass
class SessionResult:
    loaded: LoadedBlock
    runs: list[BackendRun]
    attention_reference: str  # the dtype the attention errors were measured against
    validation: Validation | None
    notes: list[str] = field(default_factory=list)  # things the user should know (fallbacks)
    memory_estimate: dict[str, Any] | None = None  # `memory.MemoryEstimate.as_dict()`, set by the command
    outside: OutsideMeasurement | None = None  # --outside measure
    stages: list[StageMeasurement] = field(default_factory=list)  # --stages, measured


def processor_swap(block: torch.nn.Module, recipe: Recipe):
    """The recipe's fused RoPE (+rope) or fused prologue (+prologue) as a context manager (its
    handle, to read the counts), or nothing. Enter it after the attention backend's swap."""
    from ..patching import fused_prologue, fused_rope

    if recipe.fused_rope:
        return fused_rope(block)
    return fused_prologue(block) if recipe.fused_prologue else contextlib.nullcontext()


def _dynamo_counts() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def recipe_block(block: torch.nn.Module, recipe: Recipe, adapter: BlockAdapter) -> Iterator[tuple[torch.nn.Module, Any]]:
    """The block `recipe` runs, and its `Fp8LinearSwap` (or None).

    Attention and RoPE swaps are undone on exit; FP8 linears (torchao replaces the weights) and
    compilation cannot be, so those recipes run on a deep copy of the block; on exit dynamo's caches
    (which hold the compiled copy, and with it its weights) are dropped, and the caller drops the copy.
    """
    owned = recipe.fp8_linear or recipe.compile_mode is not None
    work = copy.deepcopy(block) if owned else block
    try:
        linears = None
        if recipe.fp8_linear:
            from ..patching.fp8_linear import quantize_linears

            linears = quantize_linears(work, adapter)
        yield work, linears
    finally:
        del work
        if recipe.compile_mode is not None:
            torch._dynamo.reset()


def _compile(block: torch.nn.Module, inputs: dict[str, Any], mode: str, device: torch.device) -> CompileStats:
    """Compile `block` in place (inductor) and make its first call, timed apart from the runs."""
    breaks_before, graphs_before = _dynamo_counts()
    block.compile(mode=mode)
    with torch.no_grad():
        seconds = wall_seconds(lambda: block(**inputs), device=device)
    breaks, graphs = _dynamo_counts()
    return CompileStats(mode, seconds, breaks - breaks_before, graphs - graphs_before)


def run_session(settings: ProfileSettings, run_dir: Path, progress: SessionProgress = NO_PROGRESS) -> SessionResult:
    """Every recipe profiled on one block, then the attention check and the --validate chain;
    `progress` is told each stage as it starts and each unit of it as it ends."""
    s = settings
    outside = None
    if s.measure_outside:  # first, and freed before the block exists: the two are never resident together
        with progress.stage("outside the blocks: the transformer without its blocks (synthetic weights), "
                            "warm-up and timed runs"):
            outside = measure_outside(s.adapter, s.workload, s.device, s.dtype, warmup=s.warmup, runs=s.runs,
                                      seed=s.seed)
    if s.checkpoint is not None:
        with progress.stage(f"loading block {s.block_index} from {s.checkpoint}"):
            loaded = load_block_from_checkpoint(s.adapter, s.checkpoint, s.block_index, s.device, s.dtype)
    else:
        with progress.stage(f"building block {s.block_index} (synthetic weights)"):
            loaded = synthetic_block(s.adapter, s.block_index, s.device, s.dtype, seed=s.seed)
    generator = torch.Generator(device=s.device).manual_seed(s.seed)
    inputs = s.adapter.make_inputs(s.workload, s.device, s.dtype, generator)

    attention_flops = sum(call.flops for call in s.adapter.attention_calls(s.workload))
    linear_flops = s.adapter.linear_flops(loaded.block, s.workload)
    if outside is not None:
        outside_ms, outside_source = outside.median_ms, outside.source
    elif s.outside_ms is not None:
        outside_ms, outside_source = s.outside_ms, "stated with --outside-ms"
    else:
        outside_ms, outside_source = 0.0, "not measured: pass --outside measure or --outside-ms to add it"
    runs: list[BackendRun] = []
    notes: list[str] = []
    reference_output = None
    for recipe in s.recipes:
        with recipe_block(loaded.block, recipe, s.adapter) as (block, linears), \
                use_attention_backend(block, recipe.backend) as routed, processor_swap(block, recipe) as swap:
            linear_summary = None if linears is None else {**linears.as_dict(), "line": linears.summary_lines()[0]}
            del linears  # it holds the block
            compile_stats = None
            if recipe.compile_mode is not None:
                with progress.stage(f"{recipe.label}: torch.compile and its first call"):
                    compile_stats = _compile(block, inputs, recipe.compile_mode, s.device)
                graphs_after_compile = _dynamo_counts()[1]  # dynamo's counters are process-wide
            profile = profile_block(block, inputs, s.adapter, device=s.device, warmup=s.warmup, runs=s.runs,
                                    trace_path=run_dir / s.trace_name(recipe) if s.trace else None,
                                    named_ranges=recipe.compile_mode is None, progress=progress, label=recipe.label)
            if compile_stats is not None:
                compile_stats.graphs_after_first_call = _dynamo_counts()[1] - graphs_after_compile
            with torch.no_grad():
                output = block(**inputs).clone()  # a CUDA-graph replay would overwrite its own output buffer
            if routed is not None:
                routed_away = {r: n for r, n in routed.fallback_calls.items() if r.startswith("routed:")}
                fell_back = {r: n for r, n in routed.fallback_calls.items() if r not in routed_away}
                if routed_away:
                    notes.append(f"{sum(routed_away.values())} attention call(s) of {recipe.label} went to the backend "
                                 f"the measured crossover found faster at their shape ({routed.crossover_note}): "
                                 f"{routed_away}")
                if fell_back:
                    notes.append(f"{sum(fell_back.values())} attention call(s) fell back from {recipe.backend}: "
                                 f"{fell_back}")
            declined = {} if swap is None else {r: n for r, n in swap.fallback_calls.items()
                                                 if not r.startswith("routed:")}  # those are noted above
            if declined:
                what = "RoPE call(s) {} ran diffusers' own function, not the fused kernel" if recipe.fused_rope else \
                    "attention call(s) {} ran diffusers' own processor, not the fused prologue"
                notes.append(f"{sum(declined.values())} {what.format('of ' + recipe.label)}: {declined}")
            if recipe.fused_rope and recipe.compile_mode is not None:
                notes.append(f"{recipe.label}: inside the compiled graph RoPE is diffusers' own function, fused by "
                             f"inductor into its neighbours, not our RoPE kernel")
            if compile_stats is not None and compile_stats.graphs_after_first_call:
                notes.append(f"{recipe.label}: {compile_stats.graphs_after_first_call} graph(s) recompiled after the "
                             f"first call, during warm-up or the timed runs (the timings may include compiling)")
        del block  # an owned copy goes with its recipe
        if (recipe.fp8_linear or recipe.compile_mode) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        error = None if reference_output is None else output_error(output, reference_output)
        reference_output = output if reference_output is None else reference_output
        (steps, steps_source), (passes, passes_source) = s.denoising_steps(), s.passes_per_step()
        extrapolation = Extrapolation(s.adapter.num_blocks, profile.timing.median_ms, outside_ms,
                                      outside_source, steps, passes, passes_source, steps_source)
        runs.append(BackendRun(recipe.label, profile, extrapolation, attention_flops, linear_flops, error,
                               compile_stats=compile_stats,
                               fp8_linears=linear_summary))

    backends = list(dict.fromkeys(recipe.backend for recipe in s.recipes))
    with progress.stage(f"attention error on the block's own q/k/v ({len(backends)} backend(s))"):
        attention_inputs = capture_attention_inputs(loaded.block, inputs, s.adapter)
        attention_rel_err, attention_reference = attention_errors(*attention_inputs, backends)
        del attention_inputs
    for run, recipe in zip(runs, s.recipes):
        run.attention_rel_err = attention_rel_err[recipe.backend]

    stages = [measure_stage(spec, backends, device=s.device, dtype=s.dtype, warmup=s.warmup, runs=s.runs, seed=s.seed,
                            progress=progress)
              for spec in s.stages if isinstance(spec, StageSpec)]

    validation = None
    if s.validate_blocks:
        first, recipe = runs[0], s.recipes[0]
        activation_bytes = (first.profile.peak_memory_bytes or 0) - first.profile.weights_bytes
        with processor_swap(loaded.block, recipe):  # +rope's global is per model file: it covers the chain
            validation = validate_chain(s.adapter, loaded.block, inputs, s.validate_blocks, attention=recipe.backend,
                                        device=s.device, dtype=s.dtype, block_ms=first.block_ms,
                                        activation_bytes=max(0, activation_bytes), offload=s.offload,
                                        whole_model=s.workload if s.validate_model else None,
                                        outside_ms=outside_ms if s.validate_model else 0.0,
                                        outside_source=outside_source if s.validate_model else None,
                                        seed=s.seed, progress=progress)
    return SessionResult(loaded, runs, attention_reference, validation, notes, outside=outside, stages=stages)

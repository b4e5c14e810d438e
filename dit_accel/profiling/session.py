"""One profile-block session: load the block once, profile it with each attention asked for, measure
each backend's error on the block's own q/k/v, and optionally validate the extrapolation with a
chain of N blocks. `ProfileSettings` holds every choice the command line made; `run_session`
returns what `report.build_report` turns into the report."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..adapters import BlockAdapter, Workload
from ..attention.names import AttentionChoice
from ..attention.reference import rel_rms_err
from ..attention.routing import use_attention_backend
from ..loading.block import LoadedBlock, load_block_from_checkpoint, synthetic_block
from .attention_error import attention_errors, capture_attention_inputs
from .extrapolate import Extrapolation, Validation
from .profiler import profile_block
from .report import BackendRun
from .validate import validate_chain


@dataclass(frozen=True)
class ProfileSettings:
    """What to profile and how, as the command line resolved it."""

    adapter: BlockAdapter
    workload: Workload
    dtype: torch.dtype
    device: torch.device
    attention: tuple[AttentionChoice, ...]  # profiled in this order; the first is the reference
    checkpoint: Path | None = None  # None: synthetic weights
    block_index: int = 0
    warmup: int = 3
    runs: int = 10
    steps: int = 50
    guidance_passes: int = 2
    outside_ms: float | None = None  # per pass, outside the block stack, if the user measured it
    validate_blocks: int = 0
    offload: str = "resident"
    memory_budget: str | None = None  # as written, e.g. "16GiB"
    trace: bool = False
    seed: int = 0
    scaled_down: bool = False  # a CPU run of the family's scaled-down config

    def trace_name(self, choice: AttentionChoice) -> str:
        return f"trace_{choice.label.replace('+', '-')}.json"


@dataclass
class SessionResult:
    loaded: LoadedBlock
    runs: list[BackendRun]
    attention_reference: str  # the dtype the attention errors were measured against
    validation: Validation | None
    notes: list[str] = field(default_factory=list)  # things the user should know (fallbacks)


def rope_swap(block: torch.nn.Module, fuse: bool):
    """The fused-RoPE swap as a context manager (its handle, to read the counts), or nothing."""
    from ..patching import fused_rope

    return fused_rope(block) if fuse else contextlib.nullcontext()


def output_error(output: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Block output against the reference backend's: relative L2 and cosine similarity."""
    out, ref = output.double().flatten(), reference.double().flatten()
    return {"rel_l2": rel_rms_err(out, ref), "cosine": torch.nn.functional.cosine_similarity(out, ref, dim=0).item()}


def run_session(settings: ProfileSettings, run_dir: Path) -> SessionResult:
    s = settings
    if s.checkpoint is not None:
        loaded = load_block_from_checkpoint(s.adapter, s.checkpoint, s.block_index, s.device, s.dtype)
    else:
        loaded = synthetic_block(s.adapter, s.block_index, s.device, s.dtype, seed=s.seed)
    generator = torch.Generator(device=s.device).manual_seed(s.seed)
    inputs = s.adapter.make_inputs(s.workload, s.device, s.dtype, generator)

    attention_flops = sum(call.flops for call in s.adapter.attention_calls(s.workload))
    linear_flops = s.adapter.linear_flops(loaded.block, s.workload)
    outside_source = "stated with --outside-ms" if s.outside_ms is not None else "not measured: pass --outside-ms to add it"
    runs: list[BackendRun] = []
    notes: list[str] = []
    reference_output = None
    for choice in s.attention:
        with use_attention_backend(loaded.block, choice.backend) as routed, rope_swap(loaded.block, choice.fused_rope) as rope:
            profile = profile_block(loaded.block, inputs, s.adapter, device=s.device, warmup=s.warmup, runs=s.runs,
                                    trace_path=run_dir / s.trace_name(choice) if s.trace else None)
            with torch.no_grad():
                output = loaded.block(**inputs)
            if routed is not None and routed.fallback_total:
                notes.append(f"{routed.fallback_total} attention call(s) fell back from {choice.backend}: "
                             f"{dict(routed.fallback_calls)}")
            if rope is not None and rope.fallback_calls:
                notes.append(f"{sum(rope.fallback_calls.values())} RoPE call(s) of {choice.label} ran diffusers' own "
                             f"function, not the fused kernel: {dict(rope.fallback_calls)}")
        error = None if reference_output is None else output_error(output, reference_output)
        reference_output = output if reference_output is None else reference_output
        extrapolation = Extrapolation(s.adapter.num_blocks, profile.timing.median_ms, s.outside_ms or 0.0,
                                      outside_source, s.steps, s.guidance_passes)
        runs.append(BackendRun(choice.label, profile, extrapolation, attention_flops, linear_flops, error))

    attention_inputs = capture_attention_inputs(loaded.block, inputs, s.adapter)
    backends = list(dict.fromkeys(choice.backend for choice in s.attention))
    attention_rel_err, attention_reference = attention_errors(*attention_inputs, backends)
    del attention_inputs
    for run, choice in zip(runs, s.attention):
        run.attention_rel_err = attention_rel_err[choice.backend]

    validation = None
    if s.validate_blocks:
        first, choice = runs[0], s.attention[0]
        activation_bytes = (first.profile.peak_memory_bytes or 0) - first.profile.weights_bytes
        with rope_swap(loaded.block, choice.fused_rope):  # the rotary global is per model file: covers the chain
            validation = validate_chain(s.adapter, loaded.block, inputs, s.validate_blocks, attention=choice.backend,
                                        device=s.device, dtype=s.dtype, block_ms=first.block_ms,
                                        activation_bytes=max(0, activation_bytes), offload=s.offload)
    return SessionResult(loaded, runs, attention_reference, validation, notes)

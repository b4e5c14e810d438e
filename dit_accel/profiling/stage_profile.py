"""The pipeline's stages outside the denoising loop (`--stages`: VAE decode, audio decode, text
encoding), measured at the workload's size with synthetic weights like the block: built from the
family's `StageSpec` (`adapters.stage_specs`), timed (median of --runs), and profiled by the block's
own profiler (`profiler.profile_block`: the same classification and named ranges), once per
attention backend of the recipes where the stage's attention goes through diffusers' dispatch
(else once). Their memory is checked before anything is built (`stage_memory`)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..adapters.stage_specs import StageSpec
from ..attention.routing import use_attention_backend
from ..device import Ceilings
from ..adapters.building import synthetic_weights
from ..loading.block import param_bytes
from .attention_error import output_error
from .profiler import BlockProfile, profile_block
from .progress import NO_PROGRESS, SessionProgress
from .results import category_rows, range_rows, timing_noise

_GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")


class StageModule(nn.Module):
    """A stage as one module: `forward(**inputs)` is one run of it (e.g. `vae.decode(z)`), so the
    block's profiler times and instruments it (range paths start at `model.`)."""

    def __init__(self, model: nn.Module, spec: StageSpec):
        super().__init__()
        self.model = model
        self._call = spec.call

    def forward(self, **inputs: Any) -> Any:
        return self._call(self.model, **inputs)


def stage_weight_bytes(spec: StageSpec, dtype: torch.dtype) -> int:
    """The stage model's parameters in the dtypes a load gives them, counted on meta."""
    return sum(p.numel() * spec.param_dtype(name, dtype).itemsize for name, p in spec.build().named_parameters())


def count_flops(fn) -> dict[str, float]:
    """GEMM and convolution FLOPs of one call of `fn` (torch's FlopCounterMode), by kind of work."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        fn()
    flops = {"gemm": 0.0, "conv": 0.0}
    for op, count in counter.get_flop_counts().get("Global", {}).items():
        name = str(op).split(".")[-1]  # an OpOverloadPacket: "aten.addmm"
        if name in _GEMM_OPS:
            flops["gemm"] += count
        elif "convolution" in name:
            flops["conv"] += count
    return flops


@dataclass
class StageRun:
    """The stage profiled with one attention backend (None: its own attention, not patched)."""

    backend: str | None
    profile: BlockProfile
    output_vs_first: dict[str, float] | None = None
    served_calls: int | None = None  # attention calls our routed backend answered
    fallback_calls: dict[str, int] | None = None

    @property
    def ms(self) -> float:
        return self.profile.timing.median_ms


@dataclass
class StageMeasurement:
    spec: StageSpec
    param_bytes: int
    flops: dict[str, float]
    output_shape: tuple[int, ...]
    dtype: str
    runs: list[StageRun] = field(default_factory=list)

    def run_for(self, backend: str) -> StageRun:
        """The run a recipe with attention `backend` gets: its own where the stage was patched, else the one run."""
        return next((r for r in self.runs if r.backend == backend), self.runs[0])

    def as_dict(self, ceilings: Ceilings) -> dict[str, Any]:
        s = self.spec
        return {
            "stage": s.key, "title": s.title, "model": s.model_name, "config_source": s.config_source,
            "workload": s.workload, "dtype": self.dtype, "param_bytes": self.param_bytes, "flops": self.flops,
            "output_shape": list(self.output_shape), "attention_routed": s.attention_routed,
            "attention_note": s.attention_note, "notes": list(s.notes),
            "runs": [{
                "backend": r.backend, "ms": r.ms, "timing": r.profile.timing.as_dict(),
                "timing_noise": timing_noise(r.profile.timing, f"{s.title} ({r.backend or 'own attention'})"),
                "peak_memory_bytes": r.profile.peak_memory_bytes,
                "categories": category_rows(r.profile, r.ms, self.flops, ceilings),
                "modules": range_rows(r.profile, r.ms), "top_kernels": [k.as_row() for k in r.profile.kernels[:20]],
                "output_vs_first": r.output_vs_first, "served_calls": r.served_calls,
                "fallback_calls": r.fallback_calls,
            } for r in self.runs],
        }


def measure_stage(spec: StageSpec, backends: list[str], *, device: torch.device, dtype: torch.dtype,
                  warmup: int, runs: int, seed: int = 0, progress: SessionProgress = NO_PROGRESS) -> StageMeasurement:
    """Build `spec` with synthetic weights, count its FLOPs in one call, then profile it once per
    backend in `backends` (the recipes' attention, first the reference) when its attention is
    routed, else once; each later backend's output is compared with the first's."""
    model = synthetic_weights(spec.build(), device, lambda name: spec.param_dtype(name, dtype), seed)
    module = StageModule(model, spec)
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = spec.make_inputs(device, dtype, generator)
    unit_inputs = None if spec.profile_unit is None else spec.profile_unit(device, dtype, generator)
    # Counted on one of the call's equal parts where the spec names them (FlopCounterMode's Python
    # hook on each of a full-size VAE decode's ~120k ops took 38-50 s on an H200 host, 6x the decode).
    with progress.stage(f"{spec.title}: FLOP count (one run)"):
        counts = count_flops(functools.partial(module, **(unit_inputs or inputs)))
    flops = {kind: count * spec.profile_parts for kind, count in counts.items()}
    flops["attention"] = spec.attention_flops
    measurement = StageMeasurement(spec, param_bytes(model), flops, (), str(dtype).replace("torch.", ""))
    reference = None
    for backend in (backends if spec.attention_routed else [None]):
        swap = use_attention_backend(model, backend) if backend else contextlib.nullcontext()
        with swap as routed:
            label = f"{spec.title} ({backend})" if backend else spec.title
            profile = profile_block(module, inputs, spec, device=device, warmup=warmup, runs=runs,
                                    profiled_runs=1, progress=progress, label=label, profile_inputs=unit_inputs,
                                    profile_scale=spec.profile_parts)
            with torch.no_grad():
                output = module(**inputs).clone()
        run = StageRun(backend, profile)
        if routed is not None:
            run.served_calls, run.fallback_calls = routed.served_calls, dict(routed.fallback_calls)
        if reference is None:
            reference = output
            measurement.output_shape = tuple(output.shape)
        else:
            run.output_vs_first = output_error(output, reference)
        measurement.runs.append(run)
        del output
    del module, model, inputs, unit_inputs, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measurement


def stage_memory(spec: StageSpec, dtype: torch.dtype) -> tuple[int, int]:
    """(weights, activations) in bytes one run of the stage holds, before any margin."""
    return stage_weight_bytes(spec, dtype), spec.activation_bytes(dtype.itemsize)

"""Profile one block: CUDA-event timing (median of N), then one torch.profiler pass that attributes
every GPU kernel (on the CPU: every aten op's own time) to a category and to a named range."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd import DeviceType

from ..adapters import BlockAdapter, Workload
from ..timing import TimingStats, time_region
from .classify import CATEGORIES, classify
from .ranges import instrument, range_label


# Bytes per element of the dtype strings torch.profiler records for op inputs.
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
                "bool": 1, "c10::Float8_e4m3fn": 1, "signed char": 1, "unsigned char": 1, "short int": 2}


@dataclass(frozen=True)
class KernelRecord:
    """One kernel name within one range: how often it ran and its total time per block run."""

    name: str
    category: str
    range: str
    calls: float
    time_us: float
    bytes_est: float  # bytes its launching ops read (inputs) and allocated (outputs), per block run

    def as_row(self) -> dict[str, Any]:
        return {"category": self.category, "range": self.range, "kernel": self.name, "calls_per_block": self.calls,
                "time_us_per_block": self.time_us, "bytes_est_per_block": self.bytes_est}


@dataclass
class BlockProfile:
    timing: TimingStats
    kernels: list[KernelRecord]
    peak_memory_bytes: int | None
    weights_bytes: int
    profiled_runs: int
    device_kind: str  # "cuda": kernel times; "cpu": aten op self times
    trace_path: Path | None = None

    @property
    def kernel_time_us(self) -> float:
        return sum(k.time_us for k in self.kernels)

    def by(self, key: Callable[[KernelRecord], str]) -> dict[str, dict[str, float]]:
        """Sum time and bytes over records grouped by `key` (category or range)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"time_us": 0.0, "bytes_est": 0.0, "calls": 0.0})
        for k in self.kernels:
            row = out[key(k)]
            row["time_us"] += k.time_us
            row["bytes_est"] += k.bytes_est
            row["calls"] += k.calls
        return dict(out)

    def by_category(self) -> dict[str, dict[str, float]]:
        grouped = self.by(lambda k: k.category)
        return {c: grouped[c] for c in CATEGORIES if c in grouped}

    def by_range(self) -> dict[str, dict[str, float]]:
        return dict(sorted(self.by(lambda k: k.range).items(), key=lambda kv: -kv[1]["time_us"]))


def _innermost_range(event) -> str | None:
    while event is not None:
        label = range_label(event.name)
        if label is not None:
            return label
        event = event.cpu_parent
    return None


def _input_bytes(event) -> float:
    shapes = getattr(event, "input_shapes", None) or []
    dtypes = getattr(event, "input_dtypes", None) or [None] * len(shapes)
    total = 0.0
    for shape, dtype in zip(shapes, dtypes):
        if isinstance(shape, (list, tuple)) and shape and all(isinstance(d, int) for d in shape):
            numel = 1
            for d in shape:
                numel *= d
            total += numel * _DTYPE_BYTES.get(dtype, 2)
    return total


# Ops that only make views or metadata: an op whose children are all of these does its own work.
_VIEW_OPS = {"aten::resolve_conj", "aten::as_strided", "aten::empty", "aten::select", "aten::t",
             "aten::transpose", "aten::view", "aten::reshape", "aten::unsqueeze", "aten::expand",
             "aten::slice", "aten::empty_strided", "aten::_unsafe_view", "aten::split", "aten::narrow"}


def _op_bytes(event, device_kind: str) -> float:
    """Bytes an op moves, estimated: its tensor inputs plus what it allocated (its outputs)."""
    allocated = event.device_memory_usage if device_kind == "cuda" else event.cpu_memory_usage
    return _input_bytes(event) + max(0, allocated or 0)


def _does_own_work(event) -> bool:
    return all(child.name in _VIEW_OPS for child in event.cpu_children)


def _collect(prof, runs: int, device_kind: str, range_of_body: str) -> list[KernelRecord]:
    """Fold profiler events into per-(kernel, range) records, per block run."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # calls, us, bytes
    for event in prof.events():
        if event.device_type != DeviceType.CPU or range_label(event.name) is not None:
            continue
        label = _innermost_range(event) or range_of_body
        if device_kind == "cuda":
            kernels = list(event.kernels)
            op_us = sum(k.duration for k in kernels)
            op_bytes = _op_bytes(event, device_kind)
            for k in kernels:
                slot = acc[(k.name, label)]
                slot[0] += 1
                slot[1] += k.duration
                slot[2] += op_bytes * (k.duration / op_us if op_us > 0 else 0.0)
        elif event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            slot = acc[(event.name, label)]
            slot[0] += 1
            slot[1] += event.self_cpu_time_total
            slot[2] += _op_bytes(event, device_kind) if _does_own_work(event) else 0.0
    return sorted(
        (KernelRecord(name, classify(name, label), label, calls / runs, us / runs, nbytes / runs)
         for (name, label), (calls, us, nbytes) in acc.items()),
        key=lambda k: -k.time_us,
    )


def profile_block(block: nn.Module, inputs: dict[str, Any], adapter: BlockAdapter, *, device: torch.device,
                  warmup: int, runs: int, profiled_runs: int = 2, trace_path: Path | None = None) -> BlockProfile:
    """Time `block(**inputs)` and attribute its work; the inputs are reused (the block does not modify them)."""

    def step():
        with torch.no_grad():
            block(**inputs)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_region(step, device=device, warmup=warmup, runs=runs)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with instrument(block, adapter.module_ranges, use_nvtx=device.type == "cuda"):
        step()  # the hooks' first call is not profiled
        with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
            for _ in range(profiled_runs):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    kernels = _collect(prof, profiled_runs, device.type, adapter.body_label)
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    return BlockProfile(timing, kernels, peak, weights, profiled_runs, device.type, trace_path)

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
from .op_bytes import count_op_bytes
from .ranges import instrument, range_label


@dataclass(frozen=True)
class KernelRecord:
    """One kernel name within one range: how often it ran and its total time per block run."""

    name: str
    category: str
    range: str
    calls: float
    time_us: float
    bytes_est: float  # bytes its launching ops read and wrote (their tensors), per block run

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


def _collect(prof, runs: int, device_kind: str, body_label: str,
             op_bytes: dict[tuple[str, str], float]) -> list[KernelRecord]:
    """Fold profiler events into per-(kernel, range) records, per block run.

    On CUDA a record is a GPU kernel, timed by its own duration and attributed to the innermost
    range around the aten op that launched it; on the CPU it is an aten op's own (self) time. The
    op's bytes (from `count_op_bytes`, one run) are shared among its kernels by duration.
    """
    # (kernel, range) -> [calls, us]; (range, op) -> us and the kernels it launched
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    op_us: dict[tuple[str, str], float] = defaultdict(float)
    launched: dict[tuple[str, str], dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.events():
        if event.device_type != DeviceType.CPU:
            continue
        # A kernel launched outside any aten op (Triton, CuTe DSL) belongs to the innermost
        # record_function around its launch: our range events carry such kernels themselves.
        label = _innermost_range(event) or body_label
        if device_kind == "cuda":
            timed = [(k.name, k.duration) for k in event.kernels]
        elif event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            timed = [(event.name, event.self_cpu_time_total)]
        else:
            continue
        for name, us in timed:
            slot = acc[(name, label)]
            slot[0] += 1
            slot[1] += us
            op_us[(label, event.name)] += us
            launched[(label, event.name)][(name, label)] += us
    kernel_bytes: dict[tuple[str, str], float] = defaultdict(float)
    for op_key, kernels in launched.items():
        for kernel_key, us in kernels.items():
            if op_us[op_key] > 0:
                kernel_bytes[kernel_key] += op_bytes.get(op_key, 0.0) * us / op_us[op_key]
    return sorted(
        (KernelRecord(name, classify(name, label), label, calls / runs, us / runs, kernel_bytes[(name, label)])
         for (name, label), (calls, us) in acc.items()),
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
        op_bytes = count_op_bytes(step, adapter.body_label)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(profiled_runs):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    kernels = _collect(prof, profiled_runs, device.type, adapter.body_label, op_bytes)
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    return BlockProfile(timing, kernels, peak, weights, profiled_runs, device.type, trace_path)

"""Profile one block: CUDA-event timing (median of N), then one torch.profiler pass that attributes
every GPU kernel (on the CPU: every aten op's own time) to a category and to a named range."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd import DeviceType

from ..adapters import BlockAdapter
from ..adapters.ranges import range_of_kind
from ..loading.block import param_bytes
from ..timing import TimingStats, time_region
from .classify import CATEGORIES, classify, is_fp8
from .op_bytes import count_op_bytes
from .progress import NO_PROGRESS, SessionProgress
from .ranges import instrument, range_label

# libkineto (torch.profiler's tracer) writes one line to stderr at every profiler start and stop,
# `USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start` (and `:59]
# profiler_stop`). They are its USDT severity, 5, above ERROR, 4: the only switch,
# KINETO_LOG_LEVEL=6, would hide kineto's errors too, and it is read once, at the first profiler
# start of the process (not at torch's import; setting it later does nothing). TORCH_CPP_LOG_LEVEL
# does not reach kineto's logger. So the two markers are dropped by matching them, and every other
# line kineto writes meanwhile is passed on.
_KINETO_MARKER = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")
# torch 2.11 warns at a fresh profiler's first start, "Profiler clears events at the end of each cycle ... set
# acc_events=True" (its prepare_trace finds a profiler already made). A profiler pass here is one cycle, so
# nothing is lost and nothing is for the user to do: the warning is dropped there.
_ONE_CYCLE_NOTICE = r"Warning: Profiler clears events at the end of each cycle"


@contextlib.contextmanager
def kineto_markers_dropped():
    """Around a profiler start or stop: stderr (file descriptor 2, where libkineto writes) goes to a
    temporary file, and afterwards every line of it but kineto's start/stop markers goes to stderr."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _KINETO_MARKER.match(line))
            if kept:
                os.write(2, kept.encode())


# The range of every kernel of a compiled block: inductor fuses across modules, so no module range holds them.
COMPILED_RANGE_NOTE = "compiled graph (kernels fused across modules: not attributed to them)"


@dataclass(frozen=True)
class KernelRecord:
    """One kernel name within one range: how often it ran and its total time per block run."""

    name: str
    category: str
    range: str
    calls: float
    time_us: float
    bytes_est: float  # bytes its launching ops read and wrote (their tensors), per block run
    fp8: bool = False  # computes on FP8 operands (`classify.is_fp8`)
    launched_by: str | None = None  # "linear" (an nn.Linear: what FP8 linears change), "conv", or None
    # (`_launching_op`)

    def as_row(self) -> dict[str, Any]:
        return {"category": self.category, "range": self.range, "kernel": self.name, "calls_per_block": self.calls,
                "time_us_per_block": self.time_us, "bytes_est_per_block": self.bytes_est, "fp8": self.fp8,
                "launched_by": self.launched_by}


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
        """Sum time (all of it, that of FP8 kernels, that nn.Linear launched), bytes (all, and those of work no
        nn.Linear launched) and calls over records grouped by `key` (category or range)."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"time_us": 0.0, "fp8_time_us": 0.0, "linear_time_us": 0.0, "bytes_est": 0.0,
                     "not_linear_bytes_est": 0.0, "calls": 0.0})
        for k in self.kernels:
            row = out[key(k)]
            row["time_us"] += k.time_us
            row["linear_time_us"] += k.time_us if k.launched_by == "linear" else 0.0
            row["not_linear_bytes_est"] += k.bytes_est if k.launched_by != "linear" else 0.0
            row["fp8_time_us"] += k.time_us if k.fp8 else 0.0
            row["bytes_est"] += k.bytes_est
            row["calls"] += k.calls
        return dict(out)

    def by_category(self) -> dict[str, dict[str, float]]:
        grouped = self.by(lambda k: k.category)
        return {c: grouped[c] for c in CATEGORIES if c in grouped}

    def by_range(self) -> dict[str, dict[str, float]]:
        return dict(sorted(self.by(lambda k: k.range).items(), key=lambda kv: -kv[1]["time_us"]))


def _launching_op(owner) -> str | None:
    """What launched the owner's kernels, where it matters to the kind of work: "conv" under a convolution (a 1x1
    convolution runs as a GEMM kernel, but FP8 linears leave it alone), "linear" under aten::linear (an nn.Linear),
    else None; looked for from the owner outwards to its range."""
    event = owner
    while event is not None and range_label(event.name) is None:
        if _CONVOLUTION_OP.match(event.name):
            return "conv"
        if event.name == "aten::linear":
            return "linear"
        event = event.cpu_parent
    return None


_CONVOLUTION_OP = re.compile(r"aten::(?:_?convolution|conv\w*|cudnn_convolution\w*|mkldnn_convolution)$")


def _innermost_range(event) -> str | None:
    while event is not None:
        label = range_label(event.name)
        if label is not None:
            return label
        event = event.cpu_parent
    return None


# CUDA runtime / driver calls that put work on the GPU (cudaLaunchKernel, cuLaunchKernelEx,
# cudaMemcpyAsync, ...): the profiler gives each the same id as the GPU work it launched.
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")


def _timed_work(events, device_kind: str):
    """(name, µs, owner) for each piece of timed work; owner is the CPU event it ran under.

    On CUDA: every kernel, memcpy and memset on the GPU, owned by the innermost CPU event around
    the runtime call that launched it — an aten op, or, for Triton and CuTe DSL kernels launched
    outside any op, the record_function range around the launch. On the CPU: every aten op's own
    (self) time, owned by the op itself.
    """
    if device_kind != "cuda":
        for event in events:
            if event.device_type == DeviceType.CPU and event.name.startswith("aten::") \
                    and event.self_cpu_time_total > 0:
                yield event.name, event.self_cpu_time_total, event
        return
    launches = {e.id: e for e in events if e.device_type == DeviceType.CPU and _RUNTIME_CALL.match(e.name)}
    for event in events:
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False) \
                or range_label(event.name) is not None:
            continue  # GPU-side spans of record_function ranges are not work
        launch = launches.get(event.id)
        yield event.name, event.time_range.end - event.time_range.start, launch.cpu_parent if launch else None


def _bytes_key(owner, label: str, op_bytes: dict[tuple[str, str], float]) -> tuple[str, str]:
    """(range, aten op) under which `count_op_bytes` counted the owner's tensors.

    The dispatch-mode pass sees ops as they leave autograd (aten::mm, not aten::linear; aten::
    index_select, not what it calls inside), the profiler sees the whole nesting: take the
    innermost of the owner and its enclosing ops that the pass counted.
    """
    event = owner
    while event is not None and range_label(event.name) is None:
        if (label, event.name) in op_bytes:
            return label, event.name
        event = event.cpu_parent
    return label, owner.name if owner is not None else ""


def _collect(prof, runs: float, device_kind: str, body_label: str,
             op_bytes: dict[tuple[str, str], float]) -> list[KernelRecord]:
    """Fold profiler events into per-(kernel, range) records, per block run.

    The range of a record is the innermost named range around its owner (see `_timed_work`), an attention
    module's rest split by the kernel's kind (`adapters.ranges.range_of_kind`). The owner's bytes (from
    `count_op_bytes`, one run, keyed by range and aten op) are shared among the kernels it launched by
    duration.
    """
    # (kernel, range, what launched it: `_launching_op`) -> calls, µs
    acc: dict[tuple[str, str, str | None], list[float]] = defaultdict(lambda: [0.0, 0.0])
    owner_us: dict[tuple[str, str], float] = defaultdict(float)  # (range, owner op) -> µs
    launched: dict[tuple[str, str], dict[tuple[str, str, str | None], float]] = defaultdict(lambda: defaultdict(float))
    for name, us, owner in _timed_work(prof.events(), device_kind):
        label = _innermost_range(owner) or body_label
        owner_key = _bytes_key(owner, label, op_bytes)
        key = (name, label, _launching_op(owner))
        slot = acc[key]
        slot[0] += 1
        slot[1] += us
        owner_us[owner_key] += us
        launched[owner_key][key] += us
    kernel_bytes: dict[tuple[str, str, str | None], float] = defaultdict(float)
    for owner_key, kernels in launched.items():
        for kernel_key, us in kernels.items():
            if owner_us[owner_key] > 0:
                kernel_bytes[kernel_key] += op_bytes.get(owner_key, 0.0) * us / owner_us[owner_key]
    records = []
    for (name, label, launcher), (calls, us) in acc.items():
        category = classify(name, label)
        if launcher == "conv" and category == "gemm":
            category = "conv"
        records.append(KernelRecord(name, category, range_of_kind(label, category), calls / runs, us / runs,
                                    kernel_bytes[(name, label, launcher)], is_fp8(name), launcher))
    return sorted(records, key=lambda k: -k.time_us)


def profile_block(block: nn.Module, inputs: dict[str, Any], adapter: BlockAdapter, *, device: torch.device,
                  warmup: int, runs: int, profiled_runs: int = 2, trace_path: Path | None = None,
                  named_ranges: bool = True, progress: SessionProgress = NO_PROGRESS,
                  label: str = "block", profile_inputs: dict[str, Any] | None = None,
                  profile_scale: int = 1) -> BlockProfile:
    """Time `block(**inputs)` and attribute its work; the inputs are reused (the block does not modify them).

    profile_inputs, profile_scale: attribute the work of `block(**profile_inputs)`, one of
    `profile_scale` equal parts of the timed call (e.g. one clip of a VAE decode), with its kernels'
    times, calls and bytes multiplied by profile_scale; the timing is still the whole call's. For
    calls of hundreds of thousands of kernels, whose profiler events cost more than the work.

    named_ranges=False (a compiled block): no module ranges and no per-op byte count. Hooks and
    dispatch modes around a compiled graph would be traced into it or force recompiles, and its
    kernels are fused across modules anyway; every kernel then counts in the block-body range and
    is classified by its name alone. `progress` gets the warm-up, the timed runs and the profiler
    pass (the op-byte count run and the profiled runs), each stage named after `label`.
    """

    def counted(done, call_inputs=inputs):
        def run():
            with torch.no_grad():
                block(**call_inputs)
            done()
        return run

    unit = inputs if profile_inputs is None else profile_inputs

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    if warmup:
        with progress.stage(f"{label}: warm-up", warmup) as done:
            for _ in range(warmup):  # what time_region's own warm-up does, with a count
                counted(done)()
    with progress.stage(f"{label}: timed runs", runs) as done:
        timing = time_region(counted(done), device=device, warmup=0, runs=runs)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ranges = adapter.module_ranges if named_ranges else ()
    with progress.stage(f"{label}: profiler pass", profiled_runs + named_ranges) as done, \
            instrument(block, ranges, use_nvtx=device.type == "cuda"):
        op_bytes = count_op_bytes(counted(done, unit), adapter.body_label) if named_ranges else {}
        op_bytes = {key: n * profile_scale for key, n in op_bytes.items()}
        prof = torch.profiler.profile(activities=activities)
        with kineto_markers_dropped(), warnings.catch_warnings():  # `with profile(...)`'s enter and exit, filtered
            warnings.filterwarnings("ignore", message=_ONE_CYCLE_NOTICE, category=UserWarning)
            prof.__enter__()
        try:
            for _ in range(profiled_runs):
                counted(done, unit)()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            with kineto_markers_dropped():
                prof.__exit__(None, None, None)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    kernels = _collect(prof, profiled_runs / profile_scale, device.type,
                       adapter.body_label if named_ranges else COMPILED_RANGE_NOTE, op_bytes)
    return BlockProfile(timing, kernels, peak, param_bytes(block), profiled_runs, device.type, trace_path)

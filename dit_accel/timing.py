"""Timing of device work: CUDA events around the region, warm-up first, median of many runs."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class TimingStats:
    """Wall time of one call of a region, in milliseconds, over `runs` timed calls."""

    median_ms: float
    min_ms: float
    max_ms: float
    runs: int
    samples_ms: tuple[float, ...] = ()  # every timed run, in order (empty when built from a summary)

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> "TimingStats":
        return cls(statistics.median(samples_ms), min(samples_ms), max(samples_ms), len(samples_ms),
                   tuple(samples_ms))

    @property
    def max_over_min(self) -> float | None:
        """Slowest run over fastest (1.0: every run took the same time); None for a 0 ms fastest run."""
        return self.max_ms / self.min_ms if self.min_ms > 0 else None

    @property
    def cv_pct(self) -> float | None:
        """Coefficient of variation of the kept samples (sample standard deviation over mean), in
        percent; None with fewer than two samples."""
        if len(self.samples_ms) < 2:
            return None
        mean = statistics.fmean(self.samples_ms)
        return 100 * statistics.stdev(self.samples_ms) / mean if mean > 0 else None

    def as_dict(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms, "runs": self.runs,
                "max_over_min": self.max_over_min, "cv_pct": self.cv_pct, "samples_ms": list(self.samples_ms)}


def time_region(fn: Callable[[], object], *, device: torch.device, warmup: int = 3, runs: int = 10) -> TimingStats:
    """Median time of `fn()`.

    On CUDA each run is bracketed by its own pair of events on the current stream (so the launch
    queue stays full and host overhead between runs is not counted); on the CPU a perf_counter.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) for start, end in zip(starts, ends)]
    else:
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return TimingStats.from_samples(samples)


def wall_seconds(fn: Callable[[], object], *, device: torch.device) -> float:
    """Wall time of one call of `fn`, the device synchronized before and after (for one-off costs:
    a compile, a load), in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start

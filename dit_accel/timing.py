"""Timing of device work: CUDA events around the region, warm-up first, median of many runs; several cases
side by side in interleaved rounds (`time_interleaved`)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

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


def time_interleaved(
    cases: Mapping[str, Callable[[], object]],
    *,
    device: torch.device,
    warmup: int = 1,
    rounds: int = 10,
    budget_s: float | None = None,
    on_error: Callable[[str, Exception], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, TimingStats]:
    """Time of one call of each case, the cases timed in interleaved rounds, in milliseconds.

    First `warmup` calls of each case in turn (a first call may compile). Then `rounds` rounds; in each,
    every case runs once untimed and then once timed (CUDA events around it on the current stream,
    waited for; on the CPU `clock`). Interleaved, a slow start (the GPU's clocks ramp up after an idle
    spell such as a compile) falls on every case alike instead of on the first case in the list, and the
    untimed call before each timed one leaves the L2 and the clocks as that case's own back-to-back
    calls would, not as the case before it did. Measured at S = 4096 on an H200: the first of several
    kernel variants timed one after the other was 10-20% slower than the same kernel later in the list.

    budget_s: seconds from this call's start (on `clock`) after which no case starts another warm-up or
    round; each case keeps the samples it has. on_error: called with a case's name and exception, after
    which the case runs no more; None lets the exception propagate. Returns the stats of every case with
    at least one timed run, in the order of `cases`: a case missing from it raised (`on_error`) or found
    the budget spent.
    """
    started = clock()

    def out_of_time() -> bool:
        return budget_s is not None and clock() - started > budget_s

    def runs(name: str, action: Callable[[], object]) -> bool:
        """action() done; False where it raised and on_error took the exception."""
        if on_error is None:
            action()
            return True
        try:
            action()
        except Exception as error:  # noqa: BLE001 (reported per case)
            on_error(name, error)
            return False
        return True

    def warm_up(fn: Callable[[], object]) -> None:
        for _ in range(warmup):
            fn()

    def take_sample(fn: Callable[[], object], kept: list[float]) -> None:
        fn()  # untimed, then timed
        kept.append(_one_call_ms(fn, device, clock))

    live: dict[str, Callable[[], object]] = {}
    for name, fn in cases.items():
        if out_of_time():
            break
        if runs(name, lambda: warm_up(fn)):
            live[name] = fn
    samples: dict[str, list[float]] = {name: [] for name in live}
    schedule = [name for _ in range(rounds) for name in live]  # round after round of every case warmed up
    for name in schedule:
        if out_of_time():
            break  # each case keeps the samples it has
        if name in live and not runs(name, lambda: take_sample(live[name], samples[name])):
            del live[name], samples[name]
    return {name: TimingStats.from_samples(kept) for name, kept in samples.items() if kept}


def _one_call_ms(fn: Callable[[], object], device: torch.device, clock: Callable[[], float]) -> float:
    """Time of one call of fn in milliseconds: CUDA events around it on the current stream (the end one
    waited for), or on the CPU `clock`."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = clock()
    fn()
    return (clock() - t0) * 1e3

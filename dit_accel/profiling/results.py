"""What a profiled region's measurements come to, as numbers: its rows by kind of work (ms, share, and
the rate against this device's ceilings, `category_rows`) and by module (`range_rows`), a warning when
its timed runs spread widely (`timing_noise`), and one recipe's profile of the block (`BackendRun`,
with `CompileStats`). `block_report` assembles report.json from these; `render` draws them.

A matmul kind's rate is its FLOPs over its time against the GEMM ceiling of the precision it ran in:
work on FP8 operands against the FP8 GEMM (`device.FP8`), the rest against the GEMM in the block's dtype.
Which FLOPs are FP8 comes from the model where it knows (the FP8 linears' share of the GEMM FLOPs);
elsewhere a kind's FLOPs are all FP8 when FP8 kernels (`classify.is_fp8`) ran in it, as our FP8
attention does. A kind with FLOPs in both precisions gets a row per precision under it (`by_precision`),
its FP8 row timed by its FP8 kernels, the other by the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..device import FP8, Ceilings
from ..timing import TimingStats
from .classify import MATMUL_CATEGORIES
from .extrapolate import Extrapolation
from .profiler import BlockProfile

# The timed block minus the work the profiler saw: launch gaps on a GPU; Python and framework
# overhead between aten ops on the CPU.
GAPS_LABEL = {"cuda": "gaps between kernels", "cpu": "outside aten ops"}
GAPS_NOTE = {  # what the gaps row holds, under each table and plot that shows it
    "gaps between kernels": "gaps between kernels: timed block time in which the GPU ran none of its kernels "
                            "(launch latency, host work, waits)",
    "outside aten ops": "outside aten ops: timed block time no aten op held (Python, module hooks, dispatch, the "
                        "timer's own work); large in a scaled-down CPU run, whose ops are tiny",
}

COMPILED_CPU_NOTE = ("torch.compile on the CPU: inductor's fused C++ kernels are not ops the profiler sees, so these "
                     "rows hold only the ops the graph calls out to (GEMMs, attention), fitted to the timed block: "
                     "their shares mislead; compare block times only")

# Timed runs this spread out make the median a guess: the report and the terminal say so.
NOISY_MAX_OVER_MIN = 1.3  # slowest run / fastest run
NOISY_CV_PCT = 10.0  # standard deviation / mean of the runs, percent

MIXED = "mixed"  # the precision of a row whose FLOPs are in two precisions (its rows by precision are under it)


def timing_noise(timing: TimingStats, label: str) -> str | None:
    """A warning when the timed runs spread widely (max/min or CV past the thresholds), else None."""
    ratio, cv = timing.max_over_min, timing.cv_pct
    if not ((ratio is not None and ratio > NOISY_MAX_OVER_MIN) or (cv is not None and cv > NOISY_CV_PCT)):
        return None
    spread = ", ".join(([f"max/min {ratio:.2f}"] if ratio is not None else [])
                       + ([f"CV {cv:.0f}%"] if cv is not None else []))
    more = max(30, 3 * timing.runs)
    return (f"{label}: the {timing.runs} timed runs spread widely ({timing.min_ms:.2f} to {timing.max_ms:.2f} ms, "
            f"{spread}): the median {timing.median_ms:.2f} ms is uncertain; "
            f"rerun with --runs {more} on a quieter machine")


def profiled_to_timed(profile: BlockProfile, timed_ms: float) -> float:
    """Factor from profiled time to timed time. Profiled times can add up to more than the timed
    region (profiler overhead on the CPU): they are scaled down so the rows add up to it; when they
    add up to less (a GPU), the rest is shown as gaps."""
    kernel_total_ms = profile.kernel_time_us / 1e3
    return min(1.0, timed_ms / kernel_total_ms) if kernel_total_ms else 0.0


def _matmul_rate(flops: float, ms: float, precision: str, ceilings: Ceilings) -> dict[str, Any]:
    """`flops` done in `ms` in `precision`: TFLOP/s (None without time) and its percent of that precision's
    GEMM ceiling (None where the device has none), with the ceiling's name."""
    ceiling, ceiling_tflops = ceilings.gemm_ceiling(precision)
    tflops = flops / (ms * 1e-3) / 1e12 if ms else None
    pct = 100 * tflops / ceiling_tflops if tflops is not None and ceiling_tflops else None
    return {"precision": precision, "flops": flops, "tflops": tflops, "pct_of_ceiling": pct, "ceiling": ceiling}


def _matmul_rows(ms: float, fp8_ms: float, flops: float, fp8_flops: float | None, timed_ms: float,
                 ceilings: Ceilings) -> dict[str, Any]:
    """The rate fields of a matmul kind's row: `ms` of it, `fp8_ms` of that in FP8 kernels; `fp8_flops` of its
    `flops` on FP8 operands (None: all of them if FP8 kernels ran, else none)."""
    if fp8_flops is None:
        fp8_flops = flops if fp8_ms else 0.0
    parts = {precision: (part_ms, part_flops) for precision, part_ms, part_flops in
             ((FP8, fp8_ms, fp8_flops), (ceilings.dtype, ms - fp8_ms, flops - fp8_flops))
             if part_flops > 1e-9 * flops}  # less is the rounding of a difference, no work
    if len(parts) == 1:
        (precision,) = parts
        return _matmul_rate(flops, ms, precision, ceilings)
    return {"precision": MIXED, "flops": flops, "tflops": flops / (ms * 1e-3) / 1e12 if ms else None,
            "pct_of_ceiling": None, "ceiling": None,
            "by_precision": {precision: {"ms": part_ms, "share_pct": 100 * part_ms / timed_ms if timed_ms else 0.0,
                                         **_matmul_rate(part_flops, part_ms, precision, ceilings)}
                             for precision, (part_ms, part_flops) in parts.items()}}


def category_rows(profile: BlockProfile, timed_ms: float, work_flops: dict[str, float], ceilings: Ceilings,
                  fp8_flops: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Per kind of work of a profiled region (a block, a pipeline stage): ms per run, share of the
    timed run, and the rate against this device's ceilings: TFLOP/s for matmul kinds whose FLOPs
    `work_flops` gives (`fp8_flops`: how many of a kind's FLOPs are on FP8 operands, where the model
    knows; see the module docstring), GB/s from the ops' bytes for the others; the rest of the timed
    run is gaps."""
    scale = profiled_to_timed(profile, timed_ms)
    rows: dict[str, dict[str, Any]] = {}
    for category, sums in profile.by_category().items():
        kernel_ms = scale * sums["time_us"] / 1e3
        row: dict[str, Any] = {"ms": kernel_ms, "share_pct": 100 * kernel_ms / timed_ms if timed_ms else 0.0}
        if category in MATMUL_CATEGORIES:
            # What `planning.predict` reads: the GEMM time nn.Linear launched (what FP8 linears change) and the
            # tensors of the matmul work no nn.Linear launched (convolutions, bare matmuls), which a fused chain
            # of memory-bound work reads or writes as it does the linears' inputs and outputs.
            if category == "gemm":
                row["linear_ms"] = scale * sums["linear_time_us"] / 1e3
            row["not_linear_bytes_est"] = sums["not_linear_bytes_est"]
            flops = work_flops.get(category)
            if flops:
                row.update(_matmul_rows(kernel_ms, scale * sums["fp8_time_us"] / 1e3, flops,
                                        (fp8_flops or {}).get(category), timed_ms, ceilings))
        else:
            gbps = sums["bytes_est"] / (kernel_ms * 1e-3) / 1e9 if kernel_ms else 0.0
            row.update(bytes_est=sums["bytes_est"], gbps_est=gbps, pct_of_ceiling=100 * gbps / ceilings.copy_gbps,
                       ceiling="copy")
        rows[category] = row
    rows.update(_gaps_row(profile, timed_ms))
    return rows


def _gaps_row(profile: BlockProfile, timed_ms: float) -> dict[str, dict[str, float]]:
    """The timed run's time no kernel (GPU) or aten op (CPU) holds, as a row, when there is some: by kind of
    work and by module alike, so both add up to the block's time."""
    gaps_ms = timed_ms - profile.kernel_time_us / 1e3
    return {GAPS_LABEL[profile.device_kind]: {"ms": gaps_ms, "share_pct": 100 * gaps_ms / timed_ms}} \
        if gaps_ms > 0 else {}


def range_rows(profile: BlockProfile, timed_ms: float) -> dict[str, dict[str, float]]:
    """Per named range (a compiled block's kernels are all in `profiler.COMPILED_RANGE_NOTE`): ms per run and
    share of the timed run, and the gaps row as `category_rows` has it."""
    scale = profiled_to_timed(profile, timed_ms)
    ranges = profile.by_range()
    rows = {label: {"ms": scale * s["time_us"] / 1e3, "share_pct": 100 * scale * s["time_us"] / 1e3 / timed_ms}
            for label, s in ranges.items()}
    return {**rows, **_gaps_row(profile, timed_ms)}


@dataclass
class CompileStats:
    """torch.compile of one recipe's block: what it cost, and whether the graph held."""

    mode: str
    first_call_s: float  # the first call after compiling: tracing, inductor, autotuning, the run itself
    graph_breaks: int  # while tracing the block; 0 means one graph
    graphs: int  # graphs compiled by that first call
    graphs_after_first_call: int = 0  # recompiles during warm-up, timed and profiled runs

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class BackendRun:
    """One recipe's profile of the block (its attention backend and options) and what follows from it."""

    backend: str  # the recipe's label, e.g. "fp8+rope+fp8-linear+compile"
    profile: BlockProfile
    extrapolation: Extrapolation
    attention_flops: float
    linear_flops: float
    output_vs_reference: dict[str, float] | None = None  # rel_l2 / cosine against the first backend
    attention_rel_err: float | None = None  # this backend on the block's own q, k, v vs a reference
    compile_stats: CompileStats | None = None  # compiled recipes
    fp8_linears: dict[str, Any] | None = None  # FP8-linear recipes: which linears went FP8, which stayed
    fp8_linear_flops: float = 0.0  # of linear_flops, those of the linears that went FP8
    stack: str = ""  # the block stack the profiled block is of (its ModuleList's name in the model)
    # routed recipes, one block call: attention calls served, and fallen back by reason ({"served", "fallback"})
    attention_calls: dict[str, Any] | None = None

    @property
    def block_ms(self) -> float:
        return self.profile.timing.median_ms

    def category_rows(self, ceilings: Ceilings) -> dict[str, dict[str, Any]]:
        """Per category: time per block, share of the block, and the achieved rate against a ceiling."""
        work_flops = {"attention": self.attention_flops, "gemm": self.linear_flops}
        return category_rows(self.profile, self.block_ms, work_flops, ceilings,
                             fp8_flops={"gemm": self.fp8_linear_flops})

    def next_levers(self, ceilings: Ceilings, count: int = 4) -> list[dict[str, Any]]:
        """Where the time left beside attention goes, largest first: what to speed up next."""
        rows = [{"kind": category, **row} for category, row in self.category_rows(ceilings).items()
                if category != "attention" and category not in GAPS_LABEL.values()]
        return sorted(rows, key=lambda row: -row["ms"])[:count]

    def module_rows(self) -> dict[str, dict[str, float]]:
        return range_rows(self.profile, self.block_ms)

    def as_dict(self, ceilings: Ceilings) -> dict[str, Any]:
        p = self.profile
        return {
            "backend": self.backend, "stack": self.stack, "block_ms": self.block_ms, "timing": p.timing.as_dict(),
            "timing_noise": timing_noise(p.timing, self.backend),
            "kernel_time_ms": p.kernel_time_us / 1e3, "profiled_runs": p.profiled_runs,
            "peak_memory_bytes": p.peak_memory_bytes, "weights_bytes": p.weights_bytes,
            "attention_flops": self.attention_flops, "linear_flops": self.linear_flops,
            "fp8_linear_flops": self.fp8_linear_flops,
            "categories": self.category_rows(ceilings), "modules": self.module_rows(),
            "top_kernels": [k.as_row() for k in p.kernels[:20]],
            "extrapolation": self.extrapolation.as_dict(), "output_vs_reference": self.output_vs_reference,
            "attention_rel_err": self.attention_rel_err, "next_levers": self.next_levers(ceilings),
            "compile": self.compile_stats.as_dict() if self.compile_stats else None,
            "fp8_linears": self.fp8_linears, "attention_calls": self.attention_calls,
            "trace": str(p.trace_path) if p.trace_path else None,
        }

"""The profile-block report: the report dict (`build_report`: report.json's content), terminal
tables a person reads at a glance (`render`), and report.json, ops.csv and breakdown.png in the run
folder (`write_files`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from .. import __version__
from ..adapters.stages import StageSkip
from ..device import Ceilings, DeviceInfo
from ..report_io import command_line, provenance, write_csv, write_json
from ..timing import TimingStats
from .classify import MATMUL_CATEGORIES
from .extrapolate import Extrapolation, Validation, WholeVideo
from .profiler import BlockProfile

if TYPE_CHECKING:
    from .session import ProfileSettings, SessionResult
    from .stages import StageMeasurement

# The timed block minus the work the profiler saw: launch gaps on a GPU; Python and framework
# overhead between aten ops on the CPU.
GAPS_LABEL = {"cuda": "gaps between kernels", "cpu": "outside aten ops"}


COMPILED_RANGE_NOTE = "compiled graph (kernels fused across modules: not attributed to them)"

# Timed runs this spread out make the median a guess: the report and the terminal say so.
NOISY_MAX_OVER_MIN = 1.3  # slowest run / fastest run
NOISY_CV_PCT = 10.0  # standard deviation / mean of the runs, percent

SCALED_DOWN_NOTE = ("scaled-down CPU block: its times and the whole-model figures built from them "
                    "say nothing about a GPU")


def timing_noise(timing: TimingStats, label: str) -> str | None:
    """A warning when the timed runs spread widely (max/min or CV past the thresholds), else None."""
    ratio, cv = timing.max_over_min, timing.cv_pct
    if not ((ratio is not None and ratio > NOISY_MAX_OVER_MIN) or (cv is not None and cv > NOISY_CV_PCT)):
        return None
    spread = ", ".join(([f"max/min {ratio:.2f}"] if ratio is not None else []) + ([f"CV {cv:.0f}%"] if cv is not None else []))
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


def category_rows(profile: BlockProfile, timed_ms: float, work_flops: dict[str, float],
                  ceilings: Ceilings) -> dict[str, dict[str, Any]]:
    """Per kind of work of a profiled region (a block, a pipeline stage): ms per run, share of the
    timed run, and the rate against this device's ceilings: TFLOP/s for matmul kinds whose FLOPs
    `work_flops` gives, GB/s from the ops' bytes for the others; the rest of the timed run is gaps."""
    kernel_total_ms = profile.kernel_time_us / 1e3
    scale = profiled_to_timed(profile, timed_ms)
    rows: dict[str, dict[str, Any]] = {}
    for category, sums in profile.by_category().items():
        kernel_ms = scale * sums["time_us"] / 1e3
        row: dict[str, Any] = {"ms": kernel_ms, "share_pct": 100 * kernel_ms / timed_ms if timed_ms else 0.0}
        if category in MATMUL_CATEGORIES:
            flops = work_flops.get(category)
            if flops:
                tflops = flops / (kernel_ms * 1e-3) / 1e12 if kernel_ms else 0.0
                row.update(flops=flops, tflops=tflops, pct_of_ceiling=100 * tflops / ceilings.gemm_tflops)
        else:
            gbps = sums["bytes_est"] / (kernel_ms * 1e-3) / 1e9 if kernel_ms else 0.0
            row.update(bytes_est=sums["bytes_est"], gbps_est=gbps, pct_of_ceiling=100 * gbps / ceilings.copy_gbps)
        rows[category] = row
    gaps_ms = timed_ms - kernel_total_ms
    if gaps_ms > 0:
        rows[GAPS_LABEL[profile.device_kind]] = {"ms": gaps_ms, "share_pct": 100 * gaps_ms / timed_ms}
    return rows


def range_rows(profile: BlockProfile, timed_ms: float, one_range: str | None = None) -> dict[str, dict[str, float]]:
    """Per named range: ms per run and share of the timed run (all of it under `one_range`, for a
    compiled graph, whose kernels no range holds)."""
    scale = profiled_to_timed(profile, timed_ms)
    ranges = profile.by_range()
    if one_range is not None:
        ranges = {one_range: {"time_us": sum(r["time_us"] for r in ranges.values())}}
    return {label: {"ms": scale * s["time_us"] / 1e3, "share_pct": 100 * scale * s["time_us"] / 1e3 / timed_ms}
            for label, s in ranges.items()}


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

    @property
    def block_ms(self) -> float:
        return self.profile.timing.median_ms

    def category_rows(self, ceilings: Ceilings) -> dict[str, dict[str, Any]]:
        """Per category: time per block, share of the block, and the achieved rate against a ceiling."""
        return category_rows(self.profile, self.block_ms, {"attention": self.attention_flops, "gemm": self.linear_flops},
                             ceilings)

    def next_levers(self, ceilings: Ceilings, count: int = 4) -> list[dict[str, Any]]:
        """Where the time left beside attention goes, largest first: what to speed up next."""
        rows = [{"kind": category, **row} for category, row in self.category_rows(ceilings).items()
                if category != "attention" and category not in GAPS_LABEL.values()]
        return sorted(rows, key=lambda row: -row["ms"])[:count]

    def _profiled_to_block(self) -> float:
        return profiled_to_timed(self.profile, self.block_ms)

    def module_rows(self) -> dict[str, dict[str, float]]:
        return range_rows(self.profile, self.block_ms, COMPILED_RANGE_NOTE if self.compile_stats else None)

    def as_dict(self, ceilings: Ceilings) -> dict[str, Any]:
        p = self.profile
        return {
            "backend": self.backend, "block_ms": self.block_ms, "timing": p.timing.as_dict(),
            "timing_noise": timing_noise(p.timing, self.backend),
            "kernel_time_ms": p.kernel_time_us / 1e3, "profiled_runs": p.profiled_runs,
            "peak_memory_bytes": p.peak_memory_bytes, "weights_bytes": p.weights_bytes,
            "attention_flops": self.attention_flops, "linear_flops": self.linear_flops,
            "categories": self.category_rows(ceilings), "modules": self.module_rows(),
            "top_kernels": [k.as_row() for k in p.kernels[:20]],
            "extrapolation": self.extrapolation.as_dict(), "output_vs_reference": self.output_vs_reference,
            "attention_rel_err": self.attention_rel_err, "next_levers": self.next_levers(ceilings),
            "compile": self.compile_stats.as_dict() if self.compile_stats else None,
            "fp8_linears": self.fp8_linears,
            "trace": str(p.trace_path) if p.trace_path else None,
        }


def build_report(settings: "ProfileSettings", result: "SessionResult", ceilings: Ceilings,
                 ceilings_cached: bool) -> dict[str, Any]:
    """report.json's content; its "header" is also the panel at the top of the terminal output."""
    s, loaded, runs = settings, result.loaded, result.runs
    adapter, workload = s.adapter, s.workload
    info = DeviceInfo.of(s.device)
    peak = runs[0].profile.peak_memory_bytes
    dtype = str(s.dtype).replace("torch.", "")
    header = {
        "model": f"{adapter.display_name}" + (f" ({adapter.preset})" if adapter.preset else ""),
        "block": f"{loaded.index} of {adapter.num_blocks}; {loaded.source}",
        "weights": f"{loaded.param_bytes / 1e9:.3f} GB ({sum(p.numel() for p in loaded.block.parameters()) / 1e6:.1f} M params)",
        "workload": f"batch {workload.batch} x S={workload.seq_len} rows "
                    f"({', '.join(f'{k} {v}' for k, v in workload.rows.items())}); {workload.source}",
        "dtype": dtype,
        "device": info.label,
        "block time": ", ".join(f"{r.backend} {r.block_ms:.2f} ms (median of {r.profile.timing.runs}"
                                + (f", max/min {r.profile.timing.max_over_min:.2f}" if r.profile.timing.max_over_min else "")
                                + ")" for r in runs),
        "peak memory": f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a on the CPU",
    }
    if result.memory_estimate:
        m = result.memory_estimate
        header["memory estimate"] = f"~{m['total_bytes'] / 2**30:.2f} GiB with a {m['margin']:.0%} margin ({m['summary']})"
    if result.outside:
        o = result.outside
        header["outside the blocks"] = (f"{o.median_ms:.2f} ms per pass (measured: the transformer without its "
                                        f"blocks, S={o.seq_len}, {o.param_bytes / 1e9:.3f} GB of weights)")
    if s.memory_budget:
        header["memory budget"] = s.memory_budget
    if s.offload == "stream":
        header["offload"] = "stream: the --validate pass's blocks from pinned host memory, one block ahead"
    if loaded.stats:
        st = loaded.stats
        header["load"] = f"{st.bytes_read / 1e9:.3f} GB in {st.seconds:.2f} s ({st.gbps:.2f} GB/s) from {', '.join(st.shards)}"
    if s.scaled_down:
        header["NOTE"] = (f"no GPU: scaled-down {adapter.display_name} block (hidden {adapter.hidden_size}, "
                          f"{adapter.config['num_attention_heads']} heads) at S={workload.seq_len}; run on a GPU for real numbers")
    validation = result.validation
    warnings = [w for w in (timing_noise(r.profile.timing, r.backend) for r in runs) if w]
    return {
        "dit_accel_version": __version__, "command": command_line(),
        "provenance": provenance(seed=s.seed, device=s.device),
        "run_kind": "gpu" if s.device.type == "cuda" else ("cpu-scaled-down" if s.scaled_down else "cpu"),
        "scaled_down": s.scaled_down, "scaled_down_note": SCALED_DOWN_NOTE if s.scaled_down else None,
        "warnings": warnings,
        "memory_estimate": result.memory_estimate,
        "header": header, "device": info.as_dict(), "ceilings": {**ceilings.as_dict(), "from_cache": ceilings_cached},
        "model": adapter.describe(), "block": loaded.as_dict(), "workload": workload.as_dict(),
        "dtype": dtype, "memory_budget": s.memory_budget, "offload": s.offload,
        "attention_reference": result.attention_reference,
        "runs": [r.as_dict(ceilings) for r in runs],
        "validation": validation.as_dict() if validation else None,
        "outside": result.outside.as_dict() if result.outside else None,
        "stages": [m.as_dict(ceilings) for m in result.stages],
        "stages_skipped": [{"stage": spec.key, "reason": spec.reason} for spec in s.stages if isinstance(spec, StageSkip)],
        "whole_video": [v.as_dict() for v in whole_videos(s, result)] if s.stages else None,
    }


def whole_videos(settings: "ProfileSettings", result: "SessionResult") -> list[WholeVideo]:
    """Each recipe's whole video: text encoding, its denoising, VAE decode, audio decode."""
    from ..adapters.stages import STAGE_KEYS

    measured = {m.spec.key: m for m in result.stages}
    skipped = {spec.key: spec.reason for spec in settings.stages if isinstance(spec, StageSkip)}
    notes: dict[str, str] = {}
    for key in STAGE_KEYS:
        if key in measured:
            m = measured[key]
            notes[key] = f"measured: {m.spec.model_name}, {m.spec.workload}; {m.spec.attention_note}"
        else:
            notes[key] = skipped.get(key, f"not run: add it with --stages {key}")
    videos = []
    for run, recipe in zip(result.runs, settings.recipes):
        stage_s = {key: measured[key].run_for(recipe.backend).ms / 1e3 if key in measured else None
                   for key in STAGE_KEYS}
        videos.append(WholeVideo(run.backend, run.extrapolation.video_s, stage_s, notes))
    return videos


def _fmt_rate(row: dict[str, Any]) -> str:
    if "tflops" in row:
        return f"{row['tflops']:.3g} TFLOP/s ({row['pct_of_ceiling']:.0f}%)"
    if row.get("bytes_est"):  # ops outside aten (our Triton prep, CuTe DSL kernels) have no byte count
        if row["pct_of_ceiling"] > 100:  # the ops' tensors were served from cache, not memory
            return f"~{row['gbps_est']:.3g} GB/s (above the copy ceiling: cache-resident)"
        return f"~{row['gbps_est']:.3g} GB/s ({row['pct_of_ceiling']:.0f}%)"
    return ""


def _render_validation(console: Console, v: Validation) -> None:
    """The --validate lines: what ran, measured against extrapolated with its parts, the ratio, peak memory."""
    peak = f"{v.peak_memory_bytes / 2**30:.2f} GiB" if v.peak_memory_bytes is not None else "n/a on the CPU"
    if v.whole_model:
        what = (f"the whole transformer ({v.chained_blocks} blocks and the parts outside them, {v.residency}; "
                f"S={v.pass_seq_len}: {v.pass_layout})")
        parts = f"{v.chained_blocks} x {v.block_ms:.2f} ms + outside {v.outside_ms:.2f} ms"
    else:
        cycled = "" if v.distinct_blocks == v.chained_blocks else f", {v.distinct_blocks} distinct blocks cycled: that many fit"
        what = f"{v.chained_blocks} blocks chained ({v.residency}{cycled})"
        parts = f"{v.chained_blocks} x {v.block_ms:.2f} ms"
    console.print(f"  validated: {what}: measured {v.measured_ms:.1f} ms, extrapolated {v.extrapolated_ms:.1f} ms "
                  f"({parts}), ratio {v.ratio:.3f} ({v.error_pct:+.1f}%), peak memory {peak}")
    if v.streamed:
        console.print(f"  offload stream: {v.streamed.summary()}")
    if v.whole_model:
        console.print(f"  validated: outside the blocks: {v.outside_source} (--validate model measures it in this "
                      f"session unless --outside-ms states it)")


def render(console: Console, report: dict[str, Any], runs: list[BackendRun], ceilings: Ceilings,
           validation: Validation | None) -> None:
    head = report["header"]
    title = "[bold]dit-accel profile-block[/bold]"
    if report["run_kind"] != "gpu":
        title += "  [bold red]CPU SCALED-DOWN RUN: not representative of any GPU[/bold red]"
    lines = [f"{k}: {v}" for k, v in head.items()]
    console.print(Panel("\n".join(lines), title=title, expand=False))

    rate_note = (f"rates vs this device's measured ceilings: {ceilings.dtype} GEMM {ceilings.gemm_tflops:.3g} TFLOP/s, "
                 f"copy {ceilings.copy_gbps:.3g} GB/s; ~ = bytes the ops' tensors read and wrote (cache hits can beat the DRAM ceiling)")
    for run in runs:
        table = Table(title=f"Where one block's time goes — attention backend: {run.backend}", caption=rate_note)
        for col, justify in (("kind of work", "left"), ("ms / block", "right"), ("share", "right"), ("rate", "right")):
            table.add_column(col, justify=justify)
        for category, row in run.category_rows(ceilings).items():
            table.add_row(category, f"{row['ms']:.2f}", f"{row['share_pct']:.1f}%", _fmt_rate(row))
        table.add_row("[bold]block (timed)[/bold]", f"[bold]{run.block_ms:.2f}[/bold]", "100%", "", end_section=True)
        console.print(table)

        modules = Table(title=f"By module ({run.backend})")
        modules.add_column("module (NVTX range)")
        modules.add_column("ms / block", justify="right")
        modules.add_column("share", justify="right")
        for label, row in run.module_rows().items():
            modules.add_row(label, f"{row['ms']:.2f}", f"{row['share_pct']:.1f}%")
        console.print(modules)

    scaled = bool(report.get("scaled_down"))
    mark = "*" if scaled else ""
    caption = (f"attention error: each backend on the block's own q, k, v against a "
               f"{report['attention_reference']} reference; block output: against the first backend")
    if scaled:
        caption += f"\n* {SCALED_DOWN_NOTE}"
    whole = Table(title="Whole model, extrapolated from one block" + (" (* scaled-down: not GPU figures)" if scaled else ""),
                  caption=caption)
    whole.add_column("attention")
    for col in ("block ms", "per pass", "per step", "per video", "speedup", "attention error", "block output vs first"):
        whole.add_column(col, justify="right")
    base = runs[0]
    for run in runs:
        e = run.extrapolation
        err = run.output_vs_reference
        whole.add_row(run.backend, f"{run.block_ms:.2f}{mark}", f"{e.pass_ms / 1e3:.2f} s{mark}",
                      f"{e.step_ms / 1e3:.2f} s{mark}", f"{e.video_s / 60:.1f} min{mark}", f"{base.block_ms / run.block_ms:.2f}x",
                      f"{100 * run.attention_rel_err:.3g}%" if run.attention_rel_err is not None else "—",
                      f"rel L2 {100 * err['rel_l2']:.3g}%, cos {err['cosine']:.6f}" if err else "—",
                      style="dim" if scaled else None)
    console.print(whole)
    for run in runs:
        c = run.compile_stats
        if c is not None:
            console.print(f"  {run.backend}: torch.compile mode {c.mode}: first call {c.first_call_s:.1f} s (not in the "
                          f"timings), {c.graphs} graph(s), {c.graph_breaks} graph break(s), "
                          f"{c.graphs_after_first_call} recompile(s) after the first call")
        if run.fp8_linears is not None:
            console.print(f"  {run.backend}: FP8 linears (torchao): {run.fp8_linears['line']}")
    fastest = min(runs, key=lambda r: r.block_ms)
    levers = ", ".join(f"{row['kind']} {row['ms']:.2f} ms ({row['share_pct']:.0f}%)" for row in fastest.next_levers(ceilings))
    console.print(f"  next levers beside attention ({fastest.backend}): {levers}")
    for line in base.extrapolation.assumptions():
        console.print(f"  assumes: {line}")
    if not report.get("whole_video"):
        console.print("  assumes: the denoising passes only; text encoding and VAE decode are not included "
                      "(--stages measures them)")
    if validation:
        _render_validation(console, validation)
    if report.get("whole_video"):
        _render_stages(console, report, ceilings, mark)
    for warning in report.get("warnings", []):
        console.print(f"[yellow]warning: {warning}[/yellow]")


def _fmt_s(seconds: float, mark: str) -> str:
    """Seconds as a person reads them: 4.2 min, 12.34 s, 85.1 ms."""
    if seconds >= 120:
        return f"{seconds / 60:.1f} min{mark}"
    return f"{seconds:.2f} s{mark}" if seconds >= 1 else f"{seconds * 1e3:.1f} ms{mark}"


def _render_stages(console: Console, report: dict[str, Any], ceilings: Ceilings, mark: str) -> None:
    """Each measured stage's breakdown by kind of work (its first run), then the whole-video table."""
    for stage in report["stages"]:
        runs = stage["runs"]
        table = Table(title=f"{stage['title']}: {stage['model']} — {stage['workload']}",
                      caption=f"{stage['config_source']}; {stage['dtype']}, synthetic weights; {stage['attention_note']}")
        table.add_column("kind of work")
        for run in runs:
            table.add_column(f"ms ({run['backend'] or 'its own attention'})", justify="right")
            table.add_column("share", justify="right")
        table.add_column(f"rate ({runs[0]['backend'] or 'its own attention'})", justify="right")
        kinds = list(dict.fromkeys(kind for run in runs for kind in run["categories"]))
        for kind in kinds:
            cells = []
            for run in runs:
                row = run["categories"].get(kind)
                cells += [f"{row['ms']:.2f}{mark}", f"{row['share_pct']:.1f}%"] if row else ["—", ""]
            first = runs[0]["categories"].get(kind)
            table.add_row(kind, *cells, _fmt_rate(first) if first else "")
        total = []
        for run in runs:
            total += [f"[bold]{run['ms']:.2f}{mark}[/bold]", "100%"]
        table.add_row("[bold]stage (timed)[/bold]", *total, "", end_section=True)
        peaks = [f"{r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['backend'] or 'its own attention'})"
                 for r in runs if r["peak_memory_bytes"] is not None]
        if peaks:
            table.caption += f"; peak memory {', '.join(peaks)}"
        console.print(table)
        for note in stage["notes"]:
            console.print(f"  {stage['title']}: {note}")
        for run in runs[1:]:
            err = run["output_vs_first"]
            console.print(f"  {stage['title']} with {run['backend']}: {run['ms']:.2f} ms{mark} "
                          f"({runs[0]['ms'] / run['ms']:.2f}x {runs[0]['backend']}), output vs {runs[0]['backend']}: "
                          f"rel L2 {100 * err['rel_l2']:.3g}%, cos {err['cosine']:.6f}"
                          + (f"; {run['served_calls']} attention call(s) served" if run["served_calls"] is not None else ""))

    from ..adapters.stages import STAGE_TITLES

    whole = Table(title="Whole video: every stage" + (" (* scaled-down: not GPU figures)" if mark else ""))
    whole.add_column("recipe")
    for col in ("text encoding", "denoising", "VAE decode", "audio decode", "total"):
        whole.add_column(col, justify="right")
    for video in report["whole_video"]:
        cells = [_fmt_s(video["stage_s"][key], mark) if video["stage_s"][key] is not None else "—"
                 for key in ("text", "vae", "audio")]
        whole.add_row(video["recipe"], cells[0], _fmt_s(video["denoising_s"], mark), cells[1], cells[2],
                      f"[bold]{_fmt_s(video['total_s'], mark)}[/bold]")
    console.print(whole)
    for key, note in report["whole_video"][0]["stage_notes"].items():
        console.print(f"  {STAGE_TITLES[key]}: {note}")
    console.print("  denoising: steps x passes x (blocks x block + outside the blocks), as assumed above; "
                  "the total counts a stage shown — as 0 s")


def write_files(run_dir: Path, report: dict[str, Any], runs: list[BackendRun], stages: list["StageMeasurement"] = ()) -> None:
    """report.json; ops.csv (every kernel of the block's runs, then of the stages'; the stage column
    says which); with --stages, whole_video.csv (a row per recipe); breakdown.png."""
    write_json(run_dir / "report.json", report)
    stage_rows = ({"backend": run.backend or "", **k.as_row(), "stage": stage.spec.key}
                  for stage in stages for run in stage.runs for k in run.profile.kernels)
    write_csv(run_dir / "ops.csv", [*({"backend": r.backend, **k.as_row(), "stage": "block"}
                                      for r in runs for k in r.profile.kernels), *stage_rows])
    if report.get("whole_video"):
        write_csv(run_dir / "whole_video.csv", (
            {"recipe": v["recipe"], "text_encoding_s": v["stage_s"]["text"], "denoising_s": v["denoising_s"],
             "vae_decode_s": v["stage_s"]["vae"], "audio_decode_s": v["stage_s"]["audio"], "total_s": v["total_s"]}
            for v in report["whole_video"]))
    plot_breakdown(run_dir / "breakdown.png", report)


def plot_breakdown(path: Path, report: dict[str, Any]) -> None:
    """Stacked bars of each backend's block time by kind of work, and by module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    scaled = bool(report.get("scaled_down"))
    fig, axes = plt.subplots(2, 1, figsize=(11, 2 * (1.4 + 0.6 * len(runs))), squeeze=False)
    for ax, key, title in ((axes[0][0], "categories", "by kind of work"), (axes[1][0], "modules", "by module")):
        labels = list(dict.fromkeys(label for run in runs for label in run[key]))
        cmap = plt.get_cmap("tab20")
        for y, run in enumerate(runs):
            left = 0.0
            for i, label in enumerate(labels):
                ms = run[key].get(label, {}).get("ms", 0.0)
                ax.barh(y, ms, left=left, color=cmap(i % 20), label=label if y == 0 else None,
                        alpha=0.45 if scaled else 1.0, hatch="//" if scaled else None)
                left += ms
        ax.set_yticks(range(len(runs)), [r["backend"] for r in runs])
        ax.set_xlabel("ms per block" + ("*" if scaled else ""))
        ax.set_title(f"{report['header']['model']} block, {title}" + (" (SCALED-DOWN CPU RUN*)" if scaled else ""),
                     color="dimgray" if scaled else "black")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    if scaled:
        fig.text(0.01, -0.02, f"* {SCALED_DOWN_NOTE}", fontsize=8, color="dimgray", ha="left", va="top")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)

"""The profile-block report drawn for a person: the terminal's panel and tables (`render`), and the run
folder's files (`write_files`: report.json, ops.csv, whole_video.csv, breakdown.png). It draws what
`report.build_report` and `results` computed, and computes nothing of its own."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ..adapters.stage_specs import STAGE_TITLES
from ..device import FP8, Ceilings
from ..report_io import write_csv, write_json
from .classify import CATEGORIES
from .extrapolate import Validation
from .results import COMPILED_CPU_NOTE, GAPS_LABEL, GAPS_NOTE, BackendRun
from .stage_profile import StageMeasurement

if TYPE_CHECKING:
    from ..attention.crossover import MeasuredHere


def _fmt_rate(row: dict[str, Any]) -> str:
    """A row's rate: TFLOP/s (with its percent of the ceiling where there is one) or ~GB/s, or nothing."""
    if "tflops" in row:
        if row["tflops"] is None:  # FLOPs but no time: no kernel of that precision was recognized
            return ""
        pct = row["pct_of_ceiling"]
        return f"{row['tflops']:.3g} TFLOP/s" + (f" ({pct:.0f}%)" if pct is not None else "")
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
        cycled = ("" if v.distinct_blocks == v.chained_blocks
                  else f", {v.distinct_blocks} distinct blocks cycled: that many fit")
        what = f"{v.chained_blocks} blocks chained ({v.residency}{cycled})"
        parts = f"{v.chained_blocks} x {v.block_ms:.2f} ms"
    if v.video:
        video = v.video
        console.print(f"  validated: the whole video under {video.cache}: {video.steps} steps x "
                      f"{video.passes_per_step} pass(es) of {what} in {video.seconds:.2f} s, {v.measured_ms:.1f} ms a "
                      f"pass on average against {v.extrapolated_ms:.1f} ms uncached ({parts}): {v.ratio:.0%} of it; "
                      f"peak memory {peak}")
        console.print(f"  validated: the cache's hooked modules computed {video.work_computed:.0%} of their forwards "
                      f"({video.hooked_modules} a pass; per step {', '.join(map(str, video.computed_per_step))}); "
                      f"after a warm-up of {video.warmup_steps} step(s), graphs compiled during the timed video: "
                      f"{video.graphs_compiled} (plan RUN --cache {video.cache.removeprefix('cache=')} predicts the "
                      f"pass)")
    else:
        console.print(f"  validated: {what}: measured {v.measured_ms:.1f} ms, extrapolated {v.extrapolated_ms:.1f} ms "
                      f"({parts}), ratio {v.ratio:.3f} ({v.error_pct:+.1f}%), peak memory {peak}")
    if v.streamed:
        console.print(f"  offload stream: {v.streamed.summary()}")
    if v.whole_model:
        console.print(f"  validated: outside the blocks: {v.outside_source} (--validate model measures it in this "
                      f"session unless --outside-ms states it)")


def ceilings_note(ceilings: Ceilings, *, rates_fp8: bool) -> str:
    """The footnote under a table of rates: each measured ceiling by name and value, and, where the table
    rates FP8 work but the device has no FP8 GEMM ceiling, why its FP8 rates have no percentage."""
    named = [f"{ceilings.dtype} GEMM {ceilings.gemm_tflops:.3g} TFLOP/s"]
    if ceilings.fp8_gemm_tflops is not None:
        named.append(f"FP8 GEMM {ceilings.fp8_gemm_tflops:.3g} TFLOP/s")
    named.append(f"copy {ceilings.copy_gbps:.3g} GB/s")
    note = f"rates vs this device's measured ceilings: {', '.join(named)}"
    if rates_fp8 and ceilings.fp8_gemm_tflops is None:
        note += f"; FP8 rates without a percentage: no FP8 GEMM ceiling ({ceilings.fp8_gemm_unavailable})"
    return note + "; ~ = bytes the ops' tensors read and wrote (cache hits can beat the DRAM ceiling)"


def breakdown_table(run: BackendRun, ceilings: Ceilings, *, name_stack: bool = False) -> Table:
    """One recipe's block by kind of work: ms, share and rate, a row of FP8 work marked so, a row of work
    in two precisions followed by a row for each; the footnote names the ceilings. name_stack: the title
    says which stack the block is of (a model of several stacks)."""
    rows = run.category_rows(ceilings)
    rates_fp8 = any(row.get("precision") == FP8 or FP8 in row.get("by_precision", {}) for row in rows.values())
    where = f" — a block of {run.stack}" if name_stack else ""
    gaps = [GAPS_NOTE[label] for label in rows if label in GAPS_NOTE]
    if run.compile_stats is not None and run.profile.device_kind == "cpu":
        gaps.append(COMPILED_CPU_NOTE)
    table = Table(title=f"Where one block's time goes — attention backend: {run.backend}{where}",
                  caption="\n".join([ceilings_note(ceilings, rates_fp8=rates_fp8), *gaps]))
    for col, justify in (("kind of work", "left"), ("ms / block", "right"), ("share", "right"), ("rate", "right")):
        table.add_column(col, justify=justify)
    for category, row in rows.items():
        label = f"{category} ({FP8})" if row.get("precision") == FP8 else category
        table.add_row(label, f"{row['ms']:.2f}", f"{row['share_pct']:.1f}%", _fmt_rate(row))
        for precision, part in row.get("by_precision", {}).items():
            table.add_row(f"  of which {precision}", f"{part['ms']:.2f}", f"{part['share_pct']:.1f}%",
                          _fmt_rate(part))
    table.add_row("[bold]block (timed)[/bold]", f"[bold]{run.block_ms:.2f}[/bold]", "100%", "", end_section=True)
    return table


def render(console: Console, report: dict[str, Any], runs: list[BackendRun], ceilings: Ceilings,
           validation: Validation | None) -> None:
    head = report["header"]
    title = "[bold]dit-accel profile-block[/bold]"
    if report["run_kind"] == "cpu-scaled-down":
        title += "  [bold red]CPU SCALED-DOWN RUN: not representative of any GPU[/bold red]"
    elif report["run_kind"] == "cpu":
        title += "  [bold red]CPU RUN (the checkpoint's block, a short video): not representative of any GPU[/bold red]"
    lines = [f"{k}: {v}" for k, v in head.items()]
    console.print(Panel("\n".join(lines), title=title, expand=False))

    stacks = list(dict.fromkeys(run.stack for run in runs))
    for run in runs:
        console.print(breakdown_table(run, ceilings, name_stack=len(stacks) > 1))

        modules = Table(title=f"By module ({run.backend}{', ' + run.stack if len(stacks) > 1 else ''})")
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
        caption += f"\n* {report['scaled_down_note']}"
    if len(stacks) > 1:
        caption += f"\nblock ms, attention error and block output: {' / '.join(stacks)}"
    whole = Table(title="Whole model, extrapolated from one block" + (" of each stack" if len(stacks) > 1 else "")
                  + (" (* scaled-down: not GPU figures)" if scaled else ""), caption=caption)
    whole.add_column("attention")
    for col in ("block ms", "per pass", "per step", "per video", "speedup", "attention error", "block output vs first"):
        whole.add_column(col, justify="right")
    by_recipe: dict[str, list[BackendRun]] = {}
    for run in runs:
        by_recipe.setdefault(run.backend, []).append(run)
    base = runs[0].extrapolation
    for backend, recipe_runs in by_recipe.items():
        e = recipe_runs[0].extrapolation
        whole.add_row(backend, " / ".join(f"{run.block_ms:.2f}{mark}" for run in recipe_runs),
                      f"{e.pass_ms / 1e3:.2f} s{mark}", f"{e.step_ms / 1e3:.2f} s{mark}",
                      f"{e.video_s / 60:.1f} min{mark}", f"{base.pass_ms / e.pass_ms:.2f}x",
                      " / ".join(f"{100 * run.attention_rel_err:.3g}%" if run.attention_rel_err is not None else "—"
                                 for run in recipe_runs),
                      " / ".join(f"rel L2 {100 * run.output_vs_reference['rel_l2']:.3g}%, cos "
                                 f"{run.output_vs_reference['cosine']:.6f}" if run.output_vs_reference else "—"
                                 for run in recipe_runs),
                      style="dim" if scaled else None)
    console.print(whole)
    for run in runs:
        c = run.compile_stats
        if c is not None:
            console.print(f"  {run.backend}: torch.compile mode {c.mode}: first call {c.first_call_s:.1f} s (not in "
                          f"the timings), {c.graphs} graph(s), {c.graph_breaks} graph break(s), "
                          f"{c.graphs_after_first_call} recompile(s) after the first call")
        if run.fp8_linears is not None:
            console.print(f"  {run.backend}: {run.fp8_linears['line']}")
    fastest = min(runs, key=lambda r: r.block_ms)
    levers = ", ".join(f"{row['kind']} {row['ms']:.2f} ms ({row['share_pct']:.0f}%)"
                       for row in fastest.next_levers(ceilings))
    console.print(f"  next levers beside attention ({fastest.backend}): {levers}")
    for line in base.assumptions():
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
                      caption=f"{stage['config_source']}; {stage['dtype']}, synthetic weights; "
                              f"{stage['attention_note']}")
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
            served = f"; {run['served_calls']} attention call(s) served" if run["served_calls"] is not None else ""
            console.print(f"  {stage['title']} with {run['backend']}: {run['ms']:.2f} ms{mark} "
                          f"({runs[0]['ms'] / run['ms']:.2f}x {runs[0]['backend']}), output vs {runs[0]['backend']}: "
                          f"rel L2 {100 * err['rel_l2']:.3g}%, cos {err['cosine']:.6f}{served}")

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


def write_files(run_dir: Path, report: dict[str, Any], runs: list[BackendRun],
                stages: Sequence[StageMeasurement] = (), routing: MeasuredHere | None = None) -> None:
    """report.json; ops.csv (every kernel of the block's runs, then of the stages'; the stage column
    says which); with --stages, whole_video.csv (a row per recipe); breakdown.png; the attention crossover
    data the run's device routes by, where there is any (`crossover.RUN_FILE`: `plan` reads it)."""
    write_json(run_dir / "report.json", report)
    if routing is not None:
        routing.copy_into(run_dir)
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


# One colour per kind of work and per module, the same in every run's plot (not by rank, which changes
# between runs). Every named kind and module has its own hue or shade, no two alike: the kinds take tab20's ten
# strong colours and then its light ones, the modules the light ones left and then tab20b's and tab20c's; a label
# that is both (rope) keeps the kind's colour; any other module takes one of the slots left, by a stable hash.
KIND_COLOURS = (*CATEGORIES, *GAPS_LABEL.values())
MODULE_COLOURS = ("attention core", "qkv projection", "ffn", "output projection", "qk-norm", "cross-attention",
                  "norms", "AdaLN modulation", "modulation + residual (block body)", "attention (other)")


def _palette() -> list[tuple[float, ...]]:
    import matplotlib

    tab20, tab20b, tab20c = (matplotlib.colormaps[name] for name in ("tab20", "tab20b", "tab20c"))
    return ([tab20(i) for i in range(0, 20, 2)] + [tab20(i) for i in range(1, 20, 2)]
            + [tab20b(i) for i in range(0, 20, 4)] + [tab20c(i) for i in range(0, 20, 4)]
            + [tab20b(i) for i in range(2, 20, 4)] + [tab20c(i) for i in range(2, 20, 4)])


def colour_of(label: str) -> tuple[float, ...]:
    """`label`'s colour: its slot as a kind of work, else as a named module, else one of the slots after them picked
    by a hash of the name."""
    import zlib

    palette = _palette()
    named = (*KIND_COLOURS, *(m for m in MODULE_COLOURS if m not in KIND_COLOURS))
    if label in named:
        return palette[named.index(label)]
    spare = len(palette) - len(named)
    return palette[len(named) + zlib.crc32(label.encode()) % spare]


def bar_names(runs: list[dict[str, Any]]) -> list[str]:
    """Each run's bar label: its recipe, and its stack where the model has several (a bar per recipe and stack)."""
    several_stacks = len({run.get("stack") for run in runs}) > 1
    return [f"{run['backend']}, {run['stack']}" if several_stacks else run["backend"] for run in runs]


def plot_breakdown(path: Path, report: dict[str, Any]) -> None:
    """Stacked bars of each run's block time by kind of work, and by module: one bar per recipe (and per stack, named
    so, for a model of several), top to bottom in the terminal's order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    scaled = bool(report.get("scaled_down"))
    names = bar_names(runs)
    fig, axes = plt.subplots(2, 1, figsize=(11, 2 * (1.4 + 0.6 * len(runs))), squeeze=False)
    for ax, key, title in ((axes[0][0], "categories", "by kind of work"), (axes[1][0], "modules", "by module")):
        labels = list(dict.fromkeys(label for run in runs for label in run[key]))
        for y, run in enumerate(runs):
            left = 0.0
            for label in labels:
                ms = run[key].get(label, {}).get("ms", 0.0)
                ax.barh(y, ms, left=left, color=colour_of(label), label=label if y == 0 else None,
                        alpha=0.45 if scaled else 1.0, hatch="//" if scaled else None)
                left += ms
        ax.set_yticks(range(len(runs)), names)
        ax.invert_yaxis()  # the first run on top, as the terminal's tables list them
        ax.set_xlabel("ms per block" + ("*" if scaled else ""))
        ax.set_title(f"{report['header']['model']} block, {title}" + (" (SCALED-DOWN CPU RUN*)" if scaled else ""),
                     color="dimgray" if scaled else "black")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    notes = [GAPS_NOTE[label] for label in GAPS_NOTE if any(label in run["categories"] for run in runs)]
    if scaled:
        notes.append(f"* {report['scaled_down_note']}")
    if notes:
        fig.text(0.01, -0.02, "\n".join(notes), fontsize=8, color="dimgray", ha="left", va="top")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)

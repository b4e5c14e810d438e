"""`dit-accel generate` (a whole diffusers pipeline from a local folder, stage-timed, video out) and
`dit-accel make-tiny-pipeline` (a tiny random pipeline built offline, for tests and first runs)."""
from __future__ import annotations

import contextlib
import math
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from ..errors import UserError
from ..loading import OFFLOAD_CHOICES
from ..pipelines.tiny import TINY_BUILDERS, make_tiny_pipeline as build_tiny, read_run_defaults
from ..report_io import console, print_note
from ..run_dir import DEFAULT_OUTPUT_ROOT, StagedRun, check_run_dir, default_run_name
from .options import (ATTENTION_HELP, AtLeast, DtypeChoice, FiniteFloat, RecipeParam, Seed, compile_option,
                      linear_option, skip_crossover_option)

if TYPE_CHECKING:  # torch and diffusers load when a command runs, not for --help (see cli.py)
    import torch
    from rich.progress import Progress

    from ..patching.recipe import Recipe
    from ..pipelines.generate_report import GenerateSettings
    from ..pipelines.running import Request, RunResult

DEFAULT_PROMPT = "a red fox running through fresh snow at sunset, wide shot"
MAX_STEPS_LISTED = 12  # step rows printed in full; more are summarised
MAX_FRAMES_LISTED = 32  # per-frame quality rows printed; report.json has them all


@click.command("make-tiny-pipeline")
@click.argument("family", type=click.Choice(sorted(TINY_BUILDERS)))
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--seed", type=Seed(), default=0, show_default=True, help="Seed of the random weights.")
@click.option("--transformer", "transformer_preset", metavar="PRESET", default=None,
              help="The family's real-size transformer of this preset (`dit-accel models`; random weights of "
                   "realistic scale, bf16) in place of the tiny one, the text encoder and VAE staying tiny: the "
                   "denoising loop at its real cost (recipes, step caches) without a download, on a GPU. generate "
                   "then runs the pipeline's own video size and steps.")
def make_tiny_pipeline(family, directory, seed, transformer_preset):
    """Build a tiny RANDOM pipeline of FAMILY into DIRECTORY, offline (save_pretrained layout).

    Its output is noise; every stage of the real pipeline runs, on a CPU in seconds:
    `dit-accel generate --pipeline DIRECTORY`.
    """
    info = build_tiny(family, directory, seed, transformer_preset)
    params = ", ".join(f"{name} {m:.2f} M" for name, m in info["params_m"].items())
    d = info["defaults"]
    print_note(info["moved_note"])
    what = f"{transformer_preset}'s transformer, " if transformer_preset else ""
    runs = (f"{info['pipeline']}'s own video size and steps" if transformer_preset
            else f"{d['frames']} frames at {d['height']}x{d['width']}, {d['steps']} steps")
    console.print(f"wrote {info['folder']}/: tiny random {info['pipeline']} ({what}{params} params); "
                  f"generate defaults {runs}")


def precheck(pipeline_dir: Path | None = None, **_) -> None:
    """What is checked before torch and diffusers load (`cli.LazyCommand.precheck`): the pipeline folder."""
    if pipeline_dir is not None:
        from ..loading.folders import pipeline_index

        pipeline_index(pipeline_dir)


def _progress() -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def _run(pipe, request: Request, device: torch.device, attention: Recipe, warmup: bool, folder: Path) -> RunResult:
    from ..patching.step_cache import load_mag_ratios, save_mag_ratios
    from ..pipelines.running import run_once, warm_up

    mag_ratios = load_mag_ratios(folder) if _needs_mag_ratios(attention) else None
    if warmup:
        with console.status(f"warm-up call ({attention.label} attention, 1 step)"):
            warm_up(pipe, request, device=device, attention=attention, mag_ratios=mag_ratios)
    with _progress() as progress:
        task = progress.add_task(f"denoising ({attention.label} attention)", total=request.steps)
        run = run_once(pipe, request, device=device, attention=attention, mag_ratios=mag_ratios,
                       on_step=lambda done: progress.update(task, completed=done))
    for cache in run.attention_summary.get("step_cache", ()):
        if cache["calibration"]:
            path = save_mag_ratios(folder, cache["calibration"], request.steps)
            console.print(f"MagCache: {len(cache['calibration'])} ratios measured, kept for +cache=mag in {path}")
    return run


def _stage_table(runs: list[RunResult], dtype_name: str) -> Table:
    """Stage times of each run, one column per run, headed by its attention name (`bf16` is the name of
    the model's own attention, `native`, not a dtype: the title names the run's dtype)."""
    compare = len(runs) == 2
    table = Table(title=f"Stage times (ms), dtype {dtype_name}"
                        + (f" — speed-up = {runs[1].attention} over {runs[0].attention} attention" if compare else ""))
    table.add_column("stage")
    for run in runs:
        table.add_column(f"{run.attention} attention, ms", justify="right")
    if compare:
        table.add_column("speed-up", justify="right")

    def row(label: str, values: list[float | None]) -> None:
        cells = ["—" if v is None else f"{v:.1f}" for v in values]
        if compare:
            a, b = values
            cells.append(f"{a / b:.2f}x" if a and b else "—")
        table.add_row(label, *cells)

    times = [run.times for run in runs]
    row("text encoding", [t.text_encoding_ms for t in times])
    n_steps = max(len(t.step_ms) for t in times)

    def step(t, i):
        return t.step_ms[i] if i < len(t.step_ms) else None

    if n_steps <= MAX_STEPS_LISTED:
        for i in range(n_steps):
            row(f"  step {i + 1}", [step(t, i) for t in times])
    else:  # first two, the median of the middle, the last; report.json has every step
        row("  step 1", [step(t, 0) for t in times])
        row("  step 2", [step(t, 1) for t in times])
        row(f"  steps 3-{n_steps - 1} (median)", [statistics.median(t.step_ms[2:-1]) if len(t.step_ms) > 3 else None
                                                   for t in times])
        row(f"  step {n_steps}", [step(t, n_steps - 1) for t in times])
    row("denoising (all steps)", [t.denoise_ms for t in times])
    row("VAE decode", [t.vae_decode_ms for t in times])
    if any(t.audio_decode_ms is not None for t in times):
        row("audio decode", [t.audio_decode_ms for t in times])
    row("other (latents, post-processing)", [t.other_ms for t in times])
    row("total", [t.total_ms for t in times])
    return table


def _needs_mag_ratios(attention: Recipe) -> bool:
    return attention.cache is not None and attention.cache.method == "mag" and not attention.cache.calibrate


def _calibrates_mag(attention: Recipe) -> bool:
    return attention.cache is not None and attention.cache.method == "mag" and attention.cache.calibrate


def check_mag_ratios(attention: Recipe, folder: Path, *, calibrated_before: bool = False) -> None:
    """A UserError before the pipeline loads when `+cache=mag` has no ratios measured for this pipeline yet, nor
    does an earlier run of the same call measure them (`calibrated_before`)."""
    from ..patching.step_cache import load_mag_ratios

    if _needs_mag_ratios(attention) and not calibrated_before and load_mag_ratios(folder) is None:
        calibrate = attention.label.replace(attention.cache.label, attention.cache.label + ":calibrate")
        raise UserError(f"{attention.label}: MagCache needs this pipeline's ratios, measured once; run --attn "
                        f"{calibrate} first (it skips nothing and keeps them)")


def _cache_line(attention: str, cache: dict, graphs_compiled: int) -> str:
    """What a run's step cache ran: its passes, the share of the work it hooks that was computed, the steps where it
    skipped some, and the graphs torch.compile made during the run (after the warm-up: recompiles)."""
    steps = cache["per_step"]
    skipped = [i + 1 for i, step in enumerate(steps) if step["computed"] < step["full"]]
    shown = ", ".join(map(str, skipped[:12])) + (f" and {len(skipped) - 12} more" if len(skipped) > 12 else "")
    from ..patching.step_cache import CACHE_METHODS, parse_cache
    from ..planning.cached import cache_skip_measured

    work, skip = cache["work_computed"], cache_skip_measured(cache)
    spec = parse_cache(cache["cache"].removeprefix("cache="))
    method = CACHE_METHODS[spec.method]
    why_none = measured = ""
    if not method.fixed_schedule and not spec.calibrate:
        threshold = method.params[0]
        against = f"its {threshold.name}, {spec.value(threshold.name):g}"
        changes = cache.get("changes")
        ran = (f"the changes it measured ran {changes['min']:.3f} to {changes['max']:.3f}, median "
               f"{changes['median']:.3f}" if changes else "")
        if steps and not skipped:
            why_none = (f" (it skips where what it compares changed by less than {against}"
                        f"{'; ' + ran if ran else ''}: a larger one skips more; judge the video with --compare)")
        elif ran:
            measured = f"; {ran}, against {against}"
    return (f"{attention}: {cache['method']} over {cache['passes']} transformer passes, "
            f"{'all' if work is None else f'{work:.0%} of'} the work it hooks ({cache['hooked_modules']} modules a "
            f"pass) computed" + (f"; steps with work skipped: {shown or 'none'}{why_none}" if steps else "") + measured
            + (f"; torch.compile made {graphs_compiled} graph(s) during the run" if "+compile" in attention
               or "+max-autotune" in attention or graphs_compiled else "")
            + (f"; to predict it: plan RUN --cache {spec.written} --cache-skip {skip:.3f}"
               if skip is not None else ""))


def _quality_table(quality: dict, reference: str, attention: str) -> Table:
    table = Table(title=f"{attention} against {reference}, same seed: per-frame PSNR and SSIM")
    table.add_column("frame", justify="right")
    table.add_column("PSNR dB", justify="right")
    table.add_column("SSIM", justify="right")
    psnr, ssim = quality["psnr_db_per_frame"], quality["ssim_per_frame"]
    for i in range(min(len(psnr), MAX_FRAMES_LISTED)):
        table.add_row(str(i), _decibels(psnr[i]), f"{ssim[i]:.4f}")
    if len(psnr) > MAX_FRAMES_LISTED:
        table.add_row("...", f"({len(psnr) - MAX_FRAMES_LISTED} more in report.json)", "")
    mean, identical = quality["psnr_db_mean"], quality["identical_frames"]
    mean_psnr = _decibels(mean)
    if identical and not math.isinf(mean):
        mean_psnr += f" ({identical} identical, not counted)"
    table.add_row("mean", mean_psnr, f"{quality['ssim_mean']:.4f}")
    table.add_row("min", _decibels(quality["psnr_db_min"]),
                  f"{quality['ssim_min']:.4f}")
    return table


def _decibels(psnr: float) -> str:
    return "inf" if math.isinf(psnr) else f"{psnr:.2f}"


def _comparisons_table(comparisons: list[dict]) -> Table:
    """Each --attn against the reference, a row each: the speed-ups and the video's PSNR/SSIM (per frame in
    report.json)."""
    table = Table(title=f"each attention against {comparisons[0]['reference']}, same seed (one run each)")
    for name in ("attention", "median step", "all steps", "whole call", "PSNR dB mean", "SSIM mean", "SSIM min"):
        table.add_column(name, justify="left" if name == "attention" else "right")
    for c in comparisons:
        table.add_row(c["candidate"], *(f"{c[k]:.2f}x" for k in ("median_step_speedup", "denoise_speedup",
                                                                 "total_speedup")),
                      _decibels(c["psnr_db_mean"]),
                      f"{c['ssim_mean']:.4f}", f"{c['ssim_min']:.4f}")
    return table


@click.command("generate")
@click.option("--pipeline", "pipeline_dir", type=click.Path(path_type=Path), required=True,
              help="Local diffusers pipeline folder (model_index.json, or modular_model_index.json for "
                   "MiniMax-H3); never fetched from a hub.")
@click.option("--attn", type=RecipeParam(many=True), default=None,
              help=f"Attention: {ATTENTION_HELP}. bf16/native leave the pipeline's own attention alone; fp8 is our "
                   "FP8 kernel (sm_89+ GPUs). Several, separated by commas, run one after another on the same "
                   "pipeline, seed and prompt (e.g. one recipe with each step cache). Default native (the "
                   "pipeline's own attention, in its dtype), or fp8 with --compare.")
@click.option("--compare", type=RecipeParam(), default=None,
              help="Also run the same seed with this attention first (e.g. bf16); report per-frame PSNR/SSIM of "
                   "each --attn against it and the speed-ups.")
@linear_option()
@compile_option()
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True)
@click.option("--frames", type=AtLeast(1), default=None,
              help="Frames (default: the pipeline's, or a tiny pipeline's own).")
@click.option("--height", type=AtLeast(1), default=None)
@click.option("--width", type=AtLeast(1), default=None)
@click.option("--steps", type=AtLeast(1), default=None, help="Denoising steps (default: the pipeline's).")
@click.option("--seed", type=Seed(), default=0, show_default=True)
@click.option("--guidance", type=FiniteFloat(0), default=None, help="Guidance scale (default: the pipeline's).")
@click.option("--device", "device_name", default=None, help="cuda, cuda:1 or cpu (default: cuda when present).")
@click.option("--dtype", type=DtypeChoice(), default=None, help="Default bf16 on a GPU, fp32 on the CPU.")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="An untimed 1-step call per attention first (kernel compiles stay out of the timings).")
@click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default="resident", show_default=True,
              help="stream: the transformer stays in pinned host memory and streams onto the GPU one block at a "
                   "time, the next block prefetched on a side stream (for GPUs smaller than the model).")
@click.option("--ulysses", type=AtLeast(1), default=1, show_default=True,
              help="Split the transformer's sequence over N GPUs with diffusers' Ulysses context parallelism; "
                   "start with torchrun --nproc-per-node N -m dit_accel generate ... --ulysses N.")
@skip_crossover_option()
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run folder (default outputs/generate_<pipeline>_<time>/).")
def generate(pipeline_dir, attn, compare, linear, compile_mode, prompt, frames, height, width, steps, seed, guidance,
             device_name, dtype, warmup, offload, ulysses, skip_crossover, out):
    """Run a whole diffusers pipeline from a local folder: stage timings, the video (MP4), report.json.

    --compare runs both attentions with the same seed and reports PSNR/SSIM per frame and the speed-ups of
    the median step, of all the steps and of the whole call. MiniMax-H3's modular pipeline: --steps N runs N
    denoising steps, --guidance is refused (it is guidance-distilled), and its video is 5 to 15 s (frames
    17n + 5, at least 124; height and width multiples of 32); it also writes audio.wav and muxes the sound
    into video.mp4. --offload stream needs a CUDA GPU; under --ulysses the measured crossover does not
    route calls.
    """
    import torch

    from ..device import pick_device
    from ..loading.offload import check_offload
    from ..patching.fp8_linear import fp8_linear_unavailable_reason
    from ..patching.recipe import parse_recipe
    from ..pipelines.pipeline_folder import inspect_pipeline_folder
    from ..pipelines.parallel import UNEVEN_SEQUENCE, start_ulysses, stop_ulysses
    from ..pipelines.generate_report import GenerateSettings
    from ..pipelines.running import AttentionUnavailable, Request
    from ..pipelines.video_io import mp4_writer

    candidates = [choice.with_options(fp8_linear=linear == "fp8", compile_mode=compile_mode)
                  for choice in attn or [parse_recipe("fp8" if compare else "native")]]  # --compare runs as named
    labels = [choice.label for choice in candidates]
    if compare and compare.label in labels:
        raise UserError(f"--compare {compare.label} compares other attentions against {compare.label}; "
                        f"leave it out of --attn (e.g. --attn fp8)")
    if len(set(labels)) < len(labels):
        raise UserError(f"--attn names {next(x for x in labels if labels.count(x) > 1)} twice; name each once")
    folder = inspect_pipeline_folder(pipeline_dir)
    mp4_writer()  # the video is written after every run: refuse now, not after the runs
    suggested = read_run_defaults(pipeline_dir)

    def given_or_suggested(value, key):
        return value if value is not None else suggested.get(key)

    request = Request(prompt=prompt, frames=given_or_suggested(frames, "frames"),
                      height=given_or_suggested(height, "height"), width=given_or_suggested(width, "width"),
                      steps=steps if steps is not None else (suggested.get("steps") or 50), seed=seed,
                      guidance=given_or_suggested(guidance, "guidance"))
    if ulysses > 1 and offload == "stream":
        raise UserError("--ulysses and --offload stream do not combine: the GPUs share the model, so stream on one "
                        "GPU or split over several")
    if ulysses > 1 and device_name is not None:
        raise UserError("--ulysses gives each torchrun process its own GPU (LOCAL_RANK); leave out --device")
    staged = StagedRun(out or DEFAULT_OUTPUT_ROOT / default_run_name("generate", folder.name), numbered=out is None)
    if out is not None:
        check_run_dir(out)  # on every rank, before any of them waits for the others
    group = start_ulysses(ulysses) if ulysses > 1 else None
    finished = False
    try:
        device = group.device if group else pick_device(device_name)
        if group and not group.is_main:
            console.quiet = True  # rank 0 speaks and writes for all
        order = (compare, *candidates) if compare else tuple(candidates)  # the reference first
        for choice in order:
            try:
                check_attention(choice, device)
            except AttentionUnavailable as exc:
                raise UserError(_unavailable_line(exc, as_reference=choice is compare,
                                                  defaulted=attn is None and choice is not compare)) from exc
        check_offload(offload, device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        check_video_fits(request, len(order))
        for i, choice in enumerate(order):  # FP8 linears, MagCache's ratios: refused before the pipeline loads
            reason = choice.fp8_linear and fp8_linear_unavailable_reason(device, dtype)
            if reason:
                raise UserError(f"{choice.label}: {reason}")
            check_mag_ratios(choice, folder.path, calibrated_before=any(_calibrates_mag(c) for c in order[:i]))
        settings = GenerateSettings(folder, request, device, dtype, order, warmup, offload, group, skip_crossover,
                                    reference=compare is not None)
        with (staged if group is None or group.is_main else _scratch_dir()) as run_dir:
            report = _generate(settings, run_dir)
        finished = True
    except torch.OutOfMemoryError as exc:
        raise UserError(f"the pipeline in {folder.path} does not fit in this GPU's memory at "
                        f"{request.frames} frames of {request.height}x{request.width}; lower them") from exc
    except AssertionError as exc:
        if group and UNEVEN_SEQUENCE in str(exc):  # diffusers' Ulysses sharder, the same on every rank
            raise UserError(f"--ulysses {group.degree} splits the transformer's sequence evenly over the GPUs and "
                            f"this request's does not divide by {group.degree}; change --frames, --height or "
                            f"--width (for MiniMax-H3 also the prompt, whose tokens are in the sequence) or the "
                            f"degree") from exc
        raise
    finally:
        if group:
            stop_ulysses(synchronize=finished)
    print_note(staged.moved_note)
    console.print(f"\nwrote {staged.final}/: {', '.join(report['files'])}")
    return report


# Bytes per pixel of a decoded video the run holds on the host: the pipeline's float32 RGB frames, our copy, and
# the uint8 frames the MP4 writer takes.
VIDEO_HOST_BYTES_PER_PIXEL = 3 * (4 + 4 + 1)


def check_video_fits(request: "Request", runs: int) -> None:
    """A UserError, before the pipeline loads, when the decoded videos alone (one per run, float32 RGB and
    their copies) exceed the host's available memory: a lower bound of what the run needs, so a size that
    cannot work is refused in one line with the most frames that would fit, not by an allocation failure."""
    import torch

    from ..headroom import GiB, memory_room

    if None in (request.frames, request.height, request.width):
        return  # the pipeline's own defaults: its sizes are the ones it was made for
    found = memory_room(torch.device("cpu"))
    if found is None:
        return
    room, where = found
    per_frame = request.height * request.width * VIDEO_HOST_BYTES_PER_PIXEL * runs
    need = request.frames * per_frame
    if need > room:
        raise UserError(f"{runs} decoded video(s) of {request.frames} frames at {request.height}x{request.width} "
                        f"alone need {need / GiB:.1f} GiB (float32 RGB and its copies): they do not fit in {where}; "
                        f"lower --frames (at most {room // per_frame} fit), --height or --width")


def check_attention(attention: Recipe, device: torch.device) -> None:
    """`pipelines.running.check_attention` (a name of this module, so tests can stand in for it)."""
    from ..pipelines.running import check_attention as check

    check(attention, device)


def _unavailable_line(exc, *, as_reference: bool, defaulted: bool) -> str:
    """The one line for an attention that cannot run here, naming the option the user wrote, or saying
    that nobody wrote it (--compare's default candidate is fp8)."""
    label, reason = exc.attention.label, exc.reason
    if as_reference:
        return f"--compare {label} cannot run here: {reason}; compare against --compare bf16 (or run on an sm_89+ GPU)"
    if defaulted:
        return (f"--compare runs {label} attention (the default --attn with --compare) against the reference, and "
                f"{label} cannot run here: {reason}; pass --attn with an attention that runs here (e.g. --attn math) "
                f"or run on an sm_89+ GPU")
    return str(exc)


class _StatusProgress:
    """A stage (`profiling.progress.SessionProgress`'s protocol) shown as the console's spinner while it runs."""

    @contextlib.contextmanager
    def stage(self, label: str, total: int | None = None):
        with console.status(label):
            yield lambda: None


@contextlib.contextmanager
def _scratch_dir():
    """Where a rank other than 0 writes its (identical) outputs, deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="dit-accel-rank-") as scratch:
        yield Path(scratch)


def _generate(settings: GenerateSettings, run_dir: Path) -> dict:
    from ..attention.backends import BACKENDS
    from ..attention.crossover import measure_here
    from ..loading.offload import host_to_device_gbps
    from ..pipelines.pipeline_folder import load_pipeline, streamed_bytes
    from ..pipelines.parallel import apply_ulysses
    from ..patching.apply import drop_compiled
    from ..pipelines.generate_report import build_header, build_report, compare_runs, streaming_figures, write_outputs
    from ..report_io import write_json

    s = settings
    crossover = None
    if s.group is None and any(BACKENDS[choice.backend].routed for choice in s.attention):
        routing = measure_here(s.device, skip=s.skip_crossover, progress=_StatusProgress())
        if routing.replaced:
            print_note(f"{routing.replaced}: measured again")
        console.print(f"[dim]attention routing: {routing.note}[/dim]")
        crossover = routing.as_dict()
    with console.status(f"loading {s.folder.class_name} from {s.folder.path}"):
        pipe = load_pipeline(s.folder, device=s.device, dtype=s.dtype, offload=s.offload)
        if s.group:
            apply_ulysses(pipe, s.group.degree)
    runs = []
    for i, choice in enumerate(s.attention):
        if i and s.attention[i - 1].compile_mode is not None:
            drop_compiled(pipe)  # each recipe compiles as it would in a process of its own
        runs.append(_run(pipe, s.request, s.device, choice, s.warmup, s.folder.path))
    files, videos = write_outputs(run_dir, runs)
    streaming = None
    if s.offload == "stream":
        streaming = streaming_figures(streamed_bytes(pipe), host_to_device_gbps(s.device))
    header = build_header(s, runs, streaming)
    for key, value in header.items():
        console.print(f"[bold]{key}:[/bold] {value}", style="red" if key == "NOTE" else None)
    console.print(_stage_table(runs, header["dtype"]))
    for run in runs:
        patch = run.attention_summary
        if patch.get("counted"):
            console.print(f"{run.attention}: {patch['served_calls']} attention call(s) on {patch['backend']}, "
                          f"{sum(patch['fallback_calls'].values())} on diffusers' default (report.json has why)")
        for note in patch.get("notes", ()):
            console.print(f"note: {note}")
        for cache in patch.get("step_cache", ()):
            console.print(_cache_line(run.attention, cache, run.graphs_compiled))
    comparisons = [compare_runs(runs[0], run) for run in runs[1:]] if s.reference else []
    if len(comparisons) == 1:
        comparison = comparisons[0]
        console.print(_quality_table(comparison, comparison["reference"], comparison["candidate"]))
        console.print(f"speed-up of {comparison['candidate']} over {comparison['reference']} (one run each): median "
                      f"step {comparison['median_step_speedup']:.2f}x, all steps {comparison['denoise_speedup']:.2f}x, "
                      f"whole call {comparison['total_speedup']:.2f}x")
    elif comparisons:
        console.print(_comparisons_table(comparisons))
    report = build_report(s, header, runs, videos, files, streaming, comparisons, crossover)
    write_json(run_dir / "report.json", report)
    return report

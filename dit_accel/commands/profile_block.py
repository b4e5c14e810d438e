"""`dit-accel profile-block`: one DiT block streamed onto the GPU, profiled, extrapolated to the model.

This module parses the options into `profiling.session.ProfileSettings`, checks the memory
estimate (`profiling.memory`) and prints, with the session's progress; the work is
`profiling.session.run_session`, the report's content `profiling.block_report`, its drawing and files
`profiling.render`."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator

import click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import UserError
from ..loading import OFFLOAD_CHOICES
from ..profiling.progress import NO_PROGRESS, SessionProgress
from ..report_io import console, err_console, print_note, to_json
from ..run_dir import DEFAULT_OUTPUT_ROOT, StagedRun, default_run_name
from .options import (ATTENTION_HELP, DEFAULT_FAMILY, MODEL_CACHE_HELP, MODEL_FAMILIES, AtLeast, CacheParam,
                      DtypeChoice, FiniteFloat, MemorySize, OptionError, RecipeParam, Seed, StageList, compile_option,
                      linear_option, skip_crossover_option)

# torch, diffusers (through the adapters) and the library load inside the command, not at import:
# `dit-accel profile-block --help` costs click alone.


def precheck(checkpoint: Path | None = None, **_) -> None:
    """What is checked before torch and diffusers load (`cli.LazyCommand.precheck`): the checkpoint folder."""
    if checkpoint is not None:
        from ..loading.folders import transformer_folder

        transformer_folder(checkpoint)


def _validate_count(ctx, param, value):
    """--validate: a number of blocks (0: none) or `model` (the whole transformer)."""
    if value == "model":
        return value
    try:
        count = int(value)
    except ValueError:
        raise OptionError(f"takes a number of blocks or model, got {value}", ctx=ctx, param=param) from None
    if count < 0:
        raise OptionError(f"must be at least 0, got {value}", ctx=ctx, param=param)
    return count


class _TerminalProgress(SessionProgress):
    """Each stage as a live bar with its count while it runs (on a terminal; transient), and, once
    the session has finished, one line per stage with its count and seconds. Nothing is left
    behind when the session fails: a user error stays one line."""

    def __init__(self, out: Console):
        self.out = out
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=out, transient=True)
        self.done: list[str] = []

    def __enter__(self) -> "_TerminalProgress":
        self.bar.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.bar.stop()
        if exc_type is None:
            for line in self.done:
                self.out.print(f"[dim]  {line}[/dim]")

    @contextlib.contextmanager
    def stage(self, label: str, total: int | None = None) -> Iterator[Callable[[], None]]:
        task = self.bar.add_task(label, total=total)
        start = time.perf_counter()
        try:
            yield lambda: self.bar.advance(task)
        finally:
            self.bar.remove_task(task)
        count = f" {total}/{total}" if total else ""
        self.done.append(f"{label}{count}: {time.perf_counter() - start:.1f} s")


@click.command("profile-block")
@click.option("--model", type=click.Choice(MODEL_FAMILIES), default=None,
              help=f"Model family (default {DEFAULT_FAMILY}; taken from the checkpoint when one is given).")
@click.option("--preset", default=None,
              help="Embedded config of the family (default: its first; `dit-accel models` lists them). "
                   "Ignored with --checkpoint.")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Local diffusers transformer (or pipeline) folder; only the chosen block's tensors are read. "
                   "Without it: synthetic weights of realistic scale.")
@click.option("--block", "block_spec", default="0", show_default=True, metavar="N|STACK|STACK.N",
              help="Which block to load: its index (in every stack), or a stack alone (e.g. "
                   "single_transformer_blocks; a model of several stacks profiles a block of each by default).")
@click.option("--seq-len", type=AtLeast(1), default=None,
              help="Tokens per sequence (default: the family's reference case, 30272 for H3).")
@click.option("--frames", type=AtLeast(1), default=None,
              help="Workload as a video: frames (with --height and --width).")
@click.option("--height", type=AtLeast(1), default=None)
@click.option("--width", type=AtLeast(1), default=None)
@click.option("--batch", type=AtLeast(1), default=1, show_default=True)
@click.option("--dtype", type=DtypeChoice(), default=None,
              help="Default: bf16 on a GPU; fp32 on the CPU, where bf16 matmuls are emulated.")
@click.option("--attn", type=RecipeParam(), default="native", show_default=True,
              help=f"Attention: {ATTENTION_HELP}; e.g. fp8+rope.")
@click.option("--compare-attn", type=RecipeParam(many=True), default=None,
              help="Comma-separated attention names to run side by side, e.g. cudnn,fa4,fp8,fp8+rope.")
@linear_option()
@compile_option()
@click.option("--keep-going", is_flag=True,
              help="Leave out, with a note, a recipe torch cannot compile on this block, instead of stopping "
                   "(the first recipe still has to run).")
@click.option("--warmup", type=AtLeast(0), default=3, show_default=True)
@click.option("--runs", type=AtLeast(1), default=10, show_default=True, help="Timed runs; the median is reported.")
@click.option("--steps", type=AtLeast(1), default=None,
              help="Denoising steps, for the extrapolation (default: the family's; the report says where it came "
                   "from).")
@click.option("--guidance-passes", type=AtLeast(1), default=None,
              help="Transformer passes per step, for the extrapolation (default: the family's: 1 for the "
                   "guidance-distilled MiniMax-H3, 2 for Wan 2.1 with classifier-free guidance).")
@click.option("--outside-ms", type=FiniteFloat(0), default=None,
              help="Time per pass outside the block stack (embeddings, refiner, heads), if you measured it.")
@click.option("--outside", "outside_mode", type=click.Choice(["measure"]), default=None,
              help="measure: time the transformer without its blocks (embeddings, refiner layers, output norm and "
                   "heads; synthetic weights, eager) once on this workload's pass, and add it to every recipe's "
                   "extrapolation. Default: 0 ms, or --outside-ms; --stages and --validate model measure it unless "
                   "--outside-ms states it.")
@click.option("--stages", type=StageList(), default=None,
              help="Also measure the pipeline's other stages at this workload's size, synthetic weights (text, vae, "
                   "audio, comma-separated, or all), and print the whole-video table: text encoding | denoising | "
                   "VAE decode | audio decode | total per recipe. A stage whose config is not at hand is skipped "
                   "and the report says why.")
@click.option("--text-encoder-config", type=click.Path(path_type=Path), default=None,
              help="A local folder with the text encoder's config.json (transformers; no weights needed), for "
                   "--stages text.")
@click.option("--validate", "validate_blocks", default="0", callback=_validate_count, metavar="N|model",
              show_default=True,
              help="N: chain N real blocks (synthetic weights) and compare with N x the block. model: one forward "
                   "of the whole transformer (all its blocks and the parts outside them, synthetic weights) against "
                   "blocks x block + outside (measured as --outside measure unless --outside-ms states it).")
@click.option("--cache", "video_cache", type=CacheParam(), default=None, metavar="METHOD[:PARAMS]",
              help="With --validate model: the pass is the whole video, every step and pass (--steps, "
                   "--guidance-passes), under this step cache on the transformer, written as a recipe's cache= part; "
                   f"a cache whose skips the step count alone fixes: {MODEL_CACHE_HELP}. The report gives a pass "
                   "averaged over the video, what the cache computed each step and the graphs compiled during it "
                   "(what plan RUN --cache METHOD --verify runs).")
@click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default="resident", show_default=True,
              help="stream: the --validate pass's blocks live in pinned host memory and stream onto the GPU "
                   "one at a time, prefetched on a side stream (a whole model on a small card).")
@click.option("--memory-budget", type=MemorySize(), default=None,
              help="Cap GPU memory, e.g. 16GiB, to reproduce a smaller card.")
@click.option("--trace/--no-trace", default=False,
              help="Also write a Chrome trace of the profiled runs (trace_<backend>.json).")
@click.option("--device", "device_name", default=None, help="cuda, cuda:1 or cpu (default: cuda when present).")
@click.option("--seed", type=Seed(), default=0, show_default=True)
@click.option("--refresh-ceilings", is_flag=True, help="Measure the device's GEMM and copy ceilings again.")
@skip_crossover_option()
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run folder (default outputs/profile-block_<model>_<time>/).")
@click.option("--quiet", "-q", is_flag=True,
              help="No progress lines (the tables, warnings and the folder still print).")
@click.option("--json", "as_json", is_flag=True,
              help="Print report.json's content to stdout and nothing else there (progress and warnings go to stderr).")
def profile_block(model, preset, checkpoint, block_spec, seq_len, frames, height, width, batch, dtype, attn,
                  compare_attn, linear, compile_mode, keep_going, warmup, runs, steps, guidance_passes, outside_ms,
                  outside_mode, stages, text_encoder_config, validate_blocks, video_cache, offload, memory_budget,
                  trace, device_name, seed, refresh_ceilings, skip_crossover, out, quiet, as_json):
    """Profile ONE transformer block: per-op and per-module time, memory, and the whole-model extrapolation.

    With no options: the MiniMax-H3 block at S=30272 in bf16 on the GPU, synthetic weights. Without a GPU:
    a scaled-down, clearly labelled CPU run of the same code.
    """
    import torch

    from ..device import apply_memory_budget
    from ..profiling.memory import check_fits
    from ..profiling.render import render
    from ..profiling.request import ProfileRequest, profile_settings, run_profile

    if compare_attn and click.get_current_context().get_parameter_source("attn") != ParameterSource.DEFAULT:
        listed = attn.label in {recipe.label for recipe in compare_attn}
        raise UserError(f"--attn {attn.label} and --compare-attn do not combine: --compare-attn names every recipe "
                        f"that runs; " + (f"it has {attn.label} already, so drop --attn" if listed
                                          else f"add {attn.label} to it and drop --attn"))
    recipes = tuple(r.with_options(fp8_linear=linear == "fp8", compile_mode=compile_mode)
                    for r in compare_attn or [attn])
    from .options import DTYPE_NAMES

    settings = profile_settings(ProfileRequest(
        recipes, model=model, preset=preset, checkpoint=checkpoint, block=block_spec, seq_len=seq_len, frames=frames,
        height=height, width=width, batch=batch, dtype=DTYPE_NAMES[dtype] if dtype is not None else None,
        warmup=warmup, runs=runs, steps=steps, guidance_passes=guidance_passes, outside_ms=outside_ms,
        outside_mode=outside_mode, stages=stages, text_encoder_config=text_encoder_config, validate=validate_blocks,
        cache=video_cache, offload=offload,
        memory_budget=(memory_budget.text, memory_budget.nbytes) if memory_budget else None, trace=trace,
        device=device_name, seed=seed, keep_going=keep_going))
    device, adapter, workload = settings.device, settings.adapter, settings.workload
    validate_blocks = settings.validate_blocks
    staged = StagedRun(out or DEFAULT_OUTPUT_ROOT / default_run_name("profile-block", adapter.family),
                       numbered=out is None)
    if memory_budget and device.type != "cuda":
        apply_memory_budget(device, memory_budget.nbytes)  # its one-line refusal on the CPU
    # Before anything large exists: weights, activations and what profiling adds, against the room there is.
    estimate = check_fits(settings, memory_budget.nbytes if memory_budget else None,
                          memory_budget.text if memory_budget else None)
    out_console = err_console if as_json else console  # with --json stdout carries the report alone
    progress = contextlib.nullcontext(NO_PROGRESS) if quiet else _TerminalProgress(err_console if as_json else console)
    try:
        with progress as shown, staged as run_dir:
            profiled = run_profile(settings, run_dir, shown, refresh_ceilings=refresh_ceilings,
                                   skip_crossover=skip_crossover, estimate=estimate,
                                   memory_budget_bytes=memory_budget.nbytes if memory_budget else None,
                                   on_note=lambda note: print_note(note, out_console))
            report, result, ceilings = profiled.report, profiled.result, profiled.ceilings
    except torch.OutOfMemoryError as exc:
        budget = f"the {memory_budget.text} budget" if memory_budget else "this GPU's memory"
        raise UserError(f"out of memory: the {adapter.display_name} block at S={workload.seq_len} (batch "
                        f"{workload.batch}) with its profiling{' and --validate' if validate_blocks else ''} does not "
                        f"fit in {budget}; lower --seq-len or --batch, or raise --memory-budget") from exc
    for note in result.notes:
        print_note(note, out_console)
    traces = "".join(f", {settings.trace_name(recipe)}" for recipe in settings.recipes) if trace else ""
    if as_json:
        for warning in report["warnings"]:
            err_console.print(f"[yellow]warning: {warning}[/yellow]")
        click.echo(to_json(report))
    else:
        render(console, report, result.runs, ceilings, result.validation)
    csv = ", whole_video.csv" if stages else ""
    print_note(staged.moved_note, out_console)
    out_console.print(f"\nwrote {staged.final}/: report.json, ops.csv{csv}, breakdown.png{traces}")
    return report

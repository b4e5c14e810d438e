"""`dit-accel bench-attention`: the attention backends side by side on the same tensors."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from ..errors import UserError
from ..report_io import console
from ..run_dir import DEFAULT_OUTPUT_ROOT, default_run_name, staged_run_dir
from .options import ATTENTION_BACKENDS, AtLeast, DtypeChoice, RecipeParam

if TYPE_CHECKING:  # torch loads when the command runs, not for --help (see cli.py)
    from ..attention.bench import BenchRow
    from ..device import DeviceInfo

GPU_SKIPPED_BY_DEFAULT = ("math",)  # materializes B*H*S*S scores: out of memory at video lengths
# For --help without importing torch, as text: `attention.bench`'s GPU_DEFAULT_SHAPE and CPU_DEFAULT_SHAPE,
# and the keys of its INPUT_KINDS (tests/test_cli_errors.py checks them against the library's).
HELP_GPU_DEFAULT_SHAPE, HELP_CPU_DEFAULT_SHAPE = "1x56x30272x128", "1x2x256x64"
INPUT_CHOICES = ("normal", "outliers", "flat", "block")


@click.command("bench-attention")
@click.option("--shapes", "shapes_text", default=None, metavar="BxHxSxD[,...]",
              help=f"Comma-separated shapes, BxHxSxD (self-attention) or BxHxSqxSkvxD. "
                   f"[default: {HELP_GPU_DEFAULT_SHAPE} (MiniMax-H3) on a GPU, {HELP_CPU_DEFAULT_SHAPE} on the CPU]")
@click.option("--backends", "choices", type=RecipeParam(many=True, allow_options=False), default=None, metavar="NAME[,...]",
              help=f"Comma-separated, from: {', '.join(ATTENTION_BACKENDS)}. [default: all; on a GPU all but "
                   f"{', '.join(GPU_SKIPPED_BY_DEFAULT)}] Unavailable ones are listed with the reason.")
@click.option("--dtype", type=DtypeChoice(("bf16", "fp16")), default="bf16", show_default=True,
              help="Input and output dtype.")
@click.option("--inputs", type=click.Choice(INPUT_CHOICES), default="normal", show_default=True,
              help="normal: N(0,1); outliers: 0.1% of the entries scaled 50x (FP8's hard case); flat: q x 0.05, "
                   "flat softmax rows; block: the q/k/v a MiniMax-H3 block feeds its attention (shapes Bx56xSx128).")
@click.option("--outliers", is_flag=True, help="The same as --inputs outliers.")
@click.option("--warmup", type=AtLeast(1), default=3, show_default=True, help="Untimed calls first.")
@click.option("--runs", type=AtLeast(10), default=10, show_default=True, help="Timed calls; the median is reported.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--device", "device_name", default=None, help="cuda, cuda:1 or cpu. [default: the GPU if there is one]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for report.json, results.csv and tflops.png. [default: outputs/bench-attention_<shape>_<time>/]")
def bench_attention(shapes_text, choices, dtype, inputs, outliers, warmup, runs, seed, device_name, out_dir) -> None:
    """Time every attention backend on the same random q/k/v, with TFLOP/s and error against an fp64 reference.

    Our FP8 kernel and cuDNN FP8 are timed end to end (prep included) and also as prep alone and kernel
    alone. On a machine without a GPU this is a scaled-down CPU run: it checks the tool, its numbers
    say nothing about GPU speed.
    """
    from ..attention.backends import BACKENDS, get_backend
    from ..attention.bench import BASELINE_BACKEND, CPU_DEFAULT_SHAPE, GPU_DEFAULT_SHAPE, bench_shape, parse_shapes, plot_tflops
    from ..device import DeviceInfo, pick_device
    from ..report_io import command_line, provenance, write_csv, write_json
    from .options import DTYPE_NAMES

    device = pick_device(device_name)
    is_cpu_run = device.type == "cpu"
    shapes = parse_shapes(shapes_text or (CPU_DEFAULT_SHAPE if is_cpu_run else GPU_DEFAULT_SHAPE))
    if choices:
        backends = [get_backend(choice.backend) for choice in choices]
    else:
        backends = [b for b in BACKENDS.values() if is_cpu_run or b.name not in GPU_SKIPPED_BY_DEFAULT]
    unavailable = {b.name: reason for b in backends if (reason := b.unavailable_reason(device)) is not None}
    if len(unavailable) == len(backends):  # nothing would be measured: say so instead of an empty table
        reasons = "; ".join(f"{name}: {reason}" for name, reason in unavailable.items())
        raise UserError(f"no backend asked for can run on {device} ({reasons}); pick ones that can (e.g. "
                        f"--backends math,native) or run on a GPU")
    tag = shapes[0].label + (f"+{len(shapes) - 1}" if len(shapes) > 1 else "")
    final_dir = out_dir or DEFAULT_OUTPUT_ROOT / default_run_name("bench-attention", tag)
    device_info = DeviceInfo.of(device)
    dtype_name = DTYPE_NAMES[dtype]
    if outliers and inputs not in ("normal", "outliers"):
        raise UserError(f"--outliers is --inputs outliers; it cannot go with --inputs {inputs}: keep one")
    inputs = "outliers" if outliers else inputs
    title = _title(device_info, dtype_name, inputs, is_cpu_run)

    with staged_run_dir(final_dir) as staging:
        rows: list[BenchRow] = []
        for shape in shapes:
            rows += bench_shape(shape, backends, dtype=dtype, device=device, inputs=inputs,
                                warmup=warmup, runs=runs, seed=seed)
        write_json(staging / "report.json", {
            "command_line": command_line(),
            "provenance": provenance(seed=seed, device=device),
            "device": device_info.as_dict(),
            "cpu_run_not_representative": is_cpu_run,
            "settings": {"shapes": [s.label for s in shapes], "backends": [b.name for b in backends], "dtype": dtype_name,
                         "inputs": inputs, "outliers": inputs == "outliers", "warmup": warmup, "runs": runs, "seed": seed,
                         "baseline_backend": BASELINE_BACKEND},
            "rows": [r.as_dict() for r in rows],
        })
        write_csv(staging / "results.csv", [r.as_dict() for r in rows])
        plot_tflops(rows, staging / "tflops.png", title)

    console.print(_results_table(rows, title))
    for r in rows:
        if r.status != "ok":
            console.print(f"[dim]{r.backend} at {r.shape}: {r.status}[/dim]")
    console.print(f"wrote {final_dir}/ (report.json, results.csv, tflops.png)")


def _title(info: DeviceInfo, dtype_name: str, input_kind: str, is_cpu_run: bool) -> str:
    from ..attention.bench import INPUT_KINDS

    inputs = f"{dtype_name}, {INPUT_KINDS[input_kind]}"
    if is_cpu_run:
        return f"Attention on the CPU ({info.name}), {inputs}: scaled-down CPU run, NOT representative of GPU speed"
    return f"Attention on {info.label}, {inputs}"


def _number(value: float | None, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    return "" if value is None else format(value * scale, fmt) + suffix


def _results_table(rows: list[BenchRow], title: str) -> Table:
    from ..attention.bench import BASELINE_BACKEND

    table = Table(title=title, title_justify="left")
    for column, justify in [("backend", "left"), ("timed", "left"), ("shape", "left"), ("median ms", "right"),
                            ("TFLOP/s", "right"), (f"vs {BASELINE_BACKEND}", "right"), ("error %", "right"),
                            ("reference", "left")]:
        table.add_column(column, justify=justify)
    for r in rows:
        if r.status == "ok":
            table.add_row(r.backend, r.timed, r.shape, _number(r.median_ms, ".3f"), _number(r.tflops, ".4g"),
                          _number(r.speedup_vs_baseline, ".2f", suffix="x"), _number(r.rel_rms_err, ".3f", scale=100),
                          r.reference or "")
    return table

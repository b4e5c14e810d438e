"""`dit-accel bench-attention`: the attention backends side by side on the same tensors."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from ..errors import UserError
from ..report_io import console, print_note
from ..run_dir import DEFAULT_OUTPUT_ROOT, StagedRun, default_run_name
from .options import ATTENTION_BACKENDS, AtLeast, DtypeChoice, RecipeParam, Seed

if TYPE_CHECKING:  # torch loads when the command runs, not for --help (see cli.py)
    import torch

    from ..attention.bench import AttentionShape, BenchRow
    from ..device import DeviceInfo

GPU_SKIPPED_BY_DEFAULT = ("math",)  # materializes B*H*S*S scores: out of memory at video lengths
# For --help without importing torch, as text: `attention.bench`'s GPU_DEFAULT_SHAPE and CPU_DEFAULT_SHAPE,
# and the keys of its INPUT_KINDS (tests/commands/test_cli_errors.py checks them against the library's).
HELP_GPU_DEFAULT_SHAPE, HELP_CPU_DEFAULT_SHAPE = "1x56x30272x128", "1x2x256x64"
INPUT_CHOICES = ("normal", "outliers", "flat", "block")
# `attention.crossover`'s GPU grid and DEFAULT_BACKENDS, as text (tests/attention/test_crossover.py checks them).
HELP_CROSSOVER_GRID = "128,129,1024,4096,8192,30272 x 128,129,512,777,1024,2048,4096,8192,30272 x 64,128"
HELP_CROSSOVER_BACKENDS = ("fp8", "native", "cudnn", "flash")


@click.command("bench-attention")
@click.option("--shapes", "shapes_text", default=None, metavar="BxHxSxD[,...]",
              help=f"Comma-separated shapes, BxHxSxD (self-attention) or BxHxSqxSkvxD. "
                   f"[default: {HELP_GPU_DEFAULT_SHAPE} (MiniMax-H3) on a GPU, {HELP_CPU_DEFAULT_SHAPE} on the "
                   f"CPU]")
@click.option("--backends", "choices", type=RecipeParam(many=True, allow_options=False), default=None,
              metavar="NAME[,...]",
              help=f"Comma-separated, from: {', '.join(ATTENTION_BACKENDS)}. [default: all; on a GPU all but "
                   f"{', '.join(GPU_SKIPPED_BY_DEFAULT)}] Unavailable ones are listed with the reason.")
@click.option("--dtype", type=DtypeChoice(("bf16", "fp16")), default="bf16", show_default=True,
              help="Input and output dtype.")
@click.option("--inputs", type=click.Choice(INPUT_CHOICES), default="normal", show_default=True,
              help="normal: N(0,1); outliers: 0.1% of the entries scaled 50x (FP8's hard case); flat: q x 0.05, "
                   "flat softmax rows; block: the q/k/v a MiniMax-H3 block feeds its attention (shapes "
                   "Bx56xSx128).")
@click.option("--outliers", is_flag=True, help="The same as --inputs outliers.")
@click.option("--warmup", type=AtLeast(1), default=3, show_default=True, help="Untimed calls of each first.")
@click.option("--runs", type=AtLeast(10), default=10, show_default=True,
              help="Rounds: in each, every backend runs once untimed and once timed, in turn; the median is "
                   "reported.")
@click.option("--seed", type=Seed(), default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--device", "device_name", default=None,
              help="cuda, cuda:1 or cpu. [default: the GPU if there is one]")
@click.option("--crossover", is_flag=True,
              help=f"Measure where the routed backends (fp8) lose to diffusers' backends over a grid of shapes "
                   f"(B1 H56, Sq x Skv x D: {HELP_CROSSOVER_GRID}) and write the crossover data file the router "
                   f"reads (copy it into dit_accel/attention/crossover_data/, or point DIT_ACCEL_CROSSOVER at "
                   f"it). Needs a GPU. [default backends: {','.join(HELP_CROSSOVER_BACKENDS)}]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for report.json, results.csv and tflops.png (with --crossover: the crossover data "
                   "file instead of the plot). [default: outputs/bench-attention_<shape>_<time>/]")
def bench_attention(shapes_text, choices, dtype, inputs, outliers, warmup, runs, seed, device_name, crossover,
                    out_dir) -> None:
    """Time every attention backend on the same q/k/v, with TFLOP/s and error against an fp64 reference.

    The backends are timed together in interleaved rounds, so the GPU's clock ramp falls on none in
    particular. The reference is fp32 on a GPU past 2^30 scores (the table says which). The FP8 backends
    (ours, cuDNN FP8, FA3 FP8) are timed end to end (their prep or quantization included) and also as
    prep alone and kernel alone. The routing table says which backend the router picks at each shape,
    from the device's crossover data (DIT_ACCEL_CROSSOVER=off ignores it, =PATH reads that file). On a
    machine without a GPU this is a scaled-down CPU run: it checks the tool, its numbers say nothing
    about GPU speed.
    """
    from ..device import pick_device

    device = pick_device(device_name)
    if crossover:
        if shapes_text:
            raise UserError("--crossover measures its own grid of shapes; leave --shapes out")
        if outliers or inputs != "normal":
            raise UserError("--crossover times N(0,1) inputs; leave --inputs and --outliers out")
        _measure_crossover(choices, dtype, warmup, runs, seed, device, out_dir)
        return
    _bench(shapes_text, choices, dtype, inputs, outliers, warmup, runs, seed, device, out_dir)


def _bench(shapes_text, choices, dtype, inputs, outliers, warmup, runs, seed, device, out_dir) -> None:
    from ..attention.backends import BACKENDS, get_backend
    from ..attention.bench import (BASELINE_BACKEND, CPU_DEFAULT_SHAPE, GPU_DEFAULT_SHAPE, bench_shape, parse_shapes,
                                   plot_tflops)
    from ..attention.crossover import crossover_for
    from ..device import DeviceInfo
    from ..report_io import command_line, provenance, write_csv, write_json
    from .options import DTYPE_NAMES

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
    staged = StagedRun(out_dir or DEFAULT_OUTPUT_ROOT / default_run_name("bench-attention", tag),
                       numbered=out_dir is None)
    device_info = DeviceInfo.of(device)
    dtype_name = DTYPE_NAMES[dtype]
    if outliers and inputs not in ("normal", "outliers"):
        raise UserError(f"--outliers is --inputs outliers; it cannot go with --inputs {inputs}: keep one")
    inputs = "outliers" if outliers else inputs
    title = _title(device_info, dtype_name, inputs, is_cpu_run)
    table, crossover_note = crossover_for(device)
    routed = [b.name for b in backends if b.routed]
    routing = [entry for shape in shapes for name in routed
               if table is not None and (entry := table.explain(name, shape, dtype)) is not None]

    for shape in shapes:
        check_bench_fits(shape, dtype, backends, device)
    with staged as staging:
        rows: list[BenchRow] = []
        for number, shape in enumerate(shapes, 1):
            started = time.perf_counter()
            console.print(f"[dim]{shape.label} ({number} of {len(shapes)}): the reference, then {len(backends)} "
                          f"backend(s), {warmup} warm-up call(s) and {runs} interleaved rounds...[/dim]")
            rows += bench_shape(shape, backends, dtype=dtype, device=device, inputs=inputs,
                                warmup=warmup, runs=runs, seed=seed,
                                make_qkv=block_qkv if inputs == "block" else None)
            console.print(f"[dim]{shape.label}: done in {time.perf_counter() - started:.1f} s[/dim]")
        write_json(staging / "report.json", {
            "command_line": command_line(),
            "provenance": provenance(seed=seed, device=device),
            "device": device_info.as_dict(),
            "cpu_run_not_representative": is_cpu_run,
            "settings": {"shapes": [s.label for s in shapes], "backends": [b.name for b in backends],
                         "dtype": dtype_name, "inputs": inputs, "outliers": inputs == "outliers", "warmup": warmup,
                         "runs": runs, "timing": "interleaved rounds", "seed": seed,
                         "baseline_backend": BASELINE_BACKEND},
            "rows": [r.as_dict() for r in rows],
            "crossover": {"source": crossover_note, "routing": routing},
        })
        write_csv(staging / "results.csv", [r.as_dict() for r in rows])
        plot_tflops(rows, staging / "tflops.png", title)

    console.print(_results_table(rows, title))
    for r in rows:
        if r.status != "ok":
            console.print(f"[dim]{r.backend} at {r.shape}: {r.status}[/dim]")
    if routing:
        console.print(_routing_table(routing, crossover_note))
    elif routed:
        console.print(f"routing: {crossover_note}")
    print_note(staged.moved_note)
    console.print(f"wrote {staged.final}/ (report.json, results.csv, tflops.png)")


def _measure_crossover(choices, dtype, warmup, runs, seed, device, out_dir) -> None:
    """bench-attention --crossover: the grid timed, the crossover file written and shown."""

    from ..attention.backends import get_backend
    from ..attention.crossover import DEFAULT_BACKENDS, GRIDS, Crossover, data_file_name, measure_crossover
    from ..device import DeviceInfo
    from ..report_io import command_line, provenance, write_csv, write_json

    asked = [get_backend(choice.backend) for choice in choices] if choices else list(map(get_backend, DEFAULT_BACKENDS))
    backends = [b for b in asked if b.unavailable_reason(device) is None]
    for b in asked:
        if b not in backends and choices:  # named by the user: say why it is not in the data
            console.print(f"crossover: {b.name} left out: {b.unavailable_reason(device)}")
    if not any(b.routed for b in backends) or not any(b.diffusers_backend for b in backends):
        reasons = "; ".join(f"{b.name}: {b.unavailable_reason(device) or 'runs here'}" for b in asked)
        raise UserError(f"--crossover needs a routed backend (fp8, fa4) and a diffusers one (native, cudnn, ...) "
                        f"that run on {device} ({reasons}); pick ones that can, or run on a GPU")
    grid = GRIDS[device.type]
    staged = StagedRun(out_dir or DEFAULT_OUTPUT_ROOT / default_run_name("bench-attention", "crossover"),
                       numbered=out_dir is None)
    shapes = grid.shapes()
    console.print(f"crossover: {len(shapes)} shapes x {', '.join(b.name for b in backends)}, "
                  f"B{grid.batch} H{grid.heads}, warmup {warmup}, runs {runs}"
                  + ("" if device.type == "cuda" else " (scaled-down CPU run: checks the tool, routes nothing)"))
    with staged as staging:
        started = time.perf_counter()
        rows, data = measure_crossover(grid, backends, dtype=dtype, device=device, warmup=warmup, runs=runs, seed=seed)
        data.update(elapsed_s=round(time.perf_counter() - started, 1), command=command_line(),
                    provenance=provenance(seed=seed, device=device))
        file_name = data_file_name(data["device"])
        write_json(staging / file_name, data)
        write_json(staging / "report.json", {
            "command_line": command_line(), "provenance": data["provenance"], "device": DeviceInfo.of(device).as_dict(),
            "settings": {"crossover": True, "backends": data["backends"], "grid": data["grid"], "dtype": data["dtype"],
                         "warmup": warmup, "runs": runs, "seed": seed},
            "crossover_file": file_name, "rows": [r.as_dict() for r in rows]})
        write_csv(staging / "results.csv", [r.as_dict() for r in rows])
        table = Crossover.from_data(data, file_name)  # what the router will read, checked as it will be
    for head_dim in table.head_dims:
        console.print(_crossover_grid(table, head_dim))
    print_note(staged.moved_note)
    console.print(f"measured in {data['elapsed_s']} s; wrote {staged.final}/ (report.json, results.csv, {file_name}); "
                  f"the router reads it once it is copied to dit_accel/attention/crossover_data/, or with "
                  f"DIT_ACCEL_CROSSOVER={staged.final / file_name}")


def _routing_table(routing: list[dict], source: str) -> Table:
    table = Table(title=f"Routing by crossover ({source}); ratio: fastest fallback ms / backend ms, above 1 the "
                        f"backend is faster", title_justify="left")
    for column, justify in [("shape", "left"), ("backend", "left"), ("router picks", "left"),
                            ("nearest measured", "left"), ("backend ms", "right"), ("fastest fallback", "left"),
                            ("fallback ms", "right"), ("ratio", "right")]:
        table.add_column(column, justify=justify)
    for e in routing:
        table.add_row(e["shape"], e["backend"], e["picks"], e["nearest_point"], _number(e["backend_ms"], ".3f"),
                      e["fastest_fallback"], _number(e["fallback_ms"], ".3f"), _number(e["ratio"], ".2f", suffix="x"))
    return table


def _crossover_grid(crossover, head_dim: int) -> Table:
    """One head dim of a crossover: Sq down, Skv across; each cell what the router picks there for each
    routed backend and the measured ratio (fastest fallback ms / routed backend ms)."""
    from ..attention.bench import AttentionShape

    table = Table(title=f"Crossover, D{head_dim}, B{crossover.batch} H{crossover.heads} {crossover.key['gpu']}: "
                        f"router's pick and fastest fallback ms / routed ms", title_justify="left")
    table.add_column("Sq \\ Skv", justify="right")
    for seq_kv in crossover.seq_kv:
        table.add_column(str(seq_kv), justify="right")
    for seq_q in crossover.seq_q:
        cells = []
        for seq_kv in crossover.seq_kv:
            shape = AttentionShape(crossover.batch, crossover.heads, seq_q, seq_kv, head_dim)
            entries = [crossover.explain(name, shape, crossover.dtype) for name in crossover.routed]
            cells.append(" ".join(f"{e['picks']} {_number(e['ratio'], '.2f', suffix='x')}".strip() for e in entries))
        table.add_row(str(seq_q), *cells)
    return table


def block_qkv(shape: "AttentionShape", *, dtype: "torch.dtype", device: "torch.device",
              seed: int) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """The q, k, v the MiniMax-H3 block (synthetic weights from `seed`; on the CPU its scaled-down
    config) feeds its self-attention at S = shape.seq_q: flat rows (max probability ~0.001 at S =
    30272), per-head scales after QK-norm and RoPE, what FP8 attention meets in a real model: `--inputs block`'s
    q/k/v, built here, where the block's family, weights and capture are at hand."""
    import torch

    from ..adapters import adapter_for_preset
    from ..loading.block import synthetic_block
    from ..profiling.attention_error import capture_attention_inputs

    adapter = adapter_for_preset("minimax-h3")
    if device.type == "cpu":
        adapter = adapter.scaled_down()
    heads, head_dim = adapter.config["num_attention_heads"], adapter.config["attention_head_dim"]
    if (shape.heads, shape.head_dim) != (heads, head_dim) or shape.seq_q != shape.seq_kv:
        raise UserError(f"--inputs block feeds the {adapter.display_name} block's own q/k/v: give self-attention "
                        f"shapes Bx{heads}xSx{head_dim} on this device, not {shape.label}")
    block = synthetic_block(adapter, 0, device, dtype, seed=seed).block
    workload = adapter.workload_from_seq_len(shape.seq_q, shape.batch)
    block_inputs = adapter.make_inputs(workload, device, dtype, torch.Generator(device=device).manual_seed(seed))
    return capture_attention_inputs(block, block_inputs, adapter)


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



def check_bench_fits(shape: "AttentionShape", dtype: "torch.dtype", backends: list, device: "torch.device") -> None:
    """A UserError, before anything is allocated, when benchmarking `shape` would not fit in the device's room:
    how much, where, and the longest sequence (Sq and Skv scaled alike) that fits."""
    import dataclasses

    from ..attention.bench import bench_bytes
    from ..headroom import FIXED_BYTES, MARGIN, GiB, memory_room
    from .options import DTYPE_NAMES

    found = memory_room(device)
    if found is None:
        return
    room, where = found

    def need(s: "AttentionShape") -> float:
        return bench_bytes(s, dtype, backends, device) * (1 + MARGIN) + FIXED_BYTES

    if need(shape) <= room:
        return
    scaled = lambda factor: dataclasses.replace(shape, seq_q=max(1, int(shape.seq_q * factor)),  # noqa: E731
                                                seq_kv=max(1, int(shape.seq_kv * factor)))
    low, high = 0.0, 1.0  # scaled(low) fits (low > 0), or nothing tried did (low == 0)
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if need(scaled(middle)) <= room else (low, middle)
    hint = f"the longest that fits here is {scaled(low).label}" if low > 0 else "lower the batch or heads"
    raise UserError(f"attention at {shape.label} ({DTYPE_NAMES[dtype]}) needs about {need(shape) / GiB:.1f} GiB with "
                    f"its reference and the backends asked for; it does not fit in {where}: {hint}")

"""`dit-accel profile-block`: one DiT block streamed onto the GPU, profiled, extrapolated to the model."""
from __future__ import annotations

import contextlib
from pathlib import Path

import click
import torch

from .. import __version__
from ..adapters import ADAPTERS, DEFAULT_FAMILY, BlockAdapter, adapter_for_config, adapter_for_preset, read_transformer_config
from ..attention.routing import use_attention_backend
from ..bench_attention import rel_rms_err
from ..block_loader import LoadedBlock, load_block_from_checkpoint, parse_dtype, synthetic_block
from ..checkpoint import CONFIG_NAME, transformer_folder
from ..device import DeviceInfo, apply_memory_budget, device_ceilings, parse_bytes, pick_device
from ..errors import UserError
from ..extrapolate import Extrapolation
from ..fused_rope import fused_rope
from ..offload import OFFLOAD_CHOICES, check_offload
from ..profiling.attention_error import attention_errors, capture_attention_inputs
from ..profiling.profiler import profile_block as run_profile
from ..profiling.report import BackendRun, render, write_files
from ..profiling.validate import validate_chain
from ..report_io import command_line, console
from ..run_dir import DEFAULT_OUTPUT_ROOT, default_run_name, staged_run_dir


def _adapter(model: str | None, preset: str | None, checkpoint: Path | None) -> BlockAdapter:
    if checkpoint is None:
        return adapter_for_preset(model or DEFAULT_FAMILY, preset)
    folder = transformer_folder(checkpoint)
    adapter = adapter_for_config(read_transformer_config(folder / CONFIG_NAME), str(folder))
    if model and model != adapter.family:
        raise UserError(f"--model {model} does not match the checkpoint, which is {adapter.family}; drop --model")
    return adapter


def _output_error(output: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    out, ref = output.double().flatten(), reference.double().flatten()
    return {"rel_l2": rel_rms_err(out, ref), "cosine": torch.nn.functional.cosine_similarity(out, ref, dim=0).item()}


@click.command("profile-block")
@click.option("--model", type=click.Choice(sorted(ADAPTERS)), default=None,
              help=f"Model family (default {DEFAULT_FAMILY}; taken from the checkpoint when one is given).")
@click.option("--preset", default=None, help="Embedded config of the family (h3; wan2.1-14b). Ignored with --checkpoint.")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Local diffusers transformer (or pipeline) folder; only the chosen block's tensors are read. "
                   "Without it: synthetic weights of realistic scale.")
@click.option("--block", "block_index", type=int, default=0, show_default=True, help="Which block to load.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sequence (default: the family's reference case, 30272 for H3).")
@click.option("--frames", type=int, default=None, help="Workload as a video: frames (with --height and --width).")
@click.option("--height", type=int, default=None)
@click.option("--width", type=int, default=None)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--dtype", "dtype_name", default=None,
              help="bf16, fp16 or fp32 (default: bf16 on a GPU; fp32 on the CPU, where bf16 matmuls are emulated).")
@click.option("--attn", default="native", show_default=True,
              help="Attention backend: native (diffusers default), flash, cudnn, efficient, math, fa4, fp8; "
                   "add +rope for the fused RoPE kernel too (MiniMax-H3), e.g. fp8+rope.")
@click.option("--compare-attn", default=None,
              help="Comma-separated backends to run side by side, e.g. cudnn,fa4,fp8,fp8+rope.")
@click.option("--warmup", type=int, default=3, show_default=True)
@click.option("--runs", type=int, default=10, show_default=True, help="Timed runs; the median is reported.")
@click.option("--steps", type=int, default=50, show_default=True, help="Denoising steps, for the extrapolation.")
@click.option("--guidance-passes", type=int, default=2, show_default=True,
              help="Transformer passes per step (2 with classifier-free guidance).")
@click.option("--outside-ms", type=float, default=None,
              help="Time per pass outside the block stack (embeddings, refiner, heads), if you measured it.")
@click.option("--validate", "validate_blocks", type=int, default=0,
              help="Chain N real blocks (synthetic weights) and compare with N x the block.")
@click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default="resident", show_default=True,
              help="stream: the --validate chain's blocks live in pinned host memory and stream onto the GPU "
                   "one at a time, prefetched on a side stream (a whole model on a small card).")
@click.option("--memory-budget", default=None, help="Cap GPU memory, e.g. 16GiB, to reproduce a smaller card.")
@click.option("--trace/--no-trace", default=False,
              help="Also write a Chrome trace of the profiled runs (trace_<backend>.json).")
@click.option("--device", "device_name", default=None, help="cuda, cuda:1 or cpu (default: cuda when present).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--refresh-ceilings", is_flag=True, help="Measure the device's GEMM and copy ceilings again.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run folder (default outputs/profile-block_<model>_<time>/).")
def profile_block(model, preset, checkpoint, block_index, seq_len, frames, height, width, batch, dtype_name, attn,
                  compare_attn, warmup, runs, steps, guidance_passes, outside_ms, validate_blocks, offload,
                  memory_budget, trace, device_name, seed, refresh_ceilings, out):
    """Profile ONE transformer block: per-op and per-module time, memory, and the whole-model extrapolation.

    With no options: the MiniMax-H3 block at S=30272 in bf16 on the GPU, synthetic weights. Without a GPU:
    a scaled-down, clearly labelled CPU run of the same code.
    """
    video = (frames, height, width)
    if any(v is not None for v in video) and (None in video or seq_len is not None):
        raise UserError("give the workload either as --seq-len or as all of --frames, --height and --width")
    for name, value, least in (("--batch", batch, 1), ("--runs", runs, 1), ("--steps", steps, 1),
                               ("--guidance-passes", guidance_passes, 1), ("--seq-len", seq_len, 1),
                               ("--frames", frames, 1), ("--height", height, 1), ("--width", width, 1),
                               ("--warmup", warmup, 0), ("--validate", validate_blocks, 0)):
        if value is not None and value < least:
            raise UserError(f"{name} must be at least {least}, got {value}")
    backends = [b.strip() for b in compare_attn.split(",") if b.strip()] if compare_attn else [attn.strip()]
    for spec in backends:
        _attention_spec(spec)  # a bad "+option" is refused before anything runs
    device = pick_device(device_name)
    dtype = parse_dtype(dtype_name or ("bf16" if device.type == "cuda" else "fp32"))
    if offload == "stream" and not validate_blocks:
        raise UserError("--offload stream streams the blocks of the --validate chain; add --validate N "
                        "(--validate 50: the whole H3 block stack)")
    check_offload(offload, device)
    budget_bytes = parse_bytes(memory_budget) if memory_budget else None

    adapter = _adapter(model, preset, checkpoint)
    scaled_down = device.type == "cpu" and checkpoint is None
    if scaled_down:
        adapter = type(adapter)(adapter.scaled_down_config(), preset=adapter.preset)
    if frames is not None:
        workload = adapter.workload_from_video(frames, height, width, batch)
    else:
        default_len = adapter.scaled_down_seq_len if scaled_down else adapter.default_seq_len
        workload = adapter.workload_from_seq_len(seq_len or default_len, batch)

    final_dir = out or DEFAULT_OUTPUT_ROOT / default_run_name("profile-block", adapter.family)
    # Measured (once per device) before the budget applies: the measurement itself takes ~4 GiB.
    ceilings, ceilings_cached = device_ceilings(device, dtype, refresh=refresh_ceilings)
    if budget_bytes:
        apply_memory_budget(device, budget_bytes)
    try:
        with staged_run_dir(final_dir) as run_dir:
            report = _profile(adapter, checkpoint, block_index, workload, dtype, device, backends, warmup, runs,
                              steps, guidance_passes, outside_ms, validate_blocks, offload, memory_budget, trace,
                              seed, ceilings, ceilings_cached, scaled_down, run_dir)
    except torch.OutOfMemoryError as exc:
        budget = f"the {memory_budget} budget" if memory_budget else "this GPU's memory"
        raise UserError(f"out of memory: the {adapter.display_name} block at S={workload.seq_len} (batch "
                        f"{workload.batch}) with its profiling{' and --validate' if validate_blocks else ''} does not "
                        f"fit in {budget}; lower --seq-len or --batch, or raise --memory-budget") from exc
    traces = "".join(f", {_trace_name(spec)}" for spec in backends) if trace else ""
    console.print(f"\nwrote {final_dir}/: report.json, ops.csv, breakdown.png{traces}")
    return report


def _attention_spec(spec: str) -> tuple[str, bool]:
    """"fp8+rope" -> ("fp8", True): the attention backend, and whether RoPE runs fused (`fused_rope`)."""
    name, plus, option = spec.partition("+")
    if plus and option != "rope":
        raise UserError(f"unknown option '+{option}' in attention {spec!r}; the one option is +rope (fused RoPE)")
    return name, bool(plus)


def _rope_swap(block, fuse: bool):
    """The fused-RoPE swap as a context manager (its handle, to read the counts), or nothing."""
    return fused_rope(block) if fuse else contextlib.nullcontext()


def _trace_name(spec: str) -> str:
    return f"trace_{spec.replace('+', '-')}.json"


def _profile(adapter, checkpoint, block_index, workload, dtype, device, backends, warmup, runs, steps,
             guidance_passes, outside_ms, validate_blocks, offload, memory_budget, trace, seed, ceilings,
             ceilings_cached, scaled_down, run_dir: Path) -> dict:
    if checkpoint is not None:
        loaded: LoadedBlock = load_block_from_checkpoint(adapter, checkpoint, block_index, device, dtype)
    else:
        loaded = synthetic_block(adapter, block_index, device, dtype, seed=seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = adapter.make_inputs(workload, device, dtype, generator)

    attention_flops = sum(call.flops for call in adapter.attention_calls(workload))
    linear_flops = adapter.linear_flops(loaded.block, workload)
    outside_source = "stated with --outside-ms" if outside_ms is not None else "not measured: pass --outside-ms to add it"
    results: list[BackendRun] = []
    reference_output = None
    for spec in backends:
        name, fuse_rope = _attention_spec(spec)
        with use_attention_backend(loaded.block, name) as routed, _rope_swap(loaded.block, fuse_rope) as rope:
            profile = run_profile(loaded.block, inputs, adapter, device=device, warmup=warmup, runs=runs,
                                  trace_path=run_dir / _trace_name(spec) if trace else None)
            with torch.no_grad():
                output = loaded.block(**inputs)
            if routed is not None and routed.fallback_total:
                console.print(f"[yellow]note: {routed.fallback_total} attention call(s) fell back from {name}: "
                              f"{dict(routed.fallback_calls)}[/yellow]")
            if rope is not None and rope.fallback_calls:
                console.print(f"[yellow]note: {sum(rope.fallback_calls.values())} RoPE call(s) of {spec} ran "
                              f"diffusers' own function, not the fused kernel: {dict(rope.fallback_calls)}[/yellow]")
        error = None if reference_output is None else _output_error(output, reference_output)
        reference_output = output if reference_output is None else reference_output
        extrapolation = Extrapolation(adapter.num_blocks, profile.timing.median_ms, outside_ms or 0.0,
                                      outside_source, steps, guidance_passes)
        results.append(BackendRun(spec, profile, extrapolation, attention_flops, linear_flops, error))

    attention_inputs = capture_attention_inputs(loaded.block, inputs, adapter)
    attention_names = list(dict.fromkeys(_attention_spec(spec)[0] for spec in backends))
    attention_rel_err, attention_reference = attention_errors(*attention_inputs, attention_names)
    del attention_inputs
    for run in results:
        run.attention_rel_err = attention_rel_err[_attention_spec(run.backend)[0]]

    validation = None
    if validate_blocks:
        first = results[0]
        activation_bytes = (first.profile.peak_memory_bytes or 0) - first.profile.weights_bytes
        name, fuse_rope = _attention_spec(first.backend)
        with _rope_swap(loaded.block, fuse_rope):  # the rotary global is per model file: covers the chain
            validation = validate_chain(adapter, loaded.block, inputs, validate_blocks, attention=name,
                                        device=device, dtype=dtype, block_ms=first.block_ms,
                                        activation_bytes=max(0, activation_bytes), offload=offload)

    info = DeviceInfo.of(device)
    peak = results[0].profile.peak_memory_bytes
    header = {
        "model": f"{adapter.display_name}" + (f" ({adapter.preset})" if adapter.preset else ""),
        "block": f"{loaded.index} of {adapter.num_blocks}; {loaded.source}",
        "weights": f"{loaded.param_bytes / 1e9:.3f} GB ({sum(p.numel() for p in loaded.block.parameters()) / 1e6:.1f} M params)",
        "workload": f"batch {workload.batch} x S={workload.seq_len} rows "
                    f"({', '.join(f'{k} {v}' for k, v in workload.rows.items())}); {workload.source}",
        "dtype": str(dtype).replace("torch.", ""),
        "device": info.label,
        "block time": ", ".join(f"{r.backend} {r.block_ms:.2f} ms (median of {r.profile.timing.runs})" for r in results),
        "peak memory": f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a on the CPU",
    }
    if memory_budget:
        header["memory budget"] = memory_budget
    if offload == "stream":
        header["offload"] = "stream: the --validate chain's blocks from pinned host memory, one block ahead"
    if loaded.stats:
        s = loaded.stats
        header["load"] = f"{s.bytes_read / 1e9:.3f} GB in {s.seconds:.2f} s ({s.gbps:.2f} GB/s) from {', '.join(s.shards)}"
    if scaled_down:
        header["NOTE"] = (f"no GPU: scaled-down {adapter.display_name} block (hidden {adapter.hidden_size}, "
                          f"{adapter.config['num_attention_heads']} heads) at S={workload.seq_len}; run on a GPU for real numbers")
    report = {
        "dit_accel_version": __version__, "command": command_line(),
        "run_kind": "gpu" if device.type == "cuda" else ("cpu-scaled-down" if scaled_down else "cpu"),
        "header": header, "device": info.as_dict(), "ceilings": {**ceilings.as_dict(), "from_cache": ceilings_cached},
        "model": adapter.describe(), "block": loaded.as_dict(), "workload": workload.as_dict(),
        "dtype": header["dtype"], "memory_budget": memory_budget, "offload": offload,
        "attention_reference": attention_reference,
        "runs": [r.as_dict(ceilings) for r in results],
        "validation": validation.as_dict() if validation else None,
    }
    render(console, report, results, ceilings, validation)
    write_files(run_dir, report, results)
    return report

"""report.json's content (`build_report`): a profile-block session's results, with the settings they were
measured under, this device's ceilings, the whole-video figure (`whole_videos`) and where each number
came from. Its "header" is also the panel at the top of the terminal output (`render`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..version import __version__
from ..adapters.stage_specs import STAGE_KEYS, StageSkip
from ..attention.backends import BACKENDS
from ..device import Ceilings, DeviceInfo
from ..report_io import command_line, provenance
from .extrapolate import WholeVideo
from .memory import MemoryEstimate
from .results import timing_noise
from .session import ProfileSettings, SessionResult

if TYPE_CHECKING:
    from ..attention.crossover import MeasuredHere

SCALED_DOWN_NOTE = ("scaled-down CPU block: its times and the whole-model figures built from them "
                    "say nothing about a GPU")


def build_report(settings: ProfileSettings, result: SessionResult, ceilings: Ceilings, ceilings_cached: bool,
                 memory_estimate: MemoryEstimate | None = None, routing: MeasuredHere | None = None) -> dict[str, Any]:
    """report.json's content; its "header" is also the panel at the top of the terminal output. `routing`: what
    routed our kernel's calls by shape on this device (`attention.crossover.measure_here`)."""
    s, runs = settings, result.runs
    adapter, workload = s.adapter, s.workload
    info = DeviceInfo.of(s.device)
    peak = max((r.profile.peak_memory_bytes for r in runs if r.profile.peak_memory_bytes is not None), default=None)
    dtype = str(s.dtype).replace("torch.", "")
    counts = dict(adapter.stacks)
    blocks = [(loaded, stack) for loaded, stack in zip(result.loaded, s.stack_names())]
    header = {
        "model": f"{adapter.display_name}" + (f" ({adapter.preset})" if adapter.preset else ""),
        "block": "; ".join(f"{loaded.index} of {counts[stack]}" + (f" {stack}" if len(blocks) > 1 else "")
                           for loaded, stack in blocks) + f"; {result.loaded[0].source}",
        "weights": ", ".join(f"{loaded.param_bytes / 1e9:.3f} GB "
                             f"({sum(p.numel() for p in loaded.block.parameters()) / 1e6:.1f} M params)"
                             + (f" ({stack})" if len(blocks) > 1 else "") for loaded, stack in blocks),
        "workload": f"batch {workload.batch} x S={workload.seq_len} rows "
                    f"({', '.join(f'{k} {v}' for k, v in workload.rows.items())}); {workload.source}",
        "dtype": dtype,
        "device": info.label,
        "block time": ", ".join(f"{r.backend}{' ' + r.stack if len(blocks) > 1 else ''} {r.block_ms:.2f} ms "
                                f"(median of {r.profile.timing.runs}"
                                + (f", max/min {r.profile.timing.max_over_min:.2f}"
                                   if r.profile.timing.max_over_min else "")
                                + ")" for r in runs),
        "peak memory": f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a on the CPU",
    }
    if memory_estimate:
        m = memory_estimate.as_dict()
        header["memory estimate"] = (f"~{m['total_bytes'] / 2**30:.2f} GiB with a {m['margin']:.0%} margin "
                                     f"({m['summary']})")
    if result.outside:
        o = result.outside
        header["outside the blocks"] = (f"{o.median_ms:.2f} ms per pass (measured: the transformer without its "
                                        f"blocks, S={o.seq_len}, {o.param_bytes / 1e9:.3f} GB of weights)")
    if s.memory_budget:
        header["memory budget"] = s.memory_budget
    if s.offload == "stream":
        header["offload"] = "stream: the --validate pass's blocks from pinned host memory, one block ahead"
    for loaded, stack in blocks:
        if loaded.stats:
            st = loaded.stats
            header["load" + (f" ({stack})" if len(blocks) > 1 else "")] = (
                f"{st.bytes_read / 1e9:.3f} GB in {st.seconds:.2f} s ({st.gbps:.2f} GB/s) from {', '.join(st.shards)}")
    if routing is not None and any(BACKENDS[recipe.backend].routed for recipe in s.recipes):
        header["attention routing"] = routing.note
    if s.scaled_down:
        header["NOTE"] = (f"no GPU: scaled-down {adapter.display_name} block (hidden {adapter.hidden_size}, "
                          f"{adapter.attention_heads[0]} heads) at S={workload.seq_len}; "
                          f"run on a GPU for real numbers")
    validation = result.validation
    warnings = [w for w in (timing_noise(r.profile.timing, r.backend) for r in runs) if w]
    return {
        "dit_accel_version": __version__, "command": command_line(), "rerun_options": list(s.rerun_options),
        "rerun": dict(s.rerun),
        "provenance": provenance(seed=s.seed, device=s.device),
        "run_kind": "gpu" if s.device.type == "cuda" else ("cpu-scaled-down" if s.scaled_down else "cpu"),
        "scaled_down": s.scaled_down, "scaled_down_note": SCALED_DOWN_NOTE if s.scaled_down else None,
        "warnings": warnings,
        "memory_estimate": memory_estimate.as_dict() if memory_estimate else None,
        "header": header, "device": info.as_dict(), "ceilings": {**ceilings.as_dict(), "from_cache": ceilings_cached},
        "crossover": routing.as_dict() if routing is not None else None,
        "model": adapter.describe(), "block": result.loaded[0].as_dict(),
        "blocks": {stack: loaded.as_dict() for loaded, stack in blocks}, "workload": workload.as_dict(),
        "block_work": {stack: adapter.for_stack(stack).block_work(workload) for _, stack in blocks},
        "dtype": dtype, "memory_budget": s.memory_budget, "offload": s.offload,
        "attention_reference": result.attention_reference,
        "runs": [r.as_dict(ceilings) for r in runs],
        "recipes_left_out": result.skipped,  # --keep-going: recipe label -> why torch could not compile it
        "validation": validation.as_dict() if validation else None,
        "outside": result.outside.as_dict() if result.outside else None,
        "stages": [m.as_dict(ceilings) for m in result.stages],
        "stages_skipped": [{"stage": spec.key, "reason": spec.reason}
                           for spec in s.stages if isinstance(spec, StageSkip)],
        "whole_video": [v.as_dict() for v in whole_videos(s, result)] if s.stages else None,
    }


def whole_videos(settings: ProfileSettings, result: SessionResult) -> list[WholeVideo]:
    """Each recipe's whole video: text encoding, its denoising, VAE decode, audio decode."""
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
    first_run = {}
    for run in result.runs:  # every stack's run of a recipe shares its extrapolation
        first_run.setdefault(run.backend, run)
    for recipe in settings.recipes:
        run = first_run[recipe.label]
        stage_s = {key: measured[key].run_for(recipe.backend).ms / 1e3 if key in measured else None
                   for key in STAGE_KEYS}
        videos.append(WholeVideo(run.backend, run.extrapolation.video_s, stage_s, notes))
    return videos

"""What `generate` writes: the videos (and soundtracks) of its runs, the comparison of two runs, the
header printed at the top, and report.json's content."""
from __future__ import annotations

import re

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..version import __version__
from ..device import DeviceInfo
from ..report_io import command_line, provenance
from .pipeline_folder import PipelineFolder
from .parallel import UlyssesGroup
from .quality import compare_videos
from .running import Request, RunResult
from .video_io import write_mp4, write_wav


@dataclass(frozen=True)
class GenerateSettings:
    """One generate call as the command line resolved it."""

    folder: PipelineFolder
    request: Request
    device: torch.device
    dtype: torch.dtype
    attention: tuple  # Recipe of each run, the reference (--compare) first
    warmup: bool
    offload: str
    group: UlyssesGroup | None  # --ulysses: the process group, else None
    skip_crossover: bool = False  # --skip-crossover: route by the conservative rule where the GPU has no data
    reference: bool = False  # the first run is --compare's, which the others are compared against


def file_tag(label: str) -> str:
    """A recipe's label as a file name's part: `fp8+cache=fbc:0.12` -> `fp8+cache-fbc-0.12` (no `=` or `:`)."""
    return re.sub(r"[^A-Za-z0-9.+_-]", "-", label)


def write_outputs(run_dir: Path, runs: list[RunResult]) -> tuple[list[str], list[dict[str, Any]]]:
    """video[_<attention>].mp4 per run (with its soundtrack as a WAV, muxed in, where there is one).
    Returns (file names, per-run output records)."""
    files: list[str] = []
    videos = []
    for run in runs:
        suffix = "" if len(runs) == 1 else f"_{file_tag(run.attention)}"
        sound = None
        if run.audio is not None:
            sound = write_wav(run_dir / f"audio{suffix}.wav", run.audio, run.sample_rate)
        video = write_mp4(run_dir / f"video{suffix}.mp4", run.frames, run.fps,
                          audio_path=None if sound is None else run_dir / sound["file"])
        videos.append({**video, "audio": sound})
        files += [video["file"]] + ([] if sound is None else [sound["file"]])
    return files, videos


def compare_runs(reference: RunResult, candidate: RunResult) -> dict[str, Any]:
    """Per-frame PSNR/SSIM of the candidate against the reference, and the speed-ups: of the median step
    (one stalled step, a collection or a sync, does not carry it), of all the steps, of the whole call."""
    quality = compare_videos(candidate.frames, reference.frames)
    return {"reference": reference.attention, "candidate": candidate.attention, **quality,
            "median_step_speedup": (statistics.median(reference.times.step_ms)
                                    / statistics.median(candidate.times.step_ms)),
            "denoise_speedup": reference.times.denoise_ms / candidate.times.denoise_ms,
            "total_speedup": reference.times.total_ms / candidate.times.total_ms}


def streaming_figures(streamed_bytes: int, h2d_gbps: float) -> dict[str, float]:
    return {"streamed_bytes_per_pass": streamed_bytes, "h2d_gbps": h2d_gbps,
            "transfer_ms_per_pass": streamed_bytes / h2d_gbps / 1e6}


def build_header(settings: GenerateSettings, runs: list[RunResult], streaming: dict | None) -> dict[str, str]:
    first = runs[0]
    header = {"pipeline": f"{settings.folder.class_name} from {settings.folder.path}",
              "device": DeviceInfo.of(settings.device).label,
              "dtype": str(settings.dtype).replace("torch.", ""),
              "video": f"{first.frames.shape[0]} frames of {first.frames.shape[1]}x{first.frames.shape[2]} "
                       f"at {first.fps:g} fps, {settings.request.steps} steps, seed {settings.request.seed}"}
    if first.audio is not None:
        header["audio"] = (f"{first.audio.shape[0]} channels at {first.sample_rate} Hz, "
                           f"{first.audio.shape[1] / first.sample_rate:.2f} s (WAV, and AAC in the MP4)")
    if streaming is not None:
        header["offload"] = (f"stream: {streaming['streamed_bytes_per_pass'] / 1e9:.2f} GB of transformer weights per "
                             f"pass from pinned host memory, {streaming['transfer_ms_per_pass']:.1f} ms of copies at "
                             f"{streaming['h2d_gbps']:.1f} GB/s, prefetched one block ahead (profile-block "
                             f"--validate N --offload stream measures how much is hidden)")
    if settings.group:
        header["parallel"] = settings.group.describe()
    if settings.device.type == "cpu":
        header["NOTE"] = "CPU run: the timings say nothing about a GPU"
    return header


def build_report(settings: GenerateSettings, header: dict[str, str], runs: list[RunResult],
                 videos: list[dict[str, Any]], files: list[str], streaming: dict | None,
                 comparisons: list[dict], crossover: dict | None = None) -> dict[str, Any]:
    """report.json's content. comparisons: each run against the reference (`compare_runs`; none without --compare);
    crossover: what routed our kernel's calls by shape (`MeasuredHere.as_dict`), None where no run routes."""
    folder = settings.folder
    return {"dit_accel_version": __version__, "command": command_line(),
            "provenance": provenance(seed=settings.request.seed, device=settings.device),
            "run_kind": "gpu" if settings.device.type == "cuda" else "cpu", "header": header,
            "pipeline": {"class": folder.class_name, "path": str(folder.path),
                         "components": {k: list(v) for k, v in folder.components.items()}},
            "device": DeviceInfo.of(settings.device).as_dict(), "dtype": header["dtype"],
            "request": settings.request.as_dict(), "warmup": settings.warmup, "offload": settings.offload,
            "streaming": streaming, "ulysses_degree": settings.group.degree if settings.group else 1,
            "runs": [run.as_dict() for run in runs], "outputs": videos,
            "comparisons": comparisons, "crossover": crossover, "files": [*files, "report.json"]}

"""What `dit-accel plan` predicts from: a profile-block run folder's report.json, read into the measured baseline
(its first recipe, which must be eager with bf16 linears) and the recipes the run also measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..patching.recipe import parse_recipe
from ..run_dir import read_run
from .knobs import knobs_of

COMPUTE_KINDS = ("attention", "gemm")  # rates against tensor-core ceilings; everything with bytes is memory-bound


@dataclass
class StackBaseline:
    """One stack's measured block (the baseline recipe) and the work the report says it does."""

    stack: str
    num_blocks: int
    block_ms: float
    categories: dict[str, dict[str, Any]]
    attention_calls: list[dict[str, Any]]
    linears: list[dict[str, Any]]
    param_bytes: int
    modules_ms: dict[str, float] = field(default_factory=dict)  # the block's module ranges (eager runs name them)


@dataclass
class Measured:
    """A recipe the run measured: its knobs, block ms per stack, errors."""

    label: str
    knobs: frozenset[str]
    block_ms: dict[str, float]
    attention_rel_err: float | None
    output_rel_l2: float | None
    attention_tflops: float | None = None  # its first stack's attention, as the profile classified it


@dataclass
class Baseline:
    run_dir: Path
    recipe: str  # the baseline's label
    attention_backend: str
    device_name: str
    device_memory_gib: float
    ceilings: dict[str, float | None]  # bf16 and fp8 GEMM TFLOP/s, copy and host link GB/s, measured at the run's start
    stacks: list[StackBaseline]
    outside_ms: float
    outside_source: str
    steps: int
    passes: int
    peak_memory_bytes: int
    outside_bytes: int
    dtype: str
    measured: list[Measured] = field(default_factory=list)
    # Whole-transformer passes streamed from host memory that runs measured (profile-block --validate model
    # --offload stream --memory-budget B), each its recipe, pass ms, host-to-device GB/s, budget and run folder.
    streamed: list[dict[str, Any]] = field(default_factory=list)
    # Whole videos under a step cache that runs measured (profile-block --validate model --cache), each its recipe,
    # cache, a pass averaged over the video, the graphs compiled during it and run folder.
    cached_videos: list[dict[str, Any]] = field(default_factory=list)
    rerun_options: list[str] | None = None  # the options that rebuild the block and its inputs (plan --verify)

    @property
    def pass_ms(self) -> float:
        return sum(s.num_blocks * s.block_ms for s in self.stacks) + self.outside_ms

    @property
    def activation_bytes(self) -> int:
        """The measured block's peak beyond its own weights: its inputs and activations."""
        return max(0, self.peak_memory_bytes - max(s.param_bytes for s in self.stacks))


def streamed_passes(report: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """The streamed whole-transformer pass a report's --validate measured (under its first recipe), or none."""
    validation = report.get("validation") or {}
    if not validation.get("whole_model") or validation.get("residency") != "streamed":
        return []
    return [{"recipe": report["runs"][0]["backend"].split(" of ")[0], "pass_ms": validation["measured_ms"],
             "h2d_gbps": validation["streamed"]["h2d_gbps"], "budget": report.get("memory_budget"),
             "peak_bytes": validation.get("peak_memory_bytes"), "run": str(folder)}]


def cached_videos(report: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """The whole video under a step cache a report's --validate measured (under its first recipe), or none."""
    video = (report.get("validation") or {}).get("video")
    if not video:
        return []
    return [{"recipe": report["runs"][0]["backend"].split(" of ")[0], "cache": video["cache"],
             "pass_ms": video["pass_ms"], "graphs_compiled": video["graphs_compiled"],
             "work_computed": video["work_computed"], "run": str(folder)}]


def read_baseline(folder: Path) -> Baseline:
    """The run in `folder` as a Baseline; one UserError line when it cannot be one."""
    report = read_run(folder)
    if report.get("run_kind") != "gpu":
        raise UserError(f"{folder} is a {report.get('run_kind', 'CPU')} run: predictions scale what a GPU measured, "
                        "so profile the block on a GPU first (or try a run measured on one: the repository's "
                        "examples/h3-h100)")
    work = report.get("block_work")
    if not work or any(w is None for w in work.values()):
        raise UserError(f"{folder}'s report has no block_work (attention shapes, linears): it predates "
                        "`dit-accel plan`; run profile-block again")
    runs = report["runs"]
    first = runs[0]["backend"].split(" of ")[0]
    knobs = knobs_of(first)
    if knobs is None or knobs:
        raise UserError(f"{folder}'s first recipe is {first}: predictions start from an eager recipe with the "
                        "model's own attention and bf16 linears (e.g. --compare-attn cudnn,...)")
    extrapolation = runs[0]["extrapolation"]
    counts = {s["stack"]: s["num_blocks"] for s in extrapolation["stacks"]}
    base_runs = [r for r in runs if r["backend"].split(" of ")[0] == first]
    stacks = [StackBaseline(r["stack"], counts[r["stack"]], r["block_ms"], r["categories"],
                            work[r["stack"]]["attention_calls"], work[r["stack"]]["linears"],
                            report["blocks"][r["stack"]]["param_bytes"],
                            {name: m["ms"] for name, m in (r.get("modules") or {}).items()}) for r in base_runs]
    ceilings = report["ceilings"]
    baseline = Baseline(
        folder, first, parse_recipe(first).backend, report["device"]["name"], report["device"]["total_memory_gib"],
        {"bf16": ceilings["gemm_tflops"], "fp8": ceilings.get("fp8_gemm_tflops"), "copy": ceilings["copy_gbps"],
         "host_link": ceilings.get("host_link_gbps")},
        stacks, extrapolation["outside_ms"], extrapolation["outside_source"], extrapolation["steps"],
        extrapolation["guidance_passes"], max(r["peak_memory_bytes"] or 0 for r in base_runs),
        (report.get("memory_estimate") or {}).get("outside_bytes", 0), report["dtype"])
    baseline.streamed = streamed_passes(report, folder)
    baseline.cached_videos = cached_videos(report, folder)
    baseline.rerun_options = report.get("rerun_options")
    for label in dict.fromkeys(r["backend"].split(" of ")[0] for r in runs[len(base_runs):]):
        recipe_knobs = knobs_of(label)
        if recipe_knobs is None:
            continue
        these = [r for r in runs if r["backend"].split(" of ")[0] == label]
        output = these[0].get("output_vs_reference") or {}
        attention = these[0]["categories"].get("attention") or {}
        baseline.measured.append(Measured(label, recipe_knobs, {r["stack"]: r["block_ms"] for r in these},
                                          these[0].get("attention_rel_err"), output.get("rel_l2"),
                                          attention.get("tflops")))
    return baseline


def generate_runs(folder: Path, baseline: Baseline) -> list[dict[str, Any]]:
    """The runs of the generate run in `folder` as plan sets them beside its predictions, each: its label, recipe,
    step cache summary (None uncached), the transformer's time a pass averaged over the video, the graphs compiled
    during it. One UserError line when `folder` is not a generate run on the block's GPU, video and steps."""
    import json

    try:
        report = json.loads((folder / "report.json").read_text())
        runs, request = report["runs"], report["request"]
        timed = [(run["attention"], run["stages"]["transformer_ms_per_step"]) for run in runs]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{folder} is not a dit-accel generate run folder (a report.json with its runs' stage "
                        f"times); give one, e.g. outputs/generate_...") from None
    untimed = next((label for label, per_step in timed if not per_step or sum(per_step) <= 0), None)
    if untimed is not None:
        raise UserError(f"{folder}'s {untimed} run has no transformer time per step; run generate again")
    device = (report.get("device") or {}).get("name")
    if device != baseline.device_name:
        raise UserError(f"{folder} ran on {device or 'no GPU'} and the block on {baseline.device_name}: compare runs "
                        f"of one GPU")
    from ..profiling.request import ProfileRequest

    profiled = ProfileRequest.from_rerun_options(baseline.rerun_options or [], recipes=())
    block = (profiled.frames, profiled.height, profiled.width)
    video = (request.get("frames"), request.get("height"), request.get("width"))
    if video != block or request.get("steps") != baseline.steps:
        raise UserError(f"{folder} ran {_video(video)} over {request.get('steps')} steps and the block was profiled "
                        f"for {_video(block)} over {baseline.steps}: profile the block at the generate run's video "
                        f"(profile-block --frames F --height H --width W --steps N)")
    found = []
    for run, (_, per_step) in zip(runs, timed):
        cache = ((run.get("attention_patch") or {}).get("step_cache") or [None])[0]
        passes = cache["passes"] if cache else request["steps"] * baseline.passes
        found.append({"label": run["attention"], "recipe": run["attention"].split("+cache=")[0], "cache": cache,
                      "pass_ms": sum(per_step) / passes, "graphs_compiled": run.get("graphs_compiled"),
                      "run": str(folder)})
    return found


def _video(video: tuple) -> str:
    frames, height, width = video
    return "the pipeline's own video" if None in video else f"{frames} frames of {height}x{width}"

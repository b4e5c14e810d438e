"""A profile-block session from plain values: what the command's options and `plan --verify`'s rerun of a saved run
both make (`ProfileRequest`), resolved into the session's settings (`profile_settings`, every check a user can fail
as one UserError line, before anything is loaded), and the session run into a run folder (`run_profile`: the device
ceilings, the attention crossover, the session, the report and its files). The command prints; this module does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:

    from ..attention.crossover import MeasuredHere
    from ..device import Ceilings
    from ..patching.recipe import Recipe
    from ..patching.step_cache import CacheSpec
    from .session import ProfileSettings, SessionResult

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # as written -> torch's attribute
# The request's fields that rebuild a run's block and inputs on another call (report.json's `rerun`).
RERUN_FIELDS = ("model", "preset", "checkpoint", "block", "seq_len", "frames", "height", "width", "batch", "warmup",
                "runs", "steps", "guidance_passes", "device", "seed", "dtype")


@dataclass(frozen=True)
class ProfileRequest:
    """One profile-block session as plain values (the command line's, or a saved run's `rerun` with other recipes).
    dtype: bf16, fp16 or fp32 (None: bf16 on a GPU, fp32 on the CPU); validate: blocks to chain, or "model";
    cache: the step cache a --validate model pass runs the whole video under (`check_video_cache`); memory_budget:
    as written ("16GiB") with its bytes; device: cuda, cuda:N or cpu (None: the GPU if any)."""

    recipes: tuple[Recipe, ...]
    model: str | None = None
    preset: str | None = None
    checkpoint: Path | None = None
    block: str = "0"
    seq_len: int | None = None
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    batch: int = 1
    dtype: str | None = None
    warmup: int = 3
    runs: int = 10
    steps: int | None = None
    guidance_passes: int | None = None
    outside_ms: float | None = None
    outside_mode: str | None = None
    stages: tuple[str, ...] | None = None
    text_encoder_config: Path | None = None
    validate: int | str = 0
    cache: CacheSpec | None = None
    offload: str = "resident"
    memory_budget: tuple[str, int] | None = None
    trace: bool = False
    device: str | None = None
    seed: int = 0
    keep_going: bool = False

    def rerun(self, dtype: str) -> dict[str, Any]:
        """The fields that rebuild this run's block and inputs (`dtype`: the one the run resolved), as JSON values."""
        values = {name: getattr(self, name) for name in RERUN_FIELDS}
        values["dtype"] = dtype
        values["checkpoint"] = str(self.checkpoint) if self.checkpoint is not None else None
        return {name: value for name, value in values.items() if value is not None}

    def rerun_options(self, dtype: str) -> list[str]:
        """The same as the command's options (`--seq-len=4096`), for reports and messages."""
        return [f"--{name.replace('_', '-')}={value}" for name, value in self.rerun(dtype).items()]

    @classmethod
    def from_rerun(cls, rerun: dict[str, Any], **more: Any) -> "ProfileRequest":
        """A request rebuilding a saved run's block and inputs (its `rerun`), with `more` (recipes, validate, ...)."""
        values = {name: rerun[name] for name in RERUN_FIELDS if name in rerun}
        if values.get("checkpoint") is not None:
            values["checkpoint"] = Path(values["checkpoint"])
        return cls(**values, **more)

    @classmethod
    def from_rerun_options(cls, options: list[str], **more: Any) -> "ProfileRequest":
        """From a report's `rerun_options` (`--seq-len=4096`; reports written before `rerun`)."""
        ints = {"seq_len", "frames", "height", "width", "batch", "warmup", "runs", "steps", "guidance_passes", "seed"}
        rerun = {}
        for option in options:
            name, _, value = option.removeprefix("--").partition("=")
            name = name.replace("-", "_")
            if name in RERUN_FIELDS:
                rerun[name] = int(value) if name in ints else value
        return cls.from_rerun(rerun, **more)


def _adapter(model: str | None, preset: str | None, checkpoint: Path | None):
    from ..adapters import DEFAULT_FAMILY, adapter_for_config, adapter_for_preset, read_transformer_config
    from ..loading.checkpoint import CONFIG_NAME, transformer_folder

    if checkpoint is None:
        return adapter_for_preset(model or DEFAULT_FAMILY, preset)
    folder = transformer_folder(checkpoint)
    adapter = adapter_for_config(read_transformer_config(folder / CONFIG_NAME), str(folder))
    if model and model != adapter.family:
        raise UserError(f"--model {model} does not match the checkpoint, which is {adapter.family}; drop --model")
    return adapter


def stack_and_index(adapter, spec: str) -> tuple[tuple[str, ...], int]:
    """--block: "N" (block N of every stack), "STACK" (block 0 of that stack alone) or "STACK.N"."""
    if spec.lstrip("-").isdigit() and spec.startswith("-"):
        raise UserError(f"--block {spec}: block indices count from 0 (the first block); give 0 to "
                        f"{min(count for _, count in adapter.stacks) - 1}, a stack or STACK.N")
    name, _, index = spec.rpartition(".") if not spec.isdigit() else ("", "", spec)
    if not name and not spec.isdigit():
        name, index = spec, "0"
    stacks = dict(adapter.stacks)
    if name and name not in stacks:
        raise UserError(f"--block {spec}: {adapter.display_name} has no block stack {name!r}; its stacks are "
                        f"{', '.join(stacks)}")
    if not index.isdigit():
        raise UserError(f"--block {spec}: give a block index (N), a stack ({', '.join(stacks)}) or STACK.N")
    return ((name,) if name else ()), int(index)


def check_video_cache(cache: CacheSpec, validate_model: bool, offload: str) -> None:
    """What --cache needs: the --validate model pass, resident, and a cache whose skips the step count alone
    decides (on synthetic weights and inputs held fixed, a threshold decides nothing real) without a pipeline's
    timesteps."""
    from ..patching.step_cache import CACHE_METHODS

    method = CACHE_METHODS[cache.method]
    written = cache.written
    if not validate_model:
        raise UserError(f"--cache {written} runs the whole video in the --validate model pass: add --validate model")
    if offload != "resident":
        raise UserError(f"--cache {written} runs the whole video with the blocks resident (its hooks and the "
                        f"streaming's are not run together here); drop --offload {offload}")
    usable = ", ".join(m.name for m in CACHE_METHODS.values() if m.runs_on_a_model)
    if not method.fixed_schedule:
        raise UserError(f"--cache {method.name}: {method.title} skips by a threshold on what the weights compute, "
                        f"which synthetic weights say nothing of; --validate model runs {usable}; measure "
                        f"{method.name} with generate --attn RECIPE+cache={method.name}")
    if method.needs_timestep:
        raise UserError(f"--cache {method.name}: {method.title} skips by the pipeline's timesteps, which a block run "
                        f"does not have; --validate model runs {usable}; measure {method.name} with generate "
                        f"--attn RECIPE+cache={method.name}")


def profile_settings(request: ProfileRequest) -> ProfileSettings:
    """The session's settings for `request`: the device, the family and its block, the workload, the recipes and
    stages, each checked (one UserError line for what cannot run), before any weight is read."""
    import torch

    from ..device import pick_device
    from ..loading.offload import check_offload
    from ..patching.recipe import check_recipes
    from .session import ProfileSettings

    r = request
    if r.outside_mode == "measure" and r.outside_ms is not None:
        raise UserError("--outside measure measures the time outside the blocks and --outside-ms states it; "
                        "give one of them")
    video = (r.frames, r.height, r.width)
    if any(v is not None for v in video) and (None in video or r.seq_len is not None):
        raise UserError("give the workload either as --seq-len or as all of --frames, --height and --width")
    device = pick_device(r.device)
    dtype = getattr(torch, DTYPE_NAMES[r.dtype]) if r.dtype else (torch.bfloat16 if device.type == "cuda"
                                                                   else torch.float32)
    validate_blocks = r.validate
    if r.offload == "stream" and not validate_blocks:
        raise UserError("--offload stream streams the blocks of the --validate pass; add --validate N "
                        "(--validate 50: the whole H3 block stack) or --validate model (the whole transformer)")
    check_offload(r.offload, device)

    adapter = _adapter(r.model, r.preset, r.checkpoint)
    scaled_down = device.type == "cpu" and r.checkpoint is None
    if scaled_down:
        adapter = adapter.scaled_down()
    stacks, block_index = stack_and_index(adapter, r.block)
    validate_model = validate_blocks == "model"
    if r.cache is not None:
        check_video_cache(r.cache, validate_model, r.offload)
    if validate_model:
        validate_blocks = sum(count for _, count in adapter.stacks)
    elif validate_blocks and len(stacks or adapter.stacks) > 1:
        raise UserError(f"--validate N chains the blocks of one stack, and {adapter.display_name} has "
                        f"{len(adapter.stacks)} ({', '.join(name for name, _ in adapter.stacks)}); use --validate "
                        f"model (the whole transformer) or name one stack with --block")
    if r.frames is not None:
        workload = adapter.workload_from_video(r.frames, r.height, r.width, r.batch)
    elif r.seq_len is not None:
        workload = adapter.workload_from_seq_len(r.seq_len, r.batch)
    else:
        # on the CPU a checkpoint's block too runs the short workload (its weights are full size)
        workload = adapter.default_workload(r.batch, scaled_down=device.type == "cpu")
    if validate_blocks and r.recipes[0].fused_prologue:
        raise UserError(f"--validate runs its blocks under the first recipe, and {r.recipes[0].label} adds the fused "
                        f"prologue, which it does not apply; put another recipe first in --compare-attn, or drop "
                        f"--validate")
    check_recipes(r.recipes, device, dtype, adapter)
    if r.text_encoder_config is not None and "text" not in (r.stages or ()):
        raise UserError("--text-encoder-config is read by the text stage: add --stages text (or --stages all)")
    stage_specs = tuple(adapter.pipeline_stages(workload, r.stages, scaled_down=scaled_down,
                                                text_encoder_config=r.text_encoder_config)) if r.stages else ()
    dtype_name = next(name for name, attribute in DTYPE_NAMES.items() if getattr(torch, attribute) == dtype)
    return ProfileSettings(
        adapter, workload, dtype, device, r.recipes, checkpoint=r.checkpoint,
        rerun_options=tuple(r.rerun_options(dtype_name)), rerun=r.rerun(dtype_name),
        block_index=block_index, stacks=stacks, warmup=r.warmup, runs=r.runs, steps=r.steps,
        guidance_passes=r.guidance_passes, outside_ms=r.outside_ms,
        # A whole-video figure wants the pass whole: --stages measures outside the blocks unless it is stated.
        # --validate model compares with blocks x block + outside: it measures outside the blocks too.
        measure_outside=r.outside_mode == "measure" or bool((r.stages or validate_model) and r.outside_ms is None),
        validate_blocks=validate_blocks, validate_model=validate_model, validate_cache=r.cache,
        offload=r.offload, memory_budget=r.memory_budget[0] if r.memory_budget else None, trace=r.trace,
        seed=r.seed, scaled_down=scaled_down, stages=stage_specs, keep_going=r.keep_going)


@dataclass
class ProfiledRun:
    """A finished session: its report (report.json's content), results, the ceilings it was rated against and what
    routed our kernel's calls."""

    report: dict[str, Any]
    result: SessionResult
    ceilings: Ceilings
    routing: MeasuredHere


def run_profile(settings: ProfileSettings, run_dir: Path, progress, *, memory_budget_bytes: int | None,
                refresh_ceilings: bool = False, skip_crossover: bool = False, estimate=None,
                on_note=lambda note: None) -> ProfiledRun:
    """Run the session into `run_dir` (a staging folder): the device ceilings (measured once per device, before the
    memory budget applies: the measurement itself takes ~4 GiB), the attention crossover where the GPU has none
    (`crossover.measure_here`), the session, report.json and its files. `on_note(line)` is told what a user should
    read (a cache file replaced)."""
    from ..attention.crossover import measure_here
    from ..device import apply_memory_budget, device_ceilings
    from .render import write_files
    from .block_report import build_report
    from .session import run_session

    with progress.stage("device ceilings (GEMM, FP8 GEMM where the GPU has one, copy and host link; measured "
                        "once per device, then cached)"):
        ceilings, ceilings_cached = device_ceilings(settings.device, settings.dtype, refresh=refresh_ceilings)
    routing = measure_here(settings.device, skip=skip_crossover, progress=progress)
    if routing.replaced:
        on_note(f"{routing.replaced}: measured again")
    if memory_budget_bytes:
        apply_memory_budget(settings.device, memory_budget_bytes)
    result = run_session(settings, run_dir, progress)
    report = build_report(settings, result, ceilings, ceilings_cached, estimate, routing)
    write_files(run_dir, report, result.runs, result.stages, routing)
    return ProfiledRun(report, result, ceilings, routing)

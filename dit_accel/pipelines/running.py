"""One pipeline call with a chosen attention, timed per stage: what `generate` runs once or twice.

A DiffusionPipeline's call is built from what its `__call__` accepts (prompt, num_frames, height,
width, num_inference_steps, guidance_scale, generator, output_type="np", callback_on_step_end), so any
text-to-video DiffusionPipeline of diffusers runs unchanged; its video frames are kept. A modular
pipeline's `__call__` takes any keyword, so its inputs are spelled out: MiniMax-H3 (the only modular
pipeline `loading.MODULAR_WORKFLOWS` lets through) gets its text-only inputs, and its video frames and
stereo soundtrack are kept. `Request.steps` is the number of denoising steps that run in either case.

Attention and recipes (`patching.recipe`): the default (`native`, or its alias `bf16`) leaves the pipeline
as it is; any other recipe is applied to its transformer(s) by `patching.apply_recipe` for the duration of
the call and undone after (torch.compile stays).
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from ..patching.apply import apply_recipe, compile_failures_as_user_errors, dynamo_counts
from ..patching.recipe import Recipe
from .stage_timer import StageTimer, StageTimes

DEFAULT_FPS = 16  # Wan's; a pipeline with an `fps` attribute says its own


@dataclass(frozen=True)
class Request:
    prompt: str
    frames: int | None
    height: int | None
    width: int | None
    steps: int
    seed: int
    guidance: float | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RunResult:
    attention: str
    frames: np.ndarray  # [F, H, W, 3] float in [0, 1]
    fps: float
    times: StageTimes
    attention_summary: dict = field(default_factory=dict)
    audio: np.ndarray | None = None  # [channels, samples] float in [-1, 1], from pipelines that make sound
    sample_rate: int | None = None
    graphs_compiled: int = 0  # graphs torch.compile made during the call (after a warm-up: recompiles)

    def as_dict(self) -> dict:
        audio = None if self.audio is None else {
            "channels": int(self.audio.shape[0]), "samples": int(self.audio.shape[1]), "sample_rate": self.sample_rate,
            "seconds": self.audio.shape[1] / self.sample_rate}
        return {"attention": self.attention, "frames": int(self.frames.shape[0]),
                "height": int(self.frames.shape[1]), "width": int(self.frames.shape[2]), "fps": self.fps,
                "audio": audio, "stages": self.times.as_dict(), "attention_patch": self.attention_summary,
                "graphs_compiled": self.graphs_compiled}


class AttentionUnavailable(UserError):
    """`attention` cannot run on this device, for `reason` (the backend's own words)."""

    def __init__(self, attention: Recipe, reason: str):
        self.attention, self.reason = attention, reason
        super().__init__(f"--attn {attention.label} cannot run here: {reason}; use --attn bf16 (or run on an "
                         f"sm_89+ GPU)")


def check_attention(attention: Recipe, device: torch.device) -> None:
    """AttentionUnavailable now, before any weight is read, when `attention` cannot run on `device`
    (fp8 on a CPU)."""
    if attention.is_default:
        return
    from ..attention.backends import get_backend

    reason = get_backend(attention.backend).unavailable_reason(device)
    if reason:
        raise AttentionUnavailable(attention, reason)


def _accepts(pipe: Any) -> set[str]:
    try:
        return set(inspect.signature(pipe.__call__).parameters)
    except (TypeError, ValueError):
        return set()


def _diffusion_call(pipe: Any, request: Request, generator: torch.Generator, step_callback) -> dict:
    accepted = _accepts(pipe)
    wanted = {"prompt": request.prompt, "num_frames": request.frames, "height": request.height,
              "width": request.width, "num_inference_steps": request.steps, "guidance_scale": request.guidance,
              "generator": generator, "output_type": "np"}
    kwargs = {k: v for k, v in wanted.items() if v is not None and k in accepted}
    if "callback_on_step_end" in accepted:
        kwargs["callback_on_step_end"] = step_callback
    return kwargs


def _h3_call(request: Request, generator: torch.Generator) -> dict:
    """MiniMax-H3's text-only inputs. It is guidance-distilled (no guidance scale, one transformer pass a
    step), and its scheduler counts `num_inference_steps` as sigma grid points with the terminal 0
    included, so `request.steps` denoising steps are `num_inference_steps = steps + 1`."""
    if request.guidance is not None:
        raise UserError("MiniMax-H3 is guidance-distilled and takes no guidance scale; drop --guidance")
    wanted = {"prompt": request.prompt, "num_frames": request.frames, "height": request.height,
              "width": request.width, "num_inference_steps": request.steps + 1, "generator": generator,
              "output_type": "np"}
    return {k: v for k, v in wanted.items() if v is not None}


def _refused(pipe: Any, exc: ValueError) -> UserError:
    """The pipeline's own check of the request (duration, frame count, size multiple...) as our one line."""
    reason = str(exc).strip().splitlines()[0].rstrip(".")
    hint = ("; change --frames, --height or --width"
            if any(word in reason.lower() for word in ("frame", "height", "width", "duration", "second"))
            else "")
    return UserError(f"{type(pipe).__name__} refused the request: {reason}{hint}")


def _raised_in(exc: BaseException, function: str) -> bool:
    """Whether `exc` was raised inside a function named `function` (a pipeline's `check_inputs`)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


class _DropBlockErrorLogs(logging.Filter):
    """diffusers' modular pipeline logs a failing block's error with its whole traceback ("Error in
    block: ...", level ERROR) and then raises it; the raised error becomes our one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().lstrip().startswith("Error in block")


@contextlib.contextmanager
def _without_block_error_logs():
    logger = logging.getLogger("diffusers.modular_pipelines.modular_pipeline")
    drop = _DropBlockErrorLogs()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


_COMPILE_FAILED = ("the pipeline's transformer", "run without torch.compile (--compile, +compile)")


def _call_h3(pipe: Any, request: Request, generator: torch.Generator) -> dict:
    try:
        with _without_block_error_logs(), compile_failures_as_user_errors(*_COMPILE_FAILED):
            return pipe(**_h3_call(request, generator), output=["videos", "audio", "sampling_rate"])
    except ValueError as exc:  # the pipeline's own checks of the request (duration, frame count, size multiple...)
        raise _refused(pipe, exc) from exc


def _call_diffusion(pipe: Any, kwargs: dict) -> Any:
    try:
        with compile_failures_as_user_errors(*_COMPILE_FAILED):
            return pipe(**kwargs)
    except ValueError as exc:
        if _raised_in(exc, "check_inputs"):  # e.g. WanPipeline: height and width divisible by 16
            raise _refused(pipe, exc) from exc
        raise


def _is_modular(pipe: Any) -> bool:
    from diffusers import ModularPipeline

    return isinstance(pipe, ModularPipeline)


def _as_frames(frames: Any) -> np.ndarray:
    array = np.asarray(frames[0] if isinstance(frames, list) else frames, dtype=np.float32)
    if array.ndim == 5:
        array = array[0]
    return array


def _frames_of(output: Any) -> np.ndarray:
    frames = getattr(output, "frames", None)
    if frames is None and isinstance(output, (tuple, list)):
        frames = output[0]
    if frames is None:
        raise UserError(f"the pipeline returned {type(output).__name__} with no video frames; "
                        f"generate handles text-to-video pipelines")
    return _as_frames(frames)


def run_once(pipe: Any, request: Request, *, device: torch.device, attention: Recipe,
             on_step: Callable[[int], None] | None = None, mag_ratios: list[float] | None = None) -> RunResult:
    """Run the pipeline once with `attention` (`patching.apply_recipe`), undone before returning; torch.compile
    stays on the transformers (dynamo recompiles by itself when a later patch changes what they call), so a
    warm-up call's compile serves the timed call. A step cache in the recipe counts what it ran per step; the
    graphs torch.compile made during the call are counted (`RunResult.graphs_compiled`). `mag_ratios`: MagCache's,
    for `+cache=mag`."""
    graphs_before = dynamo_counts()[1]
    with apply_recipe(pipe, attention, keep_compiled=True, steps=request.steps, mag_ratios=mag_ratios) as applied:
        generator = torch.Generator(device=device).manual_seed(request.seed)
        modular = _is_modular(pipe)
        steps_from_callback = not modular and "callback_on_step_end" in _accepts(pipe)
        timer = StageTimer(pipe, device, steps_from_callback=steps_from_callback, on_step=on_step)

        def step_callback(pipeline, step, timestep, callback_kwargs):
            applied.step_callback(pipeline, step, timestep, callback_kwargs)
            timer.step_end()
            return callback_kwargs

        calibrating = attention.cache is not None and attention.cache.calibrate
        # MagCache's calibration prints its ratios for a user to copy: the run keeps them itself
        quiet = contextlib.redirect_stdout(io.StringIO()) if calibrating else contextlib.nullcontext()
        with torch.inference_mode(), timer, quiet:
            if modular:
                output = _call_h3(pipe, request, generator)
            else:
                output = _call_diffusion(pipe, _diffusion_call(pipe, request, generator, step_callback))
        summary = {} if attention.is_default else {**applied.summary(), "notes": applied.notes()}
    graphs = dynamo_counts()[1] - graphs_before
    fps = float(getattr(pipe, "fps", None) or DEFAULT_FPS)
    if not modular:
        return RunResult(attention.label, _frames_of(output), fps, timer.times, summary, graphs_compiled=graphs)
    audio = output["audio"][0].float().cpu().numpy()  # [1, channels, samples] -> [channels, samples]
    return RunResult(attention.label, _as_frames(output["videos"]), fps, timer.times, summary, audio=audio,
                     sample_rate=int(output["sampling_rate"]), graphs_compiled=graphs)


def warm_up(pipe: Any, request: Request, *, device: torch.device, attention: Recipe,
            mag_ratios: list[float] | None = None) -> None:
    """One untimed one-step call, so first-call costs (kernel compiles, allocator growth) stay out of the timings."""
    run_once(pipe, Request(**{**request.as_dict(), "steps": 1}), device=device, attention=attention,
             mag_ratios=mag_ratios)

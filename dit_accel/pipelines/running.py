"""One pipeline call with a chosen attention, timed per stage: what `generate` runs once or twice.

The call is built from what the pipeline's `__call__` accepts (a DiffusionPipeline: prompt,
num_frames, height, width, num_inference_steps, guidance_scale, generator, output_type="np",
callback_on_step_end), so any text-to-video DiffusionPipeline of diffusers runs unchanged. Only the
video frames are kept (modular pipelines, e.g. MiniMax-H3, are refused when the folder is inspected).

Attention: "bf16" leaves the pipeline's own attention alone; "fp8" patches it with
`dit_accel.patching.patch_attention(pipe, "fp8")` for the duration of the call and undoes it after.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from .stages import StageTimer, StageTimes

ATTENTION_CHOICES = ("bf16", "fp8")
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

    def as_dict(self) -> dict:
        return {"attention": self.attention, "frames": int(self.frames.shape[0]),
                "height": int(self.frames.shape[1]), "width": int(self.frames.shape[2]), "fps": self.fps,
                "stages": self.times.as_dict(), "attention_patch": self.attention_summary}


def check_attention(attention: str, device: torch.device) -> None:
    """UserError now, before any weight is read, when `attention` cannot run on `device` (fp8 on a CPU)."""
    if attention == "bf16":
        return
    from ..attention.backends import get_backend

    reason = get_backend(attention).unavailable_reason(device)
    if reason:
        raise UserError(f"--attn {attention} cannot run here: {reason}; use --attn bf16 (or run on an sm_89+ GPU)")


def _patch(pipe: Any, attention: str):
    if attention == "bf16":
        return None
    from ..patching import patch_attention

    return patch_attention(pipe, backend=attention)


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


def _frames_of(output: Any) -> np.ndarray:
    frames = getattr(output, "frames", None)
    if frames is None and isinstance(output, (tuple, list)):
        frames = output[0]
    if frames is None:
        raise UserError(f"the pipeline returned {type(output).__name__} with no video frames; "
                        f"generate handles text-to-video pipelines")
    array = np.asarray(frames[0] if isinstance(frames, list) else frames, dtype=np.float32)
    if array.ndim == 5:
        array = array[0]
    return array


def run_once(pipe: Any, request: Request, *, device: torch.device, attention: str,
             on_step: Callable[[int], None] | None = None) -> RunResult:
    """Run the pipeline once with `attention`; the patch (if any) is undone before returning."""
    patch = _patch(pipe, attention)
    try:
        generator = torch.Generator(device=device).manual_seed(request.seed)
        steps_from_callback = "callback_on_step_end" in _accepts(pipe)
        timer = StageTimer(pipe, device, steps_from_callback=steps_from_callback, on_step=on_step)

        def step_callback(pipeline, step, timestep, callback_kwargs):
            if patch is not None and getattr(patch, "step_callback", None) is not None:
                patch.step_callback(pipeline, step, timestep, callback_kwargs)
            timer.step_end()
            return callback_kwargs

        with torch.inference_mode(), timer:
            output = pipe(**_diffusion_call(pipe, request, generator, step_callback))
        summary = patch.summary() if patch is not None else {}
    finally:
        if patch is not None:
            patch.unpatch()
    fps = float(getattr(pipe, "fps", None) or DEFAULT_FPS)
    return RunResult(attention, _frames_of(output), fps, timer.times, summary)


def warm_up(pipe: Any, request: Request, *, device: torch.device, attention: str) -> None:
    """One untimed one-step call, so first-call costs (kernel compiles, allocator growth) stay out of the timings."""
    run_once(pipe, Request(**{**request.as_dict(), "steps": 1}), device=device, attention=attention)

"""Stage timing of a pipeline run, from hooks on the pipeline's own components.

Nothing in the pipeline is edited: forward pre/post hooks on the text encoder(s) and the
transformer(s), and a wrapper around `vae.decode` (a method, not `forward`, so a hook cannot see
it), all removed by `detach()`. Timestamps are `time.perf_counter()` after a CUDA synchronize when
the run is on a GPU, so each stage's time is its device work, not its launch time.

Stages, in milliseconds:
  text_encoding_ms  every outermost text-encoder call (prompt and negative prompt), summed.
  steps             one entry per denoising step. Where the pipeline calls `callback_on_step_end`
                    (DiffusionPipelines), a step runs from its first transformer call to its callback,
                    so it holds every guidance pass and the scheduler update; in pipelines without that
                    callback (modular ones: MiniMax-H3, guidance-distilled, one pass a step) a step is one
                    transformer call, and the scheduler update falls under other_ms.
  vae_decode_ms     `vae.decode` (and `audio_decode_ms` for an audio VAE), summed.
  other_ms          the rest of the wall time of the call: latents, packing, post-processing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
TRANSFORMERS = ("transformer", "transformer_2", "transformer_ref")
DECODERS = {"vae": "vae_decode", "audio_vae": "audio_decode"}
_ABSENT = object()  # "the instance had no attribute of that name"


@dataclass
class StageTimes:
    text_encoding_ms: float = 0.0
    step_ms: list[float] = field(default_factory=list)
    transformer_ms_per_step: list[float] = field(default_factory=list)
    transformer_calls_per_step: list[int] = field(default_factory=list)
    vae_decode_ms: float = 0.0
    audio_decode_ms: float | None = None
    total_ms: float = 0.0
    steps_from: str = ""  # how step boundaries were found, in words

    @property
    def denoise_ms(self) -> float:
        return sum(self.step_ms)

    @property
    def other_ms(self) -> float:
        return (self.total_ms - self.text_encoding_ms - self.denoise_ms - self.vae_decode_ms
                - (self.audio_decode_ms or 0.0))

    def as_dict(self) -> dict:
        return {"text_encoding_ms": self.text_encoding_ms, "step_ms": self.step_ms,
                "transformer_ms_per_step": self.transformer_ms_per_step,
                "transformer_calls_per_step": self.transformer_calls_per_step,
                "denoise_ms": self.denoise_ms, "vae_decode_ms": self.vae_decode_ms,
                "audio_decode_ms": self.audio_decode_ms, "other_ms": self.other_ms, "total_ms": self.total_ms,
                "steps_from": self.steps_from}


class StageTimer:
    """Attach to a pipeline, run it, read `times`. `step_end()` is called by the step callback, if any.

    `on_step(steps_done)` is called after every step (for a progress bar).
    """

    def __init__(self, pipe: Any, device: torch.device, *, steps_from_callback: bool,
                 on_step: Callable[[int], None] | None = None):
        self.pipe, self.device, self.on_step = pipe, device, on_step
        self.steps_from_callback = steps_from_callback
        self.times = StageTimes()
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []  # (owner, method, its instance attribute or _ABSENT)
        self._depth: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._step_start: float | None = None
        self._step_transformer_ms = 0.0
        self._step_calls = 0
        self._t0 = 0.0

    # --- clock -----------------------------------------------------------------------------------
    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _enter(self, stage: str) -> bool:
        """True for the outermost call of a stage (nested calls, e.g. text_encoder.model, are not re-counted)."""
        depth = self._depth.get(stage, 0)
        self._depth[stage] = depth + 1
        if depth == 0:
            self._started[stage] = self._now()
        return depth == 0

    def _leave(self, stage: str) -> float | None:
        self._depth[stage] -= 1
        if self._depth[stage] == 0:
            return (self._now() - self._started[stage]) * 1e3
        return None

    # --- hooks -----------------------------------------------------------------------------------
    def _hook_module(self, module: torch.nn.Module, stage: str, done: Callable[[float], None]) -> None:
        def pre(*_):
            self._enter(stage)

        def post(*_):
            ms = self._leave(stage)
            if ms is not None:
                done(ms)

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _wrap_method(self, owner: Any, method: str, stage: str, done: Callable[[float], None]) -> None:
        original = getattr(owner, method)

        def wrapped(*args, **kwargs):
            self._enter(stage)
            try:
                return original(*args, **kwargs)
            finally:
                ms = self._leave(stage)
                if ms is not None:
                    done(ms)

        self._restore.append((owner, method, vars(owner).get(method, _ABSENT)))
        setattr(owner, method, wrapped)

    def attach(self) -> "StageTimer":
        for name in TEXT_ENCODERS:
            module = getattr(self.pipe, name, None)
            if isinstance(module, torch.nn.Module):
                self._hook_module(module, "text", self._add_text)
                inner = getattr(module, "model", None)  # H3 reads hidden states off text_encoder.model
                if isinstance(inner, torch.nn.Module):
                    self._hook_module(inner, "text", self._add_text)
        for name in TRANSFORMERS:
            module = getattr(self.pipe, name, None)
            if isinstance(module, torch.nn.Module):
                self._hook_module(module, "transformer", self._add_transformer)
                self._handles.append(module.register_forward_pre_hook(self._transformer_pre))
        for name, stage in DECODERS.items():
            vae = getattr(self.pipe, name, None)
            if isinstance(vae, torch.nn.Module) and hasattr(vae, "decode"):
                self._wrap_method(vae, "decode", stage, self._adder(stage))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        for owner, method, before in reversed(self._restore):
            # Exactly what the instance held before: its own attribute (another wrapper, a hook) put
            # back, or none, so the class method shows again.
            if before is _ABSENT:
                vars(owner).pop(method, None)
            else:
                vars(owner)[method] = before
        self._handles.clear()
        self._restore.clear()

    def _add_text(self, ms: float) -> None:
        self.times.text_encoding_ms += ms

    def _adder(self, stage: str) -> Callable[[float], None]:
        def add(ms: float) -> None:
            if stage == "vae_decode":
                self.times.vae_decode_ms += ms
            else:
                self.times.audio_decode_ms = (self.times.audio_decode_ms or 0.0) + ms
        return add

    def _transformer_pre(self, *_) -> None:
        if self._step_start is None and self._depth.get("transformer", 0) == 1:
            self._step_start = self._started["transformer"]

    def _add_transformer(self, ms: float) -> None:
        self._step_transformer_ms += ms
        self._step_calls += 1
        if not self.steps_from_callback:  # no step callback: one transformer pass per step
            self._close_step(self._step_start + ms / 1e3)

    def step_end(self) -> None:
        """Called from `callback_on_step_end`: closes the current step."""
        self._close_step(self._now())

    def _close_step(self, end: float) -> None:
        start = self._step_start if self._step_start is not None else end
        self.times.step_ms.append((end - start) * 1e3)
        self.times.transformer_ms_per_step.append(self._step_transformer_ms)
        self.times.transformer_calls_per_step.append(self._step_calls)
        self._step_start, self._step_transformer_ms, self._step_calls = None, 0.0, 0
        if self.on_step is not None:
            self.on_step(len(self.times.step_ms))

    # --- the whole call --------------------------------------------------------------------------
    def __enter__(self) -> "StageTimer":
        self.attach()
        self.times.steps_from = ("first transformer call to callback_on_step_end" if self.steps_from_callback
                                 else "one transformer call per step (no step callback: scheduler updates count "
                                      "as other)")
        self._t0 = self._now()
        return self

    def __exit__(self, *exc) -> None:
        self.times.total_ms = (self._now() - self._t0) * 1e3
        self.detach()

"""A model family: what dit-accel is told about a diffusers video DiT, where diffusers cannot say it.

Everything else is derived: the block stacks, each block's inputs, its attention calls and the rows its
linears see come from running the model's own forward (`capture`); the pipeline's defaults (video size,
steps, guidance, text rows, the VAE's compression) from the pipeline class (`pipeline_facts`). A family is
data, plus small hooks only where one is irreducibly special (MiniMax-H3's packed sequence, a VAE stage).
"""
from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from .stage_specs import StageSpec
    from .workload import TransformerInputs, Workload


@dataclass(frozen=True)
class Preset:
    """One embedded transformer config and where it came from."""

    config: dict[str, Any]
    source: str


PRESETS = Path(__file__).parent / "presets"


@functools.lru_cache(maxsize=None)
def class_defaults(transformer: str) -> dict[str, Any]:
    """The transformer class's own defaults, as a config (diffusers' classes default to the flagship's)."""
    import diffusers

    parameters = inspect.signature(getattr(diffusers, transformer).__init__).parameters
    return {"_class_name": transformer, **{name: p.default for name, p in parameters.items()
                                          if name != "self" and p.default is not inspect.Parameter.empty}}


def presets(transformer: str, *files: str) -> dict[str, Preset]:
    """The embedded public configs named (`presets/<name>.json`: the config and its source), in order; the class
    defaults where none is embedded."""
    found = {}
    for name in files:
        path = PRESETS / f"{name}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            found[name] = Preset(data["config"], data["source"])
    return found or {"class-defaults": Preset(class_defaults(transformer),
                                              f"diffusers' {transformer} defaults (no public config embedded)")}


@dataclass(frozen=True)
class LatentGrid:
    """The pass's latent video: `frames` x `height` x `width` latents (the transformer's input, before its patch
    embedding), in `batch` sequences."""

    batch: int
    frames: int
    height: int
    width: int


@dataclass(frozen=True)
class InputContext:
    """What a family's input hook needs to build the transformer's forward arguments for a pass."""

    config: dict[str, Any]
    grid: LatentGrid
    text_rows: int
    device: torch.device
    dtype: torch.dtype
    generator: torch.Generator
    audio_rows: int = 0  # the audio stream's rows beside the video (the workload's: `Family.audio_rows`)

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """N(0, 1) in the run's dtype (or `dtype`), drawn in float32 on the device from the run's generator."""
        x = torch.randn(*shape, generator=self.generator, device=self.device, dtype=torch.float32)
        return x.to(dtype or self.dtype)


@dataclass(frozen=True, eq=False)  # one object per family: hashed by identity (pipeline_facts caches by it)
class Family:
    """A diffusers video DiT family. `transformer` and `pipeline` are diffusers class names; `presets` the real
    public configs of its flagship models (the first is the default); the rest says what diffusers does not.

    latents: the layout of the transformer's `hidden_states`: "BCFHW" (latent video, channels first), "BFCHW"
    (frames first, CogVideoX) or "tokens" (patchified rows [B, F*H*W, C] plus `num_frames`, `height`, `width`:
    LTX). text_width: the config key of the text encoder's width. text_rows: the prompt rows the transformer
    sees, where the pipeline's `max_sequence_length` default does not say it. video: (frames, height, width),
    the family's reference video, where the pipeline's `__call__` has no default or the flagship's reference
    differs from it (`video_note` says why). vae_factors: (temporal, spatial) compression where the
    pipeline class cannot say it without its VAE. guidance: the pipeline's `__call__` argument whose default
    above 1 means classifier-free guidance (two transformer passes a step); None: one pass (distilled or
    guidance embedded), for the reason in `guidance_note`. extra_passes: (argument, threshold, what the pass is)
    for each further guidance whose `__call__` default above the threshold adds one forward a step (LTX-2's
    spatio-temporal and modality-isolation guidance). scaled_down: config overrides for CPU runs.
    inputs: a hook adding or replacing forward arguments the generic rules do not make (`inputs.py`).
    """

    name: str
    display_name: str
    transformer: str
    pipeline: str | None
    presets: dict[str, Preset]
    scaled_down: dict[str, Any]
    latents: str = "BCFHW"
    text_width: str = "text_dim"
    text_rows: int | None = None
    video: tuple[int, int, int] | None = None
    video_note: str = ""
    scaled_down_video: tuple[int, int, int] = (9, 64, 64)
    vae_factors: tuple[int, int] | None = None  # (temporal, spatial); None: the pipeline class's own
    guidance: str | None = "guidance_scale"
    guidance_note: str = ""
    extra_passes: tuple[tuple[str, float, str], ...] = ()
    inputs: Callable[[InputContext], dict[str, Any]] | None = None
    # (the video's frames) -> the rows of the audio stream a pass carries beside the video (LTX-2, Kandinsky 6):
    # the workload's "audio" rows, which the input hook makes (the same with more video: FP8 rule's capture)
    audio_rows: Callable[[int], int] | None = None
    # The stack the family's adapter stands for (its heads and width in the memory estimate, the stack --validate N
    # chains), where the forward's first is not the main one; every stack is still profiled, in forward order.
    main_stack: str | None = None
    # Hooks, each called with the adapter first (`base.BlockAdapter`). For a family whose pass is not a latent
    # video (MiniMax-H3's packed rows): the workload of (adapter, seq_len, batch) or of (adapter, frames, height,
    # width, batch), and the whole pass's inputs for (adapter, workload, device, dtype, generator).
    workload_from_seq_len: Callable[..., Workload] | None = None
    workload_from_video: Callable[..., Workload] | None = None
    transformer_inputs: Callable[..., TransformerInputs] | None = None
    default_seq_len: int | None = None
    check_workload: Callable[..., None] | None = None  # (adapter, workload): a one-line refusal, where one is known
    # The pipeline's stages beside the denoiser (`stage_specs.py`): the VAE decode of (adapter, workload, scaled_down),
    # where built; the text encoder's name; why its audio decode is not measured.
    vae_stage: Callable[..., StageSpec] | None = None
    text_encoder: str = ""
    audio_skip_reason: str = "makes no audio: no such stage"
    fused_rope: bool = False  # +rope / +prologue: dit_accel.patching.rope serves this family's attention
    # Where two families share a transformer class (Cosmos Predict2 and Predict2.5): whether a checkpoint's config is
    # this family's.
    accepts: Callable[[dict[str, Any]], bool] | None = None

    @property
    def transformer_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.transformer)

    def facts(self) -> PipelineFacts:
        return pipeline_facts(self)


@dataclass(frozen=True)
class PipelineFacts:
    """The family pipeline's defaults, each with where it came from."""

    video: tuple[int, int, int]  # frames, height, width
    video_source: str
    steps: int
    steps_source: str
    passes_per_step: int
    passes_source: str
    text_rows: int
    text_rows_source: str
    vae_factors: tuple[int, int]  # temporal, spatial
    vae_source: str
    rounds_frames: bool = False  # the pipeline rounds num_frames onto the VAE's grid (Wan's: 100 runs as 101)

    def frames_run(self, frames: int) -> int:
        """The frames the pipeline makes of `frames` asked: Wan's pipelines and those built on them round a
        count off the VAE's temporal grid down to it (temporal x k + 1); the others run what they are asked."""
        temporal = self.vae_factors[0]
        if self.rounds_frames and frames % temporal != 1:
            return frames // temporal * temporal + 1
        return frames


def _call_defaults(pipeline: type) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(pipeline.__call__).parameters.items()
            if p.default is not inspect.Parameter.empty}


# The statement with which Wan's pipelines (and SkyReels-V2's, ChronoEdit's, Kandinsky's, AnyFlow's) round a
# frame count off the VAE's grid, whitespace removed.
_FRAME_ROUNDING = "num_frames=num_frames//self.vae_scale_factor_temporal*self.vae_scale_factor_temporal+1"


def _rounds_frames(pipeline: type) -> bool:
    """Whether the pipeline's `__call__` rounds num_frames onto the VAE's temporal grid."""
    try:
        source = inspect.getsource(pipeline.__call__)
    except (OSError, TypeError):
        return False
    return _FRAME_ROUNDING in "".join(source.split())


def _vae_factors(pipeline: type) -> tuple[int, int] | None:
    """(temporal, spatial) compression the pipeline class sets without a VAE (its `__init__`'s own defaults),
    or None where it needs its VAE to say."""
    names = [n for n, p in inspect.signature(pipeline.__init__).parameters.items()
             if n != "self" and p.default is inspect.Parameter.empty]
    try:
        pipe = pipeline(**{name: None for name in names})
    except Exception:  # noqa: BLE001 (a pipeline that needs real components: the family must say)
        return None
    found = vars(pipe)
    for temporal, spatial in (("vae_scale_factor_temporal", "vae_scale_factor_spatial"),
                              ("vae_temporal_scale_factor", "vae_spatial_scale_factor")):
        if isinstance(found.get(temporal), int) and isinstance(found.get(spatial), int):
            return found[temporal], found[spatial]
    return None


@functools.lru_cache(maxsize=None)
def pipeline_facts(family: Family) -> PipelineFacts:
    """Video size, steps, transformer passes per step, text rows and VAE compression of the family's pipeline:
    its class's `__call__` defaults and `__init__` attributes where diffusers has them, else the family's own
    facts; each with its source."""
    import diffusers

    from ..quiet import quiet_imports

    with quiet_imports():  # a pipeline module's import-time notices (transformers' image processors)
        pipeline = getattr(diffusers, family.pipeline) if family.pipeline else None
    defaults = _call_defaults(pipeline) if pipeline else {}
    name = family.pipeline or family.display_name

    size = (defaults.get("num_frames", defaults.get("frames")), defaults.get("height"), defaults.get("width"))
    if family.video is not None:
        video, video_source = family.video, family.video_note or f"{family.display_name}'s reference video"
    elif all(isinstance(v, int) for v in size):
        video, video_source = size, f"{name}'s default num_frames, height and width"
    else:
        raise ValueError(f"{family.name}: {name} has no default video size; the family must give one")

    steps, steps_source = defaults.get("num_inference_steps"), f"{name}'s default num_inference_steps"
    if not isinstance(steps, int):
        steps, steps_source = 50, f"assumed: {name} has no default num_inference_steps; pass --steps"

    if family.guidance is None:
        passes, passes_source = 1, family.guidance_note
    else:
        if family.guidance == "guider":  # a guider component: diffusers' classifier-free guider, as it defaults
            from diffusers.guiders import ClassifierFreeGuidance

            scale = inspect.signature(ClassifierFreeGuidance.__init__).parameters["guidance_scale"].default
            setting = f"{name}'s guider (ClassifierFreeGuidance) default guidance_scale {scale}"
        else:
            scale = defaults.get(family.guidance)
            setting = f"{name}'s default {family.guidance} {scale}"
        passes = 2 if isinstance(scale, (int, float)) and scale > 1 else 1
        passes_source = setting + (": classifier-free guidance, a conditional and an unconditional forward per step"
                                   if passes == 2 else ": no classifier-free guidance, one forward per step")
    for argument, threshold, what in family.extra_passes:
        scale = defaults.get(argument)
        if isinstance(scale, (int, float)) and scale > threshold:
            passes += 1
            passes_source += f"; its default {argument} {scale}: one more forward per step ({what})"

    if family.text_rows is not None:
        text_rows, text_rows_source = family.text_rows, f"{family.display_name}'s prompt rows"
    else:
        text_rows, text_rows_source = defaults["max_sequence_length"], f"{name}'s default max_sequence_length"

    if family.vae_factors is not None:
        factors, vae_source = family.vae_factors, f"{family.display_name}'s VAE compression"
    else:
        factors, vae_source = _vae_factors(pipeline), f"{name}'s VAE scale factors"
    return PipelineFacts(video, video_source, steps, steps_source, passes, passes_source, text_rows,
                         text_rows_source, factors, vae_source, bool(pipeline) and _rounds_frames(pipeline))

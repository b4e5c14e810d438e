"""The stages of a family's pipeline outside the denoising loop (VAE decode, audio decode, text
encoding), as data the profiler can build and run: `StageSpec`, or `StageSkip` when a stage cannot
be measured here (its config is not at hand), with the reason in words.

Each family's adapter says which stages its pipeline has and how to build them
(`BlockAdapter.pipeline_stages`); `profiling.stage_profile` measures them. Models are built with their
parameters on the meta device (synthetic weights come later, as for the block) and their computed
buffers real.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import UserError
from .building import fp32_kept, parameters_on_meta, read_config
from .ranges import ModuleRange

STAGE_KEYS = ("text", "vae", "audio")  # --stages names, in pipeline order
STAGE_TITLES = {"text": "text encoding", "vae": "VAE decode", "audio": "audio decode"}


@dataclass(frozen=True)
class StageSkip:
    """A stage the whole-video figure leaves out, and why (one sentence a user can act on)."""

    key: str
    reason: str

    @property
    def title(self) -> str:
        return STAGE_TITLES[self.key]


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage at the workload's size: what to build, its inputs and how to call it.

    build(): the model, parameters on meta (only the parts the stage runs).  keep_in_fp32: the
    class's `_keep_in_fp32_modules` (a load keeps those in float32).  make_inputs(device, dtype,
    generator): the call's keyword arguments.  call(model, **inputs): one run of the stage.
    attention_routed: the stage's attention goes through diffusers' `dispatch_attention_fn`, so
    each recipe's attention backend is swapped into it (else it runs once, as diffusers has it);
    attention_note says which way and why.  activation_bytes(element size): what one run holds
    beyond its weights, for the memory check (`activation_source` says how that was worked out).
    GEMM and convolution FLOPs are counted when the stage runs (`profiling.stage_profile.count_flops`).
    profile_unit(device, dtype, generator), profile_parts: inputs of one of `profile_parts` equal parts
    of the call (e.g. one clip of a clip-chunked decode), which the profiler attributes in place of the
    whole call (its kernels x profile_parts); the whole call is still what is timed. None: the whole call.
    """

    key: str
    model_name: str
    config_source: str
    workload: str
    build: Callable[[], nn.Module]
    keep_in_fp32: tuple[str, ...]
    make_inputs: Callable[[torch.device, torch.dtype, torch.Generator], dict[str, Any]]
    call: Callable[..., Any]
    attention_routed: bool
    attention_note: str
    activation_bytes: Callable[[int], int]
    activation_source: str
    attention_flops: float = 0.0  # QK^T and PV of one run (4 q kv d per head), 0 when not worked out
    module_ranges: tuple[ModuleRange, ...] = ()
    body_label: str = "stage body (outside the ranges)"
    notes: tuple[str, ...] = field(default=())
    profile_unit: Callable[[torch.device, torch.dtype, torch.Generator], dict[str, Any]] | None = None
    profile_parts: int = 1

    @property
    def title(self) -> str:
        return STAGE_TITLES[self.key]

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        return fp32_kept(name, dtype, self.keep_in_fp32)


def build_on_meta(cls: type, config: dict[str, Any], drop: tuple[str, ...] = ()) -> nn.Module:
    """`cls(**config)` (the keys its __init__ takes) with parameters on meta; the submodules named
    in `drop` (parts the stage never runs, e.g. a VAE's encoder for a decode) are left out."""
    accepted = inspect.signature(cls.__init__).parameters
    with parameters_on_meta():
        model = cls(**{k: v for k, v in config.items() if k in accepted})
    for name in drop:
        setattr(model, name, None)
    return model


def vae_decode(model: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """A diffusers VAE's decode of latents `z` (the VAE stages' `StageSpec.call`)."""
    return model.decode(z, return_dict=False)[0]


def read_model_config(folder: Path, option: str) -> dict[str, Any]:
    """A local model folder's config.json (a folder given with `option`), or a UserError."""
    path = folder / "config.json" if folder.is_dir() else folder
    return read_config(path, unreadable_hint="give a folder with the model's config.json",
                       context=f"{option} {folder}: ")


def text_encoder_stage(folder: Path | None, text_rows: int, batch: int, expected: str,
                       scale_down: bool) -> StageSpec | StageSkip:
    """The text encoder from a local folder's config (transformers; synthetic weights), run on
    `text_rows` random token ids; without a folder, a StageSkip that says how to add it.
    scale_down: a CPU run keeps the architecture but 2 layers and a narrow width."""
    if folder is None:
        return StageSkip("text", f"no text encoder config given: its weights and config are not embedded here "
                                 f"({expected}); pass --text-encoder-config DIR (a local folder with its config.json, "
                                 f"no weights needed) to measure it")
    raw = read_model_config(folder, "--text-encoder-config")
    try:
        from transformers import AutoConfig, AutoModel
    except ImportError as exc:
        raise UserError("--text-encoder-config needs transformers: pip install transformers") from exc
    model_type = raw.get("model_type")
    try:
        config = AutoConfig.for_model(**raw) if model_type else None
    except (ValueError, KeyError) as exc:
        raise UserError(f"--text-encoder-config {folder}: transformers cannot read this config ({exc})") from exc
    if config is None:
        raise UserError(f"--text-encoder-config {folder}: its config.json has no model_type; give a transformers "
                        f"model's folder")
    text = getattr(config, "text_config", config)  # a vision-language model's language part encodes the prompt
    if scale_down:
        for name, value in (("num_hidden_layers", 2), ("hidden_size", 256), ("intermediate_size", 512),
                            ("num_attention_heads", 4), ("num_key_value_heads", 2), ("head_dim", 64),
                            ("d_ff", 512), ("d_kv", 64)):  # the last two: T5's names, outside its attribute map
            if hasattr(text, name):
                setattr(text, name, value)
    vocab = int(getattr(text, "vocab_size", 32000))
    hidden = int(getattr(text, "hidden_size", 0))
    layers = int(getattr(text, "num_hidden_layers", 0))

    def build() -> nn.Module:
        with parameters_on_meta():
            model = AutoModel.from_config(text)
        # An encoder-decoder (T5, umT5: Wan's text encoder) encodes the prompt with its encoder alone.
        return model.get_encoder() if getattr(text, "is_encoder_decoder", False) else model

    def make_inputs(device, dtype, generator):
        return {"input_ids": torch.randint(0, vocab, (batch, text_rows), generator=generator, device=device)}

    def call(model, input_ids):
        return model(input_ids=input_ids).last_hidden_state

    return StageSpec(
        "text", f"{type(config).__name__} ({raw.get('model_type')}; its language model: {layers} layers, hidden "
                f"{hidden})", f"--text-encoder-config {folder}", f"batch {batch} x {text_rows} prompt tokens",
        build, (), make_inputs, call, attention_routed=False,
        attention_note="transformers' own attention (not diffusers' dispatch): not patched",
        # Activations of a forward over a few hundred rows are small next to the weights.
        activation_bytes=lambda e: 64 * batch * text_rows * max(hidden, 1) * e,
        activation_source="64 hidden-width rows per token (an upper bound at a prompt's length)",
        module_ranges=(), body_label="text encoder")

"""What dit-accel needs to know about a model family to build, load and run ONE transformer block.

An adapter is configuration plus three small recipes: build the block on the meta device, name its
checkpoint keys, and make a realistic input for a workload. Adding a model family means adding one
module beside this one and registering it in `adapters/__init__.py`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import UserError
from .building import fp32_kept
from .ranges import ModuleRange
from .stages import StageSkip, StageSpec, build_on_meta, text_encoder_stage


@dataclass(frozen=True)
class Workload:
    """The input one block sees: `batch` sequences of `seq_len` rows each.

    `rows` splits the sequence by modality (e.g. video / audio / text) and `source` says how it was
    chosen (from --seq-len or from a video size), so reports can state it. `video_grid` is the
    (frames, height, width) patch grid of the video rows when a video size gave it; RoPE positions
    follow it (a --seq-len workload lays its rows on the family's reference frame instead).
    """

    seq_len: int
    batch: int
    rows: dict[str, int]
    source: str
    video_grid: tuple[int, int, int] | None = None

    def as_dict(self) -> dict:
        return {"seq_len": self.seq_len, "batch": self.batch, "rows": dict(self.rows), "source": self.source,
                "video_grid": list(self.video_grid) if self.video_grid else None}


@dataclass(frozen=True)
class TransformerInputs:
    """Keyword arguments of the whole transformer's forward, and the sequence they make.

    `seq_len` is the rows the transformer packs or patchifies from them: the workload's own S when
    its rows can be laid out exactly, else the nearest video grid's (`layout` says which).
    """

    kwargs: dict[str, Any]
    seq_len: int
    layout: str


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of the block: [batch, heads, q_len, kv_len, head_dim]."""

    name: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int

    @property
    def flops(self) -> float:
        """QK^T and PV: two GEMMs of q*kv*d multiply-adds (2*q*kv*d FLOPs) each; softmax not counted."""
        return 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim


class BlockAdapter(ABC):
    """One model family's block. Instances hold one transformer config (a diffusers config dict)."""

    family: ClassVar[str]  # CLI name, e.g. "minimax-h3"
    display_name: ClassVar[str]
    transformer_class_names: ClassVar[tuple[str, ...]]  # diffusers `_class_name` values of this family
    block_key_template: ClassVar[str]  # checkpoint key prefix of block i, e.g. "transformer_blocks.{index}."
    presets: ClassVar[dict[str, dict[str, Any]]]  # name -> full transformer config; the first is the default
    default_seq_len: ClassVar[int]
    # Transformer passes per denoising step in the family's pipeline, and why (the extrapolation's
    # default; --guidance-passes overrides it).
    passes_per_step: ClassVar[int]
    passes_per_step_source: ClassVar[str]
    # Denoising steps of a video in the family's pipeline, and where the number comes from (--steps overrides).
    default_steps: ClassVar[int]
    default_steps_source: ClassVar[str]
    module_ranges: ClassVar[tuple[ModuleRange, ...]]
    # Label of the block-body range: everything a range above does not cover (modulation, gates, residuals).
    body_label: ClassVar[str] = "modulation + residual (block body)"
    # FP8 linears (dit_accel.patching.fp8_linear): fnmatch patterns of the block's nn.Linear names that go
    # FP8, and of those that stay in the block dtype, each with its one-line reason. Unlisted linears stay.
    fp8_linear_modules: ClassVar[tuple[str, ...]] = ()
    fused_rope_supported: ClassVar[bool] = False  # +rope: dit_accel.patching.rope serves this family's attention
    fp8_bf16_linears: ClassVar[dict[str, str]] = {}

    def __init__(self, config: dict[str, Any], *, preset: str | None = None):
        self.config = dict(config)
        self.preset = preset

    # --- the model -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return int(self.config["num_layers"])

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream (the rows the block reads and writes)."""
        return int(self.config["hidden_size"])

    def block_prefix(self, index: int) -> str:
        return self.block_key_template.format(index=index)

    def check_block_index(self, index: int) -> None:
        if not 0 <= index < self.num_blocks:
            raise UserError(
                f"block {index} is out of range: {self.display_name} has {self.num_blocks} blocks "
                f"(0..{self.num_blocks - 1}); pass --block between them"
            )

    @property
    @abstractmethod
    def transformer_class(self) -> type: ...

    @abstractmethod
    def build_block(self) -> nn.Module:
        """The block with this config, parameters on the meta device (no memory, no init)."""

    @property
    @abstractmethod
    def outside_contents(self) -> str:
        """What the transformer holds outside its block stack, in words (for reports)."""

    def build_outside(self) -> nn.Module:
        """The family's whole transformer with this config but no blocks (`num_layers=0`): every
        part of a pass outside the block stack. Parameters on the meta device, computed buffers
        (RoPE tables) real, on the CPU."""
        return build_on_meta(self.transformer_class, {**self.config, "num_layers": 0})

    @abstractmethod
    def make_transformer_inputs(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                                generator: torch.Generator) -> TransformerInputs:
        """The whole transformer's forward inputs for the pass the block profile's `workload` is one
        block of: the same rows (or the nearest video grid), on `device`."""

    @property
    def keep_in_fp32(self) -> tuple[str, ...]:
        """Module names diffusers keeps in float32 whatever `torch_dtype` is (`_keep_in_fp32_modules`)."""
        return tuple(getattr(self.transformer_class, "_keep_in_fp32_modules", None) or ())

    def param_dtype(self, key: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype diffusers gives parameter `key` when the model is loaded with `torch_dtype=dtype`.

        diffusers matches `_keep_in_fp32_modules` entries against the dot-separated parts of the key.
        """
        return fp32_kept(key, dtype, self.keep_in_fp32)

    # --- the workload ----------------------------------------------------------------------------
    @abstractmethod
    def workload_from_seq_len(self, seq_len: int, batch: int) -> Workload: ...

    @abstractmethod
    def workload_from_video(self, frames: int, height: int, width: int, batch: int) -> Workload: ...

    @abstractmethod
    def make_inputs(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                    generator: torch.Generator) -> dict[str, Any]:
        """Keyword arguments of the block's forward for `workload`, on `device`."""

    @abstractmethod
    def attention_calls(self, workload: Workload) -> list[AttentionCall]: ...

    @abstractmethod
    def scaled_down_config(self) -> dict[str, Any]:
        """A small config of the same family for CPU runs (minutes on two cores, not hours)."""

    scaled_down_seq_len: ClassVar[int] = 1024

    # --- the pipeline's other stages -------------------------------------------------------------
    # The family pipeline's text encoder (named where no config is given) and why its audio decode is
    # not measured here.
    text_encoder: ClassVar[str] = ""
    audio_skip_reason: ClassVar[str] = ""

    def pipeline_stages(self, workload: Workload, keys: tuple[str, ...], *, scaled_down: bool,
                        text_encoder_config: Path | None = None) -> list[StageSpec | StageSkip]:
        """The family pipeline's stages named in `keys` ("text", "vae", "audio"; `adapters.stages`),
        each a `StageSpec` sized for the video `workload` is one pass of (scaled down on the CPU), or
        a `StageSkip` saying why it cannot be measured here."""
        stages = {
            "vae": lambda: self._vae_stage(workload, scaled_down),
            "audio": lambda: StageSkip("audio", self.audio_skip_reason),
            "text": lambda: text_encoder_stage(text_encoder_config, self.prompt_rows(workload), workload.batch,
                                               self.text_encoder, scaled_down),
        }
        return [stages[key]() for key in keys]

    @abstractmethod
    def _vae_stage(self, workload: Workload, scaled_down: bool) -> StageSpec:
        """The VAE decode of the latents the workload's video rows come from."""

    @abstractmethod
    def prompt_rows(self, workload: Workload) -> int:
        """Rows of the prompt the text encoder runs on."""

    # --- cost model ------------------------------------------------------------------------------
    def flops_per_linear(self, block: nn.Module, workload: Workload) -> dict[str, float]:
        """Each nn.Linear of the block by name: 2 * rows * in * out FLOPs, with the rows it sees."""
        return {name: 2.0 * self.linear_rows(name, workload) * module.in_features * module.out_features
                for name, module in block.named_modules() if isinstance(module, nn.Linear)}

    def linear_rows(self, linear_name: str, workload: Workload) -> int:
        """How many rows pass through linear layer `linear_name` (default: every row of the batch)."""
        return workload.batch * workload.seq_len

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "preset": self.preset, "num_blocks": self.num_blocks, "config": self.config}


def check_video_rows(video_rows: int, height: int, width: int, pixels_per_row: int) -> None:
    """A video workload must give at least one row: `pixels_per_row` is the VAE stride times the patch."""
    if video_rows < 1:
        raise UserError(f"a {height}x{width} video gives no tokens: height and width must be at least "
                        f"{pixels_per_row} pixels")

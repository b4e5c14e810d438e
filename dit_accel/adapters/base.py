"""The adapter: one transformer config of a model family, and everything dit-accel derives from it.

`BlockAdapter(family, config)` is the one adapter of every family (`family.Family` says what diffusers does
not). What a hand-written adapter used to declare is derived from diffusers itself:

- the block stacks (`capture.block_stacks`) and, per stack, the block, its checkpoint keys and its count;
- the block's inputs, attention calls and the rows each linear sees, from the model's own forward run with
  one block per stack (`capture.capture_stacks`; on the meta device for shapes before anything allocates);
- the per-module ranges from the block's module types and names (`ranges.derive_ranges`);
- which linears go FP8, by a rule stated in the report (`linears.fp8_policy`);
- the pipeline's defaults (video size, steps, passes per step, text rows, VAE compression) from the pipeline
  class (`family.pipeline_facts`).

An adapter works on one stack at a time (`stack`, the first by default; `for_stack` gives the same adapter on
another): the block it builds, loads and feeds is that stack's.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .building import fp32_kept, synthetic_weights
from .capture import AttentionCall, StackCapture, block_stacks, capture_stacks, keep_first_blocks
from .family import Family, InputContext, LatentGrid, PipelineFacts
from .inputs import forward_arguments
from .linears import Fp8Policy, fp8_policy
from .ranges import ModuleRange, derive_ranges
from .stage_specs import StageSkip, StageSpec, build_on_meta, text_encoder_stage
from .workload import TransformerInputs, Workload, check_video_rows, patch_grid, patch_sizes

__all__ = ["AttentionCall", "BlockAdapter", "ModuleRange", "TransformerInputs", "Workload", "check_video_rows",
           "patch_sizes"]


def _reads(function, name: str) -> bool:
    """Whether `function`'s body uses `name` (a block whose forward takes `*args` it never reads ignores what the
    model passes there, e.g. HunyuanVideo's token-replace extras: they can be left out)."""
    import re

    source = inspect.getsource(function)
    body = source[source.index(")", source.index(f"*{name}")):]
    return re.search(rf"\b{name}\b", body) is not None


class _Shared:
    """What the adapters of one config share, whatever their stack: the meta model and the captures."""

    def __init__(self):
        self.meta_model: nn.Module | None = None
        self.captures: dict[tuple, list[StackCapture]] = {}
        self.scaled_down: _Shared | None = None  # what the scaled-down config's adapters share


class BlockAdapter:
    """One config of a family, on one of its block stacks."""

    body_label = "modulation + residual (block body)"  # the block's time no range covers

    def __init__(self, family: Family, config: dict[str, Any], *, preset: str | None = None,
                 stack: str | None = None, _shared: _Shared | None = None):
        self.spec = family
        self.config = dict(config)
        self.preset = preset
        self._shared = _shared or _Shared()
        self.stack = stack or family.main_stack or self.stacks[0][0]
        if self.stack not in dict(self.stacks):
            raise UserError(f"{self.display_name} has no block stack {self.stack!r}; its stacks are "
                            f"{', '.join(name for name, _ in self.stacks)}")

    def for_stack(self, stack: str) -> "BlockAdapter":
        """This adapter on another of the model's stacks (the same config, model and captures)."""
        return BlockAdapter(self.spec, self.config, preset=self.preset, stack=stack, _shared=self._shared)

    def scaled_down(self) -> "BlockAdapter":
        """The family's scaled-down config for CPU runs (minutes on two cores, not hours), on the same stack."""
        if self._shared.scaled_down is None:
            self._shared.scaled_down = _Shared()
        return BlockAdapter(self.spec, self.scaled_down_config(), preset=self.preset, stack=self.stack,
                            _shared=self._shared.scaled_down)

    # --- the family --------------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.spec.name

    @property
    def display_name(self) -> str:
        return self.spec.display_name

    @property
    def transformer_class(self) -> type:
        return self.spec.transformer_class

    @property
    def facts(self) -> PipelineFacts:
        return self.spec.facts()

    @property
    def passes_per_step(self) -> int:
        return self.facts.passes_per_step

    @property
    def passes_per_step_source(self) -> str:
        return self.facts.passes_source

    @property
    def default_steps(self) -> int:
        return self.facts.steps

    @property
    def default_steps_source(self) -> str:
        return self.facts.steps_source

    @property
    def fused_rope_supported(self) -> bool:
        return self.spec.fused_rope

    @property
    def keep_in_fp32(self) -> tuple[str, ...]:
        """Module names diffusers keeps in float32 whatever `torch_dtype` is (`_keep_in_fp32_modules`)."""
        return tuple(getattr(self.transformer_class, "_keep_in_fp32_modules", None) or ())

    def param_dtype(self, key: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype diffusers gives parameter `key` when the model is loaded with `torch_dtype=dtype`."""
        return fp32_kept(key, dtype, self.keep_in_fp32)

    def summary(self) -> dict[str, Any]:
        """What `dit-accel models` lists of this config: its pipeline's default video and the rows it makes, its
        stacks, its attention heads, and whether our FP8 kernel serves its attention (and why not)."""
        workload = self.default_workload(1)
        try:
            calls = [call for name, _ in self.stacks
                     for call in self.for_stack(name).stack_capture(workload, torch.device("meta"),
                                                                    torch.float32).attention_calls]
            head_dims, shapes = sorted({call.head_dim for call in calls}), "the model's forward on the meta device"
        except Exception:  # noqa: BLE001 (a forward with a data-dependent step cannot run on meta)
            # The scaled-down config's forward on the CPU says which calls are masked; the head dim is the config's.
            calls = [call for name, _ in self.stacks for call in self.for_stack(name).shape_capture().attention_calls]
            head_dims, shapes = [self.attention_heads[1]], "the config, and the scaled-down forward on the CPU"
        if any(d not in (64, 128) for d in head_dims):
            fp8 = f"no: head dim {'/'.join(map(str, head_dims))} (the kernel takes 64, 128)"
        elif any(call.masked and not call.key_padding for call in calls if call.kind != "cross"):
            fp8 = "masked joint attention: to diffusers, counted"
        elif any(call.key_padding for call in calls):
            fp8 = "yes (text padding: on the kept keys)"
        else:
            fp8 = "yes"
        frames, height, width = self.facts.video if self.spec.default_seq_len is None else (None, None, None)
        return {"family": self.family, "model": self.display_name, "preset": self.preset,
                "presets": list(self.spec.presets), "pipeline": self.spec.pipeline,
                "video": None if frames is None else f"{frames} x {height}x{width}",
                "rows": dict(workload.rows), "stacks": dict(self.stacks),
                "heads": self.attention_heads[0], "head_dims": head_dims, "fp8_attention": fp8,
                "shapes": shapes}

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "preset": self.preset, "stack": self.stack, "num_blocks": self.num_blocks,
                "stacks": dict(self.stacks), "config": self.config}

    # --- the model and its stacks ------------------------------------------------------------------------
    def _meta_model(self) -> nn.Module:
        """The whole transformer with this config, parameters on meta (built once)."""
        if self._shared.meta_model is None:
            self._shared.meta_model = build_on_meta(self.transformer_class, self.config)
        return self._shared.meta_model

    @property
    def stacks(self) -> list[tuple[str, int]]:
        """(name, blocks) of each block stack, in forward order."""
        return [(name, len(stack)) for name, stack in block_stacks(self._meta_model())]

    @property
    def num_blocks(self) -> int:
        """Blocks of this adapter's stack."""
        return dict(self.stacks)[self.stack]

    @cached_property
    def attention_heads(self) -> tuple[int, int]:
        """(heads, head dim) of this stack's attention: the config's, or where it names them otherwise (Kandinsky
        5: model_dim and axes_dims) its block's main attention call's (the one over the most query x key rows)."""
        c = self.config
        if "num_attention_heads" in c and "attention_head_dim" in c:
            return c["num_attention_heads"], c["attention_head_dim"]
        call = max(self.shape_capture().attention_calls, key=lambda call: call.q_len * call.kv_len)
        return call.heads, call.head_dim

    @property
    def sequence_argument(self) -> str:
        """The argument of this stack's block forward that carries its rows (its first: `hidden_states` in most
        diffusers blocks, `x` and `visual_embed` in Kandinsky 5's)."""
        forward = type(getattr(self._meta_model(), self.stack)[0]).forward
        return list(inspect.signature(forward).parameters)[1]

    @property
    def block_key_template(self) -> str:
        """Checkpoint key prefix of block i of this stack, e.g. "transformer_blocks.{index}."."""
        return f"{self.stack}.{{index}}."

    def block_prefix(self, index: int) -> str:
        return self.block_key_template.format(index=index)

    def check_block_index(self, index: int) -> None:
        if not 0 <= index < self.num_blocks:
            raise UserError(f"block {index} is out of range: {self.display_name}'s {self.stack} has "
                            f"{self.num_blocks} blocks (0..{self.num_blocks - 1}); pass --block between them")

    def build_block(self) -> nn.Module:
        """A block of this stack, parameters on the meta device (no memory, no init)."""
        return copy.deepcopy(getattr(self._meta_model(), self.stack)[0])

    def build_outside(self) -> nn.Module:
        """The whole transformer with no blocks in any stack: every part of a pass outside the block stacks.
        Parameters on the meta device, computed buffers (RoPE tables) real, on the CPU."""
        model = build_on_meta(self.transformer_class, self.config)
        for name, _ in block_stacks(model):
            setattr(model, name, nn.ModuleList())
        return model

    @property
    def outside_contents(self) -> str:
        """What the transformer holds outside its block stacks, in words (for reports)."""
        stacks = dict(self.stacks)
        return ", ".join(name for name, child in self._meta_model().named_children()
                         if name not in stacks and any(True for _ in child.parameters()))

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream (the rows the block reads and writes)."""
        c = self.config
        return int(c.get("hidden_size") or c.get("model_dim") or c["num_attention_heads"] * c["attention_head_dim"])

    # --- workloads ---------------------------------------------------------------------------------------
    def workload_from_video(self, frames: int, height: int, width: int, batch: int) -> Workload:
        """The pass of a video of `frames` frames at `height` x `width`; a size off the patch grid's pixel multiple
        runs floored, as the VAE and the patch embedding floor it, and the workload's source says so."""
        workload = self._workload_from_video(frames, height, width, batch)
        _, spatial = self.facts.vae_factors
        _, ph, pw = patch_sizes(self.config)
        runs = (height // (spatial * ph) * spatial * ph, width // (spatial * pw) * spatial * pw)
        if runs != (height, width):
            note = (f"; {height}x{width} runs as {runs[0]}x{runs[1]}: the patch grid takes multiples of "
                    f"{spatial * ph}x{spatial * pw} pixels")
            workload = dataclasses.replace(workload, source=workload.source + note)
        return workload

    def _workload_from_video(self, frames: int, height: int, width: int, batch: int) -> Workload:
        if self.spec.workload_from_video is not None:
            return self._checked(self.spec.workload_from_video(self, frames, height, width, batch))
        temporal, spatial = self.facts.vae_factors
        run = self.facts.frames_run(frames)
        grid = patch_grid(self.config, spatial, (run - 1) // temporal + 1, height, width)
        video = grid[0] * grid[1] * grid[2]
        rows = {"video": video, "text": self.facts.text_rows}
        if self.spec.audio_rows is not None:  # the audio of the video's duration (LTX-2's, Kandinsky 6's)
            rows["audio"] = self.spec.audio_rows(run)
        source = f"{run} frames {height}x{width}"
        if run != frames:
            source += f" ({self.spec.pipeline} rounds {frames} frames to {run})"
        return self._checked(Workload(video, batch, rows, source, grid))

    def workload_from_seq_len(self, seq_len: int, batch: int) -> Workload:
        """`seq_len` video rows laid out on the patch grid of the pipeline's default frame size, whole frames
        first (fewer rows than one frame: whole rows of it)."""
        if self.spec.workload_from_seq_len is not None:
            return self._checked(self.spec.workload_from_seq_len(self, seq_len, batch))
        rows, source = {"video": seq_len, "text": self.facts.text_rows}, f"--seq-len {seq_len}"
        if self.spec.audio_rows is not None:  # the audio of the frames its grid's latents decode to
            grid, _ = self.latent_grid(Workload(seq_len, batch, dict(rows), source))
            rows["audio"] = self.spec.audio_rows((grid.frames - 1) * self.facts.vae_factors[0] + 1)
        return self._checked(Workload(seq_len, batch, rows, source))

    def _checked(self, workload: Workload) -> Workload:
        if self.spec.check_workload is not None:
            self.spec.check_workload(self, workload)
        return workload

    def default_workload(self, batch: int, *, scaled_down: bool = False) -> Workload:
        """The pass a user would run: the pipeline's default video (the family's default sequence for a packed
        family); scaled down, a small video the CPU runs in seconds."""
        if self.spec.default_seq_len is not None:
            seq_len = 1024 if scaled_down else self.spec.default_seq_len
            workload = self.workload_from_seq_len(seq_len, batch)
            why = "the CPU's short run" if scaled_down else f"{self.display_name}'s default"
            return dataclasses.replace(workload, source=workload.source.replace(f"--seq-len {seq_len}",
                                                                                f"S = {seq_len}, {why}", 1))
        frames, height, width = self.spec.scaled_down_video if scaled_down else self.facts.video
        return self.workload_from_video(frames, height, width, batch)

    def latent_grid(self, workload: Workload) -> tuple[LatentGrid, str]:
        """The latent video whose patchified rows make the workload's video rows (or the nearest whole grid,
        for a --seq-len S that is not one), and that layout in words."""
        pt, ph, pw = patch_sizes(self.config)
        if workload.video_grid:
            frames, height, width = workload.video_grid
        else:
            temporal, spatial = self.facts.vae_factors
            _, default_height, default_width = self.facts.video
            frame_h, frame_w = default_height // spatial // ph, default_width // spatial // pw
            s = workload.rows["video"]
            if s >= frame_h * frame_w:
                frames, height, width = max(1, round(s / (frame_h * frame_w))), frame_h, frame_w
            else:
                width = min(frame_w, s)
                frames, height = 1, max(1, round(s / width))
        rows = frames * height * width
        exact = "exact" if rows == workload.rows["video"] else f"the nearest whole grid to {workload.rows['video']}"
        layout = (f"latents {frames * pt} x {height * ph} x {width * pw} -> {frames} x {height} x {width} patches = "
                  f"{rows} video rows ({exact}), {workload.rows.get('text', 0)} text rows")
        return LatentGrid(workload.batch, frames * pt, height * ph, width * pw), layout

    # --- the pass ----------------------------------------------------------------------------------------
    def make_transformer_inputs(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                                generator: torch.Generator) -> TransformerInputs:
        """The whole transformer's forward arguments for the pass `workload` is one block of, on `device`."""
        if self.spec.transformer_inputs is not None:
            return self.spec.transformer_inputs(self, workload, device, dtype, generator)
        grid, layout = self.latent_grid(workload)
        ctx = InputContext(self.config, grid, workload.rows.get("text", 0), device, dtype, generator,
                           workload.rows.get("audio", 0))
        pt, ph, pw = patch_sizes(self.config)
        history = workload.seq_len - workload.rows["video"]  # the rows a sectioned pipeline packs ahead (FramePack)
        if history:
            layout += f", {history} history rows ahead of the video's"
        return TransformerInputs(forward_arguments(self.spec, ctx), grid.frames * grid.height * grid.width
                                 // (pt * ph * pw) + history, layout)

    def capture(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> list[StackCapture]:
        """What each stack's first block sees in the pass (`capture.capture_stacks`): the transformer with one
        block per stack, synthetic weights, run on the pass's inputs on `device` (on "meta": shapes alone).
        Kept per (workload, device, dtype, seed)."""
        key = (workload.key, str(device), dtype, seed)
        if key not in self._shared.captures:
            model = build_on_meta(self.transformer_class, self.config)
            counts = keep_first_blocks(model)
            if device.type == "meta":
                model = model.to_empty(device="meta")
            else:
                model = synthetic_weights(model, device, lambda name: self.param_dtype(name, dtype), seed)
            generator = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
            inputs = self.make_transformer_inputs(workload, device, dtype, generator)
            self._shared.captures[key] = capture_stacks(model, inputs.kwargs, counts)
        return self._shared.captures[key]

    def stack_capture(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                      seed: int = 0) -> StackCapture:
        return next(c for c in self.capture(workload, device, dtype, seed) if c.name == self.stack)

    def make_inputs(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                    generator: torch.Generator) -> dict[str, Any]:
        """Keyword arguments of this stack's block for `workload`, on `device`: what its first block received
        in the model's own forward (positional arguments bound to their names)."""
        captured = self.stack_capture(workload, device, dtype, generator.initial_seed())
        signature = inspect.signature(captured.block_type.forward)
        bound = signature.bind(None, *captured.args, **captured.kwargs)
        inputs = {}
        for name, value in list(bound.arguments.items())[1:]:  # all but self
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                inputs.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value and _reads(captured.block_type.forward, name):
                    raise RuntimeError(f"{captured.block_type.__name__} reads the extra positional arguments its "
                                       f"model passes it: its inputs cannot be given by name")
            else:
                inputs[name] = value
        return inputs

    def _pass_capture(self, workload: Workload) -> StackCapture:
        """This stack's capture of `workload`'s pass: one already made on a device, else one on the meta device
        (shapes only)."""
        for (key, _, _, _), captures in self._shared.captures.items():
            if key == workload.key:
                return next(c for c in captures if c.name == self.stack)
        return self.stack_capture(workload, torch.device("meta"), torch.float32)

    def attention_calls(self, workload: Workload) -> list[AttentionCall] | None:
        """This stack's block's attention calls in the pass (`_pass_capture`); None where the model's forward
        cannot run on meta (a data-dependent step) and nothing has run yet."""
        try:
            return self._pass_capture(workload).attention_calls
        except Exception:  # noqa: BLE001 (a forward with a data-dependent step cannot run on meta)
            return None

    def block_work(self, workload: Workload) -> dict[str, Any] | None:
        """The work of this stack's block in `workload`'s pass, as report.json keeps it for predictions
        (`dit-accel plan`): every attention call's shape and every linear's rows and features with its FP8
        choice. None where the pass cannot be captured on meta and nothing has run yet."""
        try:
            capture = self._pass_capture(workload)
        except Exception:  # noqa: BLE001 (a forward with a data-dependent step cannot run on meta)
            return None
        fp8 = set(self.fp8_linear_modules)
        return {
            "attention_calls": [{"module": c.module, "kind": c.kind, "batch": c.batch, "heads": c.heads,
                                 "q_len": c.q_len, "kv_len": c.kv_len, "head_dim": c.head_dim, "masked": c.masked,
                                 "key_padding": c.key_padding, "mask_bytes": c.mask_bytes,
                                 "kept": [list(pair) for pair in c.kept] if c.kept else None, "flops": c.flops}
                                for c in capture.attention_calls],
            "linears": [{"name": name, "rows": capture.linear_rows.get(name, 0), "in_features": shape[0],
                         "out_features": shape[1], "fp8": name in fp8}
                        for name, shape in capture.linear_shapes.items()],
        }

    def flops_per_linear(self, block: nn.Module, workload: Workload) -> dict[str, float]:
        """Each nn.Linear of the block by name: 2 * rows * in * out FLOPs, with the rows it saw in the pass."""
        rows = self._pass_capture(workload).linear_rows
        return {name: 2.0 * rows.get(name, 0) * module.in_features * module.out_features
                for name, module in block.named_modules() if isinstance(module, nn.Linear)}

    def shape_capture(self) -> StackCapture:
        """This stack's block in the family's default pass, shapes only: on the meta device where the model's
        forward runs there, else (a data-dependent step) a real run of the scaled-down config on the CPU, whose
        block has the same linears under the same names."""
        return self.shape_captures(1)[0]

    def shape_captures(self, *video_scales: int) -> list[StackCapture]:
        """`shape_capture` of the default pass with its video rows times each of `video_scales` (`more_video`;
        text, audio and timestep inputs as they are), all on the meta device or all, scaled down, on the CPU."""
        try:
            workload = self.default_workload(1)
            return [self.stack_capture(self.more_video(workload, scale), torch.device("meta"), torch.float32)
                    for scale in video_scales]
        except Exception:  # noqa: BLE001 (see above)
            small = self.scaled_down()
            workload = small.default_workload(1, scaled_down=True)
            return [small.stack_capture(small.more_video(workload, scale), torch.device("cpu"), torch.float32)
                    for scale in video_scales]

    def more_video(self, workload: Workload, scale: int) -> Workload:
        """`workload` with `scale` times its video rows (`scale` times the frames of its patch grid, where it has
        one) and its other rows (text, audio) unchanged: the pass whose linears' rows say which run on the
        video."""
        if scale == 1:
            return workload
        video = workload.rows["video"]
        grid = workload.video_grid and (workload.video_grid[0] * scale, *workload.video_grid[1:])
        return self._checked(dataclasses.replace(
            workload, seq_len=workload.seq_len + (scale - 1) * video, rows={**workload.rows, "video": scale * video},
            source=f"{workload.source}, with {scale}x the video rows", video_grid=grid))

    # --- derived from the block --------------------------------------------------------------------------
    @cached_property
    def module_ranges(self) -> tuple[ModuleRange, ...]:
        calls = self.shape_capture().attention_calls
        softmax = frozenset(call.module for call in calls)
        cross = frozenset(call.module for call in calls if call.kind == "cross")
        return derive_ranges(self.build_block(), softmax, cross)

    @cached_property
    def fp8_linears(self) -> Fp8Policy:
        """Which of the block's linears go FP8 and why each other one stays, by the rule `linears.RULE`, on the
        rows each saw in the family's default pass and in that pass with twice the video rows (`shape_captures`):
        those whose rows grow with the video run on the block's sequence."""
        shapes = {name: (m.in_features, m.out_features) for name, m in self.build_block().named_modules()
                  if isinstance(m, nn.Linear)}  # the full-size block's, where the captures ran scaled down
        return fp8_policy(*self.shape_captures(1, 2), shapes)

    @property
    def fp8_linear_modules(self) -> tuple[str, ...]:
        return self.fp8_linears.fp8

    @property
    def fp8_bf16_linears(self) -> dict[str, str]:
        return self.fp8_linears.kept

    # --- the pipeline's other stages ---------------------------------------------------------------------
    @property
    def text_encoder(self) -> str:
        return self.spec.text_encoder

    def prompt_rows(self, workload: Workload) -> int:
        return workload.rows.get("text", self.facts.text_rows)

    def pipeline_stages(self, workload: Workload, keys: tuple[str, ...], *, scaled_down: bool,
                        text_encoder_config: Path | None = None) -> list[StageSpec | StageSkip]:
        """The family pipeline's stages named in `keys` ("text", "vae", "audio"; `adapters.stage_specs`), each a
        `StageSpec` sized for the video `workload` is one pass of (scaled down on the CPU), or a `StageSkip`
        saying why it cannot be measured here."""
        def vae() -> StageSpec | StageSkip:
            if self.spec.vae_stage is None:
                return StageSkip("vae", f"{self.display_name}'s VAE decode is not built by dit-accel yet: not "
                                        f"measured, not in the total")
            return self.spec.vae_stage(self, workload, scaled_down)

        stages = {
            "vae": vae,
            "audio": lambda: StageSkip("audio", self.spec.audio_skip_reason),
            "text": lambda: text_encoder_stage(text_encoder_config, self.prompt_rows(workload), workload.batch,
                                               self.text_encoder, scaled_down),
        }
        return [stages[key]() for key in keys]

    def scaled_down_config(self) -> dict[str, Any]:
        return {**self.config, **self.spec.scaled_down}

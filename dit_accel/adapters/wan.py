"""Wan 2.x: video self-attention with 3-axis RoPE, cross-attention to 512 text rows, GELU FFN.

diffusers: `transformer_wan.WanTransformerBlock`. A block sees `hidden_states [B, S, dim]`, the text
context `encoder_hidden_states [B, 512, dim]` (already projected by the model's condition embedder),
`temb [B, 6, dim]` (the timestep projection) and the RoPE (cos, sin), each `[1, S, 1, head_dim]`.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers.models.autoencoders import autoencoder_kl_wan as wan_vae
from diffusers.models.transformers import transformer_wan as wan

from ..errors import UserError
from .base import AttentionCall, BlockAdapter, ModuleRange, TransformerInputs, Workload, check_video_rows
from .stages import StageSpec, build_on_meta, vae_decode

_WAN_MODULE = wan.__name__

WAN21_14B_CONFIG = {
    "_class_name": "WanTransformer3DModel",
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}
TEXT_ROWS = 512  # Wan pads its umT5 text context to 512 rows
VAE_SPATIAL, VAE_TEMPORAL = 8, 4
GRID_HEIGHT, GRID_WIDTH = 45, 80  # patch grid of a 720x1280 frame, for --seq-len workloads
# A CPU run's VAE: AutoencoderKLWan's layout at a quarter of its width, on 2 latent frames of 8 x 8.
WAN_VAE_SCALED_DOWN = {"base_dim": 24}
SCALED_DOWN_LATENTS = (2, 8, 8)
TEXT_ENCODER = "umT5-XXL (WanPipeline's text_encoder, UMT5EncoderModel)"


class WanAdapter(BlockAdapter):
    family = "wan"
    display_name = "Wan 2.x"
    transformer_class_names = ("WanTransformer3DModel",)
    block_key_template = "blocks.{index}."
    presets = {"wan2.1-14b": WAN21_14B_CONFIG}
    default_seq_len = 75600  # 81 frames at 720x1280: 21 latent frames x 45 x 80
    passes_per_step = 2
    default_steps = 50
    default_steps_source = "WanPipeline's default num_inference_steps"
    passes_per_step_source = ("Wan 2.1 with classifier-free guidance (WanPipeline's default guidance_scale 5.0): a "
                              "conditional and an unconditional forward per step")
    module_ranges = (
        ModuleRange("self-attention (other)", modules=("attn1",)),
        ModuleRange("qkv projection", modules=("attn1.to_q", "attn1.to_k", "attn1.to_v")),
        ModuleRange("qk-norm", modules=("attn1.norm_q", "attn1.norm_k")),
        ModuleRange("attention core", functions=((_WAN_MODULE, "dispatch_attention_fn"),)),
        ModuleRange("output projection", modules=("attn1.to_out.0",)),  # to_out is a ModuleList
        ModuleRange("cross-attention", modules=("attn2",)),
        ModuleRange("ffn", modules=("ffn",)),
        ModuleRange("norms", modules=("norm1", "norm2", "norm3")),
    )
    # The S-row GEMMs: self-attention q/k/v/out, cross-attention q/out, the GELU FFN's two projections (all
    # [5120 -> 5120] but the FFN's [5120 -> 13824 -> 5120]). The block's modulation is no Linear
    # (`scale_shift_table` + the model's timestep projection), so there is none to keep.
    fp8_linear_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
                          "ffn.net.0.proj", "ffn.net.2")
    fp8_bf16_linears = {
        "attn2.to_[kv]": "cross-attention key/value: runs on the 512 text rows only (~0.1% of the block's linear "
                         "FLOPs at 75600 video rows), and every video query's softmax reads these keys",
        "attn2.add_[kv]_proj": "I2V image key/value: runs on the 257 image-context rows only; every video query "
                               "reads these keys",
    }

    @property
    def transformer_class(self) -> type:
        return wan.WanTransformer3DModel

    @property
    def hidden_size(self) -> int:  # Wan's config has no hidden_size: the width is heads x head dim
        return self.config["num_attention_heads"] * self.config["attention_head_dim"]

    @property
    def outside_contents(self) -> str:
        return ("patch embedding (Conv3d), timestep and text embedders, RoPE, output norm and modulation, output "
                "projection and unpatchify")

    def build_block(self) -> torch.nn.Module:
        c = self.config
        with torch.device("meta"):
            return wan.WanTransformerBlock(
                dim=self.hidden_size, ffn_dim=c["ffn_dim"], num_heads=c["num_attention_heads"], qk_norm=c["qk_norm"],
                cross_attn_norm=c["cross_attn_norm"], eps=c["eps"], added_kv_proj_dim=c["added_kv_proj_dim"],
            )

    def workload_from_seq_len(self, seq_len: int, batch: int) -> Workload:
        workload = Workload(seq_len, batch, {"video": seq_len, "text context": TEXT_ROWS}, f"--seq-len {seq_len}")
        self._check_rope_positions(workload)
        return workload

    def workload_from_video(self, frames: int, height: int, width: int, batch: int) -> Workload:
        pt, ph, pw = self.config["patch_size"]
        grid = ((frames - 1) // VAE_TEMPORAL // pt + 1, height // VAE_SPATIAL // ph, width // VAE_SPATIAL // pw)
        video = grid[0] * grid[1] * grid[2]
        check_video_rows(video, height, width, VAE_SPATIAL * ph)
        workload = Workload(video, batch, {"video": video, "text context": TEXT_ROWS},
                            f"{frames} frames {height}x{width}", grid)
        self._check_rope_positions(workload)
        return workload

    def _positions(self, workload: Workload) -> tuple[int, int, int]:
        """How many (frame, row, column) positions of the patch grid the workload's rows reach."""
        _, grid_height, grid_width = workload.video_grid or (None, GRID_HEIGHT, GRID_WIDTH)
        last = workload.seq_len - 1
        return (last // (grid_height * grid_width) + 1, min(grid_height, last // grid_width + 1),
                min(grid_width, workload.seq_len))

    def _check_rope_positions(self, workload: Workload) -> None:
        """UserError when a grid axis reaches past the model's RoPE table (`rope_max_seq_len` positions
        per axis: 1024 for Wan 2.1, 64 for a tiny test pipeline), which would fail deep in the block."""
        table = self.config.get("rope_max_seq_len", 1024)
        positions = self._positions(workload)
        if max(positions) <= table:
            return
        layout = ("" if workload.video_grid else
                  f" (its rows laid out on the {GRID_HEIGHT}x{GRID_WIDTH} patch grid of a 720x1280 frame)")
        raise UserError(f"the {workload.source} workload{layout} needs {max(positions)} RoPE positions on one axis "
                        f"({positions[0]} frames x {positions[1]} rows x {positions[2]} columns of patches), but this "
                        f"Wan config has {table} (rope_max_seq_len); give a smaller video with --frames, --height and "
                        f"--width (e.g. --frames 9 --height 64 --width 64)")

    def _rope(self, workload: Workload, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, S, 1, head_dim] for the rows laid out frame by frame on the video's patch grid
        (for --seq-len workloads, a 45 x 80 grid as at 720x1280)."""
        rope = wan.WanRotaryPosEmbed(self.config["attention_head_dim"], self.config["patch_size"],
                                     self.config["rope_max_seq_len"])
        _, grid_height, grid_width = workload.video_grid or (None, GRID_HEIGHT, GRID_WIDTH)
        row = torch.arange(workload.seq_len)
        positions = (row // (grid_height * grid_width), (row // grid_width) % grid_height, row % grid_width)
        sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
        cos = torch.cat([f[p] for f, p in zip(rope.freqs_cos.split(sizes, dim=1), positions)], dim=-1)
        sin = torch.cat([f[p] for f, p in zip(rope.freqs_sin.split(sizes, dim=1), positions)], dim=-1)
        return (cos.float().to(device)[None, :, None, :], sin.float().to(device)[None, :, None, :])

    def make_inputs(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                    generator: torch.Generator) -> dict[str, Any]:
        def randn(*shape):
            return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

        return {
            "hidden_states": randn(workload.batch, workload.seq_len, self.hidden_size),
            "encoder_hidden_states": randn(workload.batch, TEXT_ROWS, self.hidden_size),
            "temb": randn(workload.batch, 6, self.hidden_size),
            "rotary_emb": self._rope(workload, device),
        }

    def _latent_grid(self, workload: Workload) -> tuple[int, int, int]:
        """(frames, rows, columns) of the patch grid the whole transformer sees for `workload`: the
        video's own; for --seq-len workloads, the block's layout on the 45 x 80 frame rounded to whole
        frames (whole rows of the frame below one frame), since a latent is a full grid."""
        if workload.video_grid:
            return workload.video_grid
        frame = GRID_HEIGHT * GRID_WIDTH
        if workload.seq_len >= frame:
            return max(1, round(workload.seq_len / frame)), GRID_HEIGHT, GRID_WIDTH
        width = min(GRID_WIDTH, workload.seq_len)
        return 1, max(1, round(workload.seq_len / width)), width

    def make_transformer_inputs(self, workload: Workload, device: torch.device, dtype: torch.dtype,
                                generator: torch.Generator) -> TransformerInputs:
        """Latents [B, in_channels, F', H', W'] whose patchified rows make the workload's video rows (or
        the nearest whole grid, for a --seq-len S that is not one), the 512-row umT5 context [B, 512,
        text_dim] and one timestep per batch item."""
        c = self.config
        pt, ph, pw = c["patch_size"]
        frames, height, width = self._latent_grid(workload)

        def randn(*shape):
            return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

        kwargs = {
            "hidden_states": randn(workload.batch, c["in_channels"], frames * pt, height * ph, width * pw),
            "timestep": torch.full((workload.batch,), 500.0, device=device),
            "encoder_hidden_states": randn(workload.batch, TEXT_ROWS, c["text_dim"]),
            "return_dict": False,
        }
        seq_len = frames * height * width
        exact = "exact" if seq_len == workload.seq_len else f"the nearest whole grid to S={workload.seq_len}"
        layout = (f"latents {frames * pt} x {height * ph} x {width * pw} -> {frames} x {height} x {width} patches = "
                  f"{seq_len} video rows ({exact}), {TEXT_ROWS} text-context rows")
        return TransformerInputs(kwargs, seq_len, layout)

    def attention_calls(self, workload: Workload) -> list[AttentionCall]:
        c = self.config
        heads, head_dim = c["num_attention_heads"], c["attention_head_dim"]
        return [
            AttentionCall("self", workload.batch, heads, workload.seq_len, workload.seq_len, head_dim),
            AttentionCall("cross", workload.batch, heads, workload.seq_len, TEXT_ROWS, head_dim),
        ]

    def linear_rows(self, linear_name: str, workload: Workload) -> int:
        if linear_name.startswith(("attn2.to_k", "attn2.to_v")):
            return workload.batch * TEXT_ROWS  # cross-attention keys/values come from the text context
        return super().linear_rows(linear_name, workload)

    # --- the pipeline's other stages -----------------------------------------------------------
    text_encoder = TEXT_ENCODER
    audio_skip_reason = "Wan 2.1 makes no audio: no such stage"

    def prompt_rows(self, workload: Workload) -> int:
        return TEXT_ROWS

    def _vae_stage(self, workload: Workload, scaled_down: bool) -> StageSpec:
        """AutoencoderKLWan.decode (diffusers' default config: the Wan 2.1 VAE) of the latents whose
        patch grid the whole transformer sees (21 x 90 x 160 for 81 frames at 720x1280), untiled, as
        WanPipeline decodes: one latent frame at a time through the causal decoder."""
        config = WAN_VAE_SCALED_DOWN if scaled_down else {}
        if scaled_down:
            frames, height, width = SCALED_DOWN_LATENTS
        else:
            pt, ph, pw = self.config["patch_size"]
            grid = self._latent_grid(workload)
            frames, height, width = grid[0] * pt, grid[1] * ph, grid[2] * pw
        batch, channels = workload.batch, self.config["in_channels"]
        base_dim = config.get("base_dim", 96)
        up_blocks = len(config.get("dim_mult", (1, 2, 4, 4)))
        out_pixels = (1 + VAE_TEMPORAL * (frames - 1)) * height * width * VAE_SPATIAL ** 2

        def activation_bytes(e: int) -> int:
            # The video (3 channels, then clamped: 2 copies) plus, for the frame being decoded, the widest
            # up-block's activations at full resolution over its 4 pixel frames and the causal caches
            # (about 16 tensors of base_dim channels per pixel).
            frame_pixels = VAE_TEMPORAL * height * width * VAE_SPATIAL ** 2
            return 2 * 3 * batch * out_pixels * e + 16 * base_dim * batch * frame_pixels * e

        def make_inputs(device, dtype, generator):
            z = torch.randn(batch, channels, frames, height, width, generator=generator, device=device)
            return {"z": z.to(dtype)}

        ranges = (
            ModuleRange("mid-block attention (torch SDPA, called directly)",
                        modules=("model.decoder.mid_block.attentions.0",)),
            ModuleRange("mid block", modules=("model.decoder.mid_block",)),
            # up_blocks is a ModuleList (iterated, never called): its blocks are the ranges.
            ModuleRange("up blocks", modules=tuple(f"model.decoder.up_blocks.{i}" for i in range(up_blocks))),
            ModuleRange("conv in/out, post-quant conv", modules=("model.decoder.conv_in", "model.decoder.conv_out",
                                                                 "model.post_quant_conv")),
        )
        return StageSpec(
            "vae", f"AutoencoderKLWan (base_dim {base_dim}, causal 3D conv decoder)",
            "scaled down for the CPU from diffusers' AutoencoderKLWan defaults" if scaled_down else
            "diffusers' AutoencoderKLWan defaults (the Wan 2.1 VAE's config)",
            f"latents {batch} x {channels} x {frames} x {height} x {width} -> {1 + VAE_TEMPORAL * (frames - 1)} frames "
            f"at {height * VAE_SPATIAL}x{width * VAE_SPATIAL}, one latent frame at a time, untiled",
            lambda: build_on_meta(wan_vae.AutoencoderKLWan, config),
            tuple(getattr(wan_vae.AutoencoderKLWan, "_keep_in_fp32_modules", None) or ()), make_inputs, vae_decode,
            attention_routed=False,
            attention_note=("not patched: the VAE's only attention (one per mid block: a single head over each "
                            f"frame's {height}x{width} latent positions, head dim {base_dim * 4}) calls "
                            "F.scaled_dot_product_attention directly, not diffusers' dispatch_attention_fn, and no "
                            "FP8 kernel of ours takes that head dim; every recipe shares one measurement"),
            activation_bytes=activation_bytes,
            activation_source="the video twice over plus one frame's widest activations and caches (not calibrated "
                              "on a GPU)",
            # The mid block's attention runs on each latent frame's h x w positions, one head of 4 x base_dim.
            attention_flops=4.0 * frames * batch * (height * width) ** 2 * base_dim * 4,
            module_ranges=ranges, body_label="decode body (frame loop, cat, clamp)")

    def scaled_down_config(self) -> dict[str, Any]:
        return {**self.config, "num_attention_heads": 4, "attention_head_dim": 128, "ffn_dim": 1536}

"""Wan 2.x: video self-attention with 3-axis RoPE, cross-attention to 512 text rows, GELU FFN.

diffusers: `transformer_wan`. Everything of the block (its inputs, the self- and cross-attention calls, the
ranges, the FP8 linears) comes from the generic path; Wan's own are the RoPE table's reach (a workload past
`rope_max_seq_len` positions on an axis is refused in one line) and its VAE stage.
"""
from __future__ import annotations

import torch
from diffusers.models.autoencoders import autoencoder_kl_wan as wan_vae

from ..errors import UserError
from .base import BlockAdapter, Workload
from .family import Family, InputContext, Preset, presets
from .ranges import ModuleRange
from .stage_specs import StageSpec, build_on_meta, vae_decode

WAN21_14B_CONFIG = {
    "_class_name": "WanTransformer3DModel",
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}
VAE_SPATIAL, VAE_TEMPORAL = 8, 4
# A CPU run's VAE: AutoencoderKLWan's layout at a quarter of its width, on 2 latent frames of 8 x 8.
WAN_VAE_SCALED_DOWN = {"base_dim": 24}
SCALED_DOWN_LATENTS = (2, 8, 8)
TEXT_ENCODER = "umT5-XXL (WanPipeline's text_encoder, UMT5EncoderModel)"


IMAGE_ROWS = 257  # an image-to-video config's CLIP image context (WanImageToVideoPipeline: 257 rows)


def image_context(ctx: InputContext) -> dict[str, torch.Tensor]:
    """An image-to-video config's image context (`image_dim` set): the CLIP rows its cross-attention reads."""
    if not ctx.config.get("image_dim"):
        return {}
    return {"encoder_hidden_states_image": ctx.randn(ctx.grid.batch, IMAGE_ROWS, ctx.config["image_dim"])}


def check_workload(adapter: BlockAdapter, workload: Workload) -> None:
    """UserError when a patch-grid axis reaches past the model's RoPE table (`rope_max_seq_len` positions per
    axis: 1024 for Wan 2.1, 64 for a tiny test pipeline), which would fail deep in the block."""
    table = adapter.config.get("rope_max_seq_len", 1024)
    grid, layout = adapter.latent_grid(workload)
    pt, ph, pw = adapter.config["patch_size"]
    positions = (grid.frames // pt, grid.height // ph, grid.width // pw)
    if max(positions) <= table:
        return
    raise UserError(f"the {workload.source} workload ({layout}) needs {max(positions)} RoPE positions on one axis, "
                    f"but this Wan config has {table} (rope_max_seq_len); give a smaller video with --frames, "
                    f"--height and --width (e.g. --frames 9 --height 64 --width 64)")


def vae_stage(adapter: BlockAdapter, workload: Workload, scaled_down: bool) -> StageSpec:
    """AutoencoderKLWan.decode (diffusers' default config: the Wan 2.1 VAE) of the latents whose
    patch grid the whole transformer sees (21 x 90 x 160 for 81 frames at 720x1280), untiled, as
    WanPipeline decodes: one latent frame at a time through the causal decoder."""
    config = WAN_VAE_SCALED_DOWN if scaled_down else {}
    if scaled_down:
        frames, height, width = SCALED_DOWN_LATENTS
    else:
        grid, _ = adapter.latent_grid(workload)
        frames, height, width = grid.frames, grid.height, grid.width
    batch, channels = workload.batch, adapter.config["in_channels"]
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



FAMILY = Family(
    name="wan", display_name="Wan 2.x", transformer="WanTransformer3DModel", pipeline="WanPipeline",
    presets={"wan2.1-14b": Preset(WAN21_14B_CONFIG, "the public Wan-AI/Wan2.1-T2V-14B-Diffusers transformer "
                                                    "config.json"),
             **presets("WanTransformer3DModel", "wan2.2-t2v-a14b", "wan2.2-ti2v-5b", "wan2.1-t2v-1.3b")},
    scaled_down={"num_attention_heads": 4, "attention_head_dim": 128, "ffn_dim": 1536},
    video=(81, 720, 1280), video_note="Wan 2.1 14B's 720p reference (WanPipeline's default is 480x832)",
    inputs=image_context, vae_stage=vae_stage, check_workload=check_workload, text_encoder=TEXT_ENCODER,
    audio_skip_reason="Wan 2.1 makes no audio: no such stage",
)

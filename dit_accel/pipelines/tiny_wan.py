"""A tiny random Wan 2.x text-to-video pipeline, built offline (no hub, no download).

Same classes as the real Wan 2.1 pipeline (`WanPipeline`: `WanTransformer3DModel`, `AutoencoderKLWan`,
`UMT5EncoderModel`, flow-matching UniPC), shrunk until a few denoising steps of a 9-frame 64x64
video run on a CPU in about a second. The weights are random: the video is noise, the code path
(text encoding, classifier-free guidance, the 3-D RoPE transformer, the causal VAE decode) is real.

`wan_components` is shared with the pipelines built from Wan's parts (SkyReels-V2: its own transformer
class with Wan's config keys, Wan's VAE, UMT5 and scheduler class).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .tiny_parts import TEXT_DIM, real_size_transformer, save_and_describe, t5_text_encoder, t5_tokenizer

MAX_TEXT_TOKENS = 512  # what WanPipeline pads prompts to (max_sequence_length)

TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
)
# base_dim 8 with four levels of multiplier 1: 8x spatial and 4x temporal compression, as the real VAE.
VAE_CONFIG = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                  temperal_downsample=[False, True, True])
SCHEDULER_CONFIG = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)

# What `generate` uses for this pipeline unless told otherwise: 9 frames = 3 latent frames.
DEFAULTS = dict(frames=9, height=64, width=64, steps=4, guidance=5.0)


def wan_components(seed: int, transformer_class: type, flow_shift: float = SCHEDULER_CONFIG["flow_shift"],
                   transformer_config: dict | None = None) -> dict:
    """The keyword arguments of a Wan-style pipeline (`tokenizer`, `text_encoder`, `transformer`, `vae`,
    `scheduler`): `transformer_class` built from `TRANSFORMER_CONFIG` (or at a preset's size from
    `transformer_config`, `tiny_parts.real_size_transformer`), weights drawn from `torch.manual_seed(seed)` in a
    fixed order (transformer, VAE, text encoder), in fp32 on the CPU (a real-size transformer in bf16)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    torch.manual_seed(seed)
    if transformer_config is None:
        transformer = transformer_class(**TRANSFORMER_CONFIG)
    else:
        transformer = real_size_transformer(transformer_class, transformer_config, seed)
    vae = AutoencoderKLWan(**VAE_CONFIG)
    text_encoder = t5_text_encoder("umt5", width=transformer.config.text_dim)
    return dict(tokenizer=t5_tokenizer(MAX_TEXT_TOKENS), text_encoder=text_encoder, transformer=transformer, vae=vae,
                scheduler=UniPCMultistepScheduler(**{**SCHEDULER_CONFIG, "flow_shift": flow_shift}))


def build_tiny_wan(seed: int = 0, transformer_config: dict | None = None):
    """The pipeline object, in fp32 on the CPU, with weights drawn from `torch.manual_seed(seed)`."""
    from diffusers import WanPipeline, WanTransformer3DModel

    return WanPipeline(**wan_components(seed, WanTransformer3DModel, transformer_config=transformer_config))


def save_tiny_wan(directory: Path, seed: int = 0, transformer_config: dict | None = None) -> dict:
    """Build and `save_pretrained` into `directory`; returns what was built, for the command to print."""
    return save_and_describe(build_tiny_wan(seed, transformer_config), directory, DEFAULTS)

"""A tiny random CogVideoX text-to-video pipeline, built offline (no hub, no download).

Same classes as CogVideoX-5b's pipeline (`CogVideoXPipeline`: `CogVideoXTransformer3DModel` with 3-D RoPE,
which the pipeline computes, `AutoencoderKLCogVideoX`, a T5 v1.1 `T5EncoderModel`, `CogVideoXDDIMScheduler`),
shrunk until a few denoising steps of a 9-frame 64x64 video run on a CPU in about a second. The text encoder
and its word-level tokenizer are the shared tiny ones (`tiny_parts`). Random weights: the video is noise, the
code path (226 text tokens in one joint sequence with the video's, the guidance, the VAE decode) is real.

Two things differ from Wan's pipeline and show in `generate`'s report: the guidance runs as ONE transformer
pass a step on a batch of two (unconditional and conditional stacked), and the transformer's attention
processor (`CogVideoXAttnProcessor2_0`) calls torch's `F.scaled_dot_product_attention` itself rather than
diffusers' `dispatch_attention_fn`, so a routed attention backend (our fp8) reaches it through the stand-in
for its file's `F` (`dit_accel.attention.routing`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .tiny_parts import TEXT_DIM, real_size_transformer, save_and_describe, t5_text_encoder, t5_tokenizer

MAX_TEXT_TOKENS = 226  # what CogVideoXPipeline pads prompts to (max_sequence_length) = max_text_seq_length
LATENT_CHANNELS = 16

# CogVideoX-5b's layout (RoPE, patch 2, no temporal patch) at two heads of 64 (a head dim the FP8 kernel
# takes). sample_height/width are the latent size of the default video (64 / 8): the RoPE grid's base size.
TRANSFORMER_CONFIG = dict(
    num_attention_heads=2, attention_head_dim=64, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
    time_embed_dim=32, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=8, sample_height=8, sample_frames=9,
    patch_size=2, temporal_compression_ratio=4, max_text_seq_length=MAX_TEXT_TOKENS,
    use_rotary_positional_embeddings=True,
)
# Four levels, as the real VAE: 8x spatial (three downsamples) and 4x temporal compression.
VAE_CONFIG = dict(
    down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
    block_out_channels=(8, 8, 8, 8), latent_channels=LATENT_CHANNELS, layers_per_block=1, norm_num_groups=2,
    temporal_compression_ratio=4, sample_height=64, sample_width=64,
)
# CogVideoX's sampling: v-prediction on a zero-terminal-SNR schedule, trailing timesteps.
SCHEDULER_CONFIG = dict(prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing",
                        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                        set_alpha_to_one=True, snr_shift_scale=1.0)

# 9 frames = 3 latent frames; guidance 6, the pipeline's default.
DEFAULTS = dict(frames=9, height=64, width=64, steps=4, guidance=6.0)


def build_tiny_cogvideox(seed: int = 0, transformer_config: dict | None = None):
    """The pipeline object, in fp32 on the CPU, with weights drawn from `torch.manual_seed(seed)` (a transformer at
    a preset's size, `transformer_config`: `tiny_parts.real_size_transformer`, in bf16)."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    if transformer_config is None:
        transformer = CogVideoXTransformer3DModel(**TRANSFORMER_CONFIG)
    else:
        transformer = real_size_transformer(CogVideoXTransformer3DModel, transformer_config, seed)
    vae = AutoencoderKLCogVideoX(**VAE_CONFIG)
    text_encoder = t5_text_encoder("t5", width=transformer.config.text_embed_dim)
    return CogVideoXPipeline(tokenizer=t5_tokenizer(MAX_TEXT_TOKENS), text_encoder=text_encoder, vae=vae,
                             transformer=transformer, scheduler=CogVideoXDDIMScheduler(**SCHEDULER_CONFIG))


def save_tiny_cogvideox(directory: Path, seed: int = 0, transformer_config: dict | None = None) -> dict:
    """Build and `save_pretrained` into `directory`; returns what was built, for the command to print."""
    return save_and_describe(build_tiny_cogvideox(seed, transformer_config), directory, DEFAULTS)

"""A tiny random Wan 2.x text-to-video pipeline, built offline (no hub, no download).

Same classes as the real Wan 2.1 pipeline (`WanPipeline`: `WanTransformer3DModel`, `AutoencoderKLWan`,
`UMT5EncoderModel`, flow-matching UniPC), shrunk until a few denoising steps of a 9-frame 64x64
video run on a CPU in about a second. The weights are random: the video is noise, the code path
(text encoding, classifier-free guidance, the 3-D RoPE transformer, the causal VAE decode) is real.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .tokenizer import build_word_tokenizer

VOCAB_SIZE = 256
TEXT_DIM = 32  # UMT5 d_model = the transformer's text_dim
MAX_TEXT_TOKENS = 512  # what WanPipeline pads prompts to (max_sequence_length)

TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
)
# base_dim 8 with four levels of multiplier 1: 8x spatial and 4x temporal compression, as the real VAE.
VAE_CONFIG = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                  temperal_downsample=[False, True, True])
TEXT_ENCODER_CONFIG = dict(vocab_size=VOCAB_SIZE, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                           relative_attention_num_buckets=8, relative_attention_max_distance=32,
                           feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                           decoder_start_token_id=0)
SCHEDULER_CONFIG = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)

# What `generate` uses for this pipeline unless told otherwise: 9 frames = 3 latent frames.
DEFAULTS = dict(frames=9, height=64, width=64, steps=4, guidance=5.0)


def build_tiny_wan(seed: int = 0):
    """The pipeline object, in fp32 on the CPU, with weights drawn from `torch.manual_seed(seed)`."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TRANSFORMER_CONFIG)
    vae = AutoencoderKLWan(**VAE_CONFIG)
    text_encoder = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER_CONFIG)).eval()
    tokenizer = build_word_tokenizer(VOCAB_SIZE, model_max_length=MAX_TEXT_TOKENS)
    scheduler = UniPCMultistepScheduler(**SCHEDULER_CONFIG)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler)


def save_tiny_wan(directory: Path, seed: int = 0) -> dict:
    """Build and `save_pretrained` into `directory`; returns what was built, for the command to print."""
    pipe = build_tiny_wan(seed)
    pipe.save_pretrained(str(directory))
    return {"pipeline": "WanPipeline", "defaults": DEFAULTS,
            "params_m": {name: sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e6
                         for name in ("transformer", "vae", "text_encoder")}}

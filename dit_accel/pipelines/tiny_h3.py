"""A tiny random MiniMax-H3 text-to-video+audio pipeline, built offline (no hub, no download, no torchvision).

MiniMax-H3 is a *modular* diffusers pipeline (`MiniMaxH3ModularPipeline` over `MiniMaxH3Blocks`), saved
with a `modular_model_index.json`. The tiny one has the components of the real folder's text-only
(`t2va`) workflow, with the real classes shrunk: `MiniMaxH3Transformer3DModel`, `AutoencoderKLMiniMaxH3`
(the real 16x spatial and 4x temporal compression, so the same frame and size rules hold),
`AutoencoderKLMiniMaxH3Audio`, two `MiniMaxH3Scheduler`s (shift 12 for video, 3 for audio, as released)
and a `Qwen3VLForConditionalGeneration` conditioner with 51 decoder layers, because H3 conditions on
`hidden_states[50]` and refuses a shallower one. Two stand-ins, both built in code: the word-level
tokenizer of `tokenizer.py` (plus Qwen's vision tokens), and `H3PromptProcessor` below in place of a
`Qwen3VLProcessor`. The weights are random: the video and the sound are noise, the code path (text
encoding, the packed text+video+audio sequence, both VAE decodes) is real.

H3 generates 5 to 15 s at 24 fps, frame counts snapped up to 17n + 5: the defaults ask for its
shortest video, 124 frames, at 64x64 (sizes are multiples of 32).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers.processing_utils import ProcessorMixin

from .tiny_parts import params_m
from .tokenizer import build_word_tokenizer

# Qwen3-VL's vision tokens, added after the words; H3's text step looks up the pad tokens' ids.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
WORD_VOCAB_SIZE = 252  # + the 4 vision tokens = the conditioner's vocabulary of 256
TEXT_DIM = 16  # the conditioner's hidden size = the transformer's text_dim
TEXT_ENCODER_LAYERS = 51  # H3 reads hidden_states[50]
LATENT_CHANNELS = 4  # video and audio latents alike

TEXT_CONFIG = dict(vocab_size=WORD_VOCAB_SIZE + 4, hidden_size=TEXT_DIM, intermediate_size=32,
                   num_hidden_layers=TEXT_ENCODER_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                        mrope_interleaved=True))
VISION_CONFIG = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                     deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=2, temporal_patch_size=2)
# Head dim 64, one the FP8 attention kernel takes, so a GPU run serves every attention call with it.
TRANSFORMER_CONFIG = dict(num_attention_heads=2, attention_head_dim=64, hidden_size=64, num_layers=2,
                          num_refiner_layers=1, ffn_dim=64, in_channels=LATENT_CHANNELS,
                          audio_in_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=16, time_embed_hidden_dim=32,
                          time_embed_dim=24, rope_freq_dim=8)
VAE_CONFIG = dict(latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                  spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4,
                  decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=16,
                  decoder_num_register_tokens=4, decoder_ffn_mult=2,
                  latents_mean=[0.0] * LATENT_CHANNELS, latents_std=[1.0] * LATENT_CHANNELS)
# 8 kHz with a hop of 200 samples keeps H3's 40 audio latents per second at a quarter of the real 32 kHz work.
AUDIO_VAE_CONFIG = dict(encoder_dim=4, encoder_rates=(2, 4, 5, 5), latent_dim=8, latent_channels=LATENT_CHANNELS,
                        num_attention_heads=1, decoder_dim=32, decoder_rates=(5, 5, 2, 2, 2),
                        decoder_kernel_sizes=(9, 9, 4, 4, 4), resblock_kernel_sizes=(3,),
                        resblock_dilation_sizes=((1,),),
                        sampling_rate=8000, latents_mean=[0.0] * LATENT_CHANNELS, latents_std=[1.0] * LATENT_CHANNELS)
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0

# What `generate` uses for this pipeline unless told otherwise: H3's shortest video (5 s at 24 fps, snapped to
# 17n + 5 frames). No guidance: H3 is guidance-distilled.
DEFAULTS = dict(frames=124, height=64, width=64, steps=4)


class H3PromptProcessor(ProcessorMixin):
    """What MiniMax-H3's text-only (`t2va`) step asks of its `Qwen3VLProcessor`, without torchvision.

    The step tokenizes the prompt itself and asks the processor only for `create_mm_token_type_ids`
    (0 text, 1 image, 2 video per token), which compares token ids with the image and video pad ids.
    A `Qwen3VLProcessor` cannot be built or loaded here: it holds a `Qwen3VLVideoProcessor`, which
    imports torchvision, and torchvision does not import beside this environment's torch. This
    processor holds the tokenizer alone and answers that call as `Qwen3VLProcessor` does (the method is
    the shared `ProcessorMixin` one). It has no image or video processor, so the keyframe (`fl2va`) and
    reference (`ref2va`) workflows cannot use it.

    `save_pretrained` records it in `modular_model_index.json` under this module's path; diffusers
    resolves such a class from the modules already imported, so `pipeline_folder.py` imports this one first.
    """

    def __init__(self, tokenizer, chat_template=None):
        super().__init__(tokenizer, chat_template=chat_template)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)


def build_tiny_h3(seed: int = 0):
    """The modular pipeline object, in fp32 on the CPU, with weights drawn from `torch.manual_seed(seed)`."""
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Blocks,
                           MiniMaxH3ModularPipeline, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel)
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = build_word_tokenizer(WORD_VOCAB_SIZE)
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    token_ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END),
        ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD))}

    torch.manual_seed(seed)
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, **token_ids)).eval()
    pipe = MiniMaxH3ModularPipeline(blocks=MiniMaxH3Blocks())
    pipe.update_components(
        text_encoder=text_encoder, tokenizer=tokenizer, processor=H3PromptProcessor(tokenizer=tokenizer),
        transformer=MiniMaxH3Transformer3DModel(**TRANSFORMER_CONFIG), vae=AutoencoderKLMiniMaxH3(**VAE_CONFIG),
        audio_vae=AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE_CONFIG),
        scheduler=MiniMaxH3Scheduler(shift=VIDEO_SHIFT), audio_scheduler=MiniMaxH3Scheduler(shift=AUDIO_SHIFT))
    return pipe


def save_tiny_h3(directory: Path, seed: int = 0) -> dict:
    """Build and `save_pretrained` into `directory`; returns what was built, for the command to print.

    The saved `modular_model_index.json` points every component at `directory`, as diffusers writes it."""
    pipe = build_tiny_h3(seed)
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)
    return {"pipeline": "MiniMaxH3ModularPipeline", "defaults": DEFAULTS,
            "params_m": params_m(pipe, ("transformer", "vae", "audio_vae", "text_encoder"))}

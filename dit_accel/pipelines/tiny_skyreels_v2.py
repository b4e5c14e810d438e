"""A tiny random SkyReels-V2 text-to-video pipeline, built offline (no hub, no download).

`SkyReelsV2Pipeline` is Wan 2.1's pipeline with SkyReels' transformer (`SkyReelsV2Transformer3DModel`, which
takes Wan's config keys, plus diffusion-forcing options the T2V pipeline leaves off), so everything but the
transformer class is the tiny Wan's (`tiny_wan.wan_components`: `AutoencoderKLWan`, UMT5, UniPC). The
scheduler's flow shift is 8, the value SkyReels-V2's T2V example sets; the guidance is its default, 6.
Random weights: the video is noise, the code path (two transformer passes a step for the guidance, the
causal VAE decode) is real.
"""
from __future__ import annotations

from pathlib import Path

from .tiny_parts import save_and_describe
from .tiny_wan import DEFAULTS as WAN_DEFAULTS, wan_components

FLOW_SHIFT = 8.0  # SkyReelsV2Pipeline's example: 8.0 for T2V (5.0 for I2V)

# Wan's VAE, so Wan's sizes: 9 frames = 3 latent frames, 64x64 = 8x8 latents.
DEFAULTS = dict(WAN_DEFAULTS, guidance=6.0)


def build_tiny_skyreels_v2(seed: int = 0, transformer_config: dict | None = None):
    """The pipeline object, in fp32 on the CPU, with weights drawn from `torch.manual_seed(seed)`."""
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

    return SkyReelsV2Pipeline(**wan_components(seed, SkyReelsV2Transformer3DModel, flow_shift=FLOW_SHIFT,
                                               transformer_config=transformer_config))


def save_tiny_skyreels_v2(directory: Path, seed: int = 0, transformer_config: dict | None = None) -> dict:
    """Build and `save_pretrained` into `directory`; returns what was built, for the command to print."""
    return save_and_describe(build_tiny_skyreels_v2(seed, transformer_config), directory, DEFAULTS)

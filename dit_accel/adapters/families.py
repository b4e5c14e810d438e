"""The video DiT families dit-accel serves through the generic path, as data.

Each entry says only what diffusers does not: the transformer and pipeline classes, the flagship's public
config (`presets/*.json`, each with where it came from; a family without one uses its class defaults and says
so), a scaled-down config for CPU runs, and the few facts or input hooks the generic rules need. Adding a
family the generic path handles is one entry here. MiniMax-H3 and Wan, whose VAE stages dit-accel builds, keep
theirs beside their hooks (`minimax_h3.py`, `wan.py`).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .family import Family, InputContext, Preset

PRESETS = Path(__file__).parent / "presets"


@lru_cache(maxsize=None)
def class_defaults(transformer: str) -> dict[str, Any]:
    """The transformer class's own defaults, as a config (diffusers' classes default to the flagship's)."""
    import inspect

    import diffusers

    parameters = inspect.signature(getattr(diffusers, transformer).__init__).parameters
    return {"_class_name": transformer, **{name: p.default for name, p in parameters.items()
                                          if name != "self" and p.default is not inspect.Parameter.empty}}


def presets(transformer: str, *files: str) -> dict[str, Preset]:
    """The embedded public configs named (`presets/<name>.json`: the config and its source), in order; the class
    defaults where none is embedded."""
    found = {}
    for name in files:
        path = PRESETS / f"{name}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            found[name] = Preset(data["config"], data["source"])
    return found or {"class-defaults": Preset(class_defaults(transformer),
                                              f"diffusers' {transformer} defaults (no public config embedded)")}


def _cogvideox_rope(ctx: InputContext) -> dict[str, Any]:
    """CogVideoX's 3D RoPE, which its pipeline (not its transformer) computes: the pipeline's own method."""
    if not ctx.config.get("use_rotary_positional_embeddings"):
        return {}
    from diffusers import CogVideoXPipeline

    spatial = 8
    pipe = SimpleNamespace(vae_scale_factor_spatial=spatial, transformer=SimpleNamespace(
        config=SimpleNamespace(**ctx.config)))
    g = ctx.grid
    rope = CogVideoXPipeline._prepare_rotary_positional_embeddings(pipe, g.height * spatial, g.width * spatial,
                                                                 g.frames, ctx.device)
    return {"image_rotary_emb": rope}


def _hunyuan15_inputs(ctx: InputContext) -> dict[str, Any]:
    """HunyuanVideo 1.5's second text encoder (256 ByT5 glyph rows), its image embedding, which the pipeline
    passes as zeros for text-to-video (729 SigLIP rows), and the timestep in the latents' dtype, as the pipeline
    passes it (the model casts its time projection to the timestep's dtype)."""
    import torch

    c, b = ctx.config, ctx.grid.batch
    glyph_rows, image_rows = 256, 729  # the pipeline's tokenizer_2_max_length and vision_num_semantic_tokens
    return {"timestep": torch.full((b,), 500.0, device=ctx.device, dtype=ctx.dtype),
            "encoder_hidden_states_2": ctx.randn(b, glyph_rows, c["text_embed_2_dim"]),
            "encoder_attention_mask_2": torch.ones(b, glyph_rows, device=ctx.device),
            "image_embeds": torch.zeros(b, image_rows, c["image_embed_dim"], device=ctx.device, dtype=ctx.dtype)}


LTX2_FRAME_RATE = 24.0  # LTX2Pipeline's default frame_rate
LTX2_AUDIO_LATENTS_PER_SECOND = 25  # LTX2Pipeline: audio_sampling_rate / audio_hop_length / the audio VAE's 4x


def _ltx2_inputs(ctx: InputContext) -> dict[str, Any]:
    """LTX-2's audio stream beside the video, as LTX2Pipeline makes it: the audio latents of the clip's duration
    (packed [B, rows, channels]: 126 rows for 121 frames at 24 fps), the audio's prompt rows (its text connector's
    output, as wide as the video's), the frame rate, and the cross-modal timestep the pipeline turns on."""
    import torch

    c, g = ctx.config, ctx.grid
    temporal = c["vae_scale_factors"][0]
    frames = (g.frames - 1) * temporal + 1  # the causal VAE keeps the first frame alone
    audio_rows = round(frames / LTX2_FRAME_RATE * LTX2_AUDIO_LATENTS_PER_SECOND)
    return {"audio_hidden_states": ctx.randn(g.batch, audio_rows, c["audio_in_channels"]),
            "audio_encoder_hidden_states": ctx.randn(g.batch, ctx.text_rows, c["caption_channels"]),
            "audio_encoder_attention_mask": torch.ones(g.batch, ctx.text_rows, device=ctx.device),
            "audio_num_frames": audio_rows, "fps": LTX2_FRAME_RATE,
            "sigma": torch.full((g.batch,), 500.0, device=ctx.device), "use_cross_timestep": True}


NEW_FAMILIES = (
    Family(
        name="hunyuan-video", display_name="HunyuanVideo", transformer="HunyuanVideoTransformer3DModel",
        pipeline="HunyuanVideoPipeline", presets=presets("HunyuanVideoTransformer3DModel", "hunyuanvideo"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "rope_axes_dim": (16, 24, 24),
                     "text_embed_dim": 256, "pooled_projection_dim": 64},
        text_width="text_embed_dim", guidance="true_cfg_scale",
    ),
    Family(
        name="hunyuan-video-1.5", display_name="HunyuanVideo 1.5", transformer="HunyuanVideo15Transformer3DModel",
        pipeline="HunyuanVideo15Pipeline",
        presets=presets("HunyuanVideo15Transformer3DModel", "hunyuanvideo-1.5-720p-t2v"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "rope_axes_dim": (16, 24, 24),
                     "text_embed_dim": 256, "text_embed_2_dim": 64, "image_embed_dim": 64},
        text_width="text_embed_dim", text_rows=1000, video=(121, 720, 1280),
        video_note="HunyuanVideo 1.5's 720p reference (its pipeline sizes the video from the checkpoint)",
        vae_factors=(4, 16), guidance="guider", inputs=_hunyuan15_inputs,
    ),
    Family(
        name="ltx-video", display_name="LTX-Video", transformer="LTXVideoTransformer3DModel", pipeline="LTXPipeline",
        presets=presets("LTXVideoTransformer3DModel", "ltx-video-0.9.7-13b-dev", "ltx-video"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "cross_attention_dim": 256,
                     "caption_channels": 256},
        latents="tokens", text_width="caption_channels", vae_factors=(8, 32),
    ),
    Family(
        name="ltx-2", display_name="LTX-2", transformer="LTX2VideoTransformer3DModel", pipeline="LTX2Pipeline",
        presets=presets("LTX2VideoTransformer3DModel", "ltx-2"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "cross_attention_dim": 256,
                     "audio_num_attention_heads": 4, "audio_attention_head_dim": 32,
                     "audio_cross_attention_dim": 128, "caption_channels": 256},
        latents="tokens", text_width="caption_channels", vae_factors=(8, 32), video=(121, 512, 768),
        video_note="LTX2Pipeline's default 512x768, and its 121 frames for a checkpoint without a duration head "
                   "(LTX-2.0)",
        extra_passes=(("stg_scale", 0.0, "spatio-temporal guidance: block 28's self-attention skipped"),
                      ("modality_scale", 1.0, "modality isolation: the audio-video cross-attention off")),
        inputs=_ltx2_inputs,
    ),
    Family(
        name="cogvideox", display_name="CogVideoX", transformer="CogVideoXTransformer3DModel",
        pipeline="CogVideoXPipeline", presets=presets("CogVideoXTransformer3DModel", "cogvideox-5b", "cogvideox1.5-5b"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "text_embed_dim": 256, "time_embed_dim": 64},
        latents="BFCHW", text_width="text_embed_dim", video=(49, 480, 720),
        video_note="CogVideoX-5b's reference (49 frames at 480x720: its transformer's sample size)",
        inputs=_cogvideox_rope,
    ),
    Family(
        name="mochi", display_name="Mochi 1", transformer="MochiTransformer3DModel", pipeline="MochiPipeline",
        presets=presets("MochiTransformer3DModel", "mochi-1-preview"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "pooled_projection_dim": 128,
                     "text_embed_dim": 256, "time_embed_dim": 64},
        text_width="text_embed_dim", video=(163, 480, 848),
        video_note="Mochi 1's reference clip (5.4 s at 30 fps, 480x848; MochiPipeline's default is 19 frames)",
    ),
    Family(
        name="skyreels-v2", display_name="SkyReels-V2", transformer="SkyReelsV2Transformer3DModel",
        pipeline="SkyReelsV2Pipeline", presets=presets("SkyReelsV2Transformer3DModel", "skyreels-v2-t2v-14b-720p"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "text_dim": 256},
    ),
    Family(
        name="sana-video", display_name="SANA-Video", transformer="SanaVideoTransformer3DModel",
        pipeline="SanaVideoPipeline", presets=presets("SanaVideoTransformer3DModel", "sana-video-2b-480p"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 32, "num_cross_attention_heads": 4,
                     "cross_attention_head_dim": 32, "cross_attention_dim": 128, "caption_channels": 256},
        text_width="caption_channels",
    ),
    Family(
        name="allegro", display_name="Allegro", transformer="AllegroTransformer3DModel", pipeline="AllegroPipeline",
        presets=presets("AllegroTransformer3DModel", "allegro"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 32, "cross_attention_dim": 128,
                     "caption_channels": 256},
        text_width="caption_channels", video=(88, 720, 1280),
        video_note="Allegro's reference (88 frames at 720x1280; AllegroPipeline takes them from its sample size)",
    ),
    Family(
        name="motif-video", display_name="Motif-Video", transformer="MotifVideoTransformer3DModel",
        pipeline="MotifVideoPipeline", presets=presets("MotifVideoTransformer3DModel", "motif-video"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "rope_axes_dim": (16, 24, 24),
                     "text_embed_dim": 256},
        text_width="text_embed_dim", guidance="guider",
    ),
)

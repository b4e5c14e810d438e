"""The video DiT families dit-accel serves through the generic path, as data.

Each entry says only what diffusers does not: the transformer and pipeline classes, the flagship's public
config (`presets/*.json`, each with where it came from; a family without one uses its class defaults and says
so), a scaled-down config for CPU runs, and the few facts or input hooks the generic rules need. Adding a
family the generic path handles is one entry here. MiniMax-H3 and Wan, whose VAE stages dit-accel builds, keep
theirs beside their hooks (`minimax_h3.py`, `wan.py`).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import wan
from .family import Family, InputContext, presets
from .sections import (WAN_ANIMATE_SEGMENT, history_latents, no_seq_len, section_indices, sectioned,
                       wan_animate_segments)
from .workload import ceil_div


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


def _ltx2_audio_rows(frames: int) -> int:
    """The audio latents of `frames` video frames' duration, as LTX2Pipeline counts them (126 for 121 frames)."""
    return round(frames / LTX2_FRAME_RATE * LTX2_AUDIO_LATENTS_PER_SECOND)


def _ltx2_inputs(ctx: InputContext) -> dict[str, Any]:
    """LTX-2's audio stream beside the video, as LTX2Pipeline makes it: the audio latents of the clip's duration
    (packed [B, rows, channels]: 126 rows for 121 frames at 24 fps), the audio's prompt rows (its text connector's
    output, as wide as the video's), the frame rate, and the cross-modal timestep the pipeline turns on."""
    import torch

    c, g = ctx.config, ctx.grid
    return {"audio_hidden_states": ctx.randn(g.batch, ctx.audio_rows, c["audio_in_channels"]),
            "audio_encoder_hidden_states": ctx.randn(g.batch, ctx.text_rows, c["caption_channels"]),
            "audio_encoder_attention_mask": torch.ones(g.batch, ctx.text_rows, device=ctx.device),
            "audio_num_frames": ctx.audio_rows, "fps": LTX2_FRAME_RATE,
            "sigma": torch.full((g.batch,), 500.0, device=ctx.device), "use_cross_timestep": True}


def _wan_vace_inputs(ctx: InputContext) -> dict[str, Any]:
    """WanVACEPipeline's control input for its default call (no video, mask or reference image: a blank video
    all to be generated): [B, vace_in_channels, F, H, W] on the latents' grid (the kept and the regenerated
    part's latents, 16 + 16 channels, and the mask folded to the grid, 64), and its conditioning scale 1.0 for
    each VACE layer."""
    import torch

    c, g = ctx.config, ctx.grid
    return {"control_hidden_states": ctx.randn(g.batch, c["vace_in_channels"], g.frames, g.height, g.width),
            "control_hidden_states_scale": torch.ones(len(c["vace_layers"]), device=ctx.device, dtype=ctx.dtype)}


def _kandinsky_latents(ctx: InputContext):
    """Kandinsky 5's and 6's latents as their pipelines make them: channels last ([B, T, H, W, C]), with the zero
    image condition and zero mask a visual_cond model reads (2C + 1 channels)."""
    import torch

    c, g = ctx.config, ctx.grid
    latents = ctx.randn(g.batch, g.frames, g.height, g.width, c["in_visual_dim"])
    if c.get("visual_cond"):
        latents = torch.cat([latents, torch.zeros_like(latents), latents.new_zeros(*latents.shape[:-1], 1)], dim=-1)
    return latents


def _kandinsky5_inputs(ctx: InputContext) -> dict[str, Any]:
    """What Kandinsky5T2VPipeline passes its transformer: its latents (`_kandinsky_latents`), the CLIP pooled
    vector, the timestep in the latents' dtype, the RoPE positions (latent frames, and the latent rows and columns
    halved by the 2x2 patch; the prompt's rows 0..n-1), and the pipeline's own RoPE scale and sparse-attention
    parameters (None for the 5 s models' regular attention)."""
    import torch
    from diffusers import Kandinsky5T2VPipeline

    c, g, b = ctx.config, ctx.grid, ctx.grid.batch
    spatial = 8  # the pipeline's vae_scale_factor_spatial (HunyuanVideo's VAE)
    latents = _kandinsky_latents(ctx)
    pipe = SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(**c)),
                           fast_sta_nabla=Kandinsky5T2VPipeline.fast_sta_nabla)  # the 10 s models' sparse mask
    return {"hidden_states": latents,
            "pooled_projections": ctx.randn(b, c["in_text_dim2"]),
            "timestep": torch.full((b,), 500.0, device=ctx.device, dtype=ctx.dtype),
            "visual_rope_pos": [torch.arange(n, device=ctx.device) for n in (g.frames, g.height // 2, g.width // 2)],
            "text_rope_pos": torch.arange(ctx.text_rows, device=ctx.device),
            "scale_factor": Kandinsky5T2VPipeline._get_scale_factor(pipe, g.height * spatial, g.width * spatial),
            "sparse_params": Kandinsky5T2VPipeline.get_sparse_params(pipe, latents, ctx.device)}


def _wan_animate_inputs(ctx: InputContext) -> dict[str, Any]:
    """What WanAnimatePipeline passes beside the latents (36 channels: 16 noisy, a 4-channel mask and 16 of the
    reference or conditioning video, which the generic rule draws) and the prompt: the CLIP rows
    (`wan.image_context`), the segment's pose latents (none for the reference frame) and its face video in pixels
    ([B, 3, 77, 512, 512]), which the model's face encoder brings to the segment's latent frames."""
    c, g = ctx.config, ctx.grid
    face_frames = (g.frames - 2) * wan.VAE_TEMPORAL + 1
    size = c["motion_encoder_size"]
    return {**wan.image_context(ctx),
            "pose_hidden_states": ctx.randn(g.batch, c["latent_channels"], g.frames - 1, g.height, g.width),
            "face_pixel_values": ctx.randn(g.batch, 3, face_frames, size, size)}


FRAMEPACK_IMAGE_ROWS = 729  # SigLIP so400m-patch14-384's 27 x 27 patches: the pipeline's image encoder


def _framepack_inputs(ctx: InputContext) -> dict[str, Any]:
    """What HunyuanVideoFramepackPipeline passes beside the prompt: the image rows, the section's frame indices
    and, where the checkpoint packs history (has_clean_x_embedder), the clean latents (first frame + last latent
    frame) and the 2x and 4x history latents with theirs."""
    c, g = ctx.config, ctx.grid
    clean, two, four, section = section_indices(ctx)
    made = {"image_embeds": ctx.randn(g.batch, FRAMEPACK_IMAGE_ROWS, c["image_proj_dim"]),
            "indices_latents": section}
    if c.get("has_clean_x_embedder"):
        latents = history_latents(ctx)
        made.update(latents_clean=latents[1], indices_latents_clean=clean, latents_history_2x=latents[2],
                    indices_latents_history_2x=two, latents_history_4x=latents[4], indices_latents_history_4x=four)
    return made


def _helios_inputs(ctx: InputContext) -> dict[str, Any]:
    """What HeliosPipeline passes beside the prompt: the chunk's frame indices and, where the checkpoint packs
    history (has_multi_term_memory_patch), the short (first frame + last latent frame), mid and long history
    latents with theirs."""
    short, mid, long, section = (indices[None] for indices in section_indices(ctx))
    made = {"indices_hidden_states": section}
    if ctx.config.get("has_multi_term_memory_patch"):
        latents = history_latents(ctx)
        made.update(latents_history_short=latents[1], indices_latents_history_short=short,
                    latents_history_mid=latents[2], indices_latents_history_mid=mid,
                    latents_history_long=latents[4], indices_latents_history_long=long)
    return made


def _give_cosmos_its_resize() -> None:
    """diffusers' Cosmos transformer resizes its padding mask with torchvision (`transforms.functional.resize`,
    nearest), which dit-accel does not depend on. Without torchvision its module is given that one call, as
    torchvision runs it on a tensor: torch's nearest-neighbour interpolate (on the pipeline's mask of zeros)."""
    import torch.nn.functional as F
    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):  # torchvision is installed
        return

    def resize(x, size, interpolation="nearest"):
        return F.interpolate(x, size=size, mode="nearest")

    transformer_cosmos.transforms = SimpleNamespace(functional=SimpleNamespace(resize=resize),
                                                    InterpolationMode=SimpleNamespace(NEAREST="nearest"))


def _cosmos_inputs(ctx: InputContext) -> dict[str, Any]:
    """What Cosmos2VideoToWorldPipeline passes its transformer for a video from one image: the latents without
    the condition mask's channel (in_channels counts it), the timestep per latent frame ([B, 1, T, 1, 1]), the
    frame rate, the condition mask (the image's latent frame, the first, conditions; the rest are generated) and
    the padding mask at the video's pixel size (zeros); its resize is given first where torchvision is missing."""
    import torch

    _give_cosmos_its_resize()
    c, g = ctx.config, ctx.grid
    spatial = 8  # the pipeline's vae_scale_factor_spatial (Wan 2.1's VAE)
    return {"hidden_states": ctx.randn(g.batch, c["in_channels"] - 1, g.frames, g.height, g.width),
            "timestep": torch.full((g.batch, 1, g.frames, 1, 1), 0.5, device=ctx.device),
            "fps": 16,  # the pipeline's default
            "condition_mask": (torch.arange(g.frames, device=ctx.device) == 0).to(ctx.dtype)[None, None, :, None, None]
            .expand(g.batch, 1, g.frames, g.height, g.width),
            "padding_mask": torch.zeros(1, 1, g.height * spatial, g.width * spatial, device=ctx.device,
                                        dtype=ctx.dtype)}


def _cosmos25_inputs(ctx: InputContext) -> dict[str, Any]:
    """What Cosmos2_5_PredictBasePipeline passes its transformer: Predict2's arguments (`_cosmos_inputs`: the
    prompt's rows are the `text_width` config names, Cosmos-Reason1's 100352-wide hidden states) without the frame
    rate, so its RoPE runs at the checkpoint's own temporal scale."""
    inputs = _cosmos_inputs(ctx)
    del inputs["fps"]
    return inputs


def _cosmos_predict25(config: dict[str, Any]) -> bool:
    """A Cosmos Predict2.5 checkpoint: its prompt rows come through the cross-attention projection."""
    return bool(config.get("use_crossattn_projection"))


K6_FRAME_RATE = 24.0  # Kandinsky6TI2VAPipeline's default frame_rate
K6_AUDIO_SAMPLE_RATE = 44_100  # MMAudioVAE's sample_rate
K6_AUDIO_HOP = 1024  # MMAudioVAE's latent hop: its mel hop_length 512, downsampled once by 2


def _kandinsky6_audio_rows(frames: int) -> int:
    """The audio latents of `frames` video frames' duration, as Kandinsky6TI2VAPipeline counts them (218 for 121)."""
    return ceil_div(frames * K6_AUDIO_SAMPLE_RATE, int(K6_FRAME_RATE * K6_AUDIO_HOP))


def _kandinsky6_inputs(ctx: InputContext) -> dict[str, Any]:
    """What Kandinsky6TI2VAPipeline passes its transformer for text to video + audio: its latents
    (`_kandinsky_latents`); the audio latents of the clip's duration ([B, rows, in_audio_dim]: 218 rows for 121
    frames at 24 fps); the CLIP pooled vector; and no prompt mask (the pipeline pads every prompt to
    max_sequence_length and passes its mask, but none where the prompt keeps every row, as here). No RoPE
    positions or token types: a text-to-video call passes none."""
    c, b = ctx.config, ctx.grid.batch
    return {"hidden_states": _kandinsky_latents(ctx),
            "audio_hidden_states": ctx.randn(b, ctx.audio_rows, c["in_audio_dim"]),
            "pooled_projections": ctx.randn(b, c["in_text_dim2"]), "encoder_attention_mask": None}


def _anyflow_inputs(ctx: InputContext) -> dict[str, Any]:
    """AnyFlowPipeline's flow-map timesteps, one per latent frame ([B, F]): the source t and the target r the step
    jumps to (the next sigma of its schedule); a Wan image-to-video config's CLIP rows (`wan.image_context`)."""
    import torch

    g = ctx.grid
    return {**wan.image_context(ctx), "timestep": torch.full((g.batch, g.frames), 500.0, device=ctx.device),
            "r_timestep": torch.full((g.batch, g.frames), 250.0, device=ctx.device)}


GENERIC_FAMILIES = (
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
        name="hunyuan-video-framepack", display_name="HunyuanVideo FramePack",
        transformer="HunyuanVideoFramepackTransformer3DModel", pipeline="HunyuanVideoFramepackPipeline",
        presets=presets("HunyuanVideoFramepackTransformer3DModel", "framepack-i2v-hy"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "rope_axes_dim": (16, 24, 24),
                     "text_embed_dim": 256, "pooled_projection_dim": 64, "image_proj_dim": 64},
        text_width="text_embed_dim", guidance="true_cfg_scale", inputs=_framepack_inputs,
        workload_from_video=sectioned("has_clean_x_embedder", FRAMEPACK_IMAGE_ROWS), workload_from_seq_len=no_seq_len,
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
        inputs=_ltx2_inputs, audio_rows=_ltx2_audio_rows,
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
        name="wan-vace", display_name="Wan VACE", transformer="WanVACETransformer3DModel", pipeline="WanVACEPipeline",
        presets=presets("WanVACETransformer3DModel", "wan2.1-vace-14b"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "text_dim": 256},
        inputs=_wan_vace_inputs, vae_stage=wan.vae_stage, check_workload=wan.check_workload,
        text_encoder=wan.TEXT_ENCODER,
    ),
    Family(
        name="chronoedit", display_name="ChronoEdit", transformer="ChronoEditTransformer3DModel",
        pipeline="ChronoEditPipeline", presets=presets("ChronoEditTransformer3DModel", "chronoedit-14b"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "text_dim": 256,
                     "image_dim": 64, "added_kv_proj_dim": 256},
        video=(5, 480, 832), scaled_down_video=(5, 64, 64),
        video_note="ChronoEditPipeline's default edit: 480x832, num_frames forced to 5 without temporal reasoning "
                   "(2 latent frames: the input image's and the edit's)",
        inputs=wan.image_context, check_workload=wan.check_workload, text_encoder=wan.TEXT_ENCODER,
    ),
    Family(
        name="wan-animate", display_name="Wan Animate", transformer="WanAnimateTransformer3DModel",
        pipeline="WanAnimatePipeline", presets=presets("WanAnimateTransformer3DModel", "wan2.2-animate-14b"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "text_dim": 256,
                     "image_dim": 64, "added_kv_proj_dim": 256, "motion_encoder_size": 16,
                     "motion_encoder_channel_sizes": {"4": 32, "8": 32, "16": 32}, "motion_style_dim": 32,
                     "motion_dim": 8, "motion_encoder_dim": 32, "face_encoder_hidden_dim": 64},
        video=(WAN_ANIMATE_SEGMENT, 720, 1280),
        video_note="WanAnimatePipeline's default 720x1280, one segment of its default segment_frame_length (its "
                   "video is as long as the pose video)",
        inputs=_wan_animate_inputs, workload_from_video=wan_animate_segments, workload_from_seq_len=no_seq_len,
        check_workload=wan.check_workload, text_encoder=wan.TEXT_ENCODER,
    ),
    Family(
        name="anyflow", display_name="AnyFlow", transformer="AnyFlowTransformer3DModel",
        pipeline="AnyFlowPipeline", presets=presets("AnyFlowTransformer3DModel"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "text_dim": 256},
        latents="BFCHW", inputs=_anyflow_inputs, check_workload=wan.check_workload, text_encoder=wan.TEXT_ENCODER,
    ),
    Family(
        name="helios", display_name="Helios", transformer="HeliosTransformer3DModel", pipeline="HeliosPipeline",
        presets=presets("HeliosTransformer3DModel", "helios-base"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512, "text_dim": 256,
                     "rope_dim": (24, 20, 20)},
        inputs=_helios_inputs, workload_from_video=sectioned("has_multi_term_memory_patch"),
        workload_from_seq_len=no_seq_len, text_encoder=wan.TEXT_ENCODER,
    ),
    Family(
        name="cosmos", display_name="Cosmos Predict2", transformer="CosmosTransformer3DModel",
        pipeline="Cosmos2VideoToWorldPipeline",
        presets=presets("CosmosTransformer3DModel", "cosmos-predict2-2b-video2world",
                        "cosmos-predict2-14b-video2world"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "text_embed_dim": 256, "adaln_lora_dim": 32},
        text_width="text_embed_dim", vae_factors=(4, 8),  # Wan 2.1's VAE, which the pipeline needs to say them
        inputs=_cosmos_inputs, accepts=lambda config: not _cosmos_predict25(config),
    ),
    Family(
        name="cosmos-predict2.5", display_name="Cosmos Predict2.5", transformer="CosmosTransformer3DModel",
        pipeline="Cosmos2_5_PredictBasePipeline",
        presets=presets("CosmosTransformer3DModel", "cosmos-predict2.5-2b", "cosmos-predict2.5-14b"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "text_embed_dim": 256, "adaln_lora_dim": 32,
                     "crossattn_proj_in_channels": 512, "encoder_hidden_states_channels": 256},
        text_width="crossattn_proj_in_channels", vae_factors=(4, 8),  # Wan 2.1's VAE, as Predict2's
        inputs=_cosmos25_inputs, accepts=_cosmos_predict25,
    ),
    Family(
        name="easyanimate", display_name="EasyAnimate", transformer="EasyAnimateTransformer3DModel",
        pipeline="EasyAnimatePipeline", presets=presets("EasyAnimateTransformer3DModel", "easyanimate-v5.1-12b-zh"),
        scaled_down={"num_attention_heads": 4, "attention_head_dim": 64, "text_embed_dim": 256,
                     "time_embed_dim": 64},
        # encode_prompt pads to its default max_sequence_length, 256, which __call__ does not expose; the VAE
        # factors are AutoencoderKLMagvit's (the pipeline keeps them under names of its own)
        text_width="text_embed_dim", text_rows=256, vae_factors=(4, 8),
    ),
    Family(
        name="kandinsky-5", display_name="Kandinsky 5.0", transformer="Kandinsky5Transformer3DModel",
        pipeline="Kandinsky5T2VPipeline",
        presets=presets("Kandinsky5Transformer3DModel", "kandinsky-5.0-t2v-lite-sft-5s"),
        scaled_down={"model_dim": 256, "ff_dim": 512, "time_dim": 64, "axes_dims": (16, 24, 24), "in_text_dim": 256,
                     "in_text_dim2": 64},
        text_width="in_text_dim", inputs=_kandinsky5_inputs,
        main_stack="visual_transformer_blocks",  # not its 2 text blocks, which see the prompt rows alone
    ),
    Family(
        name="kandinsky-6", display_name="Kandinsky 6", transformer="Kandinsky6Transformer3DModel",
        pipeline="Kandinsky6TI2VAPipeline",
        presets=presets("Kandinsky6Transformer3DModel", "kandinsky-6.0-pro-sft-5s"),
        scaled_down={"model_dim": 256, "ff_dim": 512, "time_dim": 64, "axes_dims": (16, 24, 24),
                     "model_dim_a": 128, "ff_dim_a": 256, "time_dim_a": 64, "axes_dims_a": (16, 24, 24),
                     "in_text_dim": 256, "in_text_dim2": 64},
        text_width="in_text_dim", inputs=_kandinsky6_inputs, audio_rows=_kandinsky6_audio_rows,
        main_stack="visual_transformer_blocks",  # not its 4 + 4 text blocks (the video's, the audio's)
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

"""MiniMax-H3: one packed sequence of text, video and audio rows, self-attention only.

diffusers: `transformer_minimax_h3`. The default preset is the real public config (the public
transformer/config.json). The transformer takes rows, not a latent grid: the packed text, video and audio
rows with their tags, (t, h, w) positions and row indices are irreducibly H3's (`transformer_inputs`), as are
its workloads (audio rows in the seeds' ratio) and its VAE stage. Everything else (the block's inputs: the
packed rows [B, S, 5376], the float32 timestep embedding, the AdaLN table indices, the RoPE; its attention
calls, ranges and FP8 linears) comes from the generic path (`base.BlockAdapter`).
"""
from __future__ import annotations

import math

import torch
from diffusers.models.autoencoders import autoencoder_kl_minimax_h3 as h3_vae

from .base import BlockAdapter, TransformerInputs, Workload, check_video_rows
from .family import Family, Preset
from .ranges import ModuleRange
from .stage_specs import StageSpec, build_on_meta, vae_decode
from .workload import ceil_div

TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2  # `token_tags` values (diffusers' MiniMax-H3 docstring)

H3_CONFIG = {
    "_class_name": "MiniMaxH3Transformer3DModel",
    "num_attention_heads": 56, "attention_head_dim": 128, "hidden_size": 5376, "num_layers": 50,
    "num_refiner_layers": 2, "ffn_dim": 14336, "in_channels": 24, "audio_in_channels": 32,
    "patch_size": [1, 2, 2], "text_dim": 5120, "freq_dim": 256, "time_embed_hidden_dim": 5376,
    "time_embed_dim": 2688, "rope_freq_dim": 16, "rope_theta": 10000.0, "norm_eps": 1e-05,
    "qk_norm_eps": 1e-05, "final_norm_eps": 1e-05,
}

# the public pipeline's vae/config.json (a copy: tests/data/h3_vae_config.json) but `latents_mean`/`latents_std`, which
# the pipeline applies before decoding and the decode itself never reads.
H3_VAE_CONFIG = {
    "_class_name": "AutoencoderKLMiniMaxH3", "in_channels": 3, "out_channels": 3, "latent_channels": 24,
    "block_out_channels": [128, 256, 256, 512, 512, 1024], "layers_per_block": 2,
    "spatial_downsample_factors": [2, 2, 2, 2, 1, 1], "temporal_downsample_factors": [1, 2, 2, 1, 1, 1],
    "norm_num_groups": 32, "norm_eps": 1e-06, "spatial_padding_mode": "reflect", "decoder_num_layers": 36,
    "decoder_num_attention_heads": 32, "decoder_attention_head_dim": 64, "decoder_num_register_tokens": 4,
    "decoder_ffn_mult": 4, "decoder_rope_theta": 100.0, "decoder_rope_dim_ratio": 0.75, "decoder_norm_eps": 1e-05,
    "clip_length": 17, "token_drop": 3,
}
# A CPU run's VAE: the same decoder layout (heads of 64, tiling, clip chunking), 2 layers of 2 heads, on 7
# latent frames of 4 x 4 (one clip, one tile).
H3_VAE_SCALED_DOWN = {"decoder_num_layers": 2, "decoder_num_attention_heads": 2}
SCALED_DOWN_LATENTS = (7, 4, 4)
TEXT_ENCODER = "Qwen3-VL (MiniMaxH3ModularPipeline's text_encoder, Qwen3VLForConditionalGeneration)"

# The seeds' case: 121 frames at 704x1280 give 31 latent frames x 22 x 40 = 27280 video rows; with
# 2480 audio rows and 512 text rows the packed sequence is 30272 rows.
DEFAULT_TEXT_ROWS = 512
AUDIO_ROWS_PER_VIDEO_ROW = 2480 / 27280
VAE_SPATIAL, VAE_TEMPORAL = 16, 4  # the public vae/config.json: 4 spatial /2 stages, 2 temporal /2 stages


TIMESTEPS = 1  # distinct noise levels in the packed sequence (rows of the AdaLN table / 3)


def workload_from_seq_len(adapter: BlockAdapter, seq_len: int, batch: int) -> Workload:
    text = min(DEFAULT_TEXT_ROWS, seq_len // 16)  # no text rows in very short sequences
    audio = int((seq_len - text) * AUDIO_ROWS_PER_VIDEO_ROW / (1 + AUDIO_ROWS_PER_VIDEO_ROW))
    rows = {"video": seq_len - text - audio, "audio": audio, "text": text}
    return Workload(seq_len, batch, rows, f"--seq-len {seq_len} (video/audio/text rows in the seeds' ratio)")


def workload_from_video(adapter: BlockAdapter, frames: int, height: int, width: int, batch: int) -> Workload:
    pt, ph, pw = adapter.config["patch_size"]
    grid = ((frames - 1) // VAE_TEMPORAL // pt + 1, height // VAE_SPATIAL // ph, width // VAE_SPATIAL // pw)
    video = grid[0] * grid[1] * grid[2]
    check_video_rows(video, height, width, VAE_SPATIAL * ph)
    audio = round(video * AUDIO_ROWS_PER_VIDEO_ROW)
    rows = {"video": video, "audio": audio, "text": DEFAULT_TEXT_ROWS}
    return Workload(sum(rows.values()), batch, rows,
                    f"{frames} frames {height}x{width} (audio rows assumed in the seeds' ratio)", grid)


def _grid(workload: Workload) -> tuple[int, int, int]:
    """(frames, height, width) of the video rows' RoPE grid: the video's own, or for --seq-len workloads a
    22 x 40 patch frame as at 704x1280."""
    if workload.video_grid:
        return workload.video_grid
    video = workload.rows["video"]
    width = min(40, video)
    height = min(22, ceil_div(video, width))
    return ceil_div(video, height * width), height, width


def _packed_layout(workload: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_tags [S], position_ids [S, 3]) of the packed rows, on the CPU.

    Packing order: text, then video, then audio; video rows on the (t, h, w) grid, text and audio rows
    along t."""
    rows = workload.rows
    tags = torch.cat([
        torch.full((rows["text"],), TAG_TEXT), torch.full((rows["video"],), TAG_VIDEO),
        torch.full((rows["audio"],), TAG_AUDIO),
    ]).long()
    frames, height, width = _grid(workload)
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    video_pos = torch.stack([t.flatten(), h.flatten(), w.flatten()], dim=1)[: rows["video"]]
    text_pos = torch.arange(rows["text"]).unsqueeze(1) * torch.tensor([1, 0, 0])
    audio_pos = torch.arange(rows["audio"]).unsqueeze(1) * torch.tensor([1, 0, 0])
    return tags, torch.cat([text_pos, video_pos, audio_pos])


def transformer_inputs(adapter: BlockAdapter, workload: Workload, device: torch.device, dtype: torch.dtype,
                       generator: torch.Generator | None) -> TransformerInputs:
    """The packed pass the block's rows come from: patchified video rows [B, video, in_channels x patch], audio
    latent rows, text-encoder rows, one timestep, and the tags, (t, h, w) positions and row indices of the
    block's layout. The transformer takes rows, not a latent grid, so any workload's rows are laid out exactly:
    S is the workload's."""
    c, rows, batch = adapter.config, workload.rows, workload.batch
    video_channels = c["in_channels"] * c["patch_size"][0] * c["patch_size"][1] * c["patch_size"][2]

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    tags, position_ids = _packed_layout(workload)
    text, video = rows["text"], rows["video"]
    kwargs = {
        "hidden_states": randn(batch, video, video_channels),
        "audio_hidden_states": randn(batch, rows["audio"], c["audio_in_channels"]),
        "encoder_hidden_states": randn(batch, text, c["text_dim"]),
        "timestep": torch.full((TIMESTEPS,), 0.5, device=device),
        "timestep_indices": torch.zeros(workload.seq_len, dtype=torch.long, device=device),
        "token_tags": tags.to(device),
        "position_ids": position_ids.to(device),
        "text_indices": torch.arange(text, device=device),
        "video_indices": torch.arange(text, text + video, device=device),
        "audio_indices": torch.arange(text + video, workload.seq_len, device=device),
        "return_dict": False,
    }
    frames, height, width = _grid(workload)
    layout = (f"{text} text + {video} video + {rows['audio']} audio rows, the video rows on a {frames} x {height} "
              f"x {width} patch grid")
    return TransformerInputs(kwargs, workload.seq_len, layout)


def vae_stage(adapter: BlockAdapter, workload: Workload, scaled_down: bool) -> StageSpec:
    """AutoencoderKLMiniMaxH3.decode of the latents the workload's video rows come from (the
    patch grid times the patch size: 31 x 44 x 80 for the seeds' 121 frames at 704x1280), tiled
    and clip-chunked as the released pipeline decodes; only post_quant_conv and the ViT decoder
    are built (decode never runs the encoder)."""
    config = {**H3_VAE_CONFIG, **(H3_VAE_SCALED_DOWN if scaled_down else {})}
    if scaled_down:
        frames, height, width = SCALED_DOWN_LATENTS
    else:
        pt, ph, pw = adapter.config["patch_size"]
        grid = _grid(workload)
        frames, height, width = grid[0] * pt, grid[1] * ph, grid[2] * pw
    batch, channels = workload.batch, config["latent_channels"]
    layers, heads = config["decoder_num_layers"], config["decoder_num_attention_heads"]
    head_dim = config["decoder_attention_head_dim"]
    dim = heads * head_dim
    # Decode's own geometry (AutoencoderKLMiniMaxH3.__init__, _decode and _split_tiles): clips of
    # ceil(17 / 4) = 5 latent frames plus 2 of overlap, spatial tiles of 256 px overlapping >= 64 px.
    chunk = math.ceil(config["clip_length"] / VAE_TEMPORAL)
    tokens = frames + config["token_drop"]
    clips = ceil_div(tokens, chunk) - 1
    clip_frames = chunk + (-config["token_drop"]) % chunk
    tiles = _tiles(height * VAE_SPATIAL) * _tiles(width * VAE_SPATIAL)
    tile_latent = min(height, 16) * min(width, 16)
    rows_per_tile = clip_frames * tile_latent + config["decoder_num_register_tokens"] + 1
    pixels = 3 * frames * VAE_TEMPORAL * height * width * VAE_SPATIAL ** 2

    def activation_bytes(e: int) -> int:
        # The decoded video, its clips' tiles and the blends that stitch them (about 4 copies), plus one
        # tile's decoder forward (float32 residual stream, ~24 widths a row).
        return 4 * pixels * e + 24 * batch * rows_per_tile * dim * 4

    def latents(frame_count):
        def make_inputs(device, dtype, generator):
            z = torch.randn(batch, channels, frame_count, height, width, generator=generator, device=device)
            return {"z": z.to(dtype)}
        return make_inputs

    block = "model.decoder.transformer_blocks.{}."
    per_block = lambda *names: tuple(block.format(i) + n for i in range(layers) for n in names)  # noqa: E731
    ranges = (
        ModuleRange("attention (other: RoPE, layout)", modules=per_block("attn")),
        ModuleRange("qkv projection", modules=per_block("attn.to_q", "attn.to_k", "attn.to_v")),
        ModuleRange("qk-norm", modules=per_block("attn.norm_q", "attn.norm_k")),
        ModuleRange("attention core", functions=((h3_vae.__name__, "dispatch_attention_fn"),)),
        ModuleRange("output projection", modules=per_block("attn.to_out.0")),
        ModuleRange("ffn", modules=per_block("ff")),
        ModuleRange("norms", modules=per_block("norm1", "norm2") + ("model.decoder.norm_out",)),
        ModuleRange("patch projections in/out", modules=("model.post_quant_conv", "model.decoder.proj_in",
                                                         "model.decoder.proj_out")),
    )
    return StageSpec(
        "vae", f"AutoencoderKLMiniMaxH3 (ViT decoder: {layers} layers, {heads} heads x {head_dim})",
        "scaled down for the CPU from the public MiniMax-H3 vae/config.json" if scaled_down else
        "the public MiniMax-H3 vae/config.json (embedded)",
        f"latents {batch} x {channels} x {frames} x {height} x {width} -> video at "
        f"{height * VAE_SPATIAL}x{width * VAE_SPATIAL}: {clips} clip(s) x {tiles} tile(s), "
        f"{rows_per_tile} rows per decoder call",
        lambda: build_on_meta(h3_vae.AutoencoderKLMiniMaxH3, config, drop=("encoder", "quant_conv")),
        tuple(h3_vae.AutoencoderKLMiniMaxH3._keep_in_fp32_modules), latents(frames), vae_decode,
        attention_routed=True,
        attention_note=(f"the decoder's attention processor (MiniMaxH3VideoAttnProcessor) calls diffusers' "
                        f"dispatch_attention_fn: each recipe's attention backend runs in it ({heads} heads x "
                        f"{head_dim}, {rows_per_tile} rows); fused RoPE, FP8 linears and compile are not applied"),
        activation_bytes=activation_bytes,
        activation_source="the decoded video ~4 times over plus one tile's forward (not calibrated on a GPU)",
        attention_flops=4.0 * clips * tiles * layers * batch * rows_per_tile ** 2 * dim,
        module_ranges=ranges, body_label="tiling, clip chunking, blending, residuals (decode body)",
        # Every clip decodes clip_frames latent frames (the last one padded), and latents of clip_frames
        # frames decode as exactly one clip: the profiler attributes one, its kernels x clips (its events
        # for the whole decode, ~120k kernels at full size, would cost more than the decode).
        notes=(f"breakdown: one clip of {clips} ({clip_frames} latent frames, {tiles} tiles) profiled, its "
               f"kernels x {clips}; the time is the whole decode's",) if clips > 1 else (),
        profile_unit=latents(clip_frames) if clips > 1 else None, profile_parts=clips)


def _tiles(length: int, tile: int = 256, overlap: int = 64) -> int:
    """Tiles AutoencoderKLMiniMaxH3._split_tiles lays over `length` pixels (its default tile geometry)."""
    if tile >= length:
        return 1
    count = math.ceil(length / tile)
    while tile * count - overlap * (count - 1) < length:
        count += 1
    return count


FAMILY = Family(
    name="minimax-h3", display_name="MiniMax-H3", transformer="MiniMaxH3Transformer3DModel",
    pipeline="MiniMaxH3ModularPipeline",
    presets={"h3": Preset(H3_CONFIG, "the public MiniMax-H3 transformer/config.json")},
    scaled_down={"num_attention_heads": 4, "attention_head_dim": 128, "hidden_size": 384, "ffn_dim": 1024,
                 "time_embed_dim": 192, "time_embed_hidden_dim": 384, "text_dim": 256},
    text_rows=DEFAULT_TEXT_ROWS, video=(121, 704, 1280), vae_factors=(VAE_TEMPORAL, VAE_SPATIAL),
    guidance=None, guidance_note=("MiniMax-H3 is guidance-distilled: diffusers' MiniMaxH3ModularPipeline runs one "
                                  "transformer forward per step"),
    workload_from_seq_len=workload_from_seq_len, workload_from_video=workload_from_video,
    transformer_inputs=transformer_inputs, default_seq_len=30272, vae_stage=vae_stage, text_encoder=TEXT_ENCODER,
    audio_skip_reason=("MiniMax-H3's audio VAE config (audio_vae/config.json, AutoencoderKLMiniMaxH3Audio) is not "
                       "among the public configs at hand and its class defaults are not known to be the released "
                       "model's: not measured, not in the total"),
    fused_rope=True,
)

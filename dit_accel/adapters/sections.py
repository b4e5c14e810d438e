"""Pipelines that make a video in sections, each denoised by its own loop: HunyuanVideo FramePack and Helios
(sections behind the history their checkpoints pack ahead of them), Wan Animate (segments behind the reference
image). A pass is one section; `Workload.sections` says how many make the video."""
from __future__ import annotations

from typing import Any

from ..errors import UserError
from .family import InputContext
from .workload import Workload, ceil_div, patch_grid, patch_sizes


# HunyuanVideo FramePack and Helios make a video as sections of SECTION_WINDOW latent frames (33 frames), each
# denoised by its own loop behind the history their checkpoints pack ahead of the section's rows: the first frame
# and the last latent frame at the patch's size (2 frames), 2 frames at twice it and 16 at four times it
# (FramePack's history_sizes [1, 2, 16] beside its first frame, Helios' [16, 2, 1] beside its).
SECTION_WINDOW = 9  # both pipelines' default latent_window_size / num_latent_frames_per_chunk
HISTORY_FRAMES = {1: 2, 2: 2, 4: 16}  # history latent frames by their downsampling, as both pack them


def history_rows(patch: tuple[int, int, int], height: int, width: int) -> int:
    """Rows the history adds ahead of a section on `height` x `width` latents: each part through a patch
    embedding of its downsampling times the patch (the coarser ones padded to whole kernels)."""
    pt, ph, pw = patch
    return sum(ceil_div(frames, k * pt) * ceil_div(height, k * ph) * ceil_div(width, k * pw)
               for k, frames in HISTORY_FRAMES.items())


def section_workload(adapter, height: int, width: int, batch: int, latent_frames: int, sections: int,
                     history: int, context: dict[str, int], source: str) -> Workload:
    """One section's pass of a sectioned pipeline: `latent_frames` latent frames at `height` x `width`, behind
    `history` rows packed ahead of them, with `context` rows beside the prompt's; `sections` such passes make the
    video."""
    grid = patch_grid(adapter.config, adapter.facts.vae_factors[1], latent_frames, height, width)
    video = grid[0] * grid[1] * grid[2]
    rows = {"video": video, **({"history": history} if history else {}), **context, "text": adapter.facts.text_rows}
    return Workload(video + history, batch, rows, source, grid, sections)


def sectioned(history_key: str, image_rows: int = 0):
    """`workload_from_video` of FramePack and Helios: one section's pass (its SECTION_WINDOW latent frames, and
    the history rows where the config's `history_key` packs them; `image_rows` of image context beside the
    prompt's), and how many sections make the video (each (SECTION_WINDOW - 1) x the VAE's temporal factor + 1
    frames, as both pipelines count them)."""
    def workload(adapter, frames: int, height: int, width: int, batch: int) -> Workload:
        temporal, spatial = adapter.facts.vae_factors
        history = (history_rows(patch_sizes(adapter.config), height // spatial, width // spatial)
                   if adapter.config.get(history_key) else 0)
        section = (SECTION_WINDOW - 1) * temporal + 1
        sections = max(1, ceil_div(frames, section))
        source = (f"{frames} frames {height}x{width}: {sections} section(s) of {section} frames, each pass behind "
                  f"{history} history rows")
        return section_workload(adapter, height, width, batch, SECTION_WINDOW, sections, history,
                                {"image": image_rows} if image_rows else {}, source)
    return workload


WAN_ANIMATE_SEGMENT = 77  # WanAnimatePipeline's default segment_frame_length
WAN_ANIMATE_OVERLAP = 1  # its default prev_segment_conditioning_frames: the frames a segment shares with the last


def wan_animate_segments(adapter, frames: int, height: int, width: int, batch: int) -> Workload:
    """WanAnimatePipeline makes its video as segments of WAN_ANIMATE_SEGMENT frames, each denoised by its own
    loop, each after the first conditioned on the last frame of the one before; a pass is one segment's 20 latent
    frames behind the reference image's, which the pipeline puts ahead of them (a shorter pose video is padded to
    a whole segment). The video's frames say how many segments there are."""
    temporal, _ = adapter.facts.vae_factors
    latent = (WAN_ANIMATE_SEGMENT - 1) // temporal + 1
    sections = max(1, ceil_div(frames - WAN_ANIMATE_OVERLAP, WAN_ANIMATE_SEGMENT - WAN_ANIMATE_OVERLAP))
    source = (f"{frames} frames {height}x{width}: {sections} segment(s) of {WAN_ANIMATE_SEGMENT} frames, each pass "
              f"its {latent} latent frames behind the reference image's")
    return section_workload(adapter, height, width, batch, latent + 1, sections, 0, {}, source)


def no_seq_len(adapter, seq_len: int, batch: int) -> Workload:
    raise UserError(f"{adapter.display_name} makes its video as sections, each pass one section behind what its "
                    f"pipeline packs ahead of it: give the video's size with --frames, --height and --width, not "
                    f"--seq-len")


def section_indices(ctx: InputContext):
    """Frame indices of the history parts (full-size, 2x, 4x) and of the section. Their values set only RoPE
    phases, not the work, so one layout serves both pipelines, which order the history and place the section
    each their own way: the first frame, the history, then the section."""
    import torch

    sizes = [1, *HISTORY_FRAMES.values()]
    sizes[1] -= 1  # the first frame is one of the 2 full-size history frames
    parts = torch.arange(sum(sizes) + ctx.grid.frames, device=ctx.device).split([*sizes, ctx.grid.frames])
    first, one, two, four, section = parts
    return torch.cat([first, one]), two, four, section


def history_latents(ctx: InputContext) -> dict[int, Any]:
    """The history latents by their downsampling (HISTORY_FRAMES), on the section's latent grid."""
    c, g = ctx.config, ctx.grid
    return {k: ctx.randn(g.batch, c["in_channels"], frames, g.height, g.width) for k, frames in HISTORY_FRAMES.items()}

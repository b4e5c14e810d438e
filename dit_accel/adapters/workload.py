"""The pass a block is part of (`Workload`), the whole transformer's inputs for it (`TransformerInputs`), and the
patch arithmetic between a video and its rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError


@dataclass(frozen=True)
class Workload:
    """The pass one block is part of: `batch` sequences of `seq_len` rows each (the video's rows; for a packed
    family, all its rows).

    `rows` splits the pass by modality (video / text / audio, the history a sectioned pipeline packs ahead of
    its section) and `source` says how it was chosen (from --seq-len or from a video size), so reports can state
    it. `video_grid` is the (frames, height, width) patch grid of the video rows when a video size gave it.
    `sections`: how many such passes make the video at each step of the schedule, for a pipeline that makes it
    as sections, each denoised by its own loop (HunyuanVideo FramePack, Helios, Wan Animate); 1 for the rest.
    """

    seq_len: int
    batch: int
    rows: dict[str, int]
    source: str
    video_grid: tuple[int, int, int] | None = None
    sections: int = 1

    def as_dict(self) -> dict:
        return {"seq_len": self.seq_len, "batch": self.batch, "rows": dict(self.rows), "source": self.source,
                "video_grid": list(self.video_grid) if self.video_grid else None, "sections": self.sections}

    @property
    def key(self) -> tuple:
        """The workload as a hashable value (captures are kept by it)."""
        return (self.seq_len, self.batch, tuple(sorted(self.rows.items())), self.source, self.video_grid,
                self.sections)


@dataclass(frozen=True)
class TransformerInputs:
    """Keyword arguments of the whole transformer's forward, and the sequence they make.

    `seq_len` is the video rows the transformer patchifies from them (and the history a sectioned pipeline packs
    ahead of them): the workload's own S when its rows can be laid out exactly, else the nearest video grid's
    (`layout` says which).
    """

    kwargs: dict[str, Any]
    seq_len: int
    layout: str


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, in integers."""
    return -(-a // b)


def patch_sizes(config: dict[str, Any]) -> tuple[int, int, int]:
    """(frames, height, width) of one patch: a config's `patch_size` list, or an int with `patch_size_t`."""
    patch = config.get("patch_size", 1)
    if isinstance(patch, (list, tuple)):
        return tuple(int(p) for p in patch)
    return int(config.get("patch_size_t") or 1), int(patch), int(patch)


def patch_grid(config: dict[str, Any], spatial: int, latent_frames: int, height: int,
               width: int) -> tuple[int, int, int]:
    """The (frames, height, width) patch grid of `latent_frames` latent frames of a `height` x `width` video under
    the VAE's `spatial` compression; UserError where it gives no row."""
    pt, ph, pw = patch_sizes(config)
    grid = (latent_frames // pt, height // spatial // ph, width // spatial // pw)
    check_video_rows(grid[0] * grid[1] * grid[2], height, width, spatial * max(ph, pw))
    return grid


def check_video_rows(video_rows: int, height: int, width: int, pixels_per_row: int) -> None:
    """A video workload must give at least one row: `pixels_per_row` is the VAE stride times the patch."""
    if video_rows < 1:
        raise UserError(f"a {height}x{width} video gives no tokens: height and width must be at least "
                        f"{pixels_per_row} pixels")



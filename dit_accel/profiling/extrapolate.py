"""From one block of each stack to the whole model: the sum over stacks of blocks x block time, plus what runs
outside the blocks, per denoising pass; passes per step (classifier-free guidance); steps per video."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..loading.offload import StreamedRun


@dataclass(frozen=True)
class StackTime:
    """A block stack of the model: its blocks, and the measured median of one of them."""

    stack: str
    num_blocks: int
    block_ms: float


@dataclass(frozen=True)
class Extrapolation:
    """Time of a whole video's denoising, built from one measured block of each block stack.

    stacks: each stack's blocks and block time (one for most models; HunyuanVideo's dual- and single-stream
    blocks are two).  outside_ms: time per pass of the parts outside the block stacks (embeddings, refiner,
    output heads), measured or stated by the user.
    """

    stacks: tuple[StackTime, ...]
    outside_ms: float
    outside_source: str
    steps: int
    guidance_passes: int
    passes_source: str = "stated with --guidance-passes"
    steps_source: str = "stated with --steps"

    @property
    def num_blocks(self) -> int:
        return sum(s.num_blocks for s in self.stacks)

    @property
    def blocks_ms(self) -> float:
        """Every block of every stack: the sum over stacks of blocks x that stack's block time."""
        return sum(s.num_blocks * s.block_ms for s in self.stacks)

    @property
    def pass_ms(self) -> float:
        """One transformer forward: every block, plus the parts outside the blocks."""
        return self.blocks_ms + self.outside_ms

    @property
    def step_ms(self) -> float:
        return self.guidance_passes * self.pass_ms

    @property
    def video_s(self) -> float:
        return self.steps * self.step_ms / 1e3

    def assumptions(self) -> list[str]:
        if len(self.stacks) == 1:
            blocks = f"every block costs the measured block: {self.num_blocks} x {self.stacks[0].block_ms:.2f} ms"
        else:
            blocks = "every block costs its stack's measured block: " + " + ".join(
                f"{s.num_blocks} x {s.block_ms:.2f} ms ({s.stack})" for s in self.stacks)
        return [
            blocks,
            f"outside the blocks: {self.outside_ms:.2f} ms per pass ({self.outside_source})",
            f"{self.guidance_passes} transformer pass(es) per step ({self.passes_source})",
            f"{self.steps} denoising steps ({self.steps_source})",
        ]

    def as_dict(self) -> dict:
        return {**asdict(self), "stacks": [asdict(s) for s in self.stacks], "num_blocks": self.num_blocks,
                "blocks_ms": self.blocks_ms, "pass_ms": self.pass_ms, "step_ms": self.step_ms, "video_s": self.video_s,
                "assumptions": self.assumptions()}


@dataclass(frozen=True)
class WholeVideo:
    """One recipe's whole video: the pipeline's stages around the extrapolated denoising.

    stage_s: stage key ("text", "vae", "audio") -> seconds measured, or None when the stage was
    not measured (asked for and skipped, or not asked for: `stage_notes` says which and why).
    """

    recipe: str
    denoising_s: float
    stage_s: dict[str, float | None]
    stage_notes: dict[str, str]

    @property
    def total_s(self) -> float:
        """Denoising plus every measured stage (the ones not measured count 0: see stage_notes)."""
        return self.denoising_s + sum(v for v in self.stage_s.values() if v is not None)

    def as_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


@dataclass(frozen=True)
class CachedVideo:
    """`--validate model --cache`: the whole video, every step and pass, under a step cache, timed once after a
    warm-up of the cache's first cycle (its steps until a computed one followed a skipped one: every path it takes,
    compiled). computed_per_step: the hooked modules' real forwards each step, of `hooked_modules` a pass;
    graphs_compiled: what torch.compile made during the timed video (0: no recompilation from step to step)."""

    cache: str
    steps: int
    passes_per_step: int
    warmup_steps: int
    seconds: float
    hooked_modules: int
    computed_per_step: tuple[int, ...]
    graphs_compiled: int

    @property
    def pass_ms(self) -> float:
        """A pass averaged over the video."""
        return 1e3 * self.seconds / (self.steps * self.passes_per_step)

    @property
    def work_computed(self) -> float:
        """The share of the hooked modules' forwards that ran (1.0: the cache skipped nothing)."""
        return sum(self.computed_per_step) / (self.steps * self.passes_per_step * self.hooked_modules)

    def as_dict(self) -> dict:
        return {**asdict(self), "pass_ms": self.pass_ms, "work_computed": self.work_computed}


@dataclass(frozen=True)
class Validation:
    """`--validate`: one measured pass against the extrapolation from the one block.

    `--validate N`: N blocks chained on the block's inputs, extrapolated as N x block_ms.
    `--validate model`: the whole transformer (its blocks inside it, with the parts outside them)
    on the pass the block is one block of, extrapolated as num_blocks x block_ms + outside_ms (with several
    stacks, block_ms is their blocks' mean: the blocks' time over their count);
    `outside_source` says where outside_ms came from, `pass_seq_len` and `pass_layout` the rows
    that pass ran (TransformerInputs). peak_memory_bytes: the GPU's max allocated over the timed
    passes, less what the profiling session held beside the pass (`validate.session_bytes_used`; None on the CPU).
    `--validate model --cache` (`video`): measured_ms is a pass averaged over the whole video under the cache, and
    the ratio to the uncached extrapolation is what the cache kept of the work (no error: plan --cache predicts it).
    """

    chained_blocks: int
    distinct_blocks: int  # blocks held in memory; fewer than chained when they do not all fit
    measured_ms: float
    block_ms: float
    outside_ms: float = 0.0
    outside_source: str | None = None  # None: blocks only (`--validate N`)
    pass_seq_len: int | None = None
    pass_layout: str | None = None
    streamed: StreamedRun | None = None  # --offload stream: the blocks came from host memory
    peak_memory_bytes: int | None = None
    video: CachedVideo | None = None

    @property
    def whole_model(self) -> bool:
        return self.outside_source is not None

    @property
    def extrapolated_ms(self) -> float:
        return self.chained_blocks * self.block_ms + self.outside_ms

    @property
    def residency(self) -> str:
        return "streamed" if self.streamed else "resident"

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.extrapolated_ms

    @property
    def error_pct(self) -> float | None:
        return None if self.video else 100.0 * (self.ratio - 1.0)

    def as_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k not in ("streamed", "video")},
                "whole_model": self.whole_model, "residency": self.residency, "extrapolated_ms": self.extrapolated_ms,
                "ratio": self.ratio, "error_pct": self.error_pct,
                "streamed": self.streamed.as_dict() if self.streamed else None,
                "video": self.video.as_dict() if self.video else None}

"""The sm90 kernel's configuration: one frozen value (`Sm90Config`), validated here, named by a short label.

`tuning.sm90_config` gives the one fp8_attention runs for a head dim, SM count and key length; the kernel
(`kernel_sm90.Fp8AttentionSm90`), the compile (`compile.compile_fp8_attention`), the host plans
(`interface._plan`) and the check scripts take it as it is. No cutlass here: the host path and the scripts
read it without the DSL. Measurements behind each choice: docs/kernels.md.
"""
import re
from dataclasses import dataclass

from .layout import KEYS

# Registers per consumer thread by consumer warpgroup count. setmaxnreg only moves registers inside the
# CTA's launch allocation (threads x launch registers: 384 x 168 = 64512 with two consumer warpgroups,
# 512 x 128 = 65536 with three), and an increase that does not fit waits forever:
# 128 * 24 + 256 * 240 = 64512 and 128 * 24 + 384 * 160 = 64512 fit (24: the producer's, `kernel_sm90`).
CONSUMER_REGS = {2: 240, 3: 160}
# Consumer warpgroups by head dim when not given: three at D = 64 (192-row tiles; +15-17% at
# S = 30272), two at D = 128 (with three, its overlapped loop's two-level accumulators do not fit
# 160 registers: 572 B of spills).
DEFAULT_CONSUMER_WARPGROUPS = {64: 3, 128: 2}
# A configuration's label: "NxS[s][p[Q]][r][eK][wW]" (`Sm90Config.label`).
LABEL_GRAMMAR = "NxS[s][p[Q]][r][i][eK][wW]"
_LABEL = re.compile(r"(\d+)x(\d+)(s?)(p(\d?))?(r?)(i?)(?:e(\d+))?(?:w(\d))?")


@dataclass(frozen=True)
class Sm90Config:
    """What one sm90 kernel build is, beside its head dim, output dtype and LSE choice. The defaults are
    the constructor's: 128-key blocks, two stages, two-level P.V, one CTA per tile; what fp8_attention
    runs on top of them per head dim and key length is `tuning.sm90_config`'s."""

    # Keys per block, a multiple of the 32-key wgmma k-block (128 to 224 measured).
    tile_n: int = 128
    # Depth of the K and V smem rings (one full and one empty mbarrier per stage).
    num_stages: int = 2
    # Hopper's FP8 wgmma keeps only ~14 mantissa bits in its internal accumulation, so O
    # accumulated by the tensor core over 30k keys drifts (measured: 1.5% vs the emulation
    # at S=30272, against 0.3-0.6% at S<=4096). two_level_pv: each block's P.V goes into a
    # zero-initialised accumulator and is added to O in fp32 by the FMA units. On the H3
    # block's own q, k, v (profile-block --compare-attn) single-level accumulation gave 18%
    # attention error against 0.34% two-level: keep two_level_pv on for real activations.
    two_level_pv: bool = True
    # The MUFU unit does 16 exp2/clk/SM, which at D=128 is as busy as the FP8 tensor core;
    # the exp2s of the first fma_exp2_tiles n8 tiles of each row (2 of the row's 2*N/8
    # values per thread each) run as a polynomial on the FMA pipe instead (FA4's trick).
    # Measured: no gain here, so off by default.
    # At least one tile stays on the MUFU: the polynomial's clamp turns NaN into ~0, and the
    # MUFU values are what carry a NaN head (NaN descale) through to its output.
    fma_exp2_tiles: int = 0
    # Each consumer warpgroup owns 64 query rows; None: the head dim's (DEFAULT_CONSUMER_WARPGROUPS).
    # Three (192-row tiles, FA3's choice for D = 64) put three consumer warps on each SM sub-partition
    # to hide the softmax's latency, at 160 registers each; their GEMMs are not ping-ponged (the
    # named-barrier scheme is for two).
    consumer_warpgroups: int | None = None
    # 0 launches one CTA per (query tile, b*h). Otherwise that many CTAs, or one per tile where there
    # are fewer tiles (the device's SM count: one CTA fits an SM), each walk tiles blockIdx,
    # blockIdx + grid, ... (`tile_scheduler`); the consumers free Q after a tile's last S, so the
    # producer loads the next tile's Q and first K/V blocks during the tile's last P.V and epilogue
    # instead of after a CTA launch.
    persistent_ctas: int = 0
    # 2 (persistent only): the next tile's Q loads into the other stage as soon as the producer
    # reaches it (after that tile's first K finds a free stage, near this tile's end), instead of
    # after both consumer warpgroups have finished this tile's key loop.
    q_stages: int = 1
    # The row sums from the tensor core, as P times a constant 8 x N e4m3 tile (keys x [1, 0, ..., 0])
    # in the same wgmma group as P.V, instead of 64 FADDs per thread and key block. They become sums of
    # the e4m3-rounded P that O's numerator uses (the emulation's `rounded_row_sum`). Two-level only:
    # that sum is folded like O.
    pv_row_sum: bool = False
    # Q and K as int8 codes with a scale per group of the rows one thread holds (prep's INT8 contract) and
    # S = Q K^T an s8 x s8 -> s32 wgmma, instead of e4m3 with a scale per head: 3.8% error on N(0,1) q/k/v
    # against 5.3% (docs/notes/qk-quantization.md). 128-key blocks (a key scale per 64-key half and thread)
    # and every exp2 on the MUFU.
    qk_int8: bool = False

    def __post_init__(self):
        if self.tile_n % KEYS != 0:
            raise ValueError("tile_n must be a multiple of the 32-key wgmma k-block")
        if self.consumer_warpgroups is not None and self.consumer_warpgroups not in CONSUMER_REGS:
            raise ValueError(f"consumer_warpgroups must be one of {tuple(CONSUMER_REGS)}")
        if not 0 <= self.fma_exp2_tiles < self.tile_n // 8:
            raise ValueError(f"fma_exp2_tiles must be in 0..{self.tile_n // 8 - 1}")
        ctas = self.persistent_ctas
        if isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 0:
            raise ValueError(f"persistent_ctas must be an int >= 0 (the device's SM count), got {ctas!r}")
        if self.q_stages not in (1, 2) or (self.q_stages == 2 and ctas == 0):
            raise ValueError("q_stages must be 1, or 2 with persistent_ctas")
        if self.pv_row_sum and (not self.two_level_pv or self.tile_n != 128):
            raise ValueError("pv_row_sum needs two_level_pv and 128-key blocks (128-byte rows of its ones tile)")
        if self.qk_int8 and (self.tile_n != 128 or self.fma_exp2_tiles):
            raise ValueError("qk_int8 needs 128-key blocks (two 64-key scales) and fma_exp2_tiles = 0")

    def warpgroups(self, head_dim: int) -> int:
        """Consumer warpgroups at this head dim: the given count, else the head dim's default."""
        return self.consumer_warpgroups or DEFAULT_CONSUMER_WARPGROUPS[head_dim]

    def label(self) -> str:
        """The name "NxS[s][p[Q]][r][i][eK][wW]": tile_n N keys per block, S stages; "s" single-level P.V (the tensor
        core accumulates it across all blocks); "p" persistent CTAs ("p2": with two Q stages; the label
        does not hold the CTA count); "r" the tensor core's row sums; "i" INT8 Q/K; "eK" K n8 tiles of exp2s
        per row on the FMA pipe; "wW" W consumer warpgroups (none: the head dim's default). E.g. 128x2,
        192x2s, 128x2pr, 128x2i."""
        return (f"{self.tile_n}x{self.num_stages}" + ("" if self.two_level_pv else "s")
                + ("p" + ("" if self.q_stages == 1 else str(self.q_stages)) if self.persistent_ctas else "")
                + ("r" if self.pv_row_sum else "")
                + ("i" if self.qk_int8 else "")
                + (f"e{self.fma_exp2_tiles}" if self.fma_exp2_tiles else "")
                + (f"w{self.consumer_warpgroups}" if self.consumer_warpgroups else ""))

    @classmethod
    def parse(cls, label: str, sm_count: int) -> "Sm90Config":
        """The configuration a label names (`label`), "p" as sm_count persistent CTAs (one per SM); raises
        ValueError for a label outside the grammar or a configuration `__post_init__` refuses."""
        m = _LABEL.fullmatch(label)
        if not m:
            raise ValueError(f"bad variant {label!r}; {LABEL_GRAMMAR}, e.g. 128x2, 192x2s, 128x2pr")
        return cls(tile_n=int(m[1]), num_stages=int(m[2]), two_level_pv=not m[3],
                   persistent_ctas=sm_count if m[4] else 0, q_stages=int(m[5] or 1), pv_row_sum=bool(m[6]),
                   qk_int8=bool(m[7]), fma_exp2_tiles=int(m[8] or 0), consumer_warpgroups=int(m[9]) if m[9] else None)

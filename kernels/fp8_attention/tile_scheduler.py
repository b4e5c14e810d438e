"""Which tiles a CTA of the sm90 kernel computes, and the launch grid that goes with it.

A tile is one query block of one (batch, head): rows m_block * tile_m .. + tile_m - 1 of b*h. There are
m_blocks = ceil(S_pad / tile_m) per (batch, head) and num_tiles = m_blocks * B * H in all.

- One tile per CTA (`persistent_ctas` 0): the grid is (m_blocks, B * H); CTA (x, y) computes tile (x, y).
- Persistent (`persistent_ctas` N > 0): min(N, num_tiles) CTAs; CTA x computes tiles x, x + grid, x + 2 grid,
  ... of the tiles in m-fastest order (tile t = (t % m_blocks, t // m_blocks)), so the CTAs at work together
  share a head's K and V in L2.

The producer warp (`load`) and the consumer warpgroups (`consume`) of a CTA walk the same tiles in the same
order through `TileScheduler.for_each_tile`, each carrying its pipeline ring states from tile to tile.
"""
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


class Tile(NamedTuple):
    """One tile: query block m_block of the (batch, head) bh = batch * H + head."""
    m_block: Int32
    bh: Int32


class TileSchedulerParams(NamedTuple):
    """What the host passes the kernel for its scheduler."""
    m_blocks: Int32  # query tiles per (batch, head)
    num_tiles: Int32  # m_blocks * B * H


class TileScheduler:
    """This CTA's tiles (see the module docstring); persistent: whether the grid is persistent CTAs
    (compile-time). Built at the kernel's start, where it reads this CTA's block index."""

    def __init__(self, params: TileSchedulerParams, persistent: bool):
        self.m_blocks, self.num_tiles = params
        self.persistent = persistent
        x, y, _ = cute.arch.block_idx()
        self.cta_tile = Tile(x, y)  # one tile per CTA: the tile this CTA computes
        self.cta_index = x  # persistent: this CTA's index, the index of its first tile

    @staticmethod
    def params(seqlen_q_pad: Int32, num_bh: Int32, tile_m: int) -> TileSchedulerParams:
        """The tiles of S_pad query rows of num_bh (batch, head)s in tile_m-row query blocks (host side)."""
        m_blocks = cute.ceil_div(seqlen_q_pad, tile_m)
        return TileSchedulerParams(m_blocks, m_blocks * num_bh)

    @staticmethod
    def grid(params: TileSchedulerParams, num_bh: Int32, persistent_ctas: int):
        """The launch grid (host side): (m_blocks, num_bh, 1), one CTA per tile; or with persistent_ctas > 0,
        that many CTAs but no more than there are tiles (a short call launches no idle CTAs)."""
        if persistent_ctas > 0:
            return (cutlass.min(Int32(persistent_ctas), params.num_tiles), 1, 1)
        return (params.m_blocks, num_bh, 1)

    @cute.jit
    def for_each_tile(self, body, carry, *args):
        """carry = body(tile, carry, *args) for each tile of this CTA in turn; returns the last carry. One
        tile per CTA: body runs once, on `cta_tile`; persistent: a loop over the tile indices cta_index,
        + grid, ... below num_tiles."""
        if const_expr(self.persistent):
            for index in cutlass.range(self.cta_index, self.num_tiles, cute.arch.grid_dim()[0], unroll=1):
                carry = body(Tile(index % self.m_blocks, index // self.m_blocks), carry, *args)
        else:
            carry = body(self.cta_tile, carry, *args)
        return carry

"""FP8 (e4m3) flash-attention forward for Hopper (sm_90a): TMA + wgmma, warp-specialized.

Inputs are exactly v1's (see `prep.py`): Q, K [B*H, S_pad, D] e4m3 row-major, V feature-major
[B*H, D, Skv_pad] with keys permuted inside each 16-key group (`layout.key_order`), descales
[3, B*H]. The permutation v1 needs for mma.sync m16n8k32 is also the one wgmma needs: per warp,
the fp32 accumulator of an m64nNk32 wgmma has mma.sync's C layout (lane t of a row holds keys
8j + 2t + {0, 1}) and the 8-bit register A operand has mma.sync's A layout (k slots 4t..4t+3
and 16 + 4t..16 + 4t+3 of each 32-key k-block), so P goes from the S accumulator into the A
registers of the P.V wgmma without shuffles. Every wgmma operand is K-major, as FP8 wgmma needs.

One build per `config.Sm90Config` (what fp8_attention runs: `tuning.sm90_config`). CTA = 64 query rows
per consumer warpgroup of one (batch, head): at D = 128, 128 rows and 3 warpgroups (384 threads), as
below; at D = 64, 192 rows and 4 warpgroups (`consumer_warpgroups=3`, consumers at 160 registers, no
ping-pong; `config.DEFAULT_CONSUMER_WARPGROUPS`):

- warpgroup 0, producer (24 registers): warp 0 issues TMA loads of the tile's Q, then K and V blocks
  of ``tile_n`` keys into ``num_stages``-deep smem rings (`PipelineTmaAsync`, one full and one
  empty mbarrier per stage). Blocks go from last to first, so the one that needs the key-tail
  mask is the first a consumer sees.
- warpgroups 1, 2, consumers (240 registers): warpgroup w owns query rows 64(w-1)..64(w-1)+63.
  Per key block: S = Q K^T (SS wgmma), online softmax in registers (`softmax.OnlineSoftmax`),
  O += P V (RS wgmma, P from registers). Intra-warpgroup overlap: S of block n+1 is issued before
  P.V of block n, so the softmax of one block runs while the tensor cores do the other GEMM; the
  two consumer warpgroups also take turns at issuing their GEMMs (ping-pong through two named
  barriers, `named_barrier.NamedBarrier`), so one warpgroup's softmax overlaps the other's GEMMs.

One CTA per tile by default; with `persistent_ctas` (what D = 64 runs, and D = 128 up to 12288 keys:
`tuning`) that many CTAs (no more than there are tiles) each walk tiles in turn (`tile_scheduler`), and
the producer loads a tile's Q and first K/V blocks during the previous tile's last P.V and epilogue
(with `q_stages=2`, its Q without waiting for the previous tile's last S).

Where the time goes (ncu, docs/kernels.md): each SM sub-partition holds one warp of each
consumer warpgroup, and the one in its softmax issues with little instruction-level
parallelism (stalls on fixed-latency dependencies and the MUFU queue): the softmax region is
~half of a consumer warp's time, the tensor pipe ~45% busy. Moving exp2s to the FMA pipe,
rotating the loop so the exp2s cannot wait for P.V, batching both rows' reductions and
dropping the ping-pong did not help; 192-key blocks did (+13%) but only with single-level
accumulation, which the long-sequence numerics rule out (see two_level_pv).

Numerics (as v1): raw e4m3 products accumulate in fp32; the descales, softmax scale and log2(e)
fold into one factor so p = 2^(s * scale - m + 8) is one FFMA and one EX2. The +8 stores P as
p * 256 in e4m3 (p <= 1 against the running max, so codes <= 256 < 448, never saturated); the
row sum adds the same unrounded fp32 values (with `pv_row_sum`, the tensor core adds the rounded
e4m3 ones O's numerator uses), so the 256 cancels in O = acc / sum * descale_v.
O accumulates over all key blocks in fp32 registers (rescaled when the max grows).

INT8 Q/K (`qk_int8`): Q and K are int8 codes with a scale per group of the rows a thread holds (prep's
contract, `layout.q_scale_group`, `layout.k_scale_group`), S = Q K^T an s8 x s8 -> s32 wgmma at the FP8 rate.
|s| <= 128 * 127^2 < 2^22, so s + 0x4B400000 read as fp32 is 1.5 * 2^23 + s exactly (`softmax.biased_scores`:
one IADD, not an I2F on the MUFU's quarter-rate pipe), and the softmax's FFMA takes the 1.5 * 2^23 off, exactly
(`softmax.BiasedGroups`). A thread's two rows share one query scale, read once a tile; of a 128-key block it
holds keys of two key groups (one per 64-key half), two scales read per key block. The lanes of a quad hold
different key groups, so the row max is taken after scaling.
"""
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .config import CONSUMER_REGS, Sm90Config
from .epilogue import store_row
from .layout import K_SCALE_GROUPS, LOG2_E, P_SCALE_LOG2, Q_SCALE_GROUPS
from .named_barrier import NamedBarrier
from .softmax import OnlineSoftmax, biased_groups, biased_scores, rows_view
from .support import check_head_dim
from .tile_scheduler import Tile, TileScheduler, TileSchedulerParams

# Query rows per tile: 64 per consumer warpgroup (128 with two: prep's Q_ROWS padding; a 192-row tile past
# the padded rows reads TMA's zero fill and writes nothing). P is stored as p * 2^P_SCALE_LOG2 = p * 256 in
# e4m3 (max 256 < 448).
WG_THREADS = 128
ROW_SUM_COLS = 8  # pv_row_sum: the narrowest wgmma N; column 0 holds the row sum, 1-7 zeros
E4M3_ONES_WORD = 0x38383838  # four e4m3 1.0 codes
PRODUCER_REGS = 24  # the consumers': config.CONSUMER_REGS, by consumer warpgroup count


class TmaSource(NamedTuple):
    """What one operand's TMA loads read: the copy atom (its descriptor) and the gmem tensor as TMA sees it."""
    atom: cute.CopyAtom
    gmem: cute.Tensor  # Q, K: (S_pad, D, B*H); V: (D, Skv_pad, B*H)


class TmaSources(NamedTuple):
    """The producer's three TMA sources."""
    q: TmaSource
    k: TmaSource
    v: TmaSource


class SharedTensors(NamedTuple):
    """The CTA's smem operands (swizzled, K-major)."""
    q: cute.Tensor  # (M, D, q_stages)
    k: cute.Tensor  # (N, D, num_stages)
    v: cute.Tensor  # (D, N, num_stages)
    ones: cute.Tensor | None  # pv_row_sum's (8, N, 1) ones tile (row 0 all e4m3 1.0, rows 1-7 zero), else None


class SmemLayouts(NamedTuple):
    """The smem operands' layouts (`kmajor_smem_layout`), (rows, cols, stages) as in `SharedTensors`."""
    q: cute.ComposedLayout
    k: cute.ComposedLayout
    v: cute.ComposedLayout
    ones: cute.ComposedLayout


class TiledMmas(NamedTuple):
    """The CTA's wgmmas, the consumer warpgroups stacked along M, each one wgmma of 64 rows."""
    qk: cute.TiledMma  # S = Q K^T: m64nNk32, both operands from smem
    pv: cute.TiledMma  # O += P V: m64nDk32, P from registers
    row_sum: cute.TiledMma  # pv_row_sum's P times the ones tile: m64n8k32, P from registers


class Pipelines(NamedTuple):
    """The CTA's TMA pipelines (`PipelineTmaAsync`: a full and an empty mbarrier per stage)."""
    q: pipeline.PipelineTmaAsync  # q_stages deep
    k: pipeline.PipelineTmaAsync  # num_stages deep
    v: pipeline.PipelineTmaAsync  # num_stages deep; K's and V's stage n hold the same block's keys


class RingStates(NamedTuple):
    """A warp's place in the rings (stage index, phase), carried from tile to tile (`TileScheduler`)."""
    kv: pipeline.PipelineState  # the K and V rings (they advance together)
    q: pipeline.PipelineState  # Q's


class KeyBlocks(NamedTuple):
    """Key blocks 0 .. count-1 of tile_n keys; the last one may hold keys >= seqlen (zeros: prep's
    padding or TMA's out-of-bounds fill; with key lengths, the element's dropped keys), masked to -inf.
    Visited last to first."""
    seqlen: Int32  # seqlen_kv, or the tile's batch element's key length
    count: Int32  # n_blocks = ceil(seqlen / tile_n), at least 1


class KeyLengths(NamedTuple):
    """Per batch element key lengths (`fp8_attention(key_lengths=)`): element b attends its first lengths[b]
    keys (clamped to 0 .. seqlen_kv); with lengths None every element attends all seqlen_kv (compile-time)."""
    lengths: cute.Tensor | None  # [B] int32
    heads: Int32  # H: a tile's b*h // H is its batch element


class TileIO(NamedTuple):
    """What a consumer reads and writes per tile beyond the smem rings."""
    descale: cute.Tensor  # [3, B*H] fp32: Q's, K's and V's descales per (batch, head)
    q_scale: cute.Tensor | None  # INT8 Q/K: [B*H, Sq_pad / 64 * 32] fp32 scales of Q's groups; else None
    k_scale: cute.Tensor | None  # INT8 Q/K: [B*H, ceil(Skv_pad / 64) * 4] of K's groups; else None
    o: cute.Tensor  # [B, Sq, H, D] output
    lse: cute.Tensor | None  # [B, H, Sq] fp32 natural-log LSE, or None (compiled without)
    softmax_scale_log2: Float32  # softmax scale * log2(e)


class TileScalars(NamedTuple):
    """A tile's (b*h) scalars."""
    batch: Int32
    head: Int32
    qk_scale_log2: Float32  # raw e4m3 dot products -> log2-domain logits (Q's and K's descales, softmax scale)
    pv_scale: Float32  # V's descale (P's x256 cancels against the row sum)


class RowSumMma(NamedTuple):
    """pv_row_sum's GEMM of one consumer thread: P times the ones tile, in P.V's wgmma group."""
    tiled_mma: cute.TiledMma
    acc: cute.Tensor  # acc_L ((c, r), 1, 1) fp32: the block's row sums (`softmax.block_row_sums`)
    ones: cute.Tensor  # tLrOnes: the ones tile's B fragment (smem descriptors)


class WarpgroupMma(NamedTuple):
    """One consumer warpgroup's GEMMs, fragments (per warpgroup: smem descriptors) and accumulators (per
    thread). acc_S ((2, 2, N/8), 1, 1) fp32 = (column pair c, row half r, n8 tile j): row
    16 * (warp % 4) + lane / 4 + 8r of this warpgroup's 64, key 8j + 2(lane % 4) + c. acc_O is the same
    with features for keys. tOrP ((4, 2, 2), 1, N/32) e4m3 = (4 consecutive k slots, row half, k half),
    k-block: slots 4(lane % 4) + 16h + 0..3."""
    wg: Int32  # this consumer warpgroup, from 0
    qk: cute.TiledMma
    pv: cute.TiledMma
    tSrQ: cute.Tensor  # Q's A fragment; with two Q stages (..., q_stages)
    tSrK: cute.Tensor  # K's B fragment (..., num_stages)
    tOrV: cute.Tensor  # V's B fragment (..., num_stages)
    tOrP: cute.Tensor  # P, the A registers of P.V
    acc_O: cute.Tensor  # O of this thread's rows
    acc_PV: cute.Tensor  # one block's P.V (two-level accumulation), else acc_O itself
    tScS: cute.Tensor  # (row, key) in the tile of each acc_S value
    tOcO: cute.Tensor  # (row, feature) in the tile of each acc_O value
    row_sums: RowSumMma | None  # with pv_row_sum


def kmajor_smem_layout(dtype, rows: int, cols: int, stages: int):
    """(rows, cols, stages) smem layout with cols contiguous (K-major for wgmma), swizzled with
    the widest wgmma atom the row width allows (128 B rows: SW128)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def tma_partition(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor):
    """(smem, gmem) views of a CTA's TMA copies: (tile, stage) and (tile, block), each tile one copy."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                 cute.group_modes(gmem, 0, 2))


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
          zero_init: cutlass.Constexpr, wait: cutlass.Constexpr):
    """acc (+)= A B over every k-block of the fragments, as one committed wgmma group (`wgmma_group`)."""
    wgmma_group(((tiled_mma, acc, tA, tB),), zero_init, wait)


@cute.jit
def wgmma_group(gemms, zero_init: cutlass.Constexpr, wait: cutlass.Constexpr):
    """Several (tiled_mma, acc, A, B) products, acc (+)= A B over every k-block of the fragments, as one
    committed wgmma group (so one wait covers them all); waits until at most `wait` groups are in flight
    (no wait if wait < 0)."""
    warpgroup.fence()
    for tiled_mma, acc, tA, tB in gemms:
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


class Fp8AttentionSm90:
    """Non-causal FP8 attention forward on sm_90a; one compile per (head_dim, out dtype, LSE, config)."""

    def __init__(self, head_dim: int, config: Sm90Config = Sm90Config()):
        check_head_dim(head_dim)
        self.head_dim = head_dim
        self.config = config
        self.consumer_warpgroups = config.warpgroups(head_dim)
        self.tile_m = 64 * self.consumer_warpgroups  # query rows per tile
        self.ping_pong = self.consumer_warpgroups == 2  # the consumers take turns at issuing their GEMMs
        self.persistent = config.persistent_ctas > 0

    def shared_storage(self, qk_dtype, fp8, sQ_layout, sK_layout, sV_layout, sOnes_layout):
        """The CTA's shared memory: the pipelines' barriers, Q, the K and V rings (and with pv_row_sum
        the ones tile; plain Python, so the field can be left out). Q and K in qk_dtype (e4m3 or int8)."""
        cfg = self.config
        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2 * cfg.q_stages],
            "mbar_k": cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages],
            "mbar_v": cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages],
            "q": cute.struct.Align[cute.struct.MemRange[qk_dtype, cute.cosize(sQ_layout)], 1024],
            "k": cute.struct.Align[cute.struct.MemRange[qk_dtype, cute.cosize(sK_layout)], 1024],
            "v": cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sV_layout)], 1024],
        }
        if cfg.pv_row_sum:
            fields["ones"] = cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sOnes_layout)], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mDescale: cute.Tensor,
        mQScale: cute.Tensor | None,
        mKScale: cute.Tensor | None,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        mKeyLengths: cute.Tensor | None,
        softmax_scale: Float32,
        seqlen_kv: Int32,
        stream,
    ):
        """Builds the TMA atoms, smem layouts, pipelines' storage and MMAs; launches one CTA per
        (query tile, b*h), or `persistent_ctas` CTAs that walk those tiles (`TileScheduler.grid`).
        mQScale, mKScale: INT8 Q/K's group scales (`qk_int8`; mQ and mK int8), else None. mKeyLengths: [B]
        int32 key lengths per batch element (`KeyLengths`), or None."""
        qk_dtype = mQ.element_type  # e4m3, or int8 with qk_int8
        fp8 = mV.element_type
        cfg = self.config
        D, N = self.head_dim, cfg.tile_n
        # Prep pads every row to whole 16-byte chunks, so the strides are 16-byte multiples (TMA
        # needs that); then reorder to (seq or feature, contiguous dim, b*h).
        mQ, mK, mV = [
            cute.make_tensor(t.iterator, cute.make_layout(
                (t.shape[1], t.shape[2], t.shape[0]),
                stride=(cute.assume(t.stride[1], divby=16), 1, cute.assume(t.stride[0], divby=16))))
            for t in (mQ, mK, mV)
        ]  # Q, K: (S_pad, D, BH); V: (D, Skv_pad, BH)

        M = self.tile_m
        sQ_layout = kmajor_smem_layout(qk_dtype, M, D, cfg.q_stages)
        sK_layout = kmajor_smem_layout(qk_dtype, N, D, cfg.num_stages)
        sV_layout = kmajor_smem_layout(fp8, D, N, cfg.num_stages)
        sOnes_layout = kmajor_smem_layout(fp8, ROW_SUM_COLS, N, 1)  # pv_row_sum's B operand

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ, cute.select(sQ_layout, mode=[0, 1]), (M, D), 1)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK, cute.select(sK_layout, mode=[0, 1]), (N, D), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV, cute.select(sV_layout, mode=[0, 1]), (D, N), 1)

        SharedStorage = self.shared_storage(qk_dtype, fp8, sQ_layout, sK_layout, sV_layout, sOnes_layout)

        # The consumer warpgroups stacked along M, each one wgmma of 64 rows.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            qk_dtype, qk_dtype, OperandMajorMode.K, OperandMajorMode.K, Int32 if const_expr(cfg.qk_int8) else Float32,
            atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, N))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, D),
            a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_sum = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, ROW_SUM_COLS),
            a_source=warpgroup.OperandSource.RMEM)

        num_bh = cute.size(mQ.shape[2])
        tiles = TileScheduler.params(mQ.shape[0], num_bh, M)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            TileIO(mDescale, mQScale, mKScale, mO, mLSE, softmax_scale * LOG2_E), seqlen_kv,
            KeyLengths(mKeyLengths, mO.shape[2]), tiles,
            SmemLayouts(sQ_layout, sK_layout, sV_layout, sOnes_layout),
            TiledMmas(tiled_mma_qk, tiled_mma_pv, tiled_mma_sum), SharedStorage,
        ).launch(grid=TileScheduler.grid(tiles, num_bh, cfg.persistent_ctas),
                 block=[WG_THREADS * (1 + self.consumer_warpgroups), 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        io: TileIO,
        seqlen_kv: Int32,
        key_lengths: KeyLengths,
        tiles: TileSchedulerParams,
        layouts: SmemLayouts,
        mmas: TiledMmas,
        SharedStorage: cutlass.Constexpr,
    ):
        """The CTA: set-up, then the producer warp (`load`) and the consumer warpgroups (`consume`). The TMA
        atoms and tensors come first and one by one: the kernel's name is made from its first arguments'
        types. Q, K: (S_pad, D, B*H), V: (D, Skv_pad, B*H) (`__call__`)."""
        # ------------------------------------------------------------------ set-up
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        scheduler = TileScheduler(tiles, self.persistent)
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        smem = SharedTensors(
            q=storage.q.get_tensor(layouts.q.outer, swizzle=layouts.q.inner),
            k=storage.k.get_tensor(layouts.k.outer, swizzle=layouts.k.inner),
            v=storage.v.get_tensor(layouts.v.outer, swizzle=layouts.v.inner),
            ones=self.ones_tile(storage, layouts.ones, warp_idx) if const_expr(self.config.pv_row_sum) else None)
        pipes = self.make_pipelines(storage)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        keys = KeyBlocks(seqlen_kv, cute.ceil_div(seqlen_kv, self.config.tile_n))

        if warp_idx < 4:
            # -------------------------------------------------------------- producer
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                tma = TmaSources(TmaSource(tma_atom_Q, mQ), TmaSource(tma_atom_K, mK), TmaSource(tma_atom_V, mV))
                self.load(tma, smem, pipes, scheduler, keys, key_lengths)
        else:
            # -------------------------------------------------------------- consumers
            cute.arch.setmaxregister_increase(CONSUMER_REGS[self.consumer_warpgroups])
            self.consume(smem, mmas, pipes, scheduler, keys, key_lengths, io)

    @cute.jit
    def ones_tile(self, storage, sOnes_layout: cute.ComposedLayout, warp_idx: Int32) -> cute.Tensor:
        """pv_row_sum's B operand, keys x [1, 0, ..., 0]: row 0 of the 8-row tile all e4m3 1.0 (0x38), rows 1-7
        zero. The swizzle only moves 16-byte chunks within a row, so the first 128 bytes are row 0. The
        producer warpgroup writes it (128 threads x 8 bytes); the fence hands it to the async proxy that wgmma
        reads through, and the CTA barrier after the pipelines' set-up orders it before any use."""
        sOnes = storage.ones.get_tensor(sOnes_layout.outer, swizzle=sOnes_layout.inner)
        if warp_idx < 4:
            words = cute.make_tensor(cute.recast_ptr(storage.ones.data_ptr(), dtype=Int32),
                                     cute.make_layout(cute.cosize(sOnes_layout) // 4))
            tid = cute.arch.thread_idx()[0]
            for i in cutlass.range_constexpr(2):
                words[2 * tid + i] = Int32(E4M3_ONES_WORD) if 2 * tid + i < self.config.tile_n // 4 else Int32(0)
            cute.arch.fence_view_async_shared()
        return sOnes

    def make_pipelines(self, storage) -> Pipelines:
        """The Q, K and V pipelines on their barriers in smem. Full barriers: the producer's one elected thread
        arms them with the TMA byte count. Empty barriers: lane 0 of each consumer warp (8, or 12 with three
        warpgroups) arrives once per stage use."""
        cfg = self.config
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warpgroups * 4)
        D, N = self.head_dim, cfg.tile_n
        return Pipelines(
            q=pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_q.data_ptr(), num_stages=cfg.q_stages, producer_group=producer,
                consumer_group=consumers, tx_count=self.tile_m * D, defer_sync=True),
            k=pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_k.data_ptr(), num_stages=cfg.num_stages,
                producer_group=producer, consumer_group=consumers, tx_count=N * D, defer_sync=True),
            v=pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=cfg.num_stages,
                producer_group=producer, consumer_group=consumers, tx_count=D * N, defer_sync=True))

    # ---------------------------------------------------------------------- producer
    @cute.jit
    def load(self, tma: TmaSources, smem: SharedTensors, pipes: Pipelines, scheduler: TileScheduler,
             keys: KeyBlocks, key_lengths: KeyLengths):
        """Producer warp: every tile of this CTA in turn (`load_tile`); the K/V rings run on across tiles."""
        states = RingStates(kv=pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.num_stages),
                            q=pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.q_stages))
        scheduler.for_each_tile(self.load_tile, states, tma, smem, pipes, keys, key_lengths)

    @cute.jit
    def load_tile(self, tile: Tile, states: RingStates, tma: TmaSources, smem: SharedTensors, pipes: Pipelines,
                  keys: KeyBlocks, key_lengths: KeyLengths) -> RingStates:
        """One tile: Q, then K of block n with V of block n+1 (V lags one block, the order in which the
        consumers' overlapped loop needs them). Returns the ring states for the next tile."""
        D, N = self.head_dim, self.config.tile_n
        n_blocks = self.tile_keys(keys, key_lengths, tile.bh).count
        state, q_state = states
        gQ = cute.local_tile(tma.q.gmem[None, None, tile.bh], (self.tile_m, D), (None, 0))  # (M, D, m_blocks)
        gK = cute.local_tile(tma.k.gmem[None, None, tile.bh], (N, D), (None, 0))  # (N, D, n_blocks)
        gV = cute.local_tile(tma.v.gmem[None, None, tile.bh], (D, N), (0, None))  # (D, N, n_blocks)
        tQsQ, tQgQ = tma_partition(tma.q.atom, smem.q, gQ)
        tKsK, tKgK = tma_partition(tma.k.atom, smem.k, gK)
        tVsV, tVgV = tma_partition(tma.v.atom, smem.v, gV)

        self.load_block(tma.k.atom, tKgK, tKsK, pipes.k, n_blocks - 1, state)
        pipes.q.producer_acquire(q_state)
        q_slot = 0
        if const_expr(self.config.q_stages > 1):
            q_slot = q_state.index
        cute.copy(tma.q.atom, tQgQ[None, tile.m_block], tQsQ[None, q_slot],
                  tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
        for i in cutlass.range(n_blocks - 1, unroll=1):
            block_v = n_blocks - 1 - i
            state_v = state.clone()
            state.advance()
            self.load_block(tma.k.atom, tKgK, tKsK, pipes.k, block_v - 1, state)
            self.load_block(tma.v.atom, tVgV, tVsV, pipes.v, block_v, state_v)
        self.load_block(tma.v.atom, tVgV, tVsV, pipes.v, 0, state)
        state.advance()
        q_state.advance()
        return RingStates(state, q_state)

    @cute.jit
    def load_block(self, tma_atom, tXgX, tXsX, pipe, block: Int32, state):
        """Waits for the stage to be free, arms its full barrier, issues the TMA copy."""
        pipe.producer_acquire(state)
        cute.copy(tma_atom, tXgX[None, block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))

    # ---------------------------------------------------------------------- consumers
    @cute.jit
    def consume(self, smem: SharedTensors, mmas: TiledMmas, pipes: Pipelines, scheduler: TileScheduler,
                keys: KeyBlocks, key_lengths: KeyLengths, io: TileIO):
        """Consumer warpgroup: for each tile of this CTA (`consume_tile`), the whole key loop for its
        64 query rows, then the epilogue."""
        cfg = self.config
        tidx = cute.arch.thread_idx()[0] - WG_THREADS  # 0..M*2-1 over the consumer warpgroups
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)  # this consumer warpgroup, from 0
        # One tile per CTA: its scalars are read first, as the one-tile kernel always has (reading them
        # where a persistent CTA does, at the tile's start, reorders its PTX); persistent: per tile.
        scalars = None
        if const_expr(not self.persistent):
            scalars = self.tile_scalars(io, scheduler.cta_tile.bh)
        mma = self.warpgroup_mma(smem, mmas, tidx, wg)
        softmax = OnlineSoftmax.create(cfg.fma_exp2_tiles, cfg.two_level_pv, cfg.pv_row_sum,
                                       key_lengths.lengths is not None)

        # Ping-pong: consumer warpgroup 1 lets warpgroup 0 issue first.
        if const_expr(self.ping_pong):
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.CONSUMER_WG0_MAY_ISSUE),
                                         number_of_threads=2 * WG_THREADS)

        states = RingStates(kv=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages),
                            q=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.q_stages))
        scheduler.for_each_tile(self.consume_tile, states, mma, softmax, pipes, keys, key_lengths, io, scalars)

    def warpgroup_mma(self, smem: SharedTensors, mmas: TiledMmas, tidx: Int32, wg: Int32) -> WarpgroupMma:
        """This thread's slices of the wgmmas: the warpgroup's fragments, the thread's accumulators."""
        M, N, D = self.tile_m, self.config.tile_n, self.head_dim
        wg_mma_qk = mmas.qk.get_slice(wg * WG_THREADS)
        wg_mma_pv = mmas.pv.get_slice(wg * WG_THREADS)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(
            smem.q[None, None, 0] if const_expr(self.config.q_stages == 1) else smem.q))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(smem.k))
        tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(smem.v))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((M, N)))
        thr_mma_qk = mmas.qk.get_slice(tidx)
        thr_mma_pv = mmas.pv.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((M, D)), Float32)
        acc_PV = cute.make_rmem_tensor(acc_O.shape, Float32) if const_expr(self.config.two_level_pv) else acc_O
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((M, N)))
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((M, D)))
        # pv_row_sum: the ones tile as P.V's second B operand, and a block's row sums (per thread
        # (c, r): column 2(lane % 4) + c, so only lane % 4 == 0's c = 0 is not zero).
        row_sums = None
        if const_expr(self.config.pv_row_sum):
            wg_mma_sum = mmas.row_sum.get_slice(wg * WG_THREADS)
            tLrOnes = wg_mma_sum.make_fragment_B(wg_mma_sum.partition_B(smem.ones[None, None, 0]))
            acc_L = cute.make_rmem_tensor(mmas.row_sum.get_slice(tidx).partition_shape_C((M, ROW_SUM_COLS)),
                                          Float32)
            row_sums = RowSumMma(mmas.row_sum, acc_L, tLrOnes)
        return WarpgroupMma(wg, mmas.qk, mmas.pv, tSrQ, tSrK, tOrV, tOrP, acc_O, acc_PV, tScS, tOcO, row_sums)

    @cute.jit
    def tile_keys(self, keys: KeyBlocks, key_lengths: KeyLengths, bh: Int32) -> KeyBlocks:
        """A tile's key blocks: the call's (`keys`), or with key lengths its batch element's first lengths[b]
        keys, clamped to 0 .. seqlen_kv, in at least one block (an element with none: one all-masked block,
        `OnlineSoftmax.keyless_rows`). The producer and the consumers compute the same."""
        if const_expr(key_lengths.lengths is None):
            return keys
        seqlen = cutlass.max(cutlass.min(key_lengths.lengths[bh // key_lengths.heads], keys.seqlen), Int32(0))
        return KeyBlocks(seqlen, cutlass.max(cute.ceil_div(seqlen, self.config.tile_n), Int32(1)))

    @cute.jit
    def tile_scalars(self, io: TileIO, bh: Int32) -> TileScalars:
        """The scalars of a tile's (b*h)."""
        num_heads = io.o.shape[2]
        return TileScalars(bh // num_heads, bh % num_heads,
                           io.descale[0, bh] * io.descale[1, bh] * io.softmax_scale_log2, io.descale[2, bh])

    @cute.jit
    def consume_tile(self, tile: Tile, states: RingStates, mma: WarpgroupMma, softmax: OnlineSoftmax,
                     pipes: Pipelines, keys: KeyBlocks, key_lengths: KeyLengths, io: TileIO,
                     scalars: TileScalars | None) -> RingStates:
        """One tile: online softmax over every key block, then O and LSE of its rows. scalars: the tile's, or
        None to read them here. Returns the ring states for the next tile."""
        keys = self.tile_keys(keys, key_lengths, tile.bh)
        mma.acc_O.fill(0.0)
        softmax.reset()
        if const_expr(scalars is None):
            scalars = self.tile_scalars(io, tile.bh)
        qk_scale_log2 = scalars.qk_scale_log2
        if const_expr(self.config.qk_int8):  # this warpgroup's rows are one query block; this thread's two one group
            q_blocks = io.q_scale.shape[1] // Q_SCALE_GROUPS
            q_block = cutlass.min(tile.m_block * self.consumer_warpgroups + mma.wg, q_blocks - 1)
            qk_scale_log2 *= io.q_scale[tile.bh, q_block * Q_SCALE_GROUPS + cute.arch.warp_idx() % 4 * 8
                                        + cute.arch.lane_idx() // 4]
        state, q_state = states
        pipes.q.consumer_wait(q_state)

        # ------------------------------------------------------------------ main loop
        # First (last-in-order) block alone: S, key-tail mask, softmax, P.
        pipes.k.consumer_wait(state)
        tile_q = mma.tSrQ  # this tile's Q stage
        if const_expr(self.config.q_stages > 1):
            tile_q = mma.tSrQ[None, None, None, q_state.index]
        acc_S = self.qk(mma, tile_q, state.index, 0)
        pipes.k.consumer_release(state)
        scores = self.scores(acc_S)
        self.mask_key_tail(scores, mma.tScS, keys)
        scales = self.key_scales(io, tile.bh, qk_scale_log2, keys.count - 1)
        softmax.online_update(scores, scales, True, self.biased(scales))
        self.store_p(scores, mma.tOrP)

        # Steady state: S of block n - 1 is in flight while P.V of block n runs, then the
        # softmax of S overlaps the other warpgroup's GEMMs.
        for i in cutlass.range(keys.count - 1, unroll=1):
            state_v = state.clone()
            state.advance()
            pipes.k.consumer_wait(state)
            self.wait_for_turn(mma.wg)
            acc_S_next = self.qk(mma, tile_q, state.index, -1)
            scales = self.key_scales(io, tile.bh, qk_scale_log2, keys.count - 2 - i)
            pipes.v.consumer_wait(state_v)
            self.pv(mma, state_v.index, -1)
            self.pass_turn(mma.wg)
            warpgroup.wait_group(1)  # S has landed; P.V may still run
            pipes.k.consumer_release(state)
            scores = self.scores(acc_S_next)
            row_scale = softmax.online_update(scores, scales, False, self.biased(scales))
            warpgroup.wait_group(0)  # P.V done: P registers and the V stage are free
            pipes.v.consumer_release(state_v)
            self.store_p(scores, mma.tOrP)
            softmax.add_block(mma.acc_O, mma.acc_PV, self.block_sums(mma), row_scale)

        if const_expr(self.persistent):  # the tile's last S has landed: Q's stage is free
            pipes.q.consumer_release(q_state)

        # Last P.V.
        pipes.v.consumer_wait(state)
        self.pv(mma, state.index, 0)
        pipes.v.consumer_release(state)
        softmax.add_block(mma.acc_O, mma.acc_PV, self.block_sums(mma), None)

        # ------------------------------------------------------------------ epilogue
        self.store_tile(tile.m_block, mma, softmax, io, scalars)
        state.advance()
        q_state.advance()
        return RingStates(state, q_state)

    @cute.jit
    def store_tile(self, m_block: Int32, mma: WarpgroupMma, softmax: OnlineSoftmax, io: TileIO,
                   scalars: TileScalars):
        """O and LSE of this thread's two rows. Row half r of this thread: its (c, j) values of O. The row sum
        is of p * 256, which cancels in O and comes off the LSE as P_SCALE_LOG2."""
        lane = cute.arch.lane_idx()
        acc_O_rows = rows_view(mma.acc_O)
        for r in cutlass.range_constexpr(2):
            store_row(io.o, io.lse, scalars.batch, scalars.head, m_block, acc_O_rows[r, None],
                      mma.tOcO[(None, r, None), 0, 0], softmax.row_max[r], softmax.row_sum[r], scalars.pv_scale,
                      lane, P_SCALE_LOG2, self.tile_m)

    @cute.jit
    def wait_for_turn(self, wg: Int32):
        """Ping-pong: waits until this consumer warpgroup may issue its GEMMs (no-op without ping-pong)."""
        if const_expr(self.ping_pong):
            cute.arch.barrier(barrier_id=int(NamedBarrier.CONSUMER_WG0_MAY_ISSUE) + wg,
                              number_of_threads=2 * WG_THREADS)

    @cute.jit
    def pass_turn(self, wg: Int32):
        """Ping-pong: this warpgroup's GEMMs are issued; the other may issue its own."""
        if const_expr(self.ping_pong):
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.CONSUMER_WG0_MAY_ISSUE) + 1 - wg,
                                     number_of_threads=2 * WG_THREADS)

    @cute.jit
    def mask_key_tail(self, acc_S: cute.Tensor, tScS: cute.Tensor, keys: KeyBlocks):
        """Scores of keys >= seqlen_kv in the last block (the first one processed) to -inf."""
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            if (keys.count - 1) * self.config.tile_n + tScS[i][1] >= keys.seqlen:
                acc_S[i] = -Float32.inf

    @cute.jit
    def qk(self, mma: WarpgroupMma, tSrQ: cute.Tensor, stage: Int32, wait: cutlass.Constexpr):
        """S = Q K^T of one key block into a fresh accumulator (raw e4m3 products in fp32, or INT8 Q/K's in
        s32: `scores`)."""
        acc_S = cute.make_rmem_tensor(mma.tScS.shape, Int32 if const_expr(self.config.qk_int8) else Float32)
        wgmma(mma.qk, acc_S, tSrQ, mma.tSrK[None, None, None, stage], True, wait)
        return acc_S

    @cute.jit
    def scores(self, acc_S: cute.Tensor) -> cute.Tensor:
        """A landed S accumulator as fp32 raw scores: itself, or INT8 Q/K's s32 as 1.5 * 2^23 + s in place
        (`softmax.biased_scores`; `biased` takes the bias off)."""
        if const_expr(self.config.qk_int8):
            acc_S = biased_scores(acc_S)
        return acc_S

    def biased(self, scales: tuple):
        """INT8 Q/K: the softmax's `softmax.BiasedGroups` of a key block's scales; else None."""
        return biased_groups(scales) if const_expr(self.config.qk_int8) else None

    @cute.jit
    def key_scales(self, io: TileIO, bh: Int32, qk_scale_log2: Float32, block: Int32) -> tuple:
        """The scales (log2 units) of this thread's scores of a key block by key group (`softmax.key_groups_view`):
        the tile's qk_scale_log2 alone, or with INT8 Q/K (qk_scale_log2 holding this thread's query group) times
        the scale of its keys' group in each 64-key half of the block (`layout.k_scale_group`; a half past the
        last key reads the last block's: its keys are masked)."""
        if const_expr(not self.config.qk_int8):
            return (qk_scale_log2,)
        last = io.k_scale.shape[1] // K_SCALE_GROUPS - 1
        group = cute.arch.lane_idx() % 4
        return tuple(qk_scale_log2 * io.k_scale[bh, cutlass.min(2 * block + g, last) * K_SCALE_GROUPS + group]
                     for g in range(2))

    @cute.jit
    def pv(self, mma: WarpgroupMma, stage: Int32, wait: cutlass.Constexpr):
        """P.V of one block (and with pv_row_sum its row sums, P times the ones tile, in the same wgmma
        group)."""
        tOrV_stage = mma.tOrV[None, None, None, stage]
        if const_expr(self.config.pv_row_sum):
            sums = mma.row_sums
            wgmma_group(((mma.pv, mma.acc_PV, mma.tOrP, tOrV_stage), (sums.tiled_mma, sums.acc, mma.tOrP, sums.ones)),
                        True, wait)
        else:
            wgmma(mma.pv, mma.acc_PV, mma.tOrP, tOrV_stage, self.config.two_level_pv, wait)

    def block_sums(self, mma: WarpgroupMma) -> cute.Tensor | None:
        """pv_row_sum: the last P.V's row sums (acc_L), else None."""
        return mma.row_sums.acc if const_expr(self.config.pv_row_sum) else None

    @cute.jit
    def store_p(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        """p * 256 (fp32, accumulator layout) -> e4m3 A-operand registers, lane-locally.

        Accumulator value (c, r, j) of k-block kb = j // 4 is key 8(j % 4) + 2t + c of that
        block; V's prep order puts it at k slot 4t + 2((j % 4) % 2) + c + 16((j % 4) // 2),
        which is A value c + 2(jj % 2) + 4r + 8(jj // 2) (jj = j % 4) of k-block kb.
        """
        kb = cute.size(tOrP.shape[2])
        src = cute.make_tensor(acc_S.iterator, cute.make_layout(
            ((2, 2), (2, 2), kb), stride=((1, 2), (4, 8), 16)))  # ((c, r), (jj%2, jj//2), kb)
        dst = cute.make_tensor(tOrP.iterator, cute.make_layout(
            ((2, 2), (2, 2), kb), stride=((1, 4), (2, 8), 16)))
        dst.store(src.load().to(tOrP.element_type))

"""FP8 (e4m3) flash-attention forward for Hopper (sm_90a): TMA + wgmma, warp-specialized.

Inputs are exactly v1's (see `prep.py`): Q, K [B*H, S_pad, D] e4m3 row-major, V feature-major
[B*H, D, Skv_pad] with keys permuted inside each 16-key group (`layout.key_order`), descales
[3, B*H]. The permutation v1 needs for mma.sync m16n8k32 is also the one wgmma needs: per warp,
the fp32 accumulator of an m64nNk32 wgmma has mma.sync's C layout (lane t of a row holds keys
8j + 2t + {0, 1}) and the 8-bit register A operand has mma.sync's A layout (k slots 4t..4t+3
and 16 + 4t..16 + 4t+3 of each 32-key k-block), so P goes from the S accumulator into the A
registers of the P.V wgmma without shuffles. Every wgmma operand is K-major, as FP8 wgmma needs.

CTA = 64 query rows per consumer warpgroup of one (batch, head): at D = 128, 128 rows and 3
warpgroups (384 threads), as below; at D = 64, 192 rows and 4 warpgroups (`consumer_warpgroups=3`,
consumers at 160 registers, no ping-pong; `DEFAULT_CONSUMER_WARPGROUPS`):

- warpgroup 0, producer (24 registers): warp 0 issues TMA loads of the tile's Q, then K and V blocks
  of ``tile_n`` keys into ``num_stages``-deep smem rings (`PipelineTmaAsync`, one full and one
  empty mbarrier per stage). Blocks go from last to first, so the one that needs the key-tail
  mask is the first a consumer sees.
- warpgroups 1, 2, consumers (240 registers): warpgroup w owns query rows 64(w-1)..64(w-1)+63.
  Per key block: S = Q K^T (SS wgmma), online softmax in registers, O += P V (RS wgmma, P from
  registers). Intra-warpgroup overlap: S of block n+1 is issued before P.V of block n, so the
  softmax of one block runs while the tensor cores do the other GEMM; the two consumer
  warpgroups also take turns at issuing their GEMMs (ping-pong through two named barriers,
  `named_barrier.NamedBarrier`),
  so one warpgroup's softmax overlaps the other's GEMMs.

One CTA per tile by default; with `persistent_ctas` (what D = 64 runs, and D = 128 up to 12288 keys:
`tuning`) that many CTAs (no more than there are tiles) each walk tiles in turn, and the producer
loads a tile's Q and first K/V blocks during the previous tile's last P.V and epilogue (with
`q_stages=2`, its Q without waiting for the previous tile's last S).

Where the time goes (ncu, kernels/NOTES.md): each SM sub-partition holds one warp of each
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
"""
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .epilogue import store_row
from .layout import KEYS, LOG2_E, P_SCALE_LOG2
from .named_barrier import NamedBarrier
from .softmax import quad_max
from .support import check_head_dim

# Query rows per CTA: 64 per consumer warpgroup (128 with the default two: prep's Q_ROWS padding; a
# 192-row tile past the padded rows reads TMA's zero fill and writes nothing). P is stored as
# p * 2^P_SCALE_LOG2 = p * 256 in e4m3 (max 256 < 448).
DEFAULT_TILE_N = 128  # keys per block (kernels/NOTES.md: 128 to 224 measured)
WG_THREADS = 128
ROW_SUM_COLS = 8  # pv_row_sum: the narrowest wgmma N; column 0 holds the row sum, 1-7 zeros
E4M3_ONES_WORD = 0x38383838  # four e4m3 1.0 codes
PRODUCER_REGS = 24
# Registers per consumer thread by consumer warpgroup count. setmaxnreg only moves registers inside the
# CTA's launch allocation (threads x launch registers: 384 x 168 = 64512 with two consumer warpgroups,
# 512 x 128 = 65536 with three), and an increase that does not fit waits forever:
# 128 * 24 + 256 * 240 = 64512 and 128 * 24 + 384 * 160 = 64512 fit.
CONSUMER_REGS = {2: 240, 3: 160}
# Consumer warpgroups by head dim when not given: three at D = 64 (192-row tiles; +15-17% at
# S = 30272, kernels/NOTES.md), two at D = 128 (with three, its overlapped loop's two-level
# accumulators do not fit 160 registers: 572 B of spills).
DEFAULT_CONSUMER_WARPGROUPS = {64: 3, 128: 2}
# exp2 on the FMA pipe: x + 1.5 * 2^23 rounds x to the nearest integer j (kept in the low
# mantissa bits), f = x - j in [-0.5, 0.5], 2^f by a degree-2 polynomial (minimax relative
# error 1.7e-3, far below e4m3's 2^-4 rounding of P), then j is added to the exponent field.
ROUND_TO_INT = 1.5 * 2**23
EXP2_POLY = (1.0004431009292603, 0.7034448981285095, 0.23842675983905792)


def kmajor_smem_layout(dtype, rows: int, cols: int, stages: int):
    """(rows, cols, stages) smem layout with cols contiguous (K-major for wgmma), swizzled with
    the widest wgmma atom the row width allows (128 B rows: SW128)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


@dsl_user_op
def add_to_exponent(rounded: Float32, mantissa: Float32, *, loc=None, ip=None) -> Float32:
    """Float with the bits (bits(rounded) << 23) + bits(mantissa): 2^j * mantissa, where j is
    the integer held in the low bits of `rounded` (one LEA on the ALU pipe)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(rounded).ir_value(loc=loc, ip=ip), Float32(mantissa).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 j, m, e;\n\tmov.b32 j, $1;\n\tmov.b32 m, $2;\n\t"
        "shl.b32 e, j, 23;\n\tadd.s32 e, e, m;\n\tmov.b32 $0, e;\n\t}",
        "=f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def exp2_on_fma(x: Float32) -> Float32:
    """2^x for x <= 127 without the MUFU unit (3 FADD, 2 FFMA, FMNMX, LEA); x below -126
    (masked keys are -inf) gives ~0."""
    x = cute.arch.fmax(x, Float32(-126.0))
    rounded = x + ROUND_TO_INT
    frac = x - (rounded - ROUND_TO_INT)
    mantissa = (EXP2_POLY[2] * frac + EXP2_POLY[1]) * frac + EXP2_POLY[0]
    return add_to_exponent(rounded, mantissa)


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
    """Non-causal FP8 attention forward on sm_90a; one compile per (head_dim, out dtype, LSE)."""

    def __init__(self, head_dim: int, tile_n: int = DEFAULT_TILE_N, num_stages: int = 2,
                 two_level_pv: bool = True, fma_exp2_tiles: int = 0, consumer_warpgroups: int | None = None,
                 persistent_ctas: int = 0, q_stages: int = 1, pv_row_sum: bool = False):
        check_head_dim(head_dim)
        if consumer_warpgroups is None:
            consumer_warpgroups = DEFAULT_CONSUMER_WARPGROUPS[head_dim]
        if tile_n % KEYS != 0:
            raise ValueError("tile_n must be a multiple of the 32-key wgmma k-block")
        if consumer_warpgroups not in CONSUMER_REGS:
            raise ValueError(f"consumer_warpgroups must be one of {tuple(CONSUMER_REGS)}")
        # Each consumer warpgroup owns 64 query rows. Three (192-row tiles, FA3's choice for D = 64)
        # put three consumer warps on each SM sub-partition to hide the softmax's latency, at 160
        # registers each; their GEMMs are not ping-ponged (the named-barrier scheme is for two).
        self.consumer_warpgroups = consumer_warpgroups
        self.tile_m = 64 * consumer_warpgroups
        self.ping_pong = consumer_warpgroups == 2
        self.head_dim = head_dim
        self.tile_n = tile_n
        self.num_stages = num_stages
        # Hopper's FP8 wgmma keeps only ~14 mantissa bits in its internal accumulation, so O
        # accumulated by the tensor core over 30k keys drifts (measured: 1.5% vs the emulation
        # at S=30272, against 0.3-0.6% at S<=4096). two_level_pv: each block's P.V goes into a
        # zero-initialised accumulator and is added to O in fp32 by the FMA units. On the H3
        # block's own q, k, v (profile-block --compare-attn) single-level accumulation gave 18%
        # attention error against 0.34% two-level: keep two_level_pv on for real activations.
        self.two_level_pv = two_level_pv
        # The MUFU unit does 16 exp2/clk/SM, which at D=128 is as busy as the FP8 tensor core;
        # the exp2s of the first fma_exp2_tiles n8 tiles of each row (2 of the row's 2*N/8
        # values per thread each) run as a polynomial on the FMA pipe instead (FA4's trick).
        # Measured: no gain here (kernels/NOTES.md), so off by default.
        # At least one tile stays on the MUFU: the polynomial's clamp turns NaN into ~0, and the
        # MUFU values are what carry a NaN head (NaN descale) through to its output.
        if not 0 <= fma_exp2_tiles < tile_n // 8:
            raise ValueError(f"fma_exp2_tiles must be in 0..{tile_n // 8 - 1}")
        self.fma_exp2_tiles = fma_exp2_tiles
        # persistent_ctas: 0 launches one CTA per (query tile, b*h). Otherwise that many CTAs, or one per
        # tile where there are fewer tiles (the device's SM count: one CTA fits an SM), each walk tiles
        # blockIdx, blockIdx + grid, ...; the consumers free Q after a tile's last S, so the producer
        # loads the next tile's Q and first K/V blocks during the tile's last P.V and epilogue instead of
        # after a CTA launch.
        if isinstance(persistent_ctas, bool) or not isinstance(persistent_ctas, int) or persistent_ctas < 0:
            raise ValueError(f"persistent_ctas must be an int >= 0 (the device's SM count), got {persistent_ctas!r}")
        self.persistent_ctas = persistent_ctas
        # q_stages 2 (persistent only): the next tile's Q loads into the other stage as soon as the
        # producer reaches it (after that tile's first K finds a free stage, near this tile's end),
        # instead of after both consumer warpgroups have finished this tile's key loop.
        if q_stages not in (1, 2) or (q_stages == 2 and persistent_ctas == 0):
            raise ValueError("q_stages must be 1, or 2 with persistent_ctas")
        self.q_stages = q_stages
        # pv_row_sum (what D = 64 runs, `tuning`): the row sums come from the tensor core, as P times a
        # constant 8 x N e4m3 tile (keys x [1, 0, ..., 0]) in the same wgmma group as P.V, instead of
        # 64 FADDs per thread and key block. They become sums of the e4m3-rounded P that O's numerator
        # uses (the emulation's `rounded_row_sum`). Two-level only: that sum is folded like O.
        if pv_row_sum and (not two_level_pv or tile_n != 128):
            raise ValueError("pv_row_sum needs two_level_pv and 128-key blocks (128-byte rows of its ones tile)")
        self.pv_row_sum = pv_row_sum

    def shared_storage(self, fp8, sQ_layout, sK_layout, sV_layout, sOnes_layout):
        """The CTA's shared memory: the pipelines' barriers, Q, the K and V rings (and with pv_row_sum
        the ones tile; plain Python, so the field can be left out)."""
        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages],
            "mbar_k": cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            "mbar_v": cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            "q": cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sQ_layout)], 1024],
            "k": cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sK_layout)], 1024],
            "v": cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sV_layout)], 1024],
        }
        if self.pv_row_sum:
            fields["ones"] = cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sOnes_layout)], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mDescale: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        softmax_scale: Float32,
        seqlen_kv: Int32,
        stream,
    ):
        """Builds the TMA atoms, smem layouts, pipelines' storage and MMAs; launches one CTA per
        (query tile, b*h), or `persistent_ctas` CTAs that walk those tiles."""
        fp8 = mQ.element_type
        D, N = self.head_dim, self.tile_n
        # Prep pads every row to whole 16-byte chunks, so the strides are 16-byte multiples (TMA
        # needs that); then reorder to (seq or feature, contiguous dim, b*h).
        mQ, mK, mV = [
            cute.make_tensor(t.iterator, cute.make_layout(
                (t.shape[1], t.shape[2], t.shape[0]),
                stride=(cute.assume(t.stride[1], divby=16), 1, cute.assume(t.stride[0], divby=16))))
            for t in (mQ, mK, mV)
        ]  # Q, K: (S_pad, D, BH); V: (D, Skv_pad, BH)

        M = self.tile_m
        sQ_layout = kmajor_smem_layout(fp8, M, D, self.q_stages)
        sK_layout = kmajor_smem_layout(fp8, N, D, self.num_stages)
        sV_layout = kmajor_smem_layout(fp8, D, N, self.num_stages)
        sOnes_layout = kmajor_smem_layout(fp8, ROW_SUM_COLS, N, 1)  # pv_row_sum's B operand

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ, cute.select(sQ_layout, mode=[0, 1]), (M, D), 1)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK, cute.select(sK_layout, mode=[0, 1]), (N, D), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV, cute.select(sV_layout, mode=[0, 1]), (D, N), 1)

        SharedStorage = self.shared_storage(fp8, sQ_layout, sK_layout, sV_layout, sOnes_layout)

        # The consumer warpgroups stacked along M, each one wgmma of 64 rows.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, N))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, D),
            a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_sum = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, ROW_SUM_COLS),
            a_source=warpgroup.OperandSource.RMEM)

        m_blocks = cute.ceil_div(mQ.shape[0], M)
        num_tiles = m_blocks * cute.size(mQ.shape[2])
        grid = (m_blocks, cute.size(mQ.shape[2]), 1)
        if const_expr(self.persistent_ctas > 0):  # no more CTAs than tiles: a short call launches no idle CTAs
            grid = (cutlass.min(Int32(self.persistent_ctas), num_tiles), 1, 1)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mDescale, mO, mLSE, softmax_scale * LOG2_E, seqlen_kv, m_blocks, num_tiles,
            sQ_layout, sK_layout, sV_layout, sOnes_layout, tiled_mma_qk, tiled_mma_pv, tiled_mma_sum, SharedStorage,
        ).launch(grid=grid, block=[WG_THREADS * (1 + self.consumer_warpgroups), 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        mDescale: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        softmax_scale_log2: Float32,
        seqlen_kv: Int32,
        m_blocks: Int32,
        num_tiles: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sOnes_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tiled_mma_sum: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        # ------------------------------------------------------------------ set-up
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # One tile (m_block, bh) = (x, y) per CTA; persistent: tiles x, x + grid, ... in m-fastest order
        # (the CTAs at work together share a head's K and V in L2).
        tile_x, tile_y, _ = cute.arch.block_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.q.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (M, D, q_stages)
        sK = storage.k.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (N, D, stages)
        sV = storage.v.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (D, N, stages)
        sOnes = None
        if const_expr(self.pv_row_sum):
            # Keys x [1, 0, ..., 0]: row 0 of the 8-row tile all e4m3 1.0 (0x38), rows 1-7 zero. The
            # swizzle only moves 16-byte chunks within a row, so the first 128 bytes are row 0. The
            # producer warpgroup writes it (128 threads x 8 bytes); the fence hands it to the async
            # proxy that wgmma reads through, and the CTA barrier below orders it before any use.
            sOnes = storage.ones.get_tensor(sOnes_layout.outer, swizzle=sOnes_layout.inner)
            if warp_idx < 4:
                words = cute.make_tensor(cute.recast_ptr(storage.ones.data_ptr(), dtype=Int32),
                                         cute.make_layout(cute.cosize(sOnes_layout) // 4))
                tid = cute.arch.thread_idx()[0]
                for i in cutlass.range_constexpr(2):
                    words[2 * tid + i] = Int32(E4M3_ONES_WORD) if 2 * tid + i < self.tile_n // 4 else Int32(0)
                cute.arch.fence_view_async_shared()

        # Full barriers: the producer's one elected thread arms them with the TMA byte count.
        # Empty barriers: lane 0 of each consumer warp (8, or 12 with three warpgroups) arrives once per
        # stage use.
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warpgroups * 4)
        D, N = self.head_dim, self.tile_n
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.tile_m * D, defer_sync=True)
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=N * D, defer_sync=True)
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=D * N, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Key blocks 0 .. n_blocks-1; the last one may hold keys >= seqlen_kv (zeros: prep's
        # padding or TMA's out-of-bounds fill), masked to -inf. Visited last to first.
        n_blocks = cute.ceil_div(seqlen_kv, N)

        if warp_idx < 4:
            # -------------------------------------------------------------- producer
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load(tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                          pipeline_q, pipeline_k, pipeline_v, tile_x, tile_y, m_blocks, num_tiles, n_blocks)
        else:
            # -------------------------------------------------------------- consumers
            cute.arch.setmaxregister_increase(CONSUMER_REGS[self.consumer_warpgroups])
            self.consume(mDescale, mO, mLSE, softmax_scale_log2, seqlen_kv, sQ, sK, sV, sOnes,
                         tiled_mma_qk, tiled_mma_pv, tiled_mma_sum, pipeline_q, pipeline_k, pipeline_v,
                         tile_x, tile_y, m_blocks, num_tiles, n_blocks)

    @cute.jit
    def load(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, pipeline_q, pipeline_k,
             pipeline_v, tile_x: Int32, tile_y: Int32, m_blocks: Int32, num_tiles: Int32, n_blocks: Int32):
        """Producer warp: every tile of this CTA in turn (`load_tile`); the K/V rings run on across tiles."""
        args = (tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, pipeline_q, pipeline_k, pipeline_v)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        if const_expr(self.persistent_ctas > 0):
            for tile in cutlass.range(tile_x, num_tiles, cute.arch.grid_dim()[0], unroll=1):
                state, q_state = self.load_tile(*args, tile % m_blocks, tile // m_blocks, n_blocks, state, q_state)
        else:
            self.load_tile(*args, tile_x, tile_y, n_blocks, state, q_state)

    @cute.jit
    def load_tile(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, pipeline_q, pipeline_k,
                  pipeline_v, m_block: Int32, bh: Int32, n_blocks: Int32, state, q_state):
        """One tile: Q, then K of block n with V of block n+1 (V lags one block, the order in which the
        consumers' overlapped loop needs them). Returns the ring states for the next tile."""
        D, N = self.head_dim, self.tile_n
        gQ = cute.local_tile(mQ[None, None, bh], (self.tile_m, D), (None, 0))  # (M, D, m_blocks)
        gK = cute.local_tile(mK[None, None, bh], (N, D), (None, 0))  # (N, D, n_blocks)
        gV = cute.local_tile(mV[None, None, bh], (D, N), (0, None))  # (D, N, n_blocks)
        partition = lambda atom, s, g: cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))
        tQsQ, tQgQ = partition(tma_atom_Q, sQ, gQ)
        tKsK, tKgK = partition(tma_atom_K, sK, gK)
        tVsV, tVgV = partition(tma_atom_V, sV, gV)

        self.load_block(tma_atom_K, tKgK, tKsK, pipeline_k, n_blocks - 1, state)
        pipeline_q.producer_acquire(q_state)
        q_slot = 0
        if const_expr(self.q_stages > 1):
            q_slot = q_state.index
        cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, q_slot],
                  tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
        for i in cutlass.range(n_blocks - 1, unroll=1):
            block_v = n_blocks - 1 - i
            state_v = state.clone()
            state.advance()
            self.load_block(tma_atom_K, tKgK, tKsK, pipeline_k, block_v - 1, state)
            self.load_block(tma_atom_V, tVgV, tVsV, pipeline_v, block_v, state_v)
        self.load_block(tma_atom_V, tVgV, tVsV, pipeline_v, 0, state)
        state.advance()
        q_state.advance()
        return state, q_state

    @cute.jit
    def load_block(self, tma_atom, tXgX, tXsX, pipe, block: Int32, state):
        """Waits for the stage to be free, arms its full barrier, issues the TMA copy."""
        pipe.producer_acquire(state)
        cute.copy(tma_atom, tXgX[None, block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def consume(self, mDescale, mO, mLSE, softmax_scale_log2: Float32, seqlen_kv: Int32,
                sQ, sK, sV, sOnes, tiled_mma_qk, tiled_mma_pv, tiled_mma_sum, pipeline_q, pipeline_k, pipeline_v,
                tile_x: Int32, tile_y: Int32, m_blocks: Int32, num_tiles: Int32, n_blocks: Int32):
        """Consumer warpgroup: for each tile of this CTA (`consume_tile`), the whole key loop for its
        64 query rows, then the epilogue."""
        D, N = self.head_dim, self.tile_n
        M = self.tile_m
        tidx = cute.arch.thread_idx()[0] - WG_THREADS  # 0..M*2-1 over the consumer warpgroups
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)  # this consumer warpgroup, from 0
        persistent = self.persistent_ctas > 0
        # One tile: its scalars and the zeroed state here, in the order the one-tile kernel has always
        # had them (its PTX stays the same); persistent: per tile, in the loop.
        if const_expr(not persistent):
            scalars = self.tile_scalars(mDescale, mO, softmax_scale_log2, tile_y)

        # wgmma fragments are per warpgroup (descriptors for smem operands); accumulators per
        # thread. Per thread, acc_S ((2, 2, N/8), 1, 1) fp32 = (column pair c, row half r, n8
        # tile j): row 16 * (warp % 4) + lane / 4 + 8r of this warpgroup's 64, key 8j + 2(lane % 4)
        # + c. acc_O is the same with features for keys. tOrP ((4, 2, 2), 1, N/32) e4m3 =
        # (4 consecutive k slots, row half, k half), k-block: slots 4(lane % 4) + 16h + 0..3.
        wg_mma_qk = tiled_mma_qk.get_slice(wg * WG_THREADS)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * WG_THREADS)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ[None, None, 0] if const_expr(self.q_stages == 1) else sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sV))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((M, N)))
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((M, D)), Float32)
        if const_expr(not persistent):
            acc_O.fill(0.0)
        # Per-block P.V accumulator (two-level accumulation), else P.V accumulates into acc_O.
        acc_PV = cute.make_rmem_tensor(acc_O.shape, Float32) if const_expr(self.two_level_pv) else acc_O
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((M, N)))
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((M, D)))
        # pv_row_sum: the ones tile as P.V's second B operand, and a block's row sums (per thread
        # (c, r): column 2(lane % 4) + c, so only lane % 4 == 0's c = 0 is not zero).
        sums = None
        if const_expr(self.pv_row_sum):
            wg_mma_sum = tiled_mma_sum.get_slice(wg * WG_THREADS)
            tLrOnes = wg_mma_sum.make_fragment_B(wg_mma_sum.partition_B(sOnes[None, None, 0]))
            acc_L = cute.make_rmem_tensor(tiled_mma_sum.get_slice(tidx).partition_shape_C((M, ROW_SUM_COLS)),
                                          Float32)
            sums = (tiled_mma_sum, acc_L, tLrOnes)

        # Online-softmax state of this thread's 2 rows: row_max in log2-logit units, row_sum
        # this lane's share of sum(p * 256) (the 4 lanes of a quad are added in the epilogue).
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        if const_expr(not persistent):
            self.reset_rows(row_max, row_sum)

        # Ping-pong: consumer warpgroup 1 lets warpgroup 0 issue first.
        if const_expr(self.ping_pong):
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.CONSUMER_WG0_MAY_ISSUE),
                                         number_of_threads=2 * WG_THREADS)

        args = (mO, mLSE, seqlen_kv, tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v,
                tSrQ, tSrK, tOrV, tOrP, acc_O, acc_PV, tScS, tOcO, row_max, row_sum, sums, wg)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        if const_expr(persistent):
            for tile in cutlass.range(tile_x, num_tiles, cute.arch.grid_dim()[0], unroll=1):
                m_block, bh = tile % m_blocks, tile // m_blocks
                acc_O.fill(0.0)
                self.reset_rows(row_max, row_sum)
                state, q_state = self.consume_tile(
                    *args, m_block, self.tile_scalars(mDescale, mO, softmax_scale_log2, bh), n_blocks, state, q_state)
        else:
            self.consume_tile(*args, tile_x, scalars, n_blocks, state, q_state)

    @cute.jit
    def tile_scalars(self, mDescale, mO, softmax_scale_log2: Float32, bh: Int32):
        """(batch, head, qk_scale_log2, pv_scale) of a tile's (b*h). qk_scale_log2: raw e4m3 dot products
        -> log2-domain logits (descales of Q and K, softmax scale, log2 e). pv_scale: V's descale (P's
        x256 cancels against the row sum)."""
        num_heads = mO.shape[2]
        return (bh // num_heads, bh % num_heads, mDescale[0, bh] * mDescale[1, bh] * softmax_scale_log2,
                mDescale[2, bh])

    @cute.jit
    def reset_rows(self, row_max: cute.Tensor, row_sum: cute.Tensor):
        """A tile's online-softmax state before its first key block."""
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

    @cute.jit
    def consume_tile(self, mO, mLSE, seqlen_kv: Int32, tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k,
                     pipeline_v, tSrQ, tSrK, tOrV, tOrP, acc_O, acc_PV, tScS, tOcO, row_max, row_sum, sums,
                     wg: Int32, m_block: Int32, scalars, n_blocks: Int32, state, q_state):
        """One tile, its O and softmax state zeroed: online softmax over every key block, then O and LSE
        of its rows. Returns the ring states for the next tile."""
        N, M = self.tile_n, self.tile_m
        batch, head, qk_scale_log2, pv_scale = scalars
        pipeline_q.consumer_wait(q_state)

        # ------------------------------------------------------------------ main loop
        # First (last-in-order) block alone: S, key-tail mask, softmax, P.
        pipeline_k.consumer_wait(state)
        tile_q = tSrQ  # this tile's Q stage
        if const_expr(self.q_stages > 1):
            tile_q = tSrQ[None, None, None, q_state.index]
        acc_S = self.qk(tiled_mma_qk, tScS, tile_q, tSrK, state.index, 0)
        pipeline_k.consumer_release(state)
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            if (n_blocks - 1) * N + tScS[i][1] >= seqlen_kv:
                acc_S[i] = -Float32.inf
        self.online_softmax(acc_S, acc_O, row_max, row_sum, qk_scale_log2, True)
        self.store_p(acc_S, tOrP)

        # Steady state: S of block n - 1 is in flight while P.V of block n runs, then the
        # softmax of S overlaps the other warpgroup's GEMMs.
        for _ in cutlass.range(n_blocks - 1, unroll=1):
            state_v = state.clone()
            state.advance()
            pipeline_k.consumer_wait(state)
            if const_expr(self.ping_pong):
                cute.arch.barrier(barrier_id=int(NamedBarrier.CONSUMER_WG0_MAY_ISSUE) + wg,
                                  number_of_threads=2 * WG_THREADS)
            acc_S_next = self.qk(tiled_mma_qk, tScS, tile_q, tSrK, state.index, -1)
            pipeline_v.consumer_wait(state_v)
            self.pv(tiled_mma_pv, acc_PV, tOrP, tOrV[None, None, None, state_v.index], sums, -1)
            if const_expr(self.ping_pong):
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.CONSUMER_WG0_MAY_ISSUE) + 1 - wg,
                                         number_of_threads=2 * WG_THREADS)
            warpgroup.wait_group(1)  # S has landed; P.V may still run
            pipeline_k.consumer_release(state)
            row_scale = self.online_softmax(acc_S_next, acc_O, row_max, row_sum, qk_scale_log2, False)
            warpgroup.wait_group(0)  # P.V done: P registers and the V stage are free
            pipeline_v.consumer_release(state_v)
            self.store_p(acc_S_next, tOrP)
            self.add_block(acc_O, acc_PV, row_sum, sums, row_scale)

        if const_expr(self.persistent_ctas > 0):  # the tile's last S has landed: Q's stage is free
            pipeline_q.consumer_release(q_state)

        # Last P.V.
        pipeline_v.consumer_wait(state)
        self.pv(tiled_mma_pv, acc_PV, tOrP, tOrV[None, None, None, state.index], sums, 0)
        pipeline_v.consumer_release(state)
        self.add_block(acc_O, acc_PV, row_sum, sums, None)

        # ------------------------------------------------------------------ epilogue
        # Row half r of this thread: its (c, j) values of O. The row sum is of p * 256, which
        # cancels in O and comes off the LSE as P_SCALE_LOG2.
        lane = cute.arch.lane_idx()
        acc_O_rows = self.rows_view(acc_O)
        for r in cutlass.range_constexpr(2):
            store_row(mO, mLSE, batch, head, m_block, acc_O_rows[r, None],
                      tOcO[(None, r, None), 0, 0], row_max[r], row_sum[r], pv_scale, lane, P_SCALE_LOG2, M)
        state.advance()
        q_state.advance()
        return state, q_state

    @cute.jit
    def pv(self, tiled_mma_pv, acc_PV, tOrP, tOrV_stage, sums, wait: cutlass.Constexpr):
        """P.V of one block (and with pv_row_sum its row sums, P times the ones tile, in the same wgmma
        group)."""
        if const_expr(self.pv_row_sum):
            tiled_mma_sum, acc_L, tLrOnes = sums
            wgmma_group(((tiled_mma_pv, acc_PV, tOrP, tOrV_stage), (tiled_mma_sum, acc_L, tOrP, tLrOnes)), True, wait)
        else:
            wgmma(tiled_mma_pv, acc_PV, tOrP, tOrV_stage, self.two_level_pv, wait)

    def block_row_sums(self, acc_L: cute.Tensor) -> cute.Tensor:
        """(row half r, column c) view of the row-sum accumulator: per thread acc_L ((c, r), 1, 1) holds
        columns 2(lane % 4) + c of its two row halves r; column 0 (lane % 4 == 0, c = 0) is the block's
        row sum, every other column zero, so c = 0 alone is read."""
        return cute.make_tensor(acc_L.iterator, cute.make_layout((2, 2), stride=(2, 1)))

    @cute.jit
    def qk(self, tiled_mma_qk, tScS, tSrQ, tSrK, stage: Int32, wait: cutlass.Constexpr):
        """S = Q K^T of one key block into a fresh accumulator (raw e4m3 products)."""
        acc_S = cute.make_rmem_tensor(tScS.shape, Float32)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, stage], True, wait)
        return acc_S

    def rows_view(self, acc: cute.Tensor) -> cute.Tensor:
        """(row half r, (c, j)) view of a ((2, 2, n/8), 1, 1) accumulator (compact registers)."""
        n8 = cute.size(acc.shape[0][2])
        return cute.make_tensor(acc.iterator, cute.make_layout((2, (2, n8)), stride=(2, (1, 4))))

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, acc_O: cute.Tensor, row_max: cute.Tensor,
                       row_sum: cute.Tensor, qk_scale_log2: Float32, is_first: cutlass.Constexpr):
        """Raw scores -> p * 256 = 2^(s * scale - m + 8) in place; returns the factor that O
        must be multiplied by (2^(m_old - m_new)) before the next P.V.

        The max is exact over the quad (the 4 lanes of a row), so every lane subtracts the same
        m and p <= 1 holds for every key; the sum stays per lane until the epilogue.
        """
        scores = self.rows_view(acc_S)
        row_scale = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            raw = scores[r, None].load()
            block_max = quad_max(raw.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
            # Every row sees a real key in the first block it processes (the masked block holds
            # key n_blocks-1 * N < seqlen_kv), so new_max is finite from then on.
            new_max = cute.arch.fmax(row_max[r], block_max * qk_scale_log2)
            if const_expr(is_first):
                row_scale[r] = Float32(0.0)
            else:
                row_scale[r] = cute.math.exp2(row_max[r] - new_max, fastmath=True)
            self.exp2_row(scores, r, qk_scale_log2, P_SCALE_LOG2 - new_max)
            if const_expr(not self.pv_row_sum):  # else the tensor core sums P (`add_block`)
                block_sum = scores[r, None].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                if const_expr(is_first):
                    row_sum[r] = block_sum
                else:
                    row_sum[r] = row_sum[r] * row_scale[r] + block_sum
            row_max[r] = new_max
        return row_scale

    @cute.jit
    def exp2_row(self, scores: cute.Tensor, r: cutlass.Constexpr, qk_scale_log2: Float32, bias: Float32):
        """scores[r, :] = 2^(scores * qk_scale_log2 + bias), the first fma_exp2_tiles n8 tiles on
        the FMA pipe, the rest on the MUFU."""
        if const_expr(self.fma_exp2_tiles == 0):
            scores[r, None].store(cute.math.exp2(scores[r, None].load() * qk_scale_log2 + bias, fastmath=True))
        else:
            for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                x = scores[r, i] * qk_scale_log2 + bias
                if const_expr(i < 2 * self.fma_exp2_tiles):  # (c, j) with j < tiles
                    scores[r, i] = exp2_on_fma(x)
                else:
                    scores[r, i] = cute.math.exp2(x, fastmath=True)

    @cute.jit
    def add_block(self, acc_O: cute.Tensor, acc_PV: cute.Tensor, row_sum: cute.Tensor, sums, scale):
        """Adds a block's P.V into O (and with pv_row_sum its row sums into row_sum): two-level,
        O = (O + P.V) * scale, this block's factor (None: the last block, no rescale); single-level (P.V
        already in O), O *= scale (None: nothing to do)."""
        rows = self.rows_view(acc_O)
        block = self.rows_view(acc_PV)
        if const_expr(self.two_level_pv and scale is None):
            acc_O.store(acc_O.load() + acc_PV.load())
        elif const_expr(scale is not None):
            for r in cutlass.range_constexpr(2):
                if const_expr(self.two_level_pv):
                    rows[r, None].store((rows[r, None].load() + block[r, None].load()) * scale[r])
                else:
                    rows[r, None].store(rows[r, None].load() * scale[r])
        if const_expr(self.pv_row_sum):
            block_sums = self.block_row_sums(sums[1])
            for r in cutlass.range_constexpr(2):
                if const_expr(scale is None):
                    row_sum[r] = row_sum[r] + block_sums[r, 0]
                else:
                    row_sum[r] = (row_sum[r] + block_sums[r, 0]) * scale[r]

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

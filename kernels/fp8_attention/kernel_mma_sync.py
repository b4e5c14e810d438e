"""FP8 (e4m3) flash-attention forward with warp-level mma.sync m16n8k32 (sm_89, sm_90, sm_120).

Inputs come from `prep.py` (see its docstring for the packing contract; constants in `layout`):

- ``mQ``  [B*H, Sq_pad, D]  e4m3, row-major, Sq_pad a multiple of ``Q_ROWS`` (128), zero padded.
- ``mK``  [B*H, Skv_pad, D] e4m3, row-major, Skv_pad a multiple of ``KEYS`` (32), zero padded.
- ``mV``  [B*H, D, Skv_pad] e4m3, feature-major, keys permuted within each 16-key group by
  ``layout.key_order`` so that the S accumulator feeds the P.V A operand without shuffles.
- ``mDescale`` [3, B*H] fp32: the per-(batch, head) descales of Q, K, V (amax / 448).

Outputs: ``mO`` [B, Sq, H, D] bf16/fp16 (diffusers' layout, written straight from registers) and
optionally ``mLSE`` [B, H, Sq] fp32 (natural log).

One CTA = 128 query rows of one (batch, head), 4 warps; warp w owns the two m16 tiles at rows
16w and 64 + 16w (tiled_mma repeats its 4-warp, 64-row pattern twice). The CTA walks the keys
in 32-key strips through a two-stage cp.async pipeline: strip t+1 loads while strip t computes.
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from .epilogue import store_row
from .layout import KEYS, LOG2_E, P_SCALE, Q_ROWS
from .softmax import quad_max
from .support import check_head_dim

# Q_ROWS: query rows per CTA (4 warps x 32 rows); KEYS: keys per strip, one m16n8k32 k-block
# of the P.V GEMM; P_SCALE: p in [0, 1] is stored as p * 256 in e4m3 (max 256 < 448).
NUM_THREADS = 128
SMEM_BANK_PERIOD_BYTES = 128  # 32 banks x 4 bytes
CHUNK_BYTES = 16  # one cp.async / one ldmatrix row


def fp8_smem_layout(rows: int, row_bytes: int, stages: int):
    """Swizzled smem layout (rows, row_bytes, stages) for 1-byte elements.

    ldmatrix reads 8 rows of one 16-byte chunk column. The swizzle XORs the chunk index with
    the row bits above the 128-byte bank period (shift 3 = log2(128 / 16)), so those 8 rows
    land in 8 different 16-byte bank groups for any row width: Swizzle<3,4,3> for 128-byte
    rows, <2,4,3> for 64-byte rows, <1,4,3> for 32-byte rows (V's key strips).
    """
    chunks_per_row = row_bytes // CHUNK_BYTES
    swizzle_bits = min(int(math.log2(chunks_per_row)), 3)
    base_bits = int(math.log2(CHUNK_BYTES))
    shift_bits = int(math.log2(SMEM_BANK_PERIOD_BYTES // CHUNK_BYTES))
    atom = cute.make_composed_layout(
        cute.make_swizzle(swizzle_bits, base_bits, shift_bits),
        0,
        cute.make_layout((8, row_bytes), stride=(row_bytes, 1)),
    )
    return cute.tile_to_shape(atom, (rows, row_bytes, stages), (0, 1, 2))


def g2s_tiled_copy(dtype, row_bytes: int):
    """cp.async, 16 bytes per thread per copy, threads laid out row-major over the tile."""
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
        dtype,
        num_bits_per_copy=CHUNK_BYTES * 8,
    )
    threads_per_row = row_bytes // CHUNK_BYTES
    thread_layout = cute.make_layout(
        (NUM_THREADS // threads_per_row, threads_per_row), stride=(threads_per_row, 1)
    )
    return cute.make_tiled_copy_tv(atom, thread_layout, cute.make_layout((1, CHUNK_BYTES)))


class Fp8AttentionMmaSync:
    """Non-causal FP8 attention forward, one compiled kernel per (head_dim, output dtype, LSE)."""

    def __init__(self, head_dim: int):
        check_head_dim(head_dim)
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mDescale: cute.Tensor,
        mQScale: None,
        mKScale: None,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        mKeyLengths: cute.Tensor | None,
        softmax_scale: Float32,
        seqlen_kv: Int32,
        stream,
    ):
        """Builds the smem layouts, copies and MMA, then launches one CTA per (128 rows, b*h). mQScale and
        mKScale are the sm90 kernel's INT8 Q/K group scales, None here (v1 takes e4m3 Q/K alone). mKeyLengths:
        [B] int32, batch element b attends its first mKeyLengths[b] keys (clamped to 0 .. seqlen_kv), or None."""
        fp8 = mQ.element_type
        D = self.head_dim
        # The strides of every leading mode are multiples of 16 bytes (prep pads, O is ours):
        # tell the compiler so cp.async can move 16-byte chunks.
        mQ, mK, mV = [
            cute.make_tensor(t.iterator, cute.make_layout(
                t.shape, stride=(*(cute.assume(s, divby=16) for s in t.stride[:-1]), 1)))
            for t in (mQ, mK, mV)
        ]

        sQ_layout = fp8_smem_layout(Q_ROWS, D, 1)
        sK_layout = fp8_smem_layout(KEYS, D, 2)
        sV_layout = fp8_smem_layout(D, KEYS, 2)

        @cute.struct
        class SharedStorage:
            q: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sQ_layout)], 1024]
            k: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sK_layout)], 1024]
            v: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sV_layout)], 1024]

        # 4 warps stacked along M; N permuted to 16 so one ldmatrix.x4 feeds two n8 tiles.
        tiled_mma = cute.make_tiled_mma(
            warp.MmaFP8Op(fp8, Float32, (16, 8, 32)),
            (NUM_THREADS // 32, 1, 1),
            permutation_mnk=(NUM_THREADS // 32 * 16, 16, 32),
        )
        grid = (cute.ceil_div(mQ.shape[1], Q_ROWS), cute.size(mQ.shape[0]), 1)
        self.kernel(
            mQ, mK, mV, mDescale, mO, mLSE, mKeyLengths,
            softmax_scale * LOG2_E, seqlen_kv,
            sQ_layout, sK_layout, sV_layout,
            g2s_tiled_copy(fp8, D), g2s_tiled_copy(fp8, KEYS),
            tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mDescale: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        mKeyLengths: cute.Tensor | None,
        softmax_scale_log2: Float32,
        seqlen_kv: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        copy_rows: cute.TiledCopy,
        copy_v: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        # ------------------------------------------------------------------ set-up
        tidx, _, _ = cute.arch.thread_idx()
        m_block, bh, _ = cute.arch.block_idx()
        D = self.head_dim
        num_heads = mO.shape[2]
        batch, head = bh // num_heads, bh % num_heads
        n_tiles = mK.shape[1] // KEYS  # prep pads Skv to whole strips, so n_tiles >= 1
        if const_expr(mKeyLengths is not None):  # this element's keys alone, in at least one strip (`strip`)
            seqlen_kv = cutlass.max(cutlass.min(mKeyLengths[batch], seqlen_kv), Int32(0))
            n_tiles = cutlass.max(cute.ceil_div(seqlen_kv, KEYS), Int32(1))

        # qk_scale_log2: raw e4m3 dot products -> log2-domain logits (descales, softmax scale
        # and log2(e) in one factor). pv_scale: undoes V's descale and P's x256.
        qk_scale_log2 = mDescale[0, bh] * mDescale[1, bh] * softmax_scale_log2
        pv_scale = mDescale[2, bh] / P_SCALE

        gQ = cute.local_tile(mQ[bh, None, None], (Q_ROWS, D), (m_block, 0))  # (128, D)
        gK = cute.local_tile(mK[bh, None, None], (KEYS, D), (None, 0))  # (32, D, n_tiles)
        gV = cute.local_tile(mV[bh, None, None], (D, KEYS), (0, None))  # (D, 32, n_tiles)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.q.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.k.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.v.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        thr_rows = copy_rows.get_slice(tidx)
        thr_v = copy_v.get_slice(tidx)
        tQgQ, tQsQ = thr_rows.partition_S(gQ), thr_rows.partition_D(sQ[None, None, 0])
        tKgK, tKsK = thr_rows.partition_S(gK), thr_rows.partition_D(sK)
        tVgV, tVsV = thr_v.partition_S(gV), thr_v.partition_D(sV)

        # MMA fragments. Per thread: tSrS ((2,2), 2, 4) fp32 = (column pair, row half), m-tile,
        # n8 tile: rows {g, g+8} (g = lane // 4) of m-tiles {16w, 64+16w}, keys 8j + 2(lane % 4)
        # + {0, 1}. tOrO ((2,2), 2, D/8) is the same for features instead of keys.
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ[None, None, 0]))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sV[None, None, 0]))
        tOrO = cute.make_rmem_tensor(thr_mma.partition_shape_C((Q_ROWS, D)), Float32)
        tOrO.fill(0.0)
        # (row, column) of every accumulator value inside the CTA tile, for masks and stores.
        tScS = thr_mma.partition_C(cute.make_identity_tensor((Q_ROWS, KEYS)))
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((Q_ROWS, D)))

        # smem -> registers: ldmatrix.x4 of 8 rows x 16 bytes (no transpose: every operand
        # is K-major, V included, because prep stores V feature-major).
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), mQ.element_type)
        ldsm_A = cute.make_tiled_copy_A(ldsm, tiled_mma)
        ldsm_B = cute.make_tiled_copy_B(ldsm, tiled_mma)
        thr_ldsm_A, thr_ldsm_B = ldsm_A.get_slice(tidx), ldsm_B.get_slice(tidx)
        smem_ops = (
            ldsm_A, ldsm_B,
            thr_ldsm_A.partition_S(sQ[None, None, 0]), thr_ldsm_A.retile(tSrQ),  # (CPY, M, D/32)
            thr_ldsm_B.partition_S(sK), thr_ldsm_B.retile(tSrK),  # (CPY, N, D/32, stage)
            thr_ldsm_B.partition_S(sV), thr_ldsm_B.retile(tOrV),  # (CPY, D, 1, stage)
        )

        # Online-softmax state for the 4 rows this thread holds (index 2 * m_tile + row half):
        # row_max in log2-logit units (already scaled), row_sum = this thread's share of
        # sum(2^(logit - row_max)); the 4 lanes of a quad are summed once, in the epilogue.
        row_max = cute.make_rmem_tensor((4,), Float32)
        row_max.fill(-Float32.inf)
        row_sum = cute.make_rmem_tensor((4,), Float32)
        row_sum.fill(0.0)

        # Prologue: Q and strip 0 in one cp.async group.
        cute.copy(copy_rows, tQgQ, tQsQ)
        cute.copy(copy_rows, tKgK[None, None, None, 0], tKsK[None, None, None, 0])
        cute.copy(copy_v, tVgV[None, None, None, 0], tVsV[None, None, None, 0])
        cute.arch.cp_async_commit_group()

        # ------------------------------------------------------------------ main loop
        # Every strip but the last holds only real keys; the last one masks the key tail.
        prefetch = (copy_rows, copy_v, tKgK, tKsK, tVgV, tVsV, n_tiles)
        for k_tile in cutlass.range(n_tiles - 1, unroll=1):
            self.strip(k_tile, prefetch, smem_ops, tiled_mma, tSrQ, tSrK, tOrV, tOrO, tScS,
                       row_max, row_sum, qk_scale_log2, seqlen_kv, False)
        self.strip(n_tiles - 1, prefetch, smem_ops, tiled_mma, tSrQ, tSrK, tOrV, tOrO, tScS,
                   row_max, row_sum, qk_scale_log2, seqlen_kv, True)

        # ------------------------------------------------------------------ epilogue
        # Row (m_tile, half) of this thread: its (column, n8 tile) values of O. pv_scale already
        # holds P's 1/256, so the row sum is of p itself and the LSE needs no offset.
        lane = tidx % 32
        for m_tile in cutlass.range_constexpr(2):
            for half in cutlass.range_constexpr(2):
                state = 2 * m_tile + half
                store_row(mO, mLSE, batch, head, m_block,
                          tOrO[(None, half), m_tile, None], tOcO[(None, half), m_tile, None],
                          row_max[state], row_sum[state], pv_scale, lane, 0, Q_ROWS)

    @cute.jit
    def strip(
        self,
        k_tile: Int32,
        prefetch: tuple,
        smem_ops: tuple,
        tiled_mma: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrV: cute.Tensor,
        tOrO: cute.Tensor,
        tScS: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        qk_scale_log2: Float32,
        seqlen_kv: Int32,
        mask_keys: cutlass.Constexpr,
    ):
        """One 32-key strip: wait for it, prefetch the next, S = QK^T, online softmax, O += PV."""
        copy_rows, copy_v, tKgK, tKsK, tVgV, tVsV, n_tiles = prefetch
        ldsm_A, ldsm_B, tSsQ, tSrQ_view, tSsK, tSrK_view, tOsV, tOrV_view = smem_ops
        stage = k_tile % 2

        # This strip has landed; the barrier also proves every warp is done with the other
        # stage (it computed strip k_tile - 1 before arriving), so it may be overwritten.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if k_tile + 1 < n_tiles:
            cute.copy(copy_rows, tKgK[None, None, None, k_tile + 1], tKsK[None, None, None, 1 - stage])
            cute.copy(copy_v, tVgV[None, None, None, k_tile + 1], tVsV[None, None, None, 1 - stage])
        cute.arch.cp_async_commit_group()

        # S = Q K^T in raw e4m3 products (fp32 accumulate), D / 32 k-blocks of 32 features.
        tSrS = cute.make_rmem_tensor(tScS.shape, Float32)
        tSrS.fill(0.0)
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.copy(ldsm_A, tSsQ[None, None, kb], tSrQ_view[None, None, kb])
            cute.copy(ldsm_B, tSsK[None, None, kb, stage], tSrK_view[None, None, kb])
            cute.gemm(tiled_mma, tSrS, tSrQ[None, None, kb], tSrK[None, None, kb], tSrS)

        if const_expr(mask_keys):
            # Keys at or past seqlen_kv (zero padding, or an element's dropped keys): -inf makes their p exactly 0
            # (an element with no key: every p, by `online_softmax`'s safe max, and its rows come out 0).
            for i in cutlass.range_constexpr(cute.size(tSrS)):
                if k_tile * KEYS + tScS[i][1] >= seqlen_kv:
                    tSrS[i] = -Float32.inf

        # P as the A operand of the P.V mma: ((4,2,2), m_tile, 1) e4m3, i.e. per m-tile the 16
        # bytes of registers a0..a3 = (4 consecutive k slots, row half, k half). The k slot
        # order is what prep's key_order gives V, so the C -> A move below is lane-local.
        tOrP = cute.make_rmem_tensor(
            cute.make_layout(((4, 2, 2), 2, 1), stride=((1, 4, 8), 16, 0)), tOrV.element_type)
        self.online_softmax(tSrS, tOrO, row_max, row_sum, qk_scale_log2)
        # Two views of the same 32 values: (column, row half), m-tile, (n8 tile % 2, n8 tile // 2).
        # C value (c, r, m, j) = key 8j + 2t + c of row r; it goes to k slot 16(j // 2) + 4t +
        # 2(j % 2) + c, which is A value c + 2(j % 2) + 4r + 8(j // 2) + 16m.
        pack_shape = ((2, 2), 2, (2, 2))
        tSrS_pack = cute.make_tensor(tSrS.iterator, cute.make_layout(pack_shape, stride=((1, 2), 4, (8, 16))))
        tOrP_pack = cute.make_tensor(tOrP.iterator, cute.make_layout(pack_shape, stride=((1, 4), 16, (2, 8))))
        tOrP_pack.store((tSrS_pack.load() * P_SCALE).to(tOrP.element_type))

        # O += P V over the 32 keys of this strip (one k-block).
        cute.copy(ldsm_B, tOsV[None, None, 0, stage], tOrV_view[None, None, 0])
        cute.gemm(tiled_mma, tOrO, tOrP[None, None, 0], tOrV[None, None, 0], tOrO)

    @cute.jit
    def online_softmax(
        self,
        tSrS: cute.Tensor,
        tOrO: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        qk_scale_log2: Float32,
    ):
        """Turns raw scores into p = 2^(logit - running max) in place and rescales O and sums.

        The row max is exact across the quad (two butterfly shuffles), because all 4 lanes must
        subtract the same max; the row sum stays per-lane until the epilogue. p <= 1 always.
        """
        for m_tile in cutlass.range_constexpr(2):
            for half in cutlass.range_constexpr(2):
                state = 2 * m_tile + half
                scores = tSrS[(None, half), m_tile, None]  # (2, 4): this lane's 8 keys of the row
                raw = scores.load()
                strip_max = quad_max(raw.reduce(cute.ReductionOp.MAX, -Float32.inf, 0) * qk_scale_log2)
                new_max = cute.arch.fmax(row_max[state], strip_max)
                # new_max is finite once a real key was seen (strip 0 always has key 0); the
                # select keeps -inf - -inf out of exp2 anyway.
                safe_max = new_max if new_max != -Float32.inf else Float32(0.0)
                rescale = cute.math.exp2(row_max[state] - safe_max, fastmath=True)
                p = cute.math.exp2(raw * qk_scale_log2 - safe_max, fastmath=True)
                scores.store(p)
                row_sum[state] = row_sum[state] * rescale + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                row_max[state] = new_max
                out_row = tOrO[(None, half), m_tile, None]
                out_row.store(out_row.load() * rescale)

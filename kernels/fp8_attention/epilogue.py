"""The epilogue both kernels share: normalise one query row of O, write it and its LSE.

A row's O values and row-sum shares sit on the 4 lanes of a quad (see `softmax`). Its row sum
is only complete once the quad has been summed, which the main loop never needs, so it
happens here, once per row.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .layout import LN_2
from .softmax import quad_sum


@cute.jit
def store_row(
    mO: cute.Tensor,
    mLSE: cute.Tensor | None,
    batch: Int32,
    head: Int32,
    m_block: Int32,
    acc_row: cute.Tensor,
    coord_row: cute.Tensor,
    row_max: Float32,
    row_sum: Float32,
    pv_scale: Float32,
    lane: Int32,
    lse_offset_log2: cutlass.Constexpr,
    tile_rows: cutlass.Constexpr,
):
    """O[batch, row, head, :] = acc_row * pv_scale / row sum, and the row's natural-log LSE.

    acc_row: this lane's fp32 accumulator values of the row; coord_row: their (row, feature)
    coordinates inside the CTA's tile of `tile_rows` query rows (the matching slice of the identity
    tensor), so the row is m_block * tile_rows + coord_row[0][0]. row_max: the running max in
    log2-logit units; row_sum: this lane's share of the sum of the stored p, summed over the
    quad here. pv_scale turns accumulator units back into V's. lse_offset_log2: log2 of the
    factor the stored p carry (sm90: P_SCALE_LOG2, its row sum is of p * 256; v1: 0, its
    pv_scale divides by 256). Rows at or past Sq (padding of the last CTA) are not written;
    the quad's first lane (lane % 4 == 0; lane as the caller computes it) writes the LSE.
    """
    total = quad_sum(row_sum)
    # total >= 1 for every real row (its max key contributes 2^0, or 2^8 with the P scale in
    # it); the guard keeps a degenerate row at 0 instead of inf / NaN.
    inv = pv_scale / total if total > 0.0 else Float32(0.0)
    row = m_block * tile_rows + coord_row[0][0]
    if row < mO.shape[1]:
        if const_expr(mLSE is not None):
            if lane % 4 == 0:
                if const_expr(lse_offset_log2 != 0):
                    mLSE[batch, head, row] = (row_max + cute.math.log2(total) - lse_offset_log2) * LN_2
                else:
                    mLSE[batch, head, row] = (row_max + cute.math.log2(total)) * LN_2
        for i in cutlass.range_constexpr(cute.size(acc_row)):
            mO[batch, row, head, coord_row[i][1]] = (acc_row[i] * inv).to(mO.element_type)

"""Online softmax: reductions over the quad that holds a query row (both kernels), and the sm90 kernel's
per-thread softmax state (`OnlineSoftmax`).

In both kernels (mma.sync m16n8k32 and the per-warp slice of an m64nNk32 wgmma) a query row's
accumulator values are spread over the 4 lanes of a quad (lanes 4g..4g+3; lane t holds keys or
features 8j + 2t + {0, 1}). Two butterfly shuffles (xor 1, then xor 2) give all 4 lanes the
quad's result; no other lane takes part.
"""
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .layout import MAX_STEP, P_SCALE_LOG2, ROUND_TO_INT

# exp2 on the FMA pipe: x + 1.5 * 2^23 rounds x to the nearest integer j (kept in the low
# mantissa bits), f = x - j in [-0.5, 0.5], 2^f by a degree-2 polynomial (minimax relative
# error 1.7e-3, far below e4m3's 2^-4 rounding of P), then j is added to the exponent field.
ROUND_TO_INT_BITS = 0x4B400000  # the fp32 bits of ROUND_TO_INT
EXP2_POLY = (1.0004431009292603, 0.7034448981285095, 0.23842675983905792)


def quad_max(x: Float32) -> Float32:
    """max of x over the 4 lanes of this lane's quad, on every lane of it."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


def quad_sum(x: Float32) -> Float32:
    """Sum of x over the 4 lanes of this lane's quad, on every lane of it."""
    x += cute.arch.shuffle_sync_bfly(x, offset=1)
    x += cute.arch.shuffle_sync_bfly(x, offset=2)
    return x


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
def biased_scores(acc_S: cute.Tensor) -> cute.Tensor:
    """INT8 Q/K: the s32 scores s of acc_S as the fp32 1.5 * 2^23 + s, exactly, in the same registers (returned
    as a Float32 view): for |s| < 2^22 those are the bits of s + ROUND_TO_INT_BITS, one IADD each, where an
    I2F would queue on the quarter-rate pipe the exp2s need. The softmax takes the bias off in the FFMA it
    already does (`BiasedGroups`)."""
    acc_S.store(acc_S.load() + Int32(ROUND_TO_INT_BITS))
    return cute.recast_tensor(acc_S, Float32)


def _f32_asm(body: str, *values: Float32, loc=None, ip=None) -> Float32:
    """One fp32 result of a PTX snippet over fp32 operands $1.. (bit operations on their b32 registers)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip) for x in values], body, "=f" + ",f" * len(values),
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def ulp_steps(x: Float32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """(u, 1/u) for a positive normal x below 2^26: u = 2^(e - 22), twice the ulp of x (e: x's exponent)."""
    step = _f32_asm("{\n\t.reg .b32 b;\n\tmov.b32 b, $1;\n\tand.b32 b, b, 0x7F800000;\n\t"
                    "sub.s32 b, b, 0x0B000000;\n\tmov.b32 $0, b;\n\t}", x, loc=loc, ip=ip)
    inverse = _f32_asm("{\n\t.reg .b32 b;\n\tmov.b32 b, $1;\n\tand.b32 b, b, 0x7F800000;\n\t"
                       "sub.s32 b, 0x7F000000, b;\n\tadd.s32 b, b, 0x0B000000;\n\tmov.b32 $0, b;\n\t}",
                       x, loc=loc, ip=ip)
    return step, inverse


@dsl_user_op
def fma_f32(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c rounded once (an fma.rn the compiler cannot split into a rounded product and an add)."""
    return _f32_asm("fma.rn.f32 $0, $1, $2, $3;", a, b, c, loc=loc, ip=ip)


@dsl_user_op
def ceil_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """x rounded up to an integer (one cvt.rpi)."""
    return _f32_asm("cvt.rpi.f32.f32 $0, $1;", x, loc=loc, ip=ip)


class BiasedGroups(NamedTuple):
    """INT8 Q/K: what `OnlineSoftmax.online_update` needs to take `biased_scores`' 1.5 * 2^23 off exactly, per key
    block and thread. u = `ulp_steps` of 1.5 * 2^23 times the largest scale of the quad; each group's scale is cut
    (rounded up) to a multiple of u * 2^-22 (21-22 significant bits for the largest, fewer for a much smaller one;
    never 0, which would make a masked key's -inf score NaN), so its bias b = 1.5 * 2^23 * scale (below 2^23 u)
    is exact and a multiple of u; with the running max m kept a multiple of u too (rounded up), the
    constant (8 - m) - b of the exp2's FFMA is exact, so s * scale - m + 8 is rounded once, as the e4m3 scores'
    is. Rounding m up lowers p by up to a factor 2^u (P is p * 256 in e4m3, normal down to 2^-6): where u >
    MAX_STEP (scales of more than ~1.3 log2 units a unit of s: INT8 codes that coarse make a poor attention
    anyway), `exact` is set and the block's scores lose the bias by a FADD each, the max unrounded."""
    scales: tuple  # per key group, cut as above
    biases: tuple  # 1.5 * 2^23 * scale, exact
    step: Float32  # u
    inverse_step: Float32  # 1 / u
    exact: cutlass.Boolean  # u > MAX_STEP


@cute.jit
def biased_groups(scales: tuple) -> BiasedGroups:
    """The key block's `BiasedGroups` from this thread's groups' scales; u from the largest scale of the quad (the
    lanes of a row hold different key groups, and the row's max must be a multiple of one u on all of them)."""
    largest = cute.arch.fmax(scales[0], scales[1]) if const_expr(len(scales) == 2) else scales[0]
    step, inverse = ulp_steps(quad_max(largest) * Float32(ROUND_TO_INT))
    quantum, inverse_quantum = step * Float32(2.0**-22), inverse * Float32(2.0**22)
    cut = tuple(ceil_f32(scale * inverse_quantum) * quantum for scale in scales)
    biases = tuple(scale * Float32(ROUND_TO_INT) for scale in cut)
    return BiasedGroups(cut, biases, step, inverse, step > Float32(MAX_STEP))


def rows_view(acc: cute.Tensor) -> cute.Tensor:
    """(row half r, (c, j)) view of a thread's ((2, 2, n/8), 1, 1) wgmma accumulator (compact registers):
    per thread, value (c, r, j) is row 16 * (warp % 4) + lane / 4 + 8r of its warpgroup's 64 and column
    8j + 2(lane % 4) + c."""
    n8 = cute.size(acc.shape[0][2])
    return cute.make_tensor(acc.iterator, cute.make_layout((2, (2, n8)), stride=(2, (1, 4))))


def key_groups_view(acc: cute.Tensor, groups: int) -> cute.Tensor:
    """(row half r, key group g, (c, j)) view of a thread's S accumulator (`rows_view`) whose n8 tiles are split
    into `groups` runs of consecutive keys (INT8 Q/K: two groups of 64 keys, each with its own scale)."""
    n8 = cute.size(acc.shape[0][2])
    per_group = n8 // groups
    return cute.make_tensor(acc.iterator, cute.make_layout((2, groups, (2, per_group)),
                                                           stride=(2, 4 * per_group, (1, 4))))


def block_row_sums(acc_L: cute.Tensor) -> cute.Tensor:
    """(row half r, column c) view of the row-sum accumulator of `pv_row_sum` (P times the ones tile): per
    thread acc_L ((c, r), 1, 1) holds columns 2(lane % 4) + c of its two row halves r; column 0
    (lane % 4 == 0, c = 0) is the block's row sum, every other column zero, so c = 0 alone is read."""
    return cute.make_tensor(acc_L.iterator, cute.make_layout((2, 2), stride=(2, 1)))


@dataclass(frozen=True)
class OnlineSoftmax:
    """The sm90 kernel's online-softmax state of this thread's 2 query rows (row halves r of its wgmma
    accumulators, `rows_view`), and what it does to a key block's scores and to O. Frozen: the DSL keeps it
    as it is through the key loop (the tensors' registers change, the object does not).

    row_max: the running max of each row in log2-logit units (raw scores times their scale: the tile's
    qk_scale_log2, or with INT8 Q/K each key group's);
    row_sum: this lane's share of the row's sum(p * 256) against that max (the 4 lanes of a quad are added
    in the epilogue), with pv_row_sum the lane % 4 == 0 lane's whole row sum of the e4m3-rounded p * 256.
    fma_exp2_tiles, two_level_pv, pv_row_sum: the configuration's (`config.Sm90Config`), compile-time;
    keyless_rows: compiled for per-element key lengths (`fp8_attention(key_lengths=)`), where a batch element
    may keep no key: its one block is all -inf, and its rows come out 0 (LSE -inf) rather than NaN.
    """

    fma_exp2_tiles: int
    two_level_pv: bool
    pv_row_sum: bool
    keyless_rows: bool
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(fma_exp2_tiles: int, two_level_pv: bool, pv_row_sum: bool, keyless_rows: bool) -> "OnlineSoftmax":
        """The state in fresh registers (`reset` before a tile's first key block)."""
        return OnlineSoftmax(fma_exp2_tiles, two_level_pv, pv_row_sum, keyless_rows,
                             cute.make_rmem_tensor((2,), Float32), cute.make_rmem_tensor((2,), Float32))

    @cute.jit
    def reset(self):
        """A tile's state before its first key block."""
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def online_update(self, acc_S: cute.Tensor, scales: tuple, is_first: cutlass.Constexpr,
                      biased: BiasedGroups | None = None):
        """Raw scores -> p * 256 = 2^(s * scale - m + 8) in place; returns the factor that O
        must be multiplied by (2^(m_old - m_new)) before the next P.V. scales: the qk scale (log2 units)
        of each key group (`key_groups_view`): one, or INT8 Q/K's two, whose scores come biased by 1.5 * 2^23
        (`biased_scores`) and are scaled by `biased`'s (its scales, not these).

        The max is exact over the quad (the 4 lanes of a row), so every lane subtracts the same
        m and p <= 1 holds for every key; the sum stays per lane until the epilogue.
        """
        row_max, row_sum = self.row_max, self.row_sum
        scores = rows_view(acc_S)
        groups = key_groups_view(acc_S, len(scales))
        row_scale = cute.make_rmem_tensor((2,), Float32)
        biases = None
        if const_expr(biased is not None):
            scales, biases = biased.scales, biased.biases
            if biased.exact:  # (uniform over the quad) the bias off by a FADD each, the max unrounded
                acc_S.store(acc_S.load() - Float32(ROUND_TO_INT))
                biases = (Float32(0.0),) * len(scales)
        for r in cutlass.range_constexpr(2):
            if const_expr(biased is not None):  # (1.5 * 2^23 + s) * scale - bias, the one rounding of s * scale;
                # this lane's scales are its own, so its max is scaled before the quad's is taken
                block_max = -Float32.inf
                for g in cutlass.range_constexpr(len(scales)):
                    lane_max = groups[r, g, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                    block_max = cute.arch.fmax(block_max, fma_f32(lane_max, scales[g], -biases[g]))
                block_max = quad_max(block_max)
            else:
                group_max = [quad_max(groups[r, g, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
                             * scales[g] for g in range(len(scales))]
                block_max = group_max[0]
                for g in cutlass.range_constexpr(1, len(scales)):
                    block_max = cute.arch.fmax(block_max, group_max[g])
            # Every row sees a real key in the first block it processes (the masked block holds
            # key n_blocks-1 * N < seqlen_kv), so new_max is finite from then on; but for a batch element that
            # keeps no key (keyless_rows), whose one block is all -inf: a max of 0 makes its p 0, not NaN.
            new_max = cute.arch.fmax(row_max[r], block_max)
            if const_expr(biased is not None):  # a multiple of the block's step u, rounded up
                if not biased.exact:
                    new_max = ceil_f32(new_max * biased.inverse_step) * biased.step
            if const_expr(is_first and self.keyless_rows):
                new_max = new_max if new_max != -Float32.inf else Float32(0.0)
            if const_expr(is_first):
                row_scale[r] = Float32(0.0)
            else:
                row_scale[r] = cute.math.exp2(row_max[r] - new_max, fastmath=True)
            if const_expr(len(scales) == 1):
                self.exp2_row(scores, r, scales[0], P_SCALE_LOG2 - new_max)
            else:
                for g in cutlass.range_constexpr(len(scales)):
                    bias = P_SCALE_LOG2 - new_max
                    if const_expr(biased is not None):
                        bias = bias - biases[g]
                    groups[r, g, None].store(cute.math.exp2(groups[r, g, None].load() * scales[g] + bias,
                                                            fastmath=True))
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
    def add_block(self, acc_O: cute.Tensor, acc_PV: cute.Tensor, acc_L: cute.Tensor | None, row_scale):
        """Adds a block's P.V into O (and with pv_row_sum its row sums, acc_L, into row_sum): two-level,
        O = (O + P.V) * row_scale, this block's factor (None: the last block, no rescale); single-level
        (P.V already in O), O *= row_scale (None: nothing to do)."""
        row_sum = self.row_sum
        rows = rows_view(acc_O)
        block = rows_view(acc_PV)
        if const_expr(self.two_level_pv and row_scale is None):
            acc_O.store(acc_O.load() + acc_PV.load())
        elif const_expr(row_scale is not None):
            for r in cutlass.range_constexpr(2):
                if const_expr(self.two_level_pv):
                    rows[r, None].store((rows[r, None].load() + block[r, None].load()) * row_scale[r])
                else:
                    rows[r, None].store(rows[r, None].load() * row_scale[r])
        if const_expr(self.pv_row_sum):
            block_sums = block_row_sums(acc_L)
            for r in cutlass.range_constexpr(2):
                if const_expr(row_scale is None):
                    row_sum[r] = row_sum[r] + block_sums[r, 0]
                else:
                    row_sum[r] = (row_sum[r] + block_sums[r, 0]) * row_scale[r]

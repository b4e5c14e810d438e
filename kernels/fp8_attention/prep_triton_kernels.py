"""Triton kernels of `prep.prep_triton` (imported lazily: Triton exists only on GPU machines).

A call costs one or two Triton launches for q, k and v together (`launch_prep` picks):

- the plain prep (no prologue) of short sequences (max(Sq_pad, Skv_pad) <= SINGLE_LAUNCH_MAX_S):
  `_fp8_prep_single_kernel`, one program per (tensor, batch entry, head) that loops over its rows
  twice: the head's amax in a register, then scales, descale and codes. No atomics, no zeroed amax
  buffer;
- otherwise, and always with the prologue, two launches (program axis 2 picks the tensor, axis 1 a
  batch entry and a group of HEADS heads, axis 0 a block of rows):
  - `_fp8_prep_amax_kernel`: amax[t, bh] = max |x_t[b, :, h, :]| by atomic max into a zeroed buffer;
  - `_fp8_prep_pack_kernel`: descale/quant from amax in the kernel, the e4m3 codes of x * quant into
    the packed layouts, and descale.

Both paths share every mechanism below (values of a row block, magnitude with NaN counted as inf so
a NaN head cannot hide, scales rounded as `prep.scales_from_amax` rounds them, codes, layouts) and
the row-block shapes; a max does not depend on its order, so their outputs are bit-identical
(`tests/kernels/test_fp8_prep_interpret.py`, and against the torch spec in `tests/kernels/test_fp8_gpu.py`).

The prologue stays at two launches. A one-launch version (a program walking all its rows serially,
up to 8 heads each) cost 1.7-5.9x the GPU time of the two launches on the H200 (B1 D128, H1-56,
S 128-2048) and was not bit-identical to them there: descale 1 ulp off in 2 of 9 entries at B1 H3 S1
D128, codes equal (compiled, the two kernels' fp32 prologue arithmetic differs; in the interpreter it did
not; docs/notes/one-launch-prep.md).

With QK_INT8 (INT8 Q/K, `prep` contract) q and k need no amax pass: a program of SCALE_BLOCK rows holds its
scale groups whole, so the pack pass takes their amax, writes their scales and its codes (`_pack_int8_heads`); the amax
launch reads v alone, and the prologue's programs take 64 rows too.

All read x [B, S, H, D] through its strides (innermost stride 1). With PROLOGUE, q and k are
the attention's raw projections and both passes compute what MiniMax-H3's processor would feed
the attention, in fp32 and without rounding in between: per-head RMSNorm (weight w, eps) and then
the rotary embedding of the first 2*HALF channels (`kernels.rope` contract), recomputed in the
pack pass instead of written out, so q and k are read twice and written once, as fp8. A prologue
program loads its rows' cos/sin once and applies them to HEADS heads in turn: one head per program
would read the [S, R] fp32 tables once per head, three times the bytes of q and k themselves.

Every launch goes through `_launch`: Triton's JIT the first time for a launch spec (`prep.launch_spec`: the
inputs' shapes, strides, dtypes, devices and alignments), then the compiled kernel it returned, which skips
the JIT's per-call binding and specialization (half of a launch's host time). Turning the specialization off
instead, so that one compiled kernel would serve every spec, cost 3.5-5.7x the GPU time of the one-launch
path (H1 S128 20.1 against 3.5 us, H56 S2048 310 against 89: no vector loads or stores without known alignment).
"""
import torch
import triton
import triton.language as tl

from .layout import E4M3_MAX, INT8_MAX, K_SCALE_GROUPS, Q_SCALE_GROUPS, ROUND_TO_INT, SCALE_BLOCK
from .memo import BoundedMemo

BLOCK_S = 64  # rows per program; a multiple of 16 so V's key permutation stays inside it
PROLOGUE_BLOCK_S = 32  # rows per prologue program: its cos/sin tiles stay in registers
PROLOGUE_HEADS = 8  # heads per prologue program, sharing one load of cos/sin
CODE_MAX = tl.constexpr(E4M3_MAX)  # a jitted function reads module globals only as constexprs
DESCALE_PER_AMAX = tl.constexpr(1.0 / E4M3_MAX)  # rounded to fp32 in the kernel, as torch rounds it
INT8_CODE_MAX = tl.constexpr(INT8_MAX)
INT8_DESCALE_PER_AMAX = tl.constexpr(1.0 / INT8_MAX)
SCALE_ROWS = tl.constexpr(SCALE_BLOCK)  # INT8 Q/K: rows per block of scale groups (a constexpr, as jit code needs)
Q_GROUPS = tl.constexpr(Q_SCALE_GROUPS)
K_GROUPS = tl.constexpr(K_SCALE_GROUPS)
TO_INT = tl.constexpr(ROUND_TO_INT)  # x + this - this: x rounded to nearest even, for |x| < 2^22
# The plain prep's one-launch path up to this padded length. GPU time (H200, B1 D128, CUDA-graph replays),
# one launch against two: H1 S128 3.5 against 5.1 us, H56 S128 5.9 / 7.7, S512 17.8 / 14.1, S1024 44.7 / 33.9,
# S2048 89.4 / 63.1 (a program walks its head's row blocks alone, twice). Host time of a prep at B1 H1 S128:
# 45.0 us in one launch, 105.2 in two with the zeroed amax buffer. 256 is kept (itself not measured): at S128
# one launch wins on both; at S512 it would cost 3.7 us more GPU time for ~60 us less host time.
SINGLE_LAUNCH_MAX_S = 256


@triton.jit
def _load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, cols):
    """x[b, rows, h, cols] in fp32, 0 outside S rows."""
    ptrs = x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_s + cols[None, :]
    return tl.load(ptrs, mask=rows[:, None] < S, other=0.0).to(tl.float32)


@triton.jit
def _rotary_tables(cos_ptr, sin_ptr, rows, S, stride_cos, stride_sin, D: tl.constexpr, HALF: tl.constexpr,
                   PROLOGUE: tl.constexpr):
    """Per channel j of rows: (partner channel, cos, signed sin) with RoPE(x)[j] = x[j] cos + x[partner] ssin:
    partner j + HALF (sin negated) in the first half, j - HALF in the second, j itself (cos 1, sin 0)
    in the pass-through channels. Without PROLOGUE the identity, never read (cos and sin unloaded)."""
    cols = tl.arange(0, D)
    partner, c, ssin = cols, 1.0, 0.0  # a constexpr branch may rebind them to tensors (the kernel ran so)
    if PROLOGUE:
        rotary = cols < 2 * HALF
        partner = tl.where(cols < HALF, cols + HALF, tl.where(rotary, cols - HALF, cols))
        m = (rows[:, None] < S) & rotary[None, :]
        c = tl.load(cos_ptr + rows[:, None] * stride_cos + cols[None, :], mask=m, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + rows[:, None] * stride_sin + cols[None, :], mask=m, other=0.0).to(tl.float32)
        ssin = tl.where(cols[None, :] < HALF, -s, s)
    return partner, c, ssin


@triton.jit
def _normed_rotated(x_ptr, w_ptr, b, h, rows, S, stride_b, stride_s, stride_h, eps, partner, c, ssin,
                    D: tl.constexpr):
    """RoPE(RMSNorm(x) * w) of rows of one head, all D channels (rotary tables from `_rotary_tables`)."""
    cols = tl.arange(0, D)
    x = _load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, cols)
    x_partner = _load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, partner)  # the same rows: cached
    r = (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))[:, None]
    r = tl.where(rows[:, None] < S, r, 0.0)  # padding rows: 0, not 0 * inf (eps = 0) = NaN
    w = tl.load(w_ptr + cols).to(tl.float32)[None, :]
    w_partner = tl.load(w_ptr + partner).to(tl.float32)[None, :]
    return (x * r * w) * c + (x_partner * r * w_partner) * ssin


@triton.jit
def _values(x_ptr, w_ptr, b, h, rows, S, stride_b, stride_s, stride_h, eps, partner, c, ssin, D: tl.constexpr,
            PROLOGUE: tl.constexpr):
    """What prep quantizes of x[b, rows, h, :]: fp32, 0 outside S rows, after the prologue with PROLOGUE."""
    if PROLOGUE:
        y = _normed_rotated(x_ptr, w_ptr, b, h, rows, S, stride_b, stride_s, stride_h, eps, partner, c, ssin, D)
    else:
        y = _load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, tl.arange(0, D))
    return y


@triton.jit
def _row_magnitude(x):
    """max |x| of each row of a block; NaN counts as inf."""
    return tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=1)


@triton.jit
def _magnitude(x):
    """max |x| of a block; NaN counts as inf."""
    return tl.max(_row_magnitude(x), axis=0)


@triton.jit
def _amax_heads(x_ptr, w_ptr, amax_ptr, b, h0, H, rows, S, stride_b, stride_s, stride_h, eps, partner, c, ssin,
                D: tl.constexpr, HEADS: tl.constexpr, PROLOGUE: tl.constexpr):
    """amax of heads h0 .. h0 + HEADS - 1 (those < H) over these rows, into amax_ptr[b * H + h]."""
    for i in tl.static_range(HEADS):
        h = h0 + i
        if h < H:
            y = _values(x_ptr, w_ptr, b, h, rows, S, stride_b, stride_s, stride_h, eps, partner, c, ssin, D, PROLOGUE)
            tl.atomic_max(amax_ptr + b * H + h, _magnitude(y))


@triton.jit
def _fp8_prep_amax_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, Sq, Skv, H, GROUPS, BH,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                 wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, eps,
                 D: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, PROLOGUE: tl.constexpr,
                 HALF: tl.constexpr, QK_INT8: tl.constexpr):
    """amax [3, B*H], zeroed by the caller: of q, k (after the prologue, with PROLOGUE) and v; with QK_INT8
    of v alone (program axis 2 has one entry)."""
    which = tl.program_id(2)
    if QK_INT8:
        which = 2
    b, h0 = tl.program_id(1) // GROUPS, tl.program_id(1) % GROUPS * HEADS
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if which == 2:  # v takes no prologue
        _amax_heads(v_ptr, wk_ptr, amax_ptr + 2 * BH, b, h0, H, rows, Skv, svb, svs, svh, eps, tl.arange(0, D), 1.0,
                    0.0, D, HEADS, False)
    else:
        partner, c, ssin = _rotary_tables(cos_ptr, sin_ptr, rows, Sq, stride_cos, stride_sin, D, HALF, PROLOGUE)
        if which == 0:
            _amax_heads(q_ptr, wq_ptr, amax_ptr, b, h0, H, rows, Sq, sqb, sqs, sqh, eps, partner, c, ssin,
                        D, HEADS, PROLOGUE)
        else:
            _amax_heads(k_ptr, wk_ptr, amax_ptr + BH, b, h0, H, rows, Skv, skb, sks, skh, eps, partner, c, ssin,
                        D, HEADS, PROLOGUE)


@triton.jit
def _codes(x, quant):
    """e4m3 codes of x * quant: round to nearest even, clamped to +-448 (no NaN codes)."""
    return tl.minimum(tl.maximum(x * quant, -CODE_MAX), CODE_MAX).to(tl.float8e4nv)


@triton.jit
def _descale(amax, PER_AMAX: tl.constexpr = DESCALE_PER_AMAX):
    """descale from amax: `prep.scales_from_amax`, rounding included (PER_AMAX: 1/448, or 1/127 for INT8);
    amax is never NaN here (`_magnitude` counts NaN as inf), and an inf amax gives a NaN descale."""
    descale = tl.where(amax > 0, amax * PER_AMAX, 1.0)
    finite = (amax == amax) & (amax != float("inf"))
    return tl.where(finite, descale, float("nan"))


@triton.jit
def _quant_from(amax, CODE: tl.constexpr = CODE_MAX):
    """quant from amax, as `prep.scales_from_amax` rounds it: CODE (448, or 127 for INT8) * (1 / amax), 1 for
    an all-zero head."""
    return tl.where(amax > 0, tl.math.div_rn(1.0, amax) * CODE, 1.0)


@triton.jit
def _int8_codes(x, quant):
    """INT8 codes of x * quant: clamped to +-127, rounded to nearest even, 0 where the product is NaN (a block
    holding inf or NaN has quant 0 or a NaN value; its scale is NaN)."""
    t = x * quant
    t = tl.minimum(tl.maximum(tl.where(t == t, t, 0.0), -INT8_CODE_MAX), INT8_CODE_MAX)  # GPU max/min drop NaN
    return ((t + TO_INT) - TO_INT).to(tl.int8)


@triton.jit
def _group_amax(rows_amax, KEY_GROUPS: tl.constexpr):
    """The amax of each scale group of a 64-row block from its rows' [64] (`layout.q_scale_group`: row
    16w + 8i + g in group 8w + g, 32 groups; with KEY_GROUPS `layout.k_scale_group`: key 8m + 2t + c in group t,
    4 groups); an all-zero group takes the block's largest finite amax."""
    if KEY_GROUPS:
        amax = tl.max(tl.max(tl.reshape(rows_amax, (8, K_GROUPS, 2)), axis=2), axis=0)
    else:
        amax = tl.reshape(tl.max(tl.reshape(rows_amax, (4, 2, 8)), axis=1), (Q_GROUPS,))
    largest = tl.max(tl.where(amax == float("inf"), 0.0, amax), axis=0)
    return tl.where(amax == 0, largest, amax)


@triton.jit
def _per_row(groups, KEY_GROUPS: tl.constexpr):
    """A value per scale group [32] or [4] (`_group_amax`) -> the same value for each row of the block [64]."""
    if KEY_GROUPS:
        rows = tl.broadcast_to(tl.reshape(groups, (1, K_GROUPS, 1)), (8, K_GROUPS, 2))
    else:
        rows = tl.broadcast_to(tl.reshape(groups, (4, 1, 8)), (4, 2, 8))
    return tl.reshape(rows, (SCALE_ROWS,))


@triton.jit
def _pack_int8_heads(x_ptr, w_ptr, scale_ptr, descale_ptr, out_ptr, b, h0, H, block, S, S_pad, stride_b, stride_s,
                     stride_h, eps, partner, c, ssin, write_descale, D: tl.constexpr, HEADS: tl.constexpr,
                     PROLOGUE: tl.constexpr, KEY_GROUPS: tl.constexpr):
    """INT8 Q or K (KEY_GROUPS), one 64-row block (rows block * SCALE_BLOCK ..) of heads h0 .. h0 + HEADS - 1
    (those < H): its groups' amax (`_group_amax`), their scales into scale_ptr [B*H, ceil(S_pad / 64) * groups],
    its codes row-major (rows >= S are 0); descale [B*H] 1 where write_descale (a no-op in the kernel's per-head
    product)."""
    GROUPS: tl.constexpr = K_GROUPS if KEY_GROUPS else Q_GROUPS
    pos = block * SCALE_ROWS + tl.arange(0, SCALE_ROWS)
    cols = tl.arange(0, D)
    n_groups = tl.cdiv(S_pad, SCALE_ROWS) * GROUPS
    for i in tl.static_range(HEADS):
        h = h0 + i
        if h < H:
            bh = b * H + h
            if write_descale:
                tl.store(descale_ptr + bh, 1.0)
            y = _values(x_ptr, w_ptr, b, h, pos, S, stride_b, stride_s, stride_h, eps, partner, c, ssin, D, PROLOGUE)
            amax = _group_amax(_row_magnitude(y), KEY_GROUPS)
            tl.store(scale_ptr + bh * n_groups + block * GROUPS + tl.arange(0, GROUPS),
                     _descale(amax, INT8_DESCALE_PER_AMAX))
            quant = _per_row(_quant_from(amax, INT8_CODE_MAX), KEY_GROUPS)
            dst = out_ptr + bh * S_pad * D + pos[:, None] * D + cols[None, :]
            tl.store(dst, _int8_codes(y, quant[:, None]), mask=pos[:, None] < S_pad)


@triton.jit
def _quant(amax_ptr, descale_ptr, bh, write_descale):
    """quant of one head from its amax in memory; the head's descale too when write_descale (one
    program per head does)."""
    amax = tl.load(amax_ptr + bh)
    if write_descale:
        descale = _descale(amax)
        tl.store(descale_ptr + bh, descale)
    return _quant_from(amax)


@triton.jit
def _source_rows(pos, FEATURE_MAJOR: tl.constexpr):
    """The row of x that packed slot pos holds: pos (q, k), or layout.key_order(pos) inside each 16-key
    group (v)."""
    if FEATURE_MAJOR:
        element = pos % 4
        src = pos // 16 * 16 + 8 * (element // 2) + 2 * ((pos % 16) // 4) + element % 2
    else:
        src = pos
    return src


@triton.jit
def _pack_head(x_ptr, w_ptr, out_ptr, b, h, bh, pos, src, S, S_pad, stride_b, stride_s, stride_h, eps, partner, c,
               ssin, quant, D: tl.constexpr, PROLOGUE: tl.constexpr, FEATURE_MAJOR: tl.constexpr):
    """Codes of head h at slots pos: row-major [S_pad, D] holding row p (q, k), or feature-major
    [D, S_pad] holding key_order(p) (v); rows >= S are 0."""
    cols = tl.arange(0, D)
    y = _values(x_ptr, w_ptr, b, h, src, S, stride_b, stride_s, stride_h, eps, partner, c, ssin, D, PROLOGUE)
    if FEATURE_MAJOR:
        dst = out_ptr + bh * D * S_pad + cols[None, :] * S_pad + pos[:, None]
    else:
        dst = out_ptr + bh * S_pad * D + pos[:, None] * D + cols[None, :]
    tl.store(dst, _codes(y, quant), mask=pos[:, None] < S_pad)


@triton.jit
def _pack_heads(x_ptr, w_ptr, amax_ptr, descale_ptr, out_ptr, b, h0, H, pos, S, S_pad, stride_b, stride_s,
                stride_h, eps, partner, c, ssin, write_descale, D: tl.constexpr, HEADS: tl.constexpr,
                PROLOGUE: tl.constexpr, FEATURE_MAJOR: tl.constexpr):
    """Codes of heads h0 .. h0 + HEADS - 1 (those < H) at slots pos, quant from amax in memory."""
    src = _source_rows(pos, FEATURE_MAJOR)
    for i in tl.static_range(HEADS):
        h = h0 + i
        if h < H:
            bh = b * H + h
            quant = _quant(amax_ptr, descale_ptr, bh, write_descale)
            _pack_head(x_ptr, w_ptr, out_ptr, b, h, bh, pos, src, S, S_pad, stride_b, stride_s, stride_h, eps,
                       partner, c, ssin, quant, D, PROLOGUE, FEATURE_MAJOR)


@triton.jit
def _fp8_prep_pack_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, out_q, out_k, out_v, descale_ptr, q_scale_ptr, k_scale_ptr,
                 Sq, Skv, Sq_pad, Skv_pad, H, GROUPS, BH, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                 wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, eps,
                 D: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, PROLOGUE: tl.constexpr,
                 HALF: tl.constexpr, QK_INT8: tl.constexpr):
    """Scales from amax (`prep.scales_from_amax`, written to descale [3, B*H] by the first block of
    rows), then codes: q and k row-major, v feature-major [D, Skv_pad] holding key_order(p). With QK_INT8
    (BLOCK = SCALE_BLOCK), q and k by `_pack_int8_heads` into the group scales q_scale and k_scale."""
    which = tl.program_id(2)
    b, h0 = tl.program_id(1) // GROUPS, tl.program_id(1) % GROUPS * HEADS
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    first = tl.program_id(0) == 0
    if which == 2:  # v takes no prologue
        _pack_heads(v_ptr, wk_ptr, amax_ptr + 2 * BH, descale_ptr + 2 * BH, out_v, b, h0, H, pos, Skv, Skv_pad,
                    svb, svs, svh, eps, tl.arange(0, D), 1.0, 0.0, first, D, HEADS, False, True)
    else:
        partner, c, ssin = _rotary_tables(cos_ptr, sin_ptr, pos, Sq, stride_cos, stride_sin, D, HALF, PROLOGUE)
        if QK_INT8:  # (a constexpr branch: the e4m3 q and k stores below are not compiled for int8 outputs)
            if which == 0:
                if tl.program_id(0) * BLOCK < Sq_pad:
                    _pack_int8_heads(q_ptr, wq_ptr, q_scale_ptr, descale_ptr, out_q, b, h0, H, tl.program_id(0), Sq,
                                     Sq_pad, sqb, sqs, sqh, eps, partner, c, ssin, first, D, HEADS, PROLOGUE, False)
            elif tl.program_id(0) * BLOCK < Skv_pad:
                _pack_int8_heads(k_ptr, wk_ptr, k_scale_ptr, descale_ptr + BH, out_k, b, h0, H, tl.program_id(0),
                                 Skv, Skv_pad, skb, sks, skh, eps, partner, c, ssin, first, D, HEADS, PROLOGUE, True)
        elif which == 0:
            _pack_heads(q_ptr, wq_ptr, amax_ptr, descale_ptr, out_q, b, h0, H, pos, Sq, Sq_pad, sqb, sqs, sqh, eps,
                        partner, c, ssin, first, D, HEADS, PROLOGUE, False)
        else:
            _pack_heads(k_ptr, wk_ptr, amax_ptr + BH, descale_ptr + BH, out_k, b, h0, H, pos, Skv, Skv_pad, skb,
                        sks, skh, eps, partner, c, ssin, first, D, HEADS, PROLOGUE, False)


@triton.jit
def _prep_head(x_ptr, descale_ptr, out_ptr, b, h, H, S, S_pad, stride_b, stride_s, stride_h, D: tl.constexpr,
               BLOCK: tl.constexpr, FEATURE_MAJOR: tl.constexpr):
    """All of the plain prep for head h of one tensor: its amax over S rows in a register, the scales,
    descale, then the codes of every slot < S_pad, in the row blocks the two-launch kernels use."""
    cols = tl.arange(0, D)
    amax = 0.0  # as the two-launch path's zeroed buffer
    for start in range(0, S, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, _magnitude(_load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, cols)))
    bh = b * H + h
    tl.store(descale_ptr + bh, _descale(amax))
    quant = _quant_from(amax)
    for start in range(0, S_pad, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        _pack_head(x_ptr, x_ptr, out_ptr, b, h, bh, pos, _source_rows(pos, FEATURE_MAJOR), S, S_pad, stride_b,
                   stride_s, stride_h, 0.0, cols, 1.0, 0.0, quant, D, False, FEATURE_MAJOR)  # no prologue: w unread


@triton.jit
def _fp8_prep_single_kernel(q_ptr, k_ptr, v_ptr, out_q, out_k, out_v, descale_ptr, q_scale_ptr, k_scale_ptr, Sq, Skv,
                            Sq_pad, Skv_pad, H, BH, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, D: tl.constexpr,
                            BLOCK: tl.constexpr, QK_INT8: tl.constexpr):
    """The whole plain prep in one launch, one program per (tensor: axis 1, batch entry and head: axis 0);
    the outputs of the two-launch kernels, bit for bit (with QK_INT8, q and k block by block)."""
    which = tl.program_id(1)
    b, h = tl.program_id(0) // H, tl.program_id(0) % H
    cols = tl.arange(0, D)
    if which == 2:
        _prep_head(v_ptr, descale_ptr + 2 * BH, out_v, b, h, H, Skv, Skv_pad, svb, svs, svh, D, BLOCK, True)
    elif QK_INT8:  # (a constexpr branch: the e4m3 q and k stores below are not compiled for int8 outputs)
        if which == 0:
            for block in range(0, tl.cdiv(Sq_pad, SCALE_ROWS)):
                _pack_int8_heads(q_ptr, q_ptr, q_scale_ptr, descale_ptr, out_q, b, h, H, block, Sq, Sq_pad, sqb, sqs,
                                 sqh, 0.0, cols, 1.0, 0.0, block == 0, D, 1, False, False)
        else:
            for block in range(0, tl.cdiv(Skv_pad, SCALE_ROWS)):
                _pack_int8_heads(k_ptr, k_ptr, k_scale_ptr, descale_ptr + BH, out_k, b, h, H, block, Skv, Skv_pad,
                                 skb, sks, skh, 0.0, cols, 1.0, 0.0, block == 0, D, 1, False, True)
    elif which == 0:
        _prep_head(q_ptr, descale_ptr, out_q, b, h, H, Sq, Sq_pad, sqb, sqs, sqh, D, BLOCK, False)
    else:
        _prep_head(k_ptr, descale_ptr + BH, out_k, b, h, H, Skv, Skv_pad, skb, sks, skh, D, BLOCK, False)


# Launchers of compiled kernels by (kernel name, launch spec, grid, constexprs): see `_launch`. A miss costs one
# JIT launch, ~10 us more, and no compile (Triton keeps its own cache).
_compiled = BoundedMemo(1024)


def _launch(kernel, grid: tuple, args: tuple, constexprs: dict, spec: tuple) -> None:
    """kernel[grid](*args, **constexprs), through Triton's JIT the first time for this `spec` (binding and
    specializing the arguments, compiling if needed) and afterwards through the compiled kernel it returned: 9
    against 18 us of host time per launch on the H200's host (B1 H1 S128). Sound because `spec`
    (`prep.launch_spec`) fixes everything the JIT specializes on: the integers' values and each pointer's
    dtype and 16-byte alignment (the outputs are fresh allocations, aligned); the one float, eps, is always
    a Python float (`launch_prep`), which the JIT does not specialize by value. grid has three entries;
    constexprs are given in the kernel's parameter order, after every runtime argument (they are passed by
    position)."""
    key = (kernel.__name__, spec, grid, *constexprs.values())
    launcher = _compiled.get(key)
    if launcher is not None:
        launcher(*args, *constexprs.values())
        return
    if tuple(constexprs) != tuple(kernel.arg_names[len(args):]):
        raise ValueError(f"{kernel.__name__}: constexprs {tuple(constexprs)} are not its last parameters in order")
    compiled = kernel[grid](*args, **constexprs)
    if compiled is None:  # Triton's interpreter (the CPU tests) compiles nothing: it runs each launch
        return
    _compiled.remember(key, compiled[grid])


def launch_prep(q, k, v, out_q, out_k, out_v, descale, prologue, spec: tuple, q_scale=None, k_scale=None) -> None:
    """One launch without a prologue when max(Sq_pad, Skv_pad) <= SINGLE_LAUNCH_MAX_S, else two (and a
    zeroed amax [3, B*H] fp32 buffer for them); prologue None or (norm_q_weight, norm_k_weight, eps, cos,
    sin) with cos, sin [S, R] (`prep.Prologue`); spec: `prep.launch_spec` of these inputs; q_scale and k_scale:
    INT8 Q/K's group scales (out_q and out_k int8), or None. Launches on the current device: q's
    (`prep.prep_triton` sees to it)."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    sq_pad, skv_pad = out_q.shape[1], out_k.shape[1]
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    qk_int8 = q_scale is not None
    scales = (q_scale, k_scale) if qk_int8 else (descale, descale)  # unread without QK_INT8: any pointer
    if prologue is None and max(sq_pad, skv_pad) <= SINGLE_LAUNCH_MAX_S:
        _launch(_fp8_prep_single_kernel, (b * h, 3, 1),
                (q, k, v, out_q, out_k, out_v, descale, *scales, sq, skv, sq_pad, skv_pad, h, b * h, *strides),
                dict(D=d, BLOCK=BLOCK_S, QK_INT8=qk_int8), spec)
        return
    if prologue is None:
        wq = wk = cos = sin = q  # unread (PROLOGUE is off): any pointer will do
        eps, stride_cos, stride_sin, half, block, heads = 0.0, 0, 0, 0, BLOCK_S, 1
    else:
        wq, wk, eps, cos, sin = prologue
        eps = float(eps)  # an int eps would be specialized by value (1 as a constexpr), which spec does not hold
        stride_cos, stride_sin, half = cos.stride(0), sin.stride(0), cos.shape[1] // 2
        block, heads = PROLOGUE_BLOCK_S, min(PROLOGUE_HEADS, h)
    if qk_int8:
        block = SCALE_BLOCK  # a program holds whole scale groups of q or k (`_pack_int8_heads`)
    groups = triton.cdiv(h, heads)
    shared = dict(D=d, BLOCK=block, HEADS=heads, PROLOGUE=prologue is not None, HALF=half, QK_INT8=qk_int8)
    tail = (wq, wk, cos, sin, stride_cos, stride_sin, eps)
    amax = torch.zeros(3, b * h, dtype=torch.float32, device=q.device)
    amax_rows, amax_tensors = (skv, 1) if qk_int8 else (max(sq, skv), 3)  # INT8 Q/K: v's amax alone
    _launch(_fp8_prep_amax_kernel, (triton.cdiv(amax_rows, block), b * groups, amax_tensors),
            (q, k, v, amax, sq, skv, h, groups, b * h, *strides, *tail), shared, spec)
    _launch(_fp8_prep_pack_kernel, (triton.cdiv(max(sq_pad, skv_pad), block), b * groups, 3),
            (q, k, v, amax, out_q, out_k, out_v, descale, *scales, sq, skv, sq_pad, skv_pad, h, groups, b * h, *strides,
             *tail), shared, spec)

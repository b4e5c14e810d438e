"""Triton kernels of `prep.prep_triton` (imported lazily: Triton exists only on GPU machines).

A call costs one or two Triton launches for q, k and v together (`launch_prep` picks):

- short sequences (max(Sq_pad, Skv_pad) <= SINGLE_LAUNCH_MAX_S): `_fp8_prep_single_kernel`, one
  program per (tensor, batch entry, group of HEADS heads) that loops over its rows twice: the heads'
  amax in registers, then scales, descale and codes. No atomics, no zeroed amax buffer;
- otherwise two launches (program axis 2 picks the tensor, axis 1 a batch entry and a group of HEADS
  heads, axis 0 a block of rows):
  - `_fp8_prep_amax_kernel`: amax[t, bh] = max |x_t[b, :, h, :]| by atomic max into a zeroed buffer;
  - `_fp8_prep_pack_kernel`: descale/quant from amax in the kernel, the e4m3 codes of x * quant into
    the packed layouts, and descale.

Both paths share every mechanism below (values of a row block, magnitude with NaN counted as inf so
a NaN head cannot hide, scales rounded as `prep.scales_from_amax` rounds them, codes, layouts) and
the row-block shapes, so their outputs are bit-identical (`tests/kernels/test_fp8_prep_interpret.py`).

All read x [B, S, H, D] through its strides (innermost stride 1). With PROLOGUE, q and k are
the attention's raw projections and both passes compute what MiniMax-H3's processor would feed
the attention, in fp32 and without rounding in between: per-head RMSNorm (weight w, eps) and then
the rotary embedding of the first 2*HALF channels (`kernels.rope` contract), recomputed in the
pack pass instead of written out, so q and k are read twice and written once, as fp8. A prologue
program loads its rows' cos/sin once and applies them to HEADS heads in turn: one head per program
would read the [S, R] fp32 tables once per head, three times the bytes of q and k themselves.
"""
import torch
import triton
import triton.language as tl

from .layout import E4M3_MAX

BLOCK_S = 64  # rows per program; a multiple of 16 so V's key permutation stays inside it
PROLOGUE_BLOCK_S = 32  # rows per prologue program: its cos/sin tiles stay in registers
PROLOGUE_HEADS = 8  # heads per prologue program, sharing one load of cos/sin
CODE_MAX = tl.constexpr(E4M3_MAX)  # a jitted function reads module globals only as constexprs
DESCALE_PER_AMAX = tl.constexpr(1.0 / E4M3_MAX)  # rounded to fp32 in the kernel, as torch rounds it
# The one-launch path up to this padded length. A short call is host-bound: each Triton launch costs
# 43-70 us of host time (H200, 1x1x128x128) and the zeroed amax buffer one more allocation and fill,
# against a few us of GPU time for a head of a few hundred rows. The single launch runs a program's
# rows serially (2 * S_pad / BLOCK row blocks: 8 at 256 without the prologue, 16 with it; 32 and 64 at
# 1024, where B1 H56 with the prologue has only 21 programs), so its GPU time grows with S while the
# saved host cost does not. 256 until `scripts/check_compile.py --per-call-only` (prep_gpu_us) has
# measured where the trade turns; it may well be higher.
SINGLE_LAUNCH_MAX_S = 256
# Warps of the one-launch program, twice the two-launch kernels' 4: a program walks its rows alone, and
# each thread holds half the tile. With 4 warps (and its pack loop's heads unrolled, which also hoists
# every head's gather addresses out of the row loop) ptxas spilled 1.7 KB a thread at D = 128 with the
# prologue; with 8 and the heads in a loop, 4 B (0 B without the prologue or at D = 64; ptxas 13.0, sm_90a).
# The rows go to the extra warps, so a row's reduction (the RMSNorm sum) runs over the same lanes and
# warps in the same order as in the two-launch kernels (TTGIR: threadsPerWarp [1, 32] and 4 warps along
# D at D = 128, 2 at D = 64, in both), which keeps the codes bit-identical.
SINGLE_LAUNCH_WARPS = 8


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
def _magnitude(x):
    """max |x| of a block; NaN counts as inf."""
    return tl.max(tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=1), axis=0)


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
                 HALF: tl.constexpr):
    """amax [3, B*H], zeroed by the caller: of q, k (after the prologue, with PROLOGUE) and v."""
    which = tl.program_id(2)
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
def _descale(amax):
    """descale from amax (a scalar or a vector of heads): `prep.scales_from_amax`, rounding included;
    amax is never NaN here (`_magnitude` counts NaN as inf), and an inf amax gives a NaN descale."""
    descale = tl.where(amax > 0, amax * DESCALE_PER_AMAX, 1.0)
    finite = (amax == amax) & (amax != float("inf"))
    return tl.where(finite, descale, float("nan"))


@triton.jit
def _quant_from(amax):
    """quant from amax, as `prep.scales_from_amax` rounds it: 448 * (1 / amax), 1 for an all-zero head."""
    return tl.where(amax > 0, tl.math.div_rn(1.0, amax) * CODE_MAX, 1.0)


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
def _fp8_prep_pack_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, out_q, out_k, out_v, descale_ptr,
                 Sq, Skv, Sq_pad, Skv_pad, H, GROUPS, BH, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                 wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, eps,
                 D: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, PROLOGUE: tl.constexpr,
                 HALF: tl.constexpr):
    """Scales from amax (`prep.scales_from_amax`, written to descale [3, B*H] by the first block of
    rows), then codes: q and k row-major, v feature-major [D, Skv_pad] holding key_order(p)."""
    which = tl.program_id(2)
    b, h0 = tl.program_id(1) // GROUPS, tl.program_id(1) % GROUPS * HEADS
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    first = tl.program_id(0) == 0
    if which == 2:  # v takes no prologue
        _pack_heads(v_ptr, wk_ptr, amax_ptr + 2 * BH, descale_ptr + 2 * BH, out_v, b, h0, H, pos, Skv, Skv_pad,
                    svb, svs, svh, eps, tl.arange(0, D), 1.0, 0.0, first, D, HEADS, False, True)
    else:
        partner, c, ssin = _rotary_tables(cos_ptr, sin_ptr, pos, Sq, stride_cos, stride_sin, D, HALF, PROLOGUE)
        if which == 0:
            _pack_heads(q_ptr, wq_ptr, amax_ptr, descale_ptr, out_q, b, h0, H, pos, Sq, Sq_pad, sqb, sqs, sqh, eps,
                        partner, c, ssin, first, D, HEADS, PROLOGUE, False)
        else:
            _pack_heads(k_ptr, wk_ptr, amax_ptr + BH, descale_ptr + BH, out_k, b, h0, H, pos, Skv, Skv_pad, skb,
                        sks, skh, eps, partner, c, ssin, first, D, HEADS, PROLOGUE, False)


@triton.jit
def _prep_heads(x_ptr, w_ptr, descale_ptr, out_ptr, b, h0, H, S, S_pad, stride_b, stride_s, stride_h, eps,
                cos_ptr, sin_ptr, stride_cos, stride_sin, D: tl.constexpr, BLOCK: tl.constexpr,
                HEADS: tl.constexpr, LANES: tl.constexpr, PROLOGUE: tl.constexpr, HALF: tl.constexpr,
                FEATURE_MAJOR: tl.constexpr):
    """All of prep for heads h0 .. h0 + HEADS - 1 (those < H) of one tensor: their amax over S rows in
    registers (lane i of a LANES-wide vector, LANES = HEADS rounded up to a power of two), the scales,
    descale, then the codes of every slot < S_pad, in the row blocks the two-launch kernels use."""
    lanes = tl.arange(0, LANES)
    amax = tl.zeros([LANES], dtype=tl.float32)
    for start in range(0, S, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        partner, c, ssin = _rotary_tables(cos_ptr, sin_ptr, rows, S, stride_cos, stride_sin, D, HALF, PROLOGUE)
        for i in tl.static_range(HEADS):
            if h0 + i < H:
                y = _values(x_ptr, w_ptr, b, h0 + i, rows, S, stride_b, stride_s, stride_h, eps, partner, c, ssin,
                            D, PROLOGUE)
                amax = tl.where(lanes == i, tl.maximum(amax, _magnitude(y)), amax)
    tl.store(descale_ptr + b * H + h0 + lanes, _descale(amax), mask=(lanes < HEADS) & (h0 + lanes < H))
    quant = _quant_from(amax)
    for start in range(0, S_pad, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        src = _source_rows(pos, FEATURE_MAJOR)
        partner, c, ssin = _rotary_tables(cos_ptr, sin_ptr, pos, S, stride_cos, stride_sin, D, HALF, PROLOGUE)
        for i in range(HEADS):  # not unrolled: see SINGLE_LAUNCH_WARPS
            h = h0 + i
            if h < H:
                head_quant = tl.max(tl.where(lanes == i, quant, 0.0), axis=0)  # quant >= 0: exactly lane i's
                _pack_head(x_ptr, w_ptr, out_ptr, b, h, b * H + h, pos, src, S, S_pad, stride_b, stride_s,
                           stride_h, eps, partner, c, ssin, head_quant, D, PROLOGUE, FEATURE_MAJOR)


@triton.jit
def _fp8_prep_single_kernel(q_ptr, k_ptr, v_ptr, out_q, out_k, out_v, descale_ptr,
                            Sq, Skv, Sq_pad, Skv_pad, H, GROUPS, BH, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                            wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, eps,
                            D: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, LANES: tl.constexpr,
                            PROLOGUE: tl.constexpr, HALF: tl.constexpr):
    """The whole prep in one launch, one program per (tensor: axis 1, batch entry and group of heads:
    axis 0); the outputs of the two-launch kernels, bit for bit."""
    which = tl.program_id(1)
    b, h0 = tl.program_id(0) // GROUPS, tl.program_id(0) % GROUPS * HEADS
    if which == 2:  # v takes no prologue
        _prep_heads(v_ptr, wk_ptr, descale_ptr + 2 * BH, out_v, b, h0, H, Skv, Skv_pad, svb, svs, svh, eps,
                    cos_ptr, sin_ptr, stride_cos, stride_sin, D, BLOCK, HEADS, LANES, False, HALF, True)
    elif which == 0:
        _prep_heads(q_ptr, wq_ptr, descale_ptr, out_q, b, h0, H, Sq, Sq_pad, sqb, sqs, sqh, eps,
                    cos_ptr, sin_ptr, stride_cos, stride_sin, D, BLOCK, HEADS, LANES, PROLOGUE, HALF, False)
    else:
        _prep_heads(k_ptr, wk_ptr, descale_ptr + BH, out_k, b, h0, H, Skv, Skv_pad, skb, sks, skh, eps,
                    cos_ptr, sin_ptr, stride_cos, stride_sin, D, BLOCK, HEADS, LANES, PROLOGUE, HALF, False)


def launch_prep(q, k, v, out_q, out_k, out_v, descale, prologue=None) -> None:
    """One launch when max(Sq_pad, Skv_pad) <= SINGLE_LAUNCH_MAX_S, else two (and a zeroed amax [3, B*H]
    fp32 buffer for them); prologue None or (norm_q_weight, norm_k_weight, eps, cos, sin) with cos, sin
    [S, R] (`prep.Prologue`)."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    sq_pad, skv_pad = out_q.shape[1], out_k.shape[1]
    if prologue is None:
        wq = wk = cos = sin = q  # unread (PROLOGUE is off): any pointer will do
        eps, stride_cos, stride_sin, half, block, heads = 0.0, 0, 0, 0, BLOCK_S, 1
    else:
        wq, wk, eps, cos, sin = prologue
        stride_cos, stride_sin, half = cos.stride(0), sin.stride(0), cos.shape[1] // 2
        block, heads = PROLOGUE_BLOCK_S, min(PROLOGUE_HEADS, h)
    groups = triton.cdiv(h, heads)
    shared = dict(D=d, BLOCK=block, HEADS=heads, PROLOGUE=prologue is not None, HALF=half)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    tail = (wq, wk, cos, sin, stride_cos, stride_sin, eps)
    if max(sq_pad, skv_pad) <= SINGLE_LAUNCH_MAX_S:
        _fp8_prep_single_kernel[(b * groups, 3)](
            q, k, v, out_q, out_k, out_v, descale, sq, skv, sq_pad, skv_pad, h, groups, b * h, *strides, *tail,
            LANES=triton.next_power_of_2(heads), num_warps=SINGLE_LAUNCH_WARPS, **shared)
        return
    amax = torch.zeros(3, b * h, dtype=torch.float32, device=q.device)
    _fp8_prep_amax_kernel[(triton.cdiv(max(sq, skv), block), b * groups, 3)](
        q, k, v, amax, sq, skv, h, groups, b * h, *strides, *tail, **shared)
    _fp8_prep_pack_kernel[(triton.cdiv(max(sq_pad, skv_pad), block), b * groups, 3)](
        q, k, v, amax, out_q, out_k, out_v, descale, sq, skv, sq_pad, skv_pad, h, groups, b * h, *strides, *tail,
        **shared)

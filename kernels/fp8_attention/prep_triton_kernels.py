"""Triton kernels of `prep.prep_triton` (imported lazily: Triton exists only on GPU machines).

Two launches serve q, k and v together (program axis 2 picks the tensor, axis 1 is b*h, axis 0
a block of rows), so a call costs two Triton launches whatever the shapes:

- `_amax_kernel`: amax[t, bh] = max |x_t[b, :, h, :]| by atomic max (NaN counts as inf, so a NaN
  head cannot hide);
- `_pack_kernel`: descale/quant from amax in the kernel (rounded as `prep.scales_from_amax`
  rounds them), the e4m3 codes of x * quant into the packed layouts, and descale.

Both read x [B, S, H, D] through its strides (innermost stride 1). With PROLOGUE, q and k are
the attention's raw projections and both kernels compute what MiniMax-H3's processor would feed
the attention, in fp32 and without rounding in between: per-head RMSNorm (weight w, eps) and then
the rotary embedding of the first 2*HALF channels (`kernels.rope` contract), recomputed in the
pack pass instead of written out, so q and k are read twice and written once, as fp8.
"""
import torch
import triton
import triton.language as tl

from .layout import E4M3_MAX

BLOCK_S = 64  # rows per program; a multiple of 16 so V's key permutation stays inside it
CODE_MAX = tl.constexpr(E4M3_MAX)  # a jitted function reads module globals only as constexprs
DESCALE_PER_AMAX = tl.constexpr(1.0 / E4M3_MAX)  # rounded to fp32 in the kernel, as torch rounds it


@triton.jit
def _load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, cols, ncols):
    """x[b, rows, h, cols] in fp32, 0 outside S rows and ncols columns."""
    ptrs = x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_s + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < S) & (cols[None, :] < ncols), other=0.0).to(tl.float32)


@triton.jit
def _normed_rotated(x_ptr, w_ptr, cos_ptr, sin_ptr, b, h, rows, S, stride_b, stride_s, stride_h,
                    stride_cos, stride_sin, eps, D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """RoPE(RMSNorm(x) * w) of rows of one head, as its three channel groups: the rotary halves
    [0, HALF), [HALF, 2 HALF) and the pass-through [2 HALF, D)."""
    j = tl.arange(0, BLOCK_HALF)
    p = tl.arange(0, BLOCK_PASS)
    x1 = _load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, j, HALF)
    x2 = _load(x_ptr + HALF, b, h, rows, S, stride_b, stride_s, stride_h, j, HALF)
    xp = _load(x_ptr + 2 * HALF, b, h, rows, S, stride_b, stride_s, stride_h, p, D - 2 * HALF)
    mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)) / D
    r = (1.0 / tl.sqrt_rn(mean_square + eps))[:, None]
    x1 = x1 * r * tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    x2 = x2 * r * tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    xp = xp * r * tl.load(w_ptr + 2 * HALF + p, mask=p < D - 2 * HALF, other=0.0).to(tl.float32)[None, :]
    m = (rows[:, None] < S) & (j[None, :] < HALF)
    c1 = tl.load(cos_ptr + rows[:, None] * stride_cos + j[None, :], mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + rows[:, None] * stride_cos + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + rows[:, None] * stride_sin + j[None, :], mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + rows[:, None] * stride_sin + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, xp


@triton.jit
def _magnitude(x):
    """max |x| of a block; NaN counts as inf."""
    return tl.max(tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=1), axis=0)


@triton.jit
def _qk_amax(x_ptr, w_ptr, cos_ptr, sin_ptr, b, h, rows, S, stride_b, stride_s, stride_h,
             stride_cos, stride_sin, eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
             BLOCK_PASS: tl.constexpr, PROLOGUE: tl.constexpr):
    if PROLOGUE:
        y1, y2, yp = _normed_rotated(x_ptr, w_ptr, cos_ptr, sin_ptr, b, h, rows, S, stride_b, stride_s,
                                     stride_h, stride_cos, stride_sin, eps, D, HALF, BLOCK_HALF, BLOCK_PASS)
        return tl.maximum(tl.maximum(_magnitude(y1), _magnitude(y2)), _magnitude(yp))
    return _magnitude(_load(x_ptr, b, h, rows, S, stride_b, stride_s, stride_h, tl.arange(0, D), D))


@triton.jit
def _amax_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, Sq, Skv, H, BH,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                 wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, eps,
                 D: tl.constexpr, BLOCK: tl.constexpr, PROLOGUE: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """amax [3, B*H], zeroed by the caller: of q, k (after the prologue, with PROLOGUE) and v."""
    which = tl.program_id(2)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if which == 0:
        m = _qk_amax(q_ptr, wq_ptr, cos_ptr, sin_ptr, b, h, rows, Sq, sqb, sqs, sqh, stride_cos, stride_sin,
                     eps, D, HALF, BLOCK_HALF, BLOCK_PASS, PROLOGUE)
    elif which == 1:
        m = _qk_amax(k_ptr, wk_ptr, cos_ptr, sin_ptr, b, h, rows, Skv, skb, sks, skh, stride_cos, stride_sin,
                     eps, D, HALF, BLOCK_HALF, BLOCK_PASS, PROLOGUE)
    else:
        m = _magnitude(_load(v_ptr, b, h, rows, Skv, svb, svs, svh, tl.arange(0, D), D))
    tl.atomic_max(amax_ptr + which * BH + bh, m)


@triton.jit
def _codes(x, quant):
    """e4m3 codes of x * quant: round to nearest even, clamped to +-448 (no NaN codes)."""
    return tl.minimum(tl.maximum(x * quant, -CODE_MAX), CODE_MAX).to(tl.float8e4nv)


@triton.jit
def _pack_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, quant, b, h, bh, pos, S, S_pad,
               stride_b, stride_s, stride_h, stride_cos, stride_sin, eps,
               D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
               PROLOGUE: tl.constexpr):
    """Row-major [S_pad, D] codes of q or k (rows >= S are 0)."""
    row = out_ptr + bh * S_pad * D + pos[:, None] * D
    in_pad = pos[:, None] < S_pad
    if PROLOGUE:
        y1, y2, yp = _normed_rotated(x_ptr, w_ptr, cos_ptr, sin_ptr, b, h, pos, S, stride_b, stride_s,
                                     stride_h, stride_cos, stride_sin, eps, D, HALF, BLOCK_HALF, BLOCK_PASS)
        j = tl.arange(0, BLOCK_HALF)[None, :]
        p = tl.arange(0, BLOCK_PASS)[None, :]
        tl.store(row + j, _codes(y1, quant), mask=in_pad & (j < HALF))
        tl.store(row + HALF + j, _codes(y2, quant), mask=in_pad & (j < HALF))
        tl.store(row + 2 * HALF + p, _codes(yp, quant), mask=in_pad & (p < D - 2 * HALF))
    else:
        cols = tl.arange(0, D)
        x = _load(x_ptr, b, h, pos, S, stride_b, stride_s, stride_h, cols, D)
        tl.store(row + cols[None, :], _codes(x, quant), mask=in_pad)


@triton.jit
def _pack_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, out_q, out_k, out_v, descale_ptr,
                 Sq, Skv, Sq_pad, Skv_pad, H, BH, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                 wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, eps,
                 D: tl.constexpr, BLOCK: tl.constexpr, PROLOGUE: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """Scales from amax (`prep.scales_from_amax`, written to descale [3, B*H] by the first block of
    rows), then codes: q and k row-major, v feature-major [D, Skv_pad] holding key_order(p)."""
    which = tl.program_id(2)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    amax = tl.load(amax_ptr + which * BH + bh)
    nonzero = amax > 0
    quant = tl.where(nonzero, tl.math.div_rn(1.0, amax) * CODE_MAX, 1.0)
    if tl.program_id(0) == 0:
        descale = tl.where(nonzero, amax * DESCALE_PER_AMAX, 1.0)
        finite = (amax == amax) & (amax != float("inf"))
        tl.store(descale_ptr + which * BH + bh, tl.where(finite, descale, float("nan")))
    if which == 0:
        _pack_rows(q_ptr, wq_ptr, cos_ptr, sin_ptr, out_q, quant, b, h, bh, pos, Sq, Sq_pad, sqb, sqs, sqh,
                   stride_cos, stride_sin, eps, D, HALF, BLOCK_HALF, BLOCK_PASS, PROLOGUE)
    elif which == 1:
        _pack_rows(k_ptr, wk_ptr, cos_ptr, sin_ptr, out_k, quant, b, h, bh, pos, Skv, Skv_pad, skb, sks, skh,
                   stride_cos, stride_sin, eps, D, HALF, BLOCK_HALF, BLOCK_PASS, PROLOGUE)
    else:  # layout.key_order, inside each 16-key group
        element = pos % 4
        src = pos // 16 * 16 + 8 * (element // 2) + 2 * ((pos % 16) // 4) + element % 2
        cols = tl.arange(0, D)
        x = _load(v_ptr, b, h, src, Skv, svb, svs, svh, cols, D)
        dst = out_v + bh * D * Skv_pad + cols[None, :] * Skv_pad + pos[:, None]
        tl.store(dst, _codes(x, quant), mask=pos[:, None] < Skv_pad)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def launch_prep(q, k, v, amax, out_q, out_k, out_v, descale, prologue=None) -> None:
    """The two launches. amax [3, B*H] fp32 zeroed by the caller; prologue None or
    (norm_q_weight, norm_k_weight, eps, cos, sin) with cos, sin [S, R] (`prep.Prologue`)."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    sq_pad, skv_pad = out_q.shape[1], out_k.shape[1]
    if prologue is None:
        wq = wk = cos = sin = q  # unread (PROLOGUE is off): any pointer will do
        eps, stride_cos, stride_sin, half = 0.0, 0, 0, 1
    else:
        wq, wk, eps, cos, sin = prologue
        stride_cos, stride_sin, half = cos.stride(0), sin.stride(0), cos.shape[1] // 2
    shared = dict(D=d, BLOCK=BLOCK_S, PROLOGUE=prologue is not None, HALF=half,
                  BLOCK_HALF=_next_power_of_2(half), BLOCK_PASS=_next_power_of_2(max(d - 2 * half, 1)))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    tail = (wq, wk, cos, sin, stride_cos, stride_sin, eps)
    _amax_kernel[(triton.cdiv(max(sq, skv), BLOCK_S), b * h, 3)](
        q, k, v, amax, sq, skv, h, b * h, *strides, *tail, **shared)
    _pack_kernel[(triton.cdiv(max(sq_pad, skv_pad), BLOCK_S), b * h, 3)](
        q, k, v, amax, out_q, out_k, out_v, descale, sq, skv, sq_pad, skv_pad, h, b * h, *strides, *tail,
        **shared)

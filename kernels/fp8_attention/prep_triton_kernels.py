"""Triton kernels of `prep.prep_triton` (imported lazily: Triton exists only on GPU machines).

Both read x [B, S, H, D] through its strides (innermost stride 1) and use program axis 1 for
b*h, so one launch covers every head.
"""
import torch
import triton
import triton.language as tl

BLOCK_S = 64  # rows per program; a multiple of 16 so V's key permutation stays inside it


@triton.jit
def _fp8_prep_amax_kernel(x_ptr, amax_ptr, S, H, stride_b, stride_s, stride_h,
                 D: tl.constexpr, BLOCK: tl.constexpr):
    """amax[bh] = max |x[b, :, h, :]|; NaN counts as inf so a NaN head cannot hide."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ptrs = x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_s + cols[None, :]
    x = tl.load(ptrs, mask=rows[:, None] < S, other=0.0).to(tl.float32)
    mag = tl.where(x != x, float("inf"), tl.abs(x))
    tl.atomic_max(amax_ptr + bh, tl.max(tl.max(mag, axis=1), axis=0))


@triton.jit
def _fp8_prep_pack_kernel(x_ptr, quant_ptr, out_ptr, S, S_pad, H, stride_b, stride_s, stride_h,
                 D: tl.constexpr, BLOCK: tl.constexpr, FEATURE_MAJOR: tl.constexpr):
    """Codes of x * quant[bh] (RNE, clamped to +-448) into out[bh] at positions p:
    row-major [S_pad, D] holding row p, or feature-major [D, S_pad] holding key_order(p)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if FEATURE_MAJOR:  # layout.key_order, inside each 16-key group
        element = pos % 4
        src = pos // 16 * 16 + 8 * (element // 2) + 2 * ((pos % 16) // 4) + element % 2
    else:
        src = pos
    cols = tl.arange(0, D)
    ptrs = x_ptr + b * stride_b + h * stride_h + src[:, None] * stride_s + cols[None, :]
    x = tl.load(ptrs, mask=src[:, None] < S, other=0.0).to(tl.float32)
    y = x * tl.load(quant_ptr + bh)
    codes = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
    if FEATURE_MAJOR:
        dst = out_ptr + bh * D * S_pad + cols[None, :] * S_pad + pos[:, None]
    else:
        dst = out_ptr + bh * S_pad * D + pos[:, None] * D + cols[None, :]
    tl.store(dst, codes, mask=pos[:, None] < S_pad)


def launch_amax(x: torch.Tensor, amax: torch.Tensor) -> None:
    """amax: fp32 [B*H], zeroed by the caller."""
    b, s, h, d = x.shape
    grid = (triton.cdiv(s, BLOCK_S), b * h)
    _fp8_prep_amax_kernel[grid](x, amax, s, h, x.stride(0), x.stride(1), x.stride(2), D=d, BLOCK=BLOCK_S)


def launch_pack(x: torch.Tensor, quant: torch.Tensor, out: torch.Tensor, feature_major: bool) -> None:
    b, s, h, d = x.shape
    s_pad = out.shape[2] if feature_major else out.shape[1]
    grid = (triton.cdiv(s_pad, BLOCK_S), b * h)
    _fp8_prep_pack_kernel[grid](x, quant, out, s, s_pad, h, x.stride(0), x.stride(1), x.stride(2),
                       D=d, BLOCK=BLOCK_S, FEATURE_MAJOR=feature_major)

"""MiniMax-H3's rotary embedding (`reference.py` states the contract) as one Triton kernel.

Why: diffusers' `_apply_rotary_emb` in `transformer_minimax_h3.py` runs in bf16 as several
elementwise kernels plus two `cat`s, moving q and k several times over where reading them once and
writing them once would do. The kernel here does that one read and one write (its time beside
diffusers': docs/benchmarks.md, "Prep and fused RoPE").

Triton is imported on the first CUDA call (`_triton_kernel()`), never at import time, so this
module loads where Triton is absent. The kernel has no backward; when to call it instead of
diffusers' function (autograd, torch.compile tracing, CPU tensors) is the caller's policy
(`dit_accel.patching.rope`).
"""
from __future__ import annotations

import functools

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # x's dtypes the kernel computes in


# --- the Triton kernel (Triton is imported on the first CUDA call, never at import time) ---------

triton = tl = None  # bound by `_triton_kernel()`; the annotations below stay strings until then


def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, S, H, BH,
                 stride_xb, stride_xs, stride_xh, stride_cs, stride_cr, stride_ss, stride_sr,
                 D: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """One program: BLOCK_S rows of one (b, h). Each x element is loaded once: the two halves of
    the rotary channels, then the pass-through channels (copied in x's dtype, bit for bit)."""
    pid = tl.program_id(0)
    bh = pid % BH  # the fastest grid index, so programs running together share cos/sin rows in L2
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = (pid // BH) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = (rows < S)[:, None]
    rows = rows.to(tl.int64)[:, None]
    x_row = x_ptr + b * stride_xb + h * stride_xh + rows * stride_xs
    out_row = out_ptr + ((b * S + rows) * H + h) * D  # contiguous [B, S, H, D]

    j = tl.arange(0, BLOCK_HALF)[None, :]
    m = row_ok & (j < HALF)
    x1 = tl.load(x_row + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + j, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + rows * stride_cs + j * stride_cr, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + rows * stride_cs + (HALF + j) * stride_cr, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + rows * stride_ss + j * stride_sr, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + rows * stride_ss + (HALF + j) * stride_sr, mask=m, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_row + j, (x1 * c1 - x2 * s1).to(out_ty), mask=m)
    tl.store(out_row + HALF + j, (x2 * c2 + x1 * s2).to(out_ty), mask=m)

    if BLOCK_PASS > 0:  # channels 2 * HALF .. D pass through
        p = tl.arange(0, BLOCK_PASS)[None, :]
        mp = row_ok & (p < D - 2 * HALF)
        tl.store(out_row + 2 * HALF + p, tl.load(x_row + 2 * HALF + p, mask=mp), mask=mp)


@functools.cache
def _triton_kernel():
    """The jitted kernel, or None where Triton cannot be imported (cached either way)."""
    global triton, tl
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton.jit(_rope_kernel)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def apply_rotary_emb_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope_reference` in one Triton launch, for CUDA tensors (see `unsupported_reason` for what it computes;
    callers also need CUDA tensors on one device, no autograd, and `is_available()`).

    Launch shape: a 1-D grid of cdiv(S, BLOCK_S) * B * H programs; program p handles rows
    [(p // (B*H)) * BLOCK_S, +BLOCK_S) of head (b, h) = divmod(p % (B*H), H), all D channels, with
    BLOCK_S * D ~ 2048 elements per program (16 rows at D = 128) and 4 warps: within 2% of the best
    of BLOCK_S 4..64 x 2..8 warps tried at the H3 shape on an H200.
    """
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("apply_rotary_emb_fused needs Triton, which cannot be imported here")
    batch, seq, heads, dim = x.shape
    rotary = cos.shape[-1]
    out = torch.empty((batch, seq, heads, dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_s = max(1, 2048 // _next_power_of_2(dim))
    grid = (triton.cdiv(seq, block_s) * batch * heads,)
    with torch.cuda.device(x.device):
        kernel[grid](x, cos, sin, out, seq, heads, batch * heads,
                     x.stride(0), x.stride(1), x.stride(2),
                     cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                     D=dim, HALF=rotary // 2, BLOCK_S=block_s, BLOCK_HALF=_next_power_of_2(rotary // 2),
                     BLOCK_PASS=_next_power_of_2(dim - rotary), num_warps=4,
                     enable_fp_fusion=False)  # no FMA: round each product as torch does, to match the reference
    return out


def is_available() -> bool:
    """Whether Triton can be imported here (the first call tries; the answer is cached)."""
    return _triton_kernel() is not None


def unsupported_reason(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel cannot compute this call's tensors (shape, rotary dim, dtype, innermost
    stride), or None. Where the tensors live (CUDA, one device) is checked by the caller."""
    if x.dim() != 4 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[1]:
        return "shape (want x [B, S, H, D], cos and sin [S, R])"
    rotary = cos.shape[1]
    if rotary == 0 or rotary % 2 or rotary > x.shape[-1]:
        return "rotary dim R odd, zero or above head dim"
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype}"
    if not (cos.is_floating_point() and sin.is_floating_point()):
        return "cos/sin not floating point"
    if x.stride(-1) != 1:
        return "innermost stride != 1"
    return None

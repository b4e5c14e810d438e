"""The rotary-embedding contract the fused kernel implements, and its float32 reference in torch.

The contract (diffusers' `_apply_rotary_emb` in `transformer_minimax_h3.py`, which
`MiniMaxH3AttnProcessor.__call__` calls as a global of its model file, once for the query and
once for the key):

    out = f(x, cos, sin)     x [B, S, H, D], any strides with stride(-1) == 1
                             cos, sin [S, R] (float32 in H3), R even, R <= D
    out[..., :R] = x[..., :R] * cos + cat(-x2, x1) * sin    (x1, x2: halves of x[..., :R])
    out[..., R:] = x[..., R:]                              (a new contiguous tensor)

Accuracy: `rope_reference` and the kernel do the arithmetic in float32 and round once to x's
dtype. diffusers rounds cos/sin to bf16 first and rounds each product and the sum to bf16, so it
is slightly less accurate (and for float32 x it is the reference exactly). The kernel matches
`rope_reference`, not diffusers' bf16 arithmetic: it is launched without FMA contraction so each
product is rounded as torch rounds it, and on the H200 it gave the reference bit for bit in bf16,
fp16 and fp32 (its GPU test allows one ulp).
"""
from __future__ import annotations

import torch


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' `_apply_rotary_emb` contract computed in float32 (or wider, for float64 x) and
    rounded once to x.dtype: what `apply_rotary_emb_fused` gives. Slightly more accurate than
    diffusers in bf16, which rounds cos/sin, each product and the sum to bf16."""
    rotary = cos.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    x_rot = x[..., :rotary].to(compute)
    x1, x2 = x_rot.chunk(2, dim=-1)
    cos = cos.to(compute)[None, :, None, :]
    sin = sin.to(compute)[None, :, None, :]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous
    out[..., :rotary] = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin  # the one rounding
    out[..., rotary:] = x[..., rotary:]
    return out

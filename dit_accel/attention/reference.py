"""The truth every attention backend is checked against, and the inputs it is checked on.

- `random_qkv`: fresh q, k, v [B, S, H, D] from N(0,1); with `outliers`, exactly 0.1% of each
  tensor's entries (at least one) scaled by 50 (FP8's hard case: one outlier stretches the
  per-head scale and every other value loses precision); with `flat_rows`, q scaled by
  FLAT_QUERY_SCALE so every softmax row is nearly uniform (max probability ~1.2 / Skv), as the
  rows of a real video DiT block are (H3's: ~0.001 at 30272 keys): the case where accumulating
  P.V in low precision across all key blocks loses the most.
- `reference_attention`: softmax(q k^T * scale) v in float64 (or a dtype asked for), chunked so
  that at most REFERENCE_CHUNK_SCORES scores exist at once; optionally only some query rows
  (rows are independent, so long sequences stay affordable).
- `reference_lse`: the natural-log sum of exp of the scaled logits, float64.
- `reference_dtype`: float64, except float32 on a GPU past FP64_REFERENCE_MAX_SCORES scores.
- `rel_rms_err`: ||out - ref|| / ||ref||, in the reference's precision (at least float32).

Used by bench-attention, profile-block's attention error, the kernel checks and the tests.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

OUTLIER_FRACTION, OUTLIER_FACTOR = 1e-3, 50.0
FLAT_QUERY_SCALE = 0.05  # logits of std ~0.05: exp varies by ~±10% across a row
FP64_REFERENCE_MAX_SCORES = 2**30  # beyond this many scores a GPU computes the reference in fp32
REFERENCE_CHUNK_SCORES = 2**28  # scores materialized at once while computing the reference


def random_qkv(batch: int, seq_q: int, seq_kv: int, heads: int, head_dim: int, outliers: bool = False,
               seed: int = 0, *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
               generator: torch.Generator | None = None,
               flat_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Sq, H, D], k and v [B, Skv, H, D] in `dtype`, drawn in float32 from `generator` (or a
    fresh one seeded with `seed`). With `outliers`, each tensor gets its outliers right after its
    values are drawn, so the same seed gives the same base values with and without them."""
    generator = generator or torch.Generator(device=device).manual_seed(seed)
    tensors = []
    for i, seq in enumerate((seq_q, seq_kv, seq_kv)):
        x = torch.randn(batch, seq, heads, head_dim, generator=generator, device=device, dtype=torch.float32)
        if flat_rows and i == 0:
            x *= FLAT_QUERY_SCALE
        if outliers:
            flat = x.view(-1)
            count = max(1, int(flat.numel() * OUTLIER_FRACTION))
            flat[torch.randperm(flat.numel(), generator=generator, device=device)[:count]] *= OUTLIER_FACTOR
        tensors.append(x.to(dtype))
    return tuple(tensors)


def reference_dtype(scores: int, device: torch.device) -> torch.dtype:
    """float64, except float32 on a GPU past FP64_REFERENCE_MAX_SCORES scores (B*H*Sq*Skv), where
    float64 takes minutes."""
    too_big = device.type == "cuda" and scores > FP64_REFERENCE_MAX_SCORES
    return torch.float32 if too_big else torch.float64


@contextlib.contextmanager
def ieee_fp32_matmul() -> Iterator[None]:
    """fp32 matmuls in full precision (no TF32) inside, whatever the process set."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@torch.no_grad()
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                        dtype: torch.dtype = torch.float64, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v in `dtype`, [B, Sq, H, D] (only query rows `rows` if given).
    scale defaults to 1/sqrt(D)."""
    if rows is not None:
        q = q[:, rows]
    batch, seq_q, heads, head_dim = q.shape
    seq_kv = k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty(batch, seq_q, heads, v.shape[-1], dtype=dtype, device=q.device)
    rows_per_chunk = max(1, REFERENCE_CHUNK_SCORES // (heads * seq_kv))
    with ieee_fp32_matmul():
        for b in range(batch):
            k_hsd, v_hsd = (t[b].to(dtype).transpose(0, 1) for t in (k, v))  # [H, Skv, D]
            for start in range(0, seq_q, rows_per_chunk):
                q_hsd = q[b, start:start + rows_per_chunk].to(dtype).transpose(0, 1)
                probs = torch.softmax(torch.matmul(q_hsd, k_hsd.transpose(1, 2)) * scale, dim=-1)
                out[b, start:start + rows_per_chunk] = torch.matmul(probs, v_hsd).transpose(0, 1)
    return out


@torch.no_grad()
def reference_lse(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """[B, H, Sq] float64: log of the sum over keys of exp(scaled logits)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = q.double().transpose(1, 2) @ k.double().transpose(1, 2).transpose(-1, -2) * scale
    return torch.logsumexp(logits, dim=-1)


def rel_rms_err(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, computed in the reference's dtype (float32 at the
    least): float64 for a float64 reference, float32 for the GPU's big-shape reference, whose
    float64 copies would not fit a 16 GB card beside the block."""
    dtype = torch.promote_types(reference.dtype, torch.float32)
    out, reference = out.to(dtype), reference.to(dtype)
    return (torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference)).item()

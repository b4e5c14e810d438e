"""Fused prep: per-(batch, head) e4m3 quantization and packing of Q, K, V for the kernel.

Contract (the kernel relies on every line):

- ``q``  [B*H, Sq_pad, D]  e4m3 row-major, Sq_pad = ceil(Sq / 128) * 128 (``layout.Q_ROWS``),
  rows >= Sq are 0.
- ``k``  [B*H, Skv_pad, D] e4m3 row-major, Skv_pad = ceil(Skv / 32) * 32 (``layout.KEYS``),
  rows >= Skv are 0.
- ``v``  [B*H, D, Skv_pad] e4m3 feature-major: ``v[bh, d, p] = V[b, key_order(p), h, d]``,
  0 where key_order(p) >= Skv.
- ``descale`` [3, B*H] fp32: amax / 448 of Q, K, V per (b, h) (1 for an all-zero head), so
  ``x ~= code * descale``. Codes are round-to-nearest-even of x * (448 / amax), clamped to
  +-448, so |code| <= 448 and no e4m3 value saturates to NaN.

Non-finite inputs give NaN heads, as in torch's attention: the amax of a head holding inf or
NaN is inf or NaN, and that head's descale is set to NaN, which the kernel multiplies into
every output of the head (Q or K: the logits; V: the output scale). No host sync: prep and
kernel stay asynchronous and can be captured in a CUDA graph.

Two implementations of the same contract: `prep_reference` (torch, any device, the spec) and
`prep_triton` (CUDA, two Triton kernels: amax, then quantize + pack). The GPU check compares
them bit for bit.
"""
from dataclasses import dataclass

import torch

from .layout import E4M3_MAX, FP8, KEYS, Q_ROWS, key_order, round_up


@dataclass
class PackedQKV:
    """Prep's output: the kernel's inputs plus the logical sizes the padding hides."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale: torch.Tensor
    batch: int
    heads: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int


def scales_from_amax(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(descale, quant), both fp32 like amax: descale = amax / 448, quant = 448 / amax; an
    all-zero head gets 1 and 1 (its codes are 0 either way); a head holding inf or NaN gets a
    NaN descale, so its output is NaN."""
    nonzero = amax > 0
    descale = torch.where(nonzero, amax / E4M3_MAX, torch.ones_like(amax))
    descale = torch.where(torch.isfinite(amax), descale, torch.full_like(amax, float("nan")))
    quant = torch.where(nonzero, E4M3_MAX / amax, torch.ones_like(amax))
    return descale, quant


def quantize(x: torch.Tensor, quant: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of x [B, S, H, D] with per-(b, h) quant [B*H]: RNE of fp32 x * quant."""
    b, _, h, _ = x.shape
    scaled = x.float() * quant.view(b, 1, h, 1)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over (S, D) for each (b, h), fp32 [B*H] (NaN if the head holds a NaN)."""
    return x.float().abs().amax(dim=(1, 3)).reshape(-1)


def prep_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> PackedQKV:
    """The packing contract in torch, on any device (the spec the Triton prep must match)."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    amax = torch.stack([head_amax(x) for x in (q, k, v)])
    descale, quant = scales_from_amax(amax)

    def rows(x, s_pad, quant_row):  # [B, S, H, D] -> [B*H, S_pad, D] codes, zero padded
        codes = quantize(x, quant_row).permute(0, 2, 1, 3).reshape(b * h, x.shape[1], d)
        out = torch.zeros(b * h, s_pad, d, dtype=FP8, device=x.device)
        out[:, : x.shape[1]] = codes
        return out

    sq_pad, skv_pad = round_up(sq, Q_ROWS), round_up(skv, KEYS)
    v_rows = rows(v, skv_pad, quant[2])
    order = key_order(torch.arange(skv_pad, device=v.device))
    return PackedQKV(
        q=rows(q, sq_pad, quant[0]),
        k=rows(k, skv_pad, quant[1]),
        v=v_rows[:, order].transpose(1, 2).contiguous(),
        descale=descale,
        batch=b, heads=h, seqlen_q=sq, seqlen_kv=skv, head_dim=d,
    )


def prep_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> PackedQKV:
    """Same contract as `prep_reference`, on CUDA: one amax launch and one pack launch per
    tensor, reading any [B, S, H, D] strides (innermost stride 1)."""
    from . import prep_triton_kernels as tk

    b, sq, h, d = q.shape
    skv = k.shape[1]
    amax = torch.zeros(3, b * h, dtype=torch.float32, device=q.device)
    for i, x in enumerate((q, k, v)):
        tk.launch_amax(x, amax[i])
    descale, quant = scales_from_amax(amax)
    sq_pad, skv_pad = round_up(sq, Q_ROWS), round_up(skv, KEYS)
    out_q = torch.empty(b * h, sq_pad, d, dtype=FP8, device=q.device)
    out_k = torch.empty(b * h, skv_pad, d, dtype=FP8, device=q.device)
    out_v = torch.empty(b * h, d, skv_pad, dtype=FP8, device=q.device)
    tk.launch_pack(q, quant[0], out_q, feature_major=False)
    tk.launch_pack(k, quant[1], out_k, feature_major=False)
    tk.launch_pack(v, quant[2], out_v, feature_major=True)
    return PackedQKV(out_q, out_k, out_v, descale, b, h, sq, skv, d)

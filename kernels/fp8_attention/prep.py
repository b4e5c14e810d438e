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
- With ``qk_int8`` (the sm90 kernel's INT8 Q/K): ``q`` and ``k`` hold int8 codes instead, in the same
  layouts, with one scale per group of the rows one kernel thread holds (`layout.q_scale_group`: 32 groups
  of 2 rows per 64 queries; `layout.k_scale_group`: 4 groups of 16 keys per 64 keys): ``q_scale``
  [B*H, Sq_pad / 64 * 32] and ``k_scale`` [B*H, ceil(Skv_pad / 64) * 4] fp32, amax / 127 of the group
  (padding rows count as 0; an all-zero group takes its 64-row block's largest finite amax); codes are
  round-to-nearest-even of x * (127 / amax), clamped to +-127. ``descale`` rows 0 and 1 are 1 (the
  kernel's per-head product of them is then a no-op); V is as above. A group holding inf or NaN gets a NaN
  scale: the rows it reaches come out NaN (a query group's own two rows; every row of the head for a key
  group).

Non-finite inputs give NaN heads, as in torch's attention: the amax of a head holding inf or
NaN is inf or NaN, and that head's descale is set to NaN, which the kernel multiplies into
every output of the head (Q or K: the logits; V: the output scale). No host sync: prep and
kernel stay asynchronous and can be captured in a CUDA graph.

Two implementations of the same contract: `prep_reference` (torch, any device, the spec) and
`prep_triton` (CUDA, Triton, q, k and v together: without the prologue and at padded lengths up to
`prep_triton_kernels.SINGLE_LAUNCH_MAX_S` one launch, a program per head doing amax, scales and
packing; otherwise two launches, amax into a zeroed buffer, then scales + quantize + pack). The GPU
check compares them bit for bit.

The prologue (`Prologue`, MiniMax-H3's attention): q and k arrive as the raw projections, and
prep quantizes RoPE(RMSNorm(x) * w) instead of x, computed in fp32 with no rounding to bf16 in
between (`apply_prologue` is the torch spec). The Triton prep recomputes it in its pack pass
rather than writing it out, so QK-norm, RoPE and quantization cost two reads of q and k and one
fp8 write. Its arithmetic is fp32 but not bit-identical to torch's (reduction order, division
vs rsqrt), so its check is against the spec within one e4m3 step on rare elements.
"""
from dataclasses import dataclass

import torch

from .layout import (E4M3_MAX, FP8, INT8_MAX, K_SCALE_GROUPS, KEYS, Q_ROWS, Q_SCALE_GROUPS, SCALE_BLOCK, k_scale_group,
                     key_order, q_scale_group, round_up)
from .support import on_device


@dataclass(frozen=True)
class Prologue:
    """What MiniMax-H3's processor does to q and k between the projections and the attention:
    per-head RMSNorm (`norm_q_weight`, `norm_k_weight` [D], `eps`), then the rotary embedding of
    the first R channels with cos, sin [S, R] (`dit_accel.kernels.rope` contract; R even, <= D)."""

    norm_q_weight: torch.Tensor
    norm_k_weight: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor


def prologue_reason(q: torch.Tensor, k: torch.Tensor, prologue: Prologue) -> str | None:
    """Why the prologue cannot be applied to these q, k [B, S, H, D], or None. Metadata only."""
    d = q.shape[-1]
    cos, sin = prologue.cos, prologue.sin
    if q.shape[1] != k.shape[1]:
        return "fp8_attention prologue: self-attention only (q and k of one length)"
    if prologue.norm_q_weight.shape != (d,) or prologue.norm_k_weight.shape != (d,):
        return f"fp8_attention prologue: norm weights must be [{d}]"
    if prologue.norm_q_weight.stride(0) != 1 or prologue.norm_k_weight.stride(0) != 1:
        return "fp8_attention prologue: norm weights must be contiguous"
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != q.shape[1]:
        return f"fp8_attention prologue: cos and sin must be [S, R] with S = {q.shape[1]}"
    if cos.shape[1] == 0 or cos.shape[1] % 2 or cos.shape[1] > d:
        return "fp8_attention prologue: rotary dim R must be even, > 0 and <= head dim"
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return "fp8_attention prologue: cos and sin need a contiguous last dim"
    if any(t.device != q.device for t in (prologue.norm_q_weight, prologue.norm_k_weight, cos, sin)):
        return "fp8_attention prologue: norm weights, cos and sin must be on q's device"
    return None


def apply_prologue(x: torch.Tensor, weight: torch.Tensor, prologue: Prologue) -> torch.Tensor:
    """The spec, fp32 out: RoPE(RMSNorm(x) * weight) of x [B, S, H, D], all in fp32."""
    x = x.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + prologue.eps) * weight.float()
    r = prologue.cos.shape[1]
    cos, sin = prologue.cos.float()[None, :, None, :], prologue.sin.float()[None, :, None, :]
    x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
    return torch.cat((x1 * cos[..., : r // 2] - x2 * sin[..., : r // 2],
                      x2 * cos[..., r // 2 :] + x1 * sin[..., r // 2 :], x[..., r:]), dim=-1)


@dataclass
class PackedQKV:
    """Prep's output: the kernel's inputs plus the logical sizes the padding hides; q_scale and k_scale
    are the INT8 Q/K group scales (None with e4m3 Q/K)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale: torch.Tensor
    batch: int
    heads: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    q_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None

    @property
    def qk_int8(self) -> bool:
        return self.q_scale is not None

    def kernel_inputs(self) -> tuple:
        """The compiled kernel's first arguments, in its order: q, k, v, descale, q_scale, k_scale."""
        return self.q, self.k, self.v, self.descale, self.q_scale, self.k_scale


def scales_from_amax(amax: torch.Tensor, code_max: float = E4M3_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """(descale, quant), both fp32 like amax: descale = amax * fp32(1/code_max), quant = code_max *
    (1/amax), each product and reciprocal rounded to fp32 (written out so that torch on any
    device and the Triton prep round the same way; torch's CUDA `amax / 448` is itself a multiply
    by the reciprocal); an all-zero head gets 1 and 1 (its codes are 0 either way); a head holding
    inf or NaN gets a NaN descale, so its output is NaN. code_max: 448 (e4m3) or 127 (INT8 Q/K)."""
    nonzero = amax > 0
    descale = torch.where(nonzero, amax * (1.0 / code_max), torch.ones_like(amax))
    descale = torch.where(torch.isfinite(amax), descale, torch.full_like(amax, float("nan")))
    quant = torch.where(nonzero, amax.reciprocal() * code_max, torch.ones_like(amax))
    return descale, quant


def quantize(x: torch.Tensor, quant: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of x [B, S, H, D] with per-(b, h) quant [B*H]: RNE of fp32 x * quant."""
    b, _, h, _ = x.shape
    scaled = x.float() * quant.view(b, 1, h, 1)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_int8_groups(rows: torch.Tensor, group_of) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes of rows [B*H, S, D] with one scale per group of rows, `group_of(row indices)` giving each row's
    (`layout.q_scale_group`, `layout.k_scale_group`: G groups per SCALE_BLOCK rows, the last block padded with
    zero rows): (codes int8 [B*H, S, D], descale fp32 [B*H, ceil(S / 64) * G]). A group's amax counts NaN as inf
    (so a group holding one gets a NaN descale and quant 0, as the Triton prep does); an all-zero group takes the
    largest finite amax of its block (its codes are 0 either way; a scale of 1 would set the kernel's max step
    for the real groups beside it); codes are RNE of fp32 x * quant, 0 where that product is NaN, clamped to
    +-127."""
    bh, s, d = rows.shape
    blocks = -(-s // SCALE_BLOCK)
    padded = torch.zeros(bh, blocks * SCALE_BLOCK, d, dtype=torch.float32, device=rows.device)
    padded[:, :s] = rows.float()
    group = group_of(torch.arange(blocks * SCALE_BLOCK, device=rows.device))
    per_block = (int(group.max()) + 1) // blocks  # groups per block
    magnitude = torch.where(torch.isnan(padded), torch.inf, padded.abs()).amax(dim=2)  # [B*H, rows]
    amax = torch.zeros(bh, blocks * per_block, dtype=torch.float32, device=rows.device)
    amax = amax.scatter_reduce(1, group.expand(bh, -1), magnitude, "amax").view(bh, blocks, per_block)
    block_max = torch.where(torch.isfinite(amax), amax, 0.0).amax(dim=2, keepdim=True)
    amax = torch.where(amax == 0, block_max, amax).view(bh, -1)
    descale, quant = scales_from_amax(amax, INT8_MAX)
    scaled = (padded * quant[:, group, None]).nan_to_num(0.0).clamp(-INT8_MAX, INT8_MAX)
    return scaled.round().to(torch.int8)[:, :s], descale


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over (S, D) for each (b, h), fp32 [B*H] (NaN if the head holds a NaN)."""
    return x.float().abs().amax(dim=(1, 3)).reshape(-1)


def padded_rows(x: torch.Tensor, s_pad: int) -> torch.Tensor:
    """[B, S, H, D] -> [B*H, S_pad, D] in x's dtype, rows >= S zero."""
    b, s, h, d = x.shape
    out = torch.zeros(b * h, s_pad, d, dtype=x.dtype, device=x.device)
    out[:, :s] = x.permute(0, 2, 1, 3).reshape(b * h, s, d)
    return out


def prep_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   prologue: Prologue | None = None, qk_int8: bool = False) -> PackedQKV:
    """The packing contract in torch, on any device (the spec the Triton prep must match)."""
    if prologue is not None:
        q, k = apply_prologue(q, prologue.norm_q_weight, prologue), apply_prologue(k, prologue.norm_k_weight, prologue)
    b, sq, h, d = q.shape
    skv = k.shape[1]
    amax = torch.stack([head_amax(x) for x in (q, k, v)])
    descale, quant = scales_from_amax(amax)
    sq_pad, skv_pad = round_up(sq, Q_ROWS), round_up(skv, KEYS)
    v_rows = padded_rows(quantize(v, quant[2]), skv_pad)
    order = key_order(torch.arange(skv_pad, device=v.device))
    q_scale = k_scale = None
    if qk_int8:
        (q_codes, q_scale), (k_codes, k_scale) = (quantize_int8_groups(padded_rows(x.float(), s_pad), group_of)
                                                  for x, s_pad, group_of in ((q, sq_pad, q_scale_group),
                                                                             (k, skv_pad, k_scale_group)))
        descale[:2] = 1.0
    else:
        q_codes, k_codes = padded_rows(quantize(q, quant[0]), sq_pad), padded_rows(quantize(k, quant[1]), skv_pad)
    return PackedQKV(
        q=q_codes,
        k=k_codes,
        v=v_rows[:, order].transpose(1, 2).contiguous(),
        descale=descale,
        batch=b, heads=h, seqlen_q=sq, seqlen_kv=skv, head_dim=d,
        q_scale=q_scale, k_scale=k_scale,
    )


def launch_spec(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prologue: Prologue | None = None) -> tuple:
    """What decides how prep launches for these inputs and whether they pass the checks, from their metadata:
    shapes, strides, dtypes, devices and each tensor's alignment (its address mod 16, which also tells apart
    any alignment split finer than Triton's divisible-by-16-or-not), of q, k, v and the
    prologue's tensors. Calls with equal specs pass the same values to the same compiled Triton kernels but for
    the tensors' addresses (`prep_triton_kernels._launch`), and get the same answer from `support.can_implement`
    and `prologue_reason` (`interface.fp8_attention`)."""
    spec = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
    if prologue is None:
        return spec
    tensors = (prologue.norm_q_weight, prologue.norm_k_weight, prologue.cos, prologue.sin)
    return spec + tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)


def prep_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prologue: Prologue | None = None,
                qk_int8: bool = False) -> PackedQKV:
    """Same contract as `prep_reference`, on CUDA: one Triton launch for short sequences without the
    prologue, else two (amax, then scales and packing; `prep_triton_kernels.launch_prep` picks) for the
    three tensors, reading any [B, S, H, D] strides (innermost stride 1)."""
    return prep_triton_with_spec(q, k, v, prologue, launch_spec(q, k, v, prologue), qk_int8)


def prep_triton_with_spec(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prologue: Prologue | None,
                          spec: tuple, qk_int8: bool = False) -> PackedQKV:
    """`prep_triton` for a caller that has `launch_spec(q, k, v, prologue)` already (`interface.fp8_attention`
    builds it once for its checks and the launches). It must be that spec: the compiled launches are keyed by
    it, and another tensors' spec would reuse a kernel specialized for them."""
    from . import prep_triton_kernels as tk

    b, sq, h, d = q.shape
    skv = k.shape[1]
    device = q.device
    descale = torch.empty(3, b * h, dtype=torch.float32, device=device)
    sq_pad, skv_pad = round_up(sq, Q_ROWS), round_up(skv, KEYS)
    qk_dtype = torch.int8 if qk_int8 else FP8
    out_q = torch.empty(b * h, sq_pad, d, dtype=qk_dtype, device=device)
    out_k = torch.empty(b * h, skv_pad, d, dtype=qk_dtype, device=device)
    out_v = torch.empty(b * h, d, skv_pad, dtype=FP8, device=device)
    q_scale = k_scale = None
    if qk_int8:
        q_scale = torch.empty(b * h, -(-sq_pad // SCALE_BLOCK) * Q_SCALE_GROUPS, dtype=torch.float32, device=device)
        k_scale = torch.empty(b * h, -(-skv_pad // SCALE_BLOCK) * K_SCALE_GROUPS, dtype=torch.float32, device=device)
    fields = None if prologue is None else (prologue.norm_q_weight, prologue.norm_k_weight, prologue.eps,
                                            prologue.cos, prologue.sin)
    with on_device(device):
        tk.launch_prep(q, k, v, out_q, out_k, out_v, descale, fields, spec, q_scale, k_scale)
    return PackedQKV(out_q, out_k, out_v, descale, b, h, sq, skv, d, q_scale, k_scale)

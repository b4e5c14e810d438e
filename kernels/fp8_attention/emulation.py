"""`emulate_fp8_attention`: the kernels' numerical scheme in float64, for checking them.

The truth it and the kernels are compared with (`reference_attention`, `reference_lse`,
`rel_rms_err`) and the test inputs (`random_qkv`) live in `dit_accel.attention.reference`;
kernels import no library code.

`emulate_fp8_attention` is the kernel's scheme with every rounding it does and nothing else:
per-(b, h) e4m3 Q, K, V (prep's `quantize`; with `qk_int8`, INT8 Q and K with a scale per group of the rows a
kernel thread holds, prep's `quantize_int8_groups`), online softmax over 32-key strips, p rounded
to e4m3 as p * 256 against the running max, row sums of the unrounded p (or, `rounded_row_sum`,
of the rounded p, as the sm90 kernel's `pv_row_sum` takes them from the tensor core), output
rounded to the output dtype. The kernel should land within ~0.5 percentage points of it (its remaining
differences: fp32 accumulation order and the hardware exp2).
"""
import math

import torch

from .layout import FP8, KEYS, LN_2, LOG2_E, MAX_STEP, P_SCALE, ROUND_TO_INT, SCALE_BLOCK, k_scale_group, q_scale_group
from .prep import head_amax, padded_rows, quantize, quantize_int8_groups, scales_from_amax

# How far a kernel's LSE may sit from the emulation's when both sum the rounded P (`rounded_row_sum`): a p
# that the kernel's arithmetic (its exp2, its logits' fp32 accumulation) puts on the other side of an e4m3
# rounding boundary moves to the neighbouring code, by at most 1/8 of itself (3 mantissa bits), and l moves
# with it: a row's LSE by at most log(1 + 2^-3) however many of its p do so. O moves with the same codes,
# so O and LSE stay consistent (what merging partial attentions by LSE needs).
ROUNDED_ROW_SUM_LSE_ATOL = math.log1p(2.0**-3)


def lse_mismatch(lse: torch.Tensor, emu_lse: torch.Tensor, rounded_row_sum: bool, rel: float = 2e-3) -> str | None:
    """Why a kernel's LSE does not match the emulation's (same shape), or None. Every row within rel of the
    largest |LSE| (at least 1: the logits' fp32 accumulation order is not the emulation's exact one); with
    rounded row sums up to ROUNDED_ROW_SUM_LSE_ATOL more, in at most max(2, 1%) of the rows (a p lands
    across a rounding boundary rarely; a wrong row sum would move most rows)."""
    err = (lse.double() - emu_lse).abs()
    rel_bound = rel * max(float(emu_lse.abs().max()), 1.0)
    beyond = int((err > rel_bound).sum())
    allowed = max(2, err.numel() // 100) if rounded_row_sum else 0
    bound = rel_bound + (ROUNDED_ROW_SUM_LSE_ATOL if rounded_row_sum else 0.0)
    worst = float(err.max())
    if worst <= bound and beyond <= allowed:
        return None
    return (f"LSE max error {worst:.4g} (bound {bound:.4g}); {beyond} of {err.numel()} rows beyond {rel_bound:.4g} "
            f"(allowed {allowed})")


def emulate_fp8_attention(q, k, v, scale=None, out_dtype=torch.bfloat16, return_lse=False, rows=None,
                          block_keys=KEYS, reverse=False, rounded_row_sum=False, qk_int8=False, key_lengths=None):
    """[B, S, H, D] -> [B, Sq, H, D] in out_dtype (and LSE [B, H, Sq] float64).

    rows: emulate only these query rows (quantized with the scales of the whole of q); rows
    are independent, so this is exact and makes long sequences affordable.
    block_keys, reverse: the key blocks the running max is taken over and their order (v1:
    32-key strips first to last; the sm90 kernel: tile_n-key blocks last to first).
    qk_int8: Q and K as the sm90 kernel's INT8 option takes them (`prep.quantize_int8_groups`).
    key_lengths: int [B], batch element b attends its first key_lengths[b] keys alone (the scales still come
    from all of k and v, as prep's); an element with none gets zero rows and an LSE of -inf."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, _, h, _ = q.shape
    amax = torch.stack([head_amax(x) for x in (q, k, v)])
    descale, quant = scales_from_amax(amax)

    def per_head(t):  # a per-(b, h) vector broadcast over [B, H, S, D]
        return t.double().view(b, h, 1, 1)

    vc = quantize(v, quant[2]).double().transpose(1, 2)  # e4m3 codes as float64, [B, H, S, D]
    max_steps = None
    if qk_int8:
        qc, kc = int8_codes(q, q_scale_group), int8_codes(k, k_scale_group)
        qc = qc if rows is None else qc[:, :, rows]
        qk_scales, max_steps = int8_kernel_scales(q, k, scale, block_keys, rows)
        logits = qc @ kc.transpose(-1, -2) * qk_scales  # log2 units, [B, H, Sq, Skv]
    else:
        qc, kc = (quantize(x, quant[i]).double().transpose(1, 2) for i, x in enumerate((q, k)))
        qc = qc if rows is None else qc[:, :, rows]
        logits = qc @ kc.transpose(-1, -2) * (per_head(descale[0]) * per_head(descale[1]) * scale * LOG2_E)
    if key_lengths is not None:
        dropped = torch.arange(k.shape[1], device=k.device) >= key_lengths.to(k.device).view(b, 1, 1, 1)
        logits = logits.masked_fill(dropped, -math.inf)
    out, lse = softmax_pv(logits, vc, per_head(descale[2]), block_keys=block_keys, reverse=reverse,
                          rounded_row_sum=rounded_row_sum, max_steps=max_steps)
    out = out.transpose(1, 2).to(out_dtype)
    return (out, lse) if return_lse else out


def int8_codes(x, group_of):
    """The codes of x [B, S, H, D] as the INT8 Q/K prep makes them with these scale groups
    (`layout.q_scale_group` or `layout.k_scale_group`), float64 [B, H, S, D]."""
    b, s, h, d = x.shape
    return quantize_int8_groups(padded_rows(x.float(), s), group_of)[0].double().view(b, h, s, d)


def int8_kernel_scales(q, k, scale, block_keys, rows=None):
    """What the sm90 kernel's INT8 Q/K scales each score by, and the running-max step of each key block
    (`softmax.BiasedGroups`): per query row and key, the fp32 product (softmax scale * log2(e)) * the row's group
    scale * the key's group scale, rounded up to a multiple of u * 2^-22, u = 2^(e - 22) for e the exponent of
    1.5 * 2^23 times the largest such scale of the row over the key block (the quad's four lanes hold all of its
    key groups); the step is u, or 0 (the max not rounded) where u > MAX_STEP.
    ([B, H, rows, Skv] float64 scales, [B, H, rows, n_blocks] float64 steps.)"""
    if block_keys != 2 * SCALE_BLOCK:
        raise ValueError(f"INT8 Q/K's kernel takes {2 * SCALE_BLOCK}-key blocks (two key scales a thread)")
    b, sq, h, _ = q.shape
    skv = k.shape[1]
    q_scale = quantize_int8_groups(padded_rows(q.float(), sq), q_scale_group)[1]
    k_scale = quantize_int8_groups(padded_rows(k.float(), skv), k_scale_group)[1]
    softmax_scale_log2 = torch.tensor(scale, dtype=torch.float32) * torch.tensor(LOG2_E, dtype=torch.float32)
    row_groups = q_scale_group(torch.arange(sq, device=q.device) if rows is None else rows.to(q.device))
    per_row = softmax_scale_log2.to(q.device) * q_scale[:, row_groups]  # [B*H, rows] fp32
    n_blocks = -(-skv // block_keys)
    per_key = torch.zeros(b * h, n_blocks * block_keys, dtype=torch.float32, device=k.device)
    per_key[:, :skv] = k_scale[:, k_scale_group(torch.arange(skv, device=k.device))]
    scales = per_row[:, :, None] * per_key[:, None, :]  # fp32 [B*H, rows, keys]
    largest = (scales.view(b * h, -1, n_blocks, block_keys).amax(-1) * ROUND_TO_INT).view(torch.int32)
    steps = torch.exp2((((largest >> 23) & 0xFF) - 127 - 22).double())  # its exponent alone is read
    quantum = (steps * 2.0**-22).repeat_interleave(block_keys, dim=-1)
    cut = (torch.ceil(scales.double() / quantum) * quantum)[..., :skv].view(b, h, -1, skv)
    steps = torch.where(steps > MAX_STEP, 0.0, steps).view(b, h, -1, n_blocks)
    return cut, steps


def softmax_pv(logits, v_codes, v_descale, block_keys=KEYS, reverse=False, rounded_row_sum=False, max_steps=None):
    """The kernels' softmax and P.V in float64 on given logits (log2 units, [B, H, Sq, Skv]) and V codes
    ([B, H, Skv, D], `v_descale` broadcast over them): an online softmax over `block_keys`-key blocks, p rounded
    to e4m3 as p * 256 against the running max, P.V of the codes accumulated per block and rescaled (the
    two-level accumulation), row sums of the unrounded p (or, `rounded_row_sum`, of the rounded p). max_steps:
    [B, H, Sq, n_blocks], the running max rounded up to a multiple of each block's (`int8_kernel_scales`; 0: not
    rounded), or None. A block whose logits are all -inf (keys past a key length) adds nothing, wherever it comes:
    against a max of -inf its p are 0 (the kernels skip such blocks); a row with no finite logit comes out 0.
    Returns (out [B, H, Sq, D] float64, LSE [B, H, Sq] float64, natural log)."""
    b, h, sq, _ = logits.shape
    row_max = torch.full((b, h, sq, 1), -math.inf, dtype=torch.float64, device=logits.device)
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros(b, h, sq, v_codes.shape[-1], dtype=torch.float64, device=logits.device)
    starts = list(range(0, logits.shape[-1], block_keys))
    for start in reversed(starts) if reverse else starts:
        strip = logits[..., start:start + block_keys]
        new_max = torch.maximum(row_max, strip.amax(-1, keepdim=True))
        if max_steps is not None:
            step = max_steps[..., start // block_keys, None]
            new_max = torch.where(step > 0, torch.ceil(new_max / step) * step, new_max)
        safe_max = torch.where(new_max == -math.inf, 0.0, new_max)  # -inf - -inf kept out of exp2
        rescale = torch.exp2(row_max - safe_max)
        p = torch.exp2(strip - safe_max)
        p_codes = (p.float() * P_SCALE).to(FP8).double()
        summed = p_codes / P_SCALE if rounded_row_sum else p
        row_sum = row_sum * rescale + summed.sum(-1, keepdim=True)
        acc = acc * rescale + p_codes @ v_codes[..., start:start + block_keys, :]
        row_max = new_max
    out = torch.where(row_sum == 0, 0.0, acc * (v_descale / P_SCALE) / row_sum)  # NaN rows stay NaN
    return out, ((row_max + torch.log2(row_sum)) * LN_2).squeeze(-1)

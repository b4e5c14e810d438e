"""INT8 Q/K's emulation on the CPU: its error class, its row subsets, and an fp32 replica of the sm90 kernel's
softmax arithmetic (`softmax.biased_scores`, `softmax.BiasedGroups`) that must land on it: the bias of
1.5 * 2^23 taken off exactly needs the running max rounded up to each key block's step, which the emulation
does too (`emulation.int8_max_steps`)."""
import math

import torch

from dit_accel.attention.reference import random_qkv, reference_attention, rel_rms_err
from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention, int8_max_steps
from dit_accel.kernels.fp8_attention.layout import FP8, LOG2_E, ROUND_TO_INT, key_order
from dit_accel.kernels.fp8_attention.prep import prep_reference

TILE_N = 128


def emulate(q, k, v, **options):
    return emulate_fp8_attention(q, k, v, block_keys=TILE_N, reverse=True, qk_int8=True, **options)


def test_int8_qk_errs_less_than_e4m3_on_gaussian_inputs_and_rows_are_exact():
    q, k, v = random_qkv(1, 512, 512, 2, 128, device="cpu")
    ref = reference_attention(q, k, v)
    int8 = rel_rms_err(emulate(q, k, v), ref)
    e4m3 = rel_rms_err(emulate_fp8_attention(q, k, v, block_keys=TILE_N, reverse=True), ref)
    assert 0.03 < int8 < 0.042 < 0.05 < e4m3 < 0.06, (int8, e4m3)
    rows = torch.tensor([0, 63, 64, 511])
    assert torch.equal(emulate(q, k, v)[:, rows], emulate(q, k, v, rows=rows))


def test_max_steps_are_twice_the_ulp_of_the_larger_bias():
    q, k, v = random_qkv(1, 70, 300, 2, 64, True, seed=3, device="cpu")
    steps = int8_max_steps(q, k, 64 ** -0.5, TILE_N)
    assert steps.shape == (1, 2, 70, 3)
    exponents = torch.log2(steps)
    assert torch.equal(exponents, exponents.round())  # powers of two
    p = prep_reference(q, k, v, qk_int8=True)
    scale = float(torch.tensor(64 ** -0.5, dtype=torch.float32) * torch.tensor(LOG2_E, dtype=torch.float32))
    row, block = 69, 1  # key block 1: k blocks 2 and 3
    bias = max(ROUND_TO_INT * scale * float(p.q_scale[0, row // 64]) * float(p.k_scale[0, g]) for g in (2, 3))
    assert float(steps[0, 0, row, block]) == 2.0 ** (math.frexp(bias)[1] - 1 - 22)


def kernel_replica(q, k, v):
    """The sm90 kernel's INT8 Q/K softmax in fp32, rows at once, key blocks last to first: s + 1.5 * 2^23 as
    fp32, scales rounded to 21 bits, the group max by one rounding, the running max rounded up to the block's
    step, exp2 of one FMA (p * 256: the 8 in its constant), p * 256 in e4m3, two-level P.V."""
    p = prep_reference(q, k, v, qk_int8=True)
    b, sq, h, d = q.shape
    skv = k.shape[1]
    f32 = torch.float32
    softmax_scale_log2 = torch.tensor(d ** -0.5, dtype=f32) * torch.tensor(LOG2_E, dtype=f32)
    order = key_order(torch.arange(p.v.shape[2]))
    out = torch.empty(b * h, sq, d, dtype=torch.float64)
    for bh in range(b * h):
        v_rows = torch.empty(p.v.shape[2], d)
        v_rows[order] = p.v[bh].float().t()
        q_scale = (softmax_scale_log2 * p.q_scale[bh]).repeat_interleave(64)[:sq, None]  # [Sq, 1]
        biased = (p.q[bh, :sq].double() @ p.k[bh, :skv].double().t() + ROUND_TO_INT).to(f32)  # exact
        m = torch.full((sq, 1), -math.inf, dtype=f32)
        row_sum, acc = torch.zeros(sq, 1, dtype=f32), torch.zeros(sq, d, dtype=f32)
        for block in reversed(range(math.ceil(skv / TILE_N))):
            keys = torch.arange(block * TILE_N, min(block * TILE_N + TILE_N, skv))
            group = (keys - block * TILE_N) // 64
            k_scale = p.k_scale[bh, (2 * block + group).clamp(max=p.k_scale.shape[1] - 1)]
            scale = q_scale * k_scale[None, :]  # fp32 [Sq, keys]
            scale = (scale.view(torch.int32) & ~7).view(f32)
            bias = scale * ROUND_TO_INT  # exact
            f = biased[:, keys]
            block_max = (f.double() * scale.double() - bias.double()).to(f32).amax(1, keepdim=True)
            step_bias = torch.stack([bias[:, group == g].amax(1) for g in group.unique()], 1).amax(1, keepdim=True)
            step = torch.exp2(torch.floor(torch.log2(step_bias.double())) - 22).to(f32)
            new = torch.ceil(torch.maximum(m, block_max) / step) * step
            constant = (8.0 - new) - bias  # exact
            prob = torch.exp2((f.double() * scale.double() + constant.double()).to(f32))
            rescale = torch.exp2(m - new)
            row_sum = row_sum * rescale + prob.sum(1, keepdim=True)
            codes = prob.to(FP8).float()
            acc = acc * rescale + (codes.double() @ v_rows[keys].double()).to(f32)
            m = new
        out[bh] = (acc / row_sum * p.descale[2, bh]).double()
    return out.view(b, h, sq, d).transpose(1, 2)


def test_the_kernels_fp32_arithmetic_lands_on_the_emulation_with_outliers():
    """30x outliers make block scales large, where a bias rounded to fp32 would put the kernel 2% off the
    emulation (what the GPU measured of such a build); taken off exactly, the replica sits within 1e-3."""
    for b, sq, skv, d, seed in ((2, 17, 17, 128, 162), (1, 130, 300, 128, 5), (1, 70, 200, 64, 9)):
        q, k, v = random_qkv(b, sq, skv, 2, d, True, seed=seed, device="cpu")
        assert rel_rms_err(kernel_replica(q, k, v), emulate(q, k, v, out_dtype=torch.float64)) < 1e-3

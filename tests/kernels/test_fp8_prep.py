"""CPU checks of the prep contract (torch reference), the emulation, and interface errors."""
import math

import pytest
import torch

from dit_accel.kernels.fp8_attention import Fp8AttentionUnsupported, fp8_attention
from dit_accel.attention.reference import reference_attention, rel_rms_err
from dit_accel.kernels.fp8_attention.emulation import ROUNDED_ROW_SUM_LSE_ATOL, emulate_fp8_attention, lse_mismatch
from dit_accel.kernels.fp8_attention.prep import FP8, key_order, prep_reference


def qkv(b=2, sq=100, skv=70, h=3, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(s):
        return torch.randn(b, s, h, d, generator=g).to(dtype)

    return make(sq), make(skv), make(skv)


def dequant_rows(codes, descale, b, h, s):  # [B*H, S_pad, D] -> [B, S, H, D] float64
    x = codes.double() * descale.double().view(-1, 1, 1)
    return x[:, :s].reshape(b, h, s, -1).transpose(1, 2)


def test_padding_shapes_and_scales():
    q, k, v = qkv()
    p = prep_reference(q, k, v)
    assert p.q.shape == (6, 128, 64) and p.k.shape == (6, 96, 64) and p.v.shape == (6, 64, 96)
    assert p.q.dtype == p.k.dtype == p.v.dtype == FP8 and p.q.is_contiguous() and p.v.is_contiguous()
    amax_q = q.float().abs().amax(dim=(1, 3)).reshape(-1)
    torch.testing.assert_close(p.descale[0], amax_q / 448.0)
    assert float(p.q.float().abs().amax()) == 448.0  # the head max maps to the top code
    assert (p.q[:, 100:].float() == 0).all() and (p.k[:, 70:].float() == 0).all()


def test_quantization_error_bound():
    q, k, v = qkv()
    p = prep_reference(q, k, v)
    for codes, x, desc in ((p.q, q, p.descale[0]), (p.k, k, p.descale[1])):
        back = dequant_rows(codes, desc, 2, 3, x.shape[1])
        err = (back - x.double()).abs()
        # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; absolute floor from
        # the smallest subnormal step 2^-9 in code units
        bound = x.double().abs() * 2.0 ** -4 + desc.double().view(2, 1, 3, 1) * 2.0 ** -10
        assert (err <= bound + 1e-12).all()


def test_v_feature_major_and_permuted():
    q, k, v = qkv(skv=70)
    p = prep_reference(q, k, v)
    order = key_order(torch.arange(96))
    codes = (v.float() * (448.0 / v.float().abs().amax(dim=(1, 3), keepdim=True))).clamp(-448, 448).to(FP8)
    codes = codes.permute(0, 2, 1, 3).reshape(6, 70, 64)  # [B*H, Skv, D]
    for slot in range(96):
        key = int(order[slot])
        expect = codes[:, key] if key < 70 else torch.zeros(6, 64, dtype=FP8)
        assert torch.equal(p.v[:, :, slot].view(torch.uint8), expect.view(torch.uint8)), slot


def test_key_order_matches_mma_fragments():
    """Derived from the PTX fragment tables of mma.m16n8k32 (e4m3), independently of prep:
    C (16x8 f32): lane holds rows lane//4 (+8), columns 2*(lane%4) + {0,1} of each n8 tile.
    A (16x32 e4m3): a0..a3 hold row lane//4, columns 4*(lane%4) + {0..3}; a8..a11 the same + 16.
    The kernel packs, in order, a lane's row-g scores of n8 tiles 0..3 (2 each) into a0..a3,
    a8..a11. P.V is then correct iff V's k slot s holds the key whose score lands in slot s."""
    slot_holds_key = {}
    for lane in range(32):
        t = lane % 4
        keys = [8 * j + 2 * t + c for j in range(4) for c in range(2)]  # C order
        slots = [4 * t + e for e in range(4)] + [16 + 4 * t + e for e in range(4)]  # A order
        for key, slot in zip(keys, slots):
            assert slot_holds_key.setdefault(slot, key) == key
    assert sorted(slot_holds_key) == list(range(32))
    order = key_order(torch.arange(64))
    for slot in range(64):
        assert int(order[slot]) == slot // 32 * 32 + slot_holds_key[slot % 32]


def test_zero_head_guard():
    q, k, v = qkv()
    v[:, :, 1] = 0
    p = prep_reference(q, k, v)
    descale_v = p.descale[2].view(2, 3)
    assert (descale_v[:, 1] == 1.0).all() and torch.isfinite(p.v.float()).all()


@pytest.mark.parametrize("tensor", [0, 1, 2])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_input_gives_a_nan_head(tensor, bad):
    """As torch's attention: the (batch, head) holding inf/NaN comes out NaN, the others exact."""
    inputs = list(qkv())
    inputs[tensor][1, 5, 2, 7] = bad
    descale = prep_reference(*inputs).descale.view(3, 2, 3)
    assert torch.isnan(descale[tensor, 1, 2]) and torch.isfinite(descale).sum() == descale.numel() - 1
    out = emulate_fp8_attention(*inputs)
    assert torch.isnan(out[1, :, 2]).all()
    out[1, :, 2] = 0
    assert torch.isfinite(out).all()
    clean = emulate_fp8_attention(*qkv())
    clean[1, :, 2] = 0
    assert torch.equal(out, clean)


def test_emulation_error_vs_fp64():
    q, k, v = qkv(b=1, sq=256, skv=256, h=2, d=128)
    err = rel_rms_err(emulate_fp8_attention(q, k, v), reference_attention(q, k, v))
    assert 0.035 < err < 0.07  # ~5.2% on N(0,1): the e4m3 rounding of Q, K, V and P


def test_emulation_with_row_sums_of_the_rounded_p():
    """`rounded_row_sum` (the sm90 kernel's pv_row_sum) divides by the sum of the e4m3 P that the
    numerator uses: a different figure from the unrounded sums, in the same error class, and the LSE
    moves by the rounding's share of each row sum only."""
    q, k, v = qkv(b=1, sq=256, skv=300, h=2, d=64)
    ref = reference_attention(q, k, v)
    out, lse = emulate_fp8_attention(q, k, v, return_lse=True, block_keys=128, reverse=True)
    out_r, lse_r = emulate_fp8_attention(q, k, v, return_lse=True, block_keys=128, reverse=True, rounded_row_sum=True)
    assert not torch.equal(out, out_r)
    assert abs(rel_rms_err(out_r, ref) - rel_rms_err(out, ref)) < 0.01
    assert float((lse_r - lse).abs().max()) < 0.05


def test_lse_mismatch_allows_rare_rounding_flips_only():
    """With rounded row sums a few rows may sit up to ROUNDED_ROW_SUM_LSE_ATOL off the emulation's LSE (a p
    rounded to the neighbouring code); a row further off, or every row off (a wrong row sum), is reported;
    without rounded row sums only the relative bound (2e-3 of max |LSE|) holds."""
    emu = torch.full((2, 3, 100), 5.0, dtype=torch.float64)
    assert lse_mismatch(emu.float(), emu, rounded_row_sum=False) is None
    two_rows = emu.clone()
    two_rows[0, 0, :2] += 0.9 * ROUNDED_ROW_SUM_LSE_ATOL
    assert lse_mismatch(two_rows, emu, rounded_row_sum=True) is None
    assert "2 of 600 rows" in lse_mismatch(two_rows, emu, rounded_row_sum=False)
    far = emu.clone()
    far[1, 2, 7] += 1.1 * ROUNDED_ROW_SUM_LSE_ATOL
    assert lse_mismatch(far, emu, rounded_row_sum=True) is not None
    every_row = emu + 0.5 * ROUNDED_ROW_SUM_LSE_ATOL
    assert "600 of 600 rows" in lse_mismatch(every_row, emu, rounded_row_sum=True)


@pytest.mark.parametrize("change, message", [
    (lambda x: x.float(), "pass bfloat16 or float16"),
    (lambda x: x[..., :48], "head dim 48 unsupported"),
    (lambda x: x, "move q, k, v to a CUDA device"),
    (lambda x: x[:0], "batch, heads and sequence lengths must be >= 1"),
    (lambda x: x[:, :, :0], "batch, heads and sequence lengths must be >= 1"),
    (lambda x: x[:, :0], "batch, heads and sequence lengths must be >= 1"),
])
def test_interface_errors(change, message):
    q, k, v = (change(x) for x in qkv())
    with pytest.raises(Fp8AttentionUnsupported, match=message):
        fp8_attention(q, k, v)


def test_random_qkv_is_seeded_and_scales_a_thousandth_by_fifty():
    from dit_accel.attention.reference import random_qkv

    q, k, v = random_qkv(2, 300, 200, 3, 64, True, seed=7, device="cpu", dtype=torch.float32)
    assert q.shape == (2, 300, 3, 64) and k.shape == v.shape == (2, 200, 3, 64)
    again = random_qkv(2, 300, 200, 3, 64, True, seed=7, device="cpu", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    plain = random_qkv(2, 300, 200, 3, 64, False, seed=7, device="cpu", dtype=torch.float32)
    scaled = (q != plain[0]).float().mean().item()
    assert 0.0005 < scaled < 0.002  # 0.1% of the elements, each exactly 50x the N(0,1) draw
    changed = q != plain[0]
    assert torch.allclose(q[changed], 50 * plain[0][changed])


def test_launch_spec_tells_apart_what_triton_specializes_and_the_checks_read():
    """`launch_spec` keys prep's compiled launches and fp8_attention's passed checks: equal for another
    tensor of the same metadata, different for each thing a launch or a check depends on."""
    from dit_accel.kernels.fp8_attention.prep import Prologue, launch_spec

    def widened(x, offset):  # the same values in [..., D + 1] storage, at element `offset` of it
        wide = torch.cat((x, x[..., :1]), dim=-1) if offset == 0 else torch.cat((x[..., :1], x), dim=-1)
        return wide[..., offset:offset + x.shape[-1]]

    q, k, v = qkv()
    base = launch_spec(q, k, v)
    assert launch_spec(q.clone(), k.clone(), v.clone()) == base
    variants = {
        "shape": qkv(sq=101),
        "strides": (q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
        "dtype": (q.half(), k.half(), v.half()),
        "v's dtype alone": (q, k, v.half()),
        "alignment": (widened(q, 1), k, v),
    }
    aligned = widened(q, 0)
    assert aligned.stride() == variants["alignment"][0].stride() and aligned.data_ptr() % 16 == 0
    assert variants["alignment"][0].data_ptr() % 16 == 2
    specs = {name: launch_spec(*inputs) for name, inputs in variants.items()}
    specs["aligned, same strides"] = launch_spec(aligned, k, v)
    assert len(set(specs.values()) | {base}) == len(specs) + 1, specs.keys()
    d, s = q.shape[-1], q.shape[1]
    prologue = Prologue(torch.ones(d), torch.ones(d), 1e-6, torch.ones(s, 32), torch.zeros(s, 32))
    with_prologue = launch_spec(q, q, q, prologue)
    assert with_prologue != launch_spec(q, q, q)
    assert with_prologue != launch_spec(q, q, q, Prologue(torch.ones(d), torch.ones(d), 1e-6, torch.ones(s, 16),
                                                          torch.zeros(s, 16)))


def test_the_host_path_memos_start_over_when_full():
    """fp8_attention's passed checks and prep's compiled launches (the latter checked in the interpreter's tests)
    are BoundedMemos: a key is remembered until a new one would take the memo past its limit; then the memo starts
    over with the new key alone."""
    from dit_accel.kernels.fp8_attention import interface
    from dit_accel.kernels.fp8_attention.memo import BoundedMemo

    memo = BoundedMemo(2)
    memo.remember("a")
    memo.remember("b", 2)
    memo.remember("b", 3)  # a key it holds: replaced, nothing forgotten
    assert memo == {"a": None, "b": 3}
    memo.remember("c")
    assert memo == {"c": None}
    assert isinstance(interface._passed_checks, BoundedMemo) and interface._passed_checks.limit == 1024


def test_int8_qk_is_refused_where_the_kernel_is_not_the_sm90_one():
    """INT8 Q/K exists in the sm90 kernel only: a device that resolves to v1 (sm_89, sm_120) is refused before
    any prep, in a line that says what to pass."""
    from dit_accel.kernels.fp8_attention.support import check_qk_int8

    check_qk_int8("sm90")
    with pytest.raises(Fp8AttentionUnsupported, match="INT8 Q/K runs on the sm_90 kernel only; pass qk_int8=False"):
        check_qk_int8("mma_sync")

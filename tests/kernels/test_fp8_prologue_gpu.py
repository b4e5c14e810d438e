"""The fused prologue on a GPU: QK-norm + RoPE computed inside the Triton prep (`prep.Prologue`)
against its fp32 spec (`prep.apply_prologue`), and the attention it feeds against the emulation."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 mma.sync (sm_89+)", allow_module_level=True)

from dit_accel.attention.reference import random_qkv, reference_attention, rel_rms_err  # noqa: E402
from dit_accel.kernels.fp8_attention import fp8_attention  # noqa: E402
from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention  # noqa: E402
from dit_accel.kernels.fp8_attention.op import FP8_ATTENTION_PROLOGUE  # noqa: E402
from dit_accel.kernels.fp8_attention import prep_triton_kernels as tk  # noqa: E402
from dit_accel.kernels.fp8_attention.prep import Prologue, apply_prologue, prep_reference, prep_triton  # noqa: E402
from testing import count_launches  # noqa: E402


def make_prologue(seq: int, head_dim: int, rotary: int, seed: int = 0) -> Prologue:
    g = torch.Generator(device="cuda").manual_seed(seed)
    angles = torch.rand(seq, rotary // 2, generator=g, device="cuda") * 50
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    wq = (torch.rand(head_dim, generator=g, device="cuda") + 0.5).bfloat16()
    wk = torch.rand(head_dim, generator=g, device="cuda") + 0.5  # fp32 weights are read as well
    return Prologue(wq, wk, 1e-5, cos, sin)


def raw_projections(seq: int, heads: int, head_dim: int, outliers: bool = False):
    """q, k, v as views of one fused projection output (what H3's to_qkv chunks give), q 7x larger."""
    q, k, v = random_qkv(1, seq, seq, heads, head_dim, outliers)
    fused = torch.cat([q * 7, k, v], dim=-1).contiguous()  # [B, S, H, 3D]
    return fused[..., :head_dim], fused[..., head_dim: 2 * head_dim], fused[..., 2 * head_dim:]


@pytest.mark.parametrize("heads", [3, 10, 56])  # one group of heads, a partial second group, H3's 56
@pytest.mark.parametrize("head_dim, rotary", [(128, 96), (128, 128), (64, 64), (64, 32)])
@pytest.mark.parametrize("seq", [1, 333, 1000])
def test_prologue_prep_matches_its_fp32_spec(monkeypatch, seq, head_dim, rotary, heads):
    """Against `prep.apply_prologue`, in two launches at every length, S_pad 128 included (the one launch
    is the plain prep's only)."""
    q, k, v = raw_projections(seq, heads, head_dim, outliers=True)
    prologue = make_prologue(seq, head_dim, rotary)
    launched = count_launches(monkeypatch, tk)
    got, want = prep_triton(q, k, v, prologue), prep_reference(q, k, v, prologue)
    assert launched == ["_fp8_prep_amax_kernel", "_fp8_prep_pack_kernel"]
    torch.testing.assert_close(got.descale, want.descale, rtol=2e-6, atol=0)
    assert torch.equal(got.v.view(torch.uint8), want.v.view(torch.uint8))  # v takes no prologue: bitwise
    for name in ("q", "k"):
        a, b = getattr(got, name).float(), getattr(want, name).float()
        differ = a != b
        # fp32 arithmetic in another order: a code may land on the other side of a rounding tie
        assert differ.float().mean() < 1e-3, name
        step = torch.maximum(a.abs(), b.abs()).clamp(min=2.0**-6) * 2.0**-3  # one e4m3 step
        assert ((a - b).abs() <= step)[differ].all(), name


@pytest.mark.parametrize("seq", [333, 4096])
def test_attention_with_prologue_matches_emulation(seq):
    q, k, v = raw_projections(seq, 4, 128)
    prologue = make_prologue(seq, 128, 96)
    out = fp8_attention(q, k, v, prologue=prologue)
    qn, kn = apply_prologue(q, prologue.norm_q_weight, prologue), apply_prologue(k, prologue.norm_k_weight, prologue)
    emu = emulate_fp8_attention(qn, kn, v, block_keys=128, reverse=True)
    ref = reference_attention(qn, kn, v)
    assert torch.isfinite(out).all()
    assert rel_rms_err(out, emu) < 0.01
    assert rel_rms_err(out, ref) < rel_rms_err(emu, ref) + 0.005


def test_prologue_op_compiles_fullgraph_and_nan_heads_stay_local():
    q, k, v = raw_projections(300, 3, 128)
    p = make_prologue(300, 128, 96)

    def attend(q, k, v):
        return FP8_ATTENTION_PROLOGUE(q, k, v, p.norm_q_weight, p.norm_k_weight, p.eps, p.cos, p.sin, None, "auto")

    eager = attend(q, k, v)
    torch.testing.assert_close(torch.compile(attend, fullgraph=True)(q, k, v), eager, rtol=0, atol=0)
    q = q.clone()
    q[0, 5, 1, 3] = float("nan")
    out = attend(q, k, v)
    assert torch.isnan(out[0, :, 1]).all()
    out[0, :, 1] = eager[0, :, 1]
    assert torch.equal(out, eager)

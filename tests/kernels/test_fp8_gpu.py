"""FP8 attention v1 (mma.sync) on a GPU: kernel vs fp64 and vs the emulation, tails, poisoning, LSE, prep."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 mma.sync (sm_89+)", allow_module_level=True)

from dit_accel.kernels.fp8_attention import fp8_attention, fp8_attention_packed, prep_fp8_attention  # noqa: E402
from dit_accel.attention.reference import (  # noqa: E402
    random_qkv, reference_attention, reference_lse, rel_rms_err)
from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention  # noqa: E402
from dit_accel.kernels.fp8_attention import prep_triton_kernels as tk  # noqa: E402
from dit_accel.kernels.fp8_attention.memo import BoundedMemo  # noqa: E402
from dit_accel.kernels.fp8_attention.prep import prep_reference, prep_triton  # noqa: E402
from testing import add_special_heads, count_launches, force_path, in_layout  # noqa: E402




@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, skv", [(1, 1), (17, 17), (127, 127), (128, 128), (1000, 1000), (1000, 512), (17, 512)])
def test_kernel_matches_emulation(sq, skv, d, b, outliers):
    q, k, v = random_qkv(b, sq, skv, 3, d, outliers)
    packed = prep_fp8_attention(q, k, v)
    out = torch.full((b, sq, 3, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, lse = fp8_attention_packed(packed, return_lse=True, out=out, kernel="mma_sync")  # v1; sm90 has its own file
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "output not fully written (poisoned NaN left) or non-finite"
    ref = reference_attention(q, k, v)
    emu, emu_lse = emulate_fp8_attention(q, k, v, return_lse=True)
    err, err_emu = rel_rms_err(out, ref), rel_rms_err(emu, ref)
    assert rel_rms_err(out, emu) < 0.02, (err, err_emu)
    assert err < err_emu + 0.005, (err, err_emu)
    torch.testing.assert_close(lse.double(), emu_lse, atol=1e-3, rtol=1e-4)
    if not outliers:  # fp8 logit error grows with 50x outliers; the emulation check covers them
        assert (lse.double() - reference_lse(q, k)).abs().max() < 0.2


def test_public_entry_point_and_scale():
    q, k, v = random_qkv(2, 300, 300, 4, 128)
    out = fp8_attention(q, k, v, scale=0.05)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_rms_err(out, reference_attention(q, k, v, scale=0.05)) < 0.08


@pytest.mark.parametrize("one_launch", [True, False])
def test_triton_prep_matches_reference_bitwise(monkeypatch, one_launch):
    q, k, v = random_qkv(2, 333, 77, 3, 128, outliers=True)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous [B, S, H, D] view
    force_path(monkeypatch, tk, one_launch)
    launched = count_launches(monkeypatch, tk)
    a, r = prep_triton(q, k, v), prep_reference(q, k, v)
    assert len(launched) == (1 if one_launch else 2)
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(r, name).view(torch.uint8)), name
    assert torch.equal(a.descale, r.descale)


@pytest.mark.parametrize("one_launch", [True, False])
def test_int8_qk_triton_prep_matches_reference_bitwise(monkeypatch, one_launch):
    """INT8 Q/K: codes and group scales bit for bit (an inf and a NaN group included: NaN scales in the same
    places), v and its descale as the e4m3 prep's."""
    q, k, v = random_qkv(2, 333, 77, 3, 128, outliers=True)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    q[1, 200, 2, 7], k[0, 70, 1, 3] = float("inf"), float("nan")
    force_path(monkeypatch, tk, one_launch)
    a, r = prep_triton(q, k, v, qk_int8=True), prep_reference(q, k, v, qk_int8=True)
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(r, name).view(torch.uint8)), name
    for name in ("q_scale", "k_scale", "descale"):
        x, y = getattr(a, name), getattr(r, name)
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), name
    assert int(a.q_scale.isnan().sum()) == 1 and int(a.k_scale.isnan().sum()) == 1


def small_prep_inputs(b, sq, skv, h, d, layout, special):
    """q, k, v with outliers in `layout` (`in_layout`); special: `add_special_heads`."""
    q, k, v = in_layout(*random_qkv(b, sq, skv, h, d, outliers=True), layout)
    if special:
        add_special_heads(q, k, v)
    return q, k, v


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("b, h, sq, skv, d, layout", [  # max(Sq_pad, Skv_pad) <= 1024, one launch forced
    (1, 1, 1, 1, 64, "contiguous"),
    (1, 1, 128, 128, 128, "contiguous"),  # the per-call cost's shape
    (2, 3, 17, 65, 128, "contiguous"),
    (1, 10, 64, 129, 64, "contiguous"),
    (2, 3, 129, 17, 128, "heads-major"),
    (1, 3, 1000, 64, 128, "contiguous"),
    (2, 1, 65, 1000, 64, "contiguous"),
    (2, 10, 129, 129, 128, "qkv"),
    (1, 10, 1000, 1000, 64, "qkv"),
    (2, 3, 1000, 1000, 128, "qkv"),
])
def test_single_launch_prep_matches_reference_bitwise(monkeypatch, b, h, sq, skv, d, layout, special):
    """The short-sequence path (one launch, no amax buffer) against the torch spec, bit for bit; a head
    holding inf or NaN has a NaN descale in both, and its codes are not compared (the spec's quant is 1
    for a NaN amax, the kernel's 0: NaN counts as inf)."""
    q, k, v = small_prep_inputs(b, sq, skv, h, d, layout, special)
    force_path(monkeypatch, tk, True)
    launched = count_launches(monkeypatch, tk)
    got, want = prep_triton(q, k, v), prep_reference(q, k, v)
    assert launched == ["_fp8_prep_single_kernel"]
    finite = torch.isfinite(want.descale)
    assert torch.equal(torch.isnan(got.descale), ~finite)
    assert torch.equal(got.descale[finite], want.descale[finite])
    assert special or bool(finite.all())
    for t, name in enumerate(("q", "k", "v")):
        a, r = getattr(got, name).view(torch.uint8), getattr(want, name).view(torch.uint8)
        assert a.shape == r.shape and torch.equal(a[finite[t]], r[finite[t]]), name


@pytest.mark.parametrize("one_launch", [True, False])
def test_prep_relaunches_compiled_kernels_only_for_equal_specs(monkeypatch, one_launch):
    """Prep launches a kernel through Triton's JIT once per launch spec and then through the compiled kernel that
    returned (`prep_triton_kernels._launch`). Each case runs twice (JIT, then compiled) and must match the
    spec bit for bit both times; the cases differ in what Triton specializes on: H = 1, lengths and strides
    divisible by 16 or not, odd strides, fused-projection strides, and contiguous tensors 16-byte aligned and
    then 2 bytes off (with their strides divisible by 16, the aligned kernel loads 16 bytes at a time: reused
    for the others, those loads would be misaligned)."""
    force_path(monkeypatch, tk, one_launch)
    monkeypatch.setattr(tk, "_compiled", BoundedMemo(1024))

    def offset_by(x, elements):  # the same values, contiguous, starting `elements` elements into their storage
        storage = torch.empty(x.numel() + elements, dtype=x.dtype, device=x.device)
        return storage[elements:].view(x.shape).copy_(x)

    def odd_strides(x):  # a view into [..., D + 1] storage
        return torch.cat((x, x[..., :1]), dim=-1)[..., :-1]

    aligned = random_qkv(2, 17, 64, 3, 128)
    off = tuple(offset_by(x, 1) for x in aligned)
    assert off[0].stride() == aligned[0].stride() and off[0].stride(1) % 16 == 0
    assert aligned[0].data_ptr() % 16 == 0 and all(x.data_ptr() % 16 == 2 for x in off)
    cases = (random_qkv(1, 128, 128, 1, 128), aligned, off, tuple(map(odd_strides, random_qkv(2, 17, 65, 3, 128))),
             in_layout(*random_qkv(1, 129, 129, 10, 128), "qkv"), random_qkv(2, 256, 32, 5, 64))
    for q, k, v in cases:
        want = prep_reference(q, k, v)
        for _ in range(2):
            got = prep_triton(q, k, v)
            for name in ("q", "k", "v"):
                assert torch.equal(getattr(got, name).view(torch.uint8), getattr(want, name).view(torch.uint8)), name
            assert torch.equal(got.descale, want.descale)
    assert len(tk._compiled) == len(cases) * (1 if one_launch else 2)  # one entry per (kernel, spec): reused


def test_checks_run_once_per_launch_spec(monkeypatch):
    """fp8_attention checks a call's inputs once per (launch spec, kernel) it took; another spec, a refused
    one included, is checked again (and a refusal is not remembered)."""
    from dit_accel.kernels.fp8_attention import Fp8AttentionUnsupported, interface

    monkeypatch.setattr(interface, "_passed_checks", BoundedMemo(1024))
    checked, check = [], interface._check
    monkeypatch.setattr(interface, "_check", lambda *args: checked.append(args[3]) or check(*args))
    q, k, v = random_qkv(1, 128, 128, 2, 128)
    fp8_attention(q, k, v)
    fp8_attention(q.clone(), k.clone(), v.clone())
    assert checked == ["auto"]
    for _ in range(2):
        with pytest.raises(Fp8AttentionUnsupported, match="kernel"):
            fp8_attention(q, k, v, kernel="bogus")
    fp8_attention(q, k, v, kernel="mma_sync")
    assert checked == ["auto", "bogus", "bogus", "mma_sync"]


@pytest.mark.parametrize("kernel", ["mma_sync", "auto"])
@pytest.mark.parametrize("tensor", [0, 1, 2])
def test_non_finite_input_gives_a_nan_head(kernel, tensor):
    """inf/NaN in q, k or v: that (batch, head) comes out NaN, every other head is unchanged,
    and nothing synchronises with the host on the way."""
    inputs = list(random_qkv(2, 300, 200, 3, 128))
    clean = fp8_attention(*inputs, kernel=kernel)
    inputs[tensor][1, 7, 2, 5] = float("inf") if tensor != 1 else float("nan")
    out = fp8_attention(*inputs, kernel=kernel)
    assert torch.isnan(out[1, :, 2]).all()
    out[1, :, 2] = clean[1, :, 2]
    assert torch.equal(out, clean)


def test_int8_qk_non_finite_input_reaches_the_rows_it_touches():
    """INT8 Q/K: inf in a row of q makes its scale group NaN (rows 70 and 78: `layout.q_scale_group`), a NaN in k
    or v the whole head (every row sees that key group; V's scale is per head); every other row is unchanged."""
    inputs = list(random_qkv(2, 300, 200, 3, 128))
    clean = fp8_attention(*inputs, qk_int8=True)
    for tensor, rows in ((0, [70, 78]), (1, slice(None)), (2, slice(None))):
        broken = [x.clone() for x in inputs]
        broken[tensor][1, 70, 2, 5] = float("inf") if tensor == 0 else float("nan")
        out = fp8_attention(*broken, qk_int8=True)
        assert torch.isnan(out[1, rows, 2]).all()
        out[1, rows, 2] = clean[1, rows, 2]
        assert torch.equal(out, clean)


def test_fp8_attention_replays_in_a_cuda_graph():
    q, k, v = random_qkv(1, 1000, 1000, 4, 128)
    eager = fp8_attention(q, k, v)  # also compiles the plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_attention(q, k, v)
    q.copy_(q.flip(1))
    graph.replay()
    torch.testing.assert_close(captured, fp8_attention(q, k, v), rtol=0, atol=0)
    assert not torch.equal(captured, eager)

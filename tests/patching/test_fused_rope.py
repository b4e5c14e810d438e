"""fused_rope: the float32 reference against diffusers' `_apply_rotary_emb`, the reversible swap of
that global (identity, nesting, counting, fallback on CPU), a tiny MiniMax-H3 transformer under it,
and on a GPU the Triton kernel against the reference and against diffusers' time."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from diffusers.models.transformers import transformer_minimax_h3 as h3_file
from testing import tiny_h3_transformer
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

from dit_accel.errors import UserError
from dit_accel.kernels.rope import apply_rotary_emb_fused, rope_reference
from dit_accel.patching.rope import ROPE_GLOBAL, fallback_reason, fused_rope

ORIGINAL = h3_file._apply_rotary_emb  # diffusers' own function, read before any test patches it
H3_LAYERS, H3_REFINER_LAYERS = 3, 2


def rope_inputs(b, s, h, d, r, dtype=torch.bfloat16, device="cpu", layout="contiguous", seed=0):
    """x [b, s, h, d] laid out as `layout` (contiguous; "qkv-slice": the query third of a fused qkv
    projection; "transposed": a [b, h, s, d] tensor seen through transpose(1, 2)), and cos/sin
    [s, r] float32 built as H3 builds them (r / 2 angles concatenated with themselves)."""
    g = torch.Generator(device).manual_seed(seed)
    shape, view = {
        "contiguous": ((b, s, h, d), lambda t: t),
        "qkv-slice": ((b, s, 3 * h * d), lambda t: t.chunk(3, dim=-1)[0].unflatten(-1, (h, d))),
        "transposed": ((b, h, s, d), lambda t: t.transpose(1, 2)),
    }[layout]
    x = view(torch.randn(shape, generator=g, device=device).to(dtype))
    angles = torch.rand(s, r // 2, generator=g, device=device) * 50.0
    angles = torch.cat((angles, angles), dim=-1)
    return x, angles.cos(), angles.sin()


# --- the reference against diffusers ---------------------------------------------------------------

SHAPES = [  # b, s, h, d, r, layout
    (2, 33, 3, 32, 24, "contiguous"),   # R < D, as in H3 (96 of 128)
    (1, 17, 4, 64, 64, "contiguous"),   # R == D
    (2, 9, 3, 128, 96, "qkv-slice"),    # the view a fused qkv projection gives
    (1, 20, 2, 32, 16, "transposed"),   # S and H strides swapped
]


@pytest.mark.parametrize("b, s, h, d, r, layout", SHAPES)
def test_reference_is_diffusers_in_float32_bit_for_bit(b, s, h, d, r, layout):
    x, cos, sin = rope_inputs(b, s, h, d, r, torch.float32, layout=layout)
    assert x.is_contiguous() == (layout == "contiguous")
    out = rope_reference(x, cos, sin)
    assert out.is_contiguous() and out.dtype == x.dtype
    assert torch.equal(out, ORIGINAL(x, cos, sin))


@pytest.mark.parametrize("b, s, h, d, r, layout", SHAPES)
def test_reference_matches_diffusers_bf16_within_its_rounding_and_is_more_accurate(b, s, h, d, r, layout):
    x, cos, sin = rope_inputs(b, s, h, d, r, torch.bfloat16, layout=layout)
    ours, theirs = rope_reference(x, cos, sin), ORIGINAL(x, cos, sin)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours[..., r:], x[..., r:])  # pass-through channels are copied exactly
    assert torch.equal(theirs[..., r:], x[..., r:])

    truth = rope_reference(x.double(), cos.double(), sin.double()).double()[..., :r]
    xr = x[..., :r].double()
    rotated = torch.cat((-xr[..., r // 2:], xr[..., :r // 2]), dim=-1)
    terms = (xr * cos.double()[None, :, None]).abs() + (rotated * sin.double()[None, :, None]).abs()
    # diffusers rounds cos/sin, both products and the sum to bf16, each by up to half an ulp, at most 2^-8
    # of the value (bf16 keeps 8 significant bits); ours rounds once. Four such roundings of the terms' size:
    diff = (ours[..., :r].double() - theirs[..., :r].double()).abs()
    assert (diff <= 2 ** -6 * terms).all()
    assert (diff == 0).float().mean() > 0.5  # mostly the same bf16 value
    # Ours is within one bf16 ulp of the exact result (plus float32 rounding of the terms), and closer than
    # diffusers' on average.
    err_ours = (ours[..., :r].double() - truth).abs()
    err_theirs = (theirs[..., :r].double() - truth).abs()
    assert (err_ours <= bf16_ulp(truth) + 2 ** -22 * terms).all()
    assert err_ours.mean() < err_theirs.mean()


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |t| (8 significant bits), in t's dtype."""
    _, exponent = torch.frexp(t.abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(t), exponent - 8)


# --- the swap ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_h3():
    return tiny_h3_transformer(H3_LAYERS, H3_REFINER_LAYERS)


@pytest.fixture
def restored_global():
    """Each test leaves diffusers' global as it found it, whatever it did."""
    yield
    assert getattr(h3_file, ROPE_GLOBAL) is ORIGINAL


def test_swap_installs_a_dispatcher_and_restores_the_exact_original(tiny_h3, restored_global):
    model, _ = tiny_h3
    with fused_rope(model) as rope:
        dispatcher = getattr(h3_file, ROPE_GLOBAL)
        assert dispatcher is not ORIGINAL and dispatcher.__wrapped__ is ORIGINAL
        assert rope.model_files == [h3_file.__name__]
    assert getattr(h3_file, ROPE_GLOBAL) is ORIGINAL

    rope = fused_rope(model)  # the plain call
    assert getattr(h3_file, ROPE_GLOBAL) is not ORIGINAL
    rope.unpatch()
    rope.unpatch()  # twice is a no-op
    assert getattr(h3_file, ROPE_GLOBAL) is ORIGINAL


def test_nested_uses_share_one_dispatcher_and_the_last_one_out_restores(tiny_h3, restored_global):
    model, _ = tiny_h3
    x, cos, sin = rope_inputs(1, 5, 2, 32, 24)
    outer = fused_rope(model)
    dispatcher = getattr(h3_file, ROPE_GLOBAL)
    with fused_rope(model) as inner:
        assert getattr(h3_file, ROPE_GLOBAL) is dispatcher  # installed once, not wrapped twice
        h3_file._apply_rotary_emb(x, cos, sin)
    assert getattr(h3_file, ROPE_GLOBAL) is dispatcher  # outer still live
    h3_file._apply_rotary_emb(x, cos, sin)
    assert (outer.fallback_calls["not a CUDA tensor"], inner.fallback_calls["not a CUDA tensor"]) == (2, 1)

    # Out of order: the first handle leaves before the second; the original comes back only at the end.
    second = fused_rope(model)
    outer.unpatch()
    assert getattr(h3_file, ROPE_GLOBAL) is dispatcher
    second.unpatch()


def test_cpu_calls_fall_back_bit_identical_and_are_counted(tiny_h3, restored_global):
    model, _ = tiny_h3
    cases = [rope_inputs(2, 7, 3, 32, 24, dtype, layout=layout)
             for dtype in (torch.bfloat16, torch.float32) for layout in ("contiguous", "qkv-slice")]
    with fused_rope(model) as rope:
        for x, cos, sin in cases:
            assert torch.equal(h3_file._apply_rotary_emb(x, cos, sin), ORIGINAL(x, cos, sin))
    assert rope.summary() == {"model_files": [h3_file.__name__], "served_calls": 0,
                              "fallback_calls": {"not a CUDA tensor": len(cases)}}


def test_fallback_reasons():
    x, cos, sin = rope_inputs(1, 6, 2, 32, 24)
    assert fallback_reason(x, cos, sin) == "not a CUDA tensor"
    assert fallback_reason(x.double(), cos, sin) == "dtype torch.float64"
    assert fallback_reason(x, cos[:, :23], sin[:, :23]).startswith("rotary dim R odd")
    wide = torch.zeros(6, 34)
    assert fallback_reason(x, wide, wide).startswith("rotary dim R odd, zero or above head dim")
    assert fallback_reason(x, cos[:5], sin[:5]).startswith("shape")
    assert fallback_reason(x[0], cos, sin).startswith("shape")
    assert fallback_reason(x, cos, sin[:, :22]).startswith("shape")
    assert fallback_reason(x.transpose(2, 3).contiguous().transpose(2, 3), cos, sin) == "innermost stride != 1"
    assert fallback_reason(x.float().requires_grad_(), cos, sin) == "autograd needed"
    with torch.no_grad():
        assert fallback_reason(x.float().requires_grad_(), cos, sin) == "not a CUDA tensor"


@torch.no_grad()
def test_tiny_h3_output_is_identical_and_every_rotary_call_reaches_the_dispatcher(tiny_h3, monkeypatch):
    model, inputs = tiny_h3
    calls = []
    monkeypatch.setattr(h3_file, ROPE_GLOBAL, lambda *a: calls.append(a) or ORIGINAL(*a))
    before = model(**inputs)[0]
    monkeypatch.undo()
    assert len(calls) == 2 * H3_LAYERS  # query and key of every block's attention (the text refiner has no RoPE)

    with fused_rope(model) as rope:
        during = model(**inputs)[0]
    assert torch.equal(during, before)
    assert rope.served_calls == 0 and rope.fallback_calls == {"not a CUDA tensor": len(calls)}
    assert getattr(h3_file, ROPE_GLOBAL) is ORIGINAL


def test_a_model_without_h3_attention_is_refused(restored_global):
    wan = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                in_channels=4, out_channels=4, text_dim=8, freq_dim=16, ffn_dim=32,
                                num_layers=1, rope_max_seq_len=32)
    for model in (wan, torch.nn.Linear(4, 4)):
        with pytest.raises(UserError, match="no MiniMax-H3 attention processors") as err:
            fused_rope(model)
        assert "\n" not in str(err.value)


def test_a_same_named_rotary_function_with_another_contract_is_not_touched(monkeypatch):
    """Several diffusers files define `_apply_rotary_emb` with other signatures; only listed files count."""
    other_file = types.ModuleType("fake_diffusers_model_file")
    other_file._apply_rotary_emb = lambda hidden_states, freqs: hidden_states
    processor_class = type("OtherProcessor", (), {"__call__": lambda self, *a: None})
    processor_class.__call__.__module__ = other_file.__name__
    monkeypatch.setitem(sys.modules, other_file.__name__, other_file)
    attention = torch.nn.Module()
    attention.processor = processor_class()
    with pytest.raises(UserError):
        fused_rope(attention)


@pytest.mark.slow
def test_importing_the_module_does_not_import_triton():
    code = "import sys, dit_accel.patching.rope, dit_accel.kernels.rope; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- on a GPU: the Triton kernel --------------------------------------------------------------------

def gpu(test):
    """Marked `gpu` and skipped without CUDA (the CPU tests above share this file, so no module-level skip)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def worst_ulps(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> float:
    """The largest |out - rope_reference| in ulps of x's dtype at the reference value (bf16: 8
    significant bits, fp16: 11, fp32: 24), over the rotary channels."""
    ref = rope_reference(x, cos, sin).float()
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[x.dtype]
    smallest = {torch.bfloat16: 2.0 ** -126, torch.float16: 2.0 ** -14, torch.float32: 2.0 ** -126}[x.dtype]
    _, exponent = torch.frexp(ref.abs().clamp_min(smallest))
    ulp = torch.ldexp(torch.ones_like(ref), exponent - bits)
    return ((out.float() - ref).abs() / ulp).max().item()


GPU_SHAPES = [  # b, s, h, d, r, layout
    (1, 17, 3, 128, 96, "contiguous"),      # odd S, fewer rows than one program's block
    (2, 1001, 5, 128, 96, "qkv-slice"),     # the view a fused qkv projection gives
    (1, 333, 4, 64, 64, "transposed"),      # R == D: no pass-through channels
    (2, 50, 3, 80, 48, "contiguous"),       # D not a power of two, nor R / 2
    (1, 30272, 56, 128, 96, "contiguous"),  # MiniMax-H3 at S = 30272
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b, s, h, d, r, layout", GPU_SHAPES)
def test_kernel_matches_the_float32_reference_within_one_ulp(b, s, h, d, r, layout, dtype):
    x, cos, sin = rope_inputs(b, s, h, d, r, dtype, device="cuda", layout=layout)
    assert x.is_contiguous() == (layout == "contiguous")
    out = apply_rotary_emb_fused(x, cos, sin)
    assert out.is_contiguous() and out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out[..., r:], x[..., r:])
    worst = worst_ulps(out, x, cos, sin)
    print(f"\n{dtype} {(b, s, h, d, r)} {layout}: worst {worst:.3g} ulp")
    assert worst <= 1.0  # 0 on an H200: the kernel rounds as torch does (no FMA contraction)


@gpu
def test_empty_input_gives_an_empty_output():
    x, cos, sin = rope_inputs(1, 0, 2, 32, 24, device="cuda")
    assert apply_rotary_emb_fused(x, cos, sin).shape == (1, 0, 2, 32)


@gpu
@torch.no_grad()
def test_tiny_h3_on_cuda_serves_every_rotary_call(tiny_h3, restored_global):
    model, inputs = tiny_h3
    model = model.to("cuda")
    inputs = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in inputs.items()}
    try:
        before = model(**inputs)[0]
        with fused_rope(model) as rope:
            during = model(**inputs)[0]
    finally:
        model.to("cpu")  # the fixture is shared with the CPU tests
    assert rope.served_calls == 2 * H3_LAYERS and not rope.fallback_calls
    torch.testing.assert_close(during, before)  # float32: diffusers' function is the reference there


def cuda_ms(fn, *args, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@gpu
def test_fused_kernel_is_faster_than_diffusers_at_the_h3_shape():
    x, cos, sin = rope_inputs(1, 30272, 56, 128, 96, torch.bfloat16, device="cuda")
    theirs, ours = cuda_ms(ORIGINAL, x, cos, sin), cuda_ms(apply_rotary_emb_fused, x, cos, sin)
    moved = 2 * x.numel() * x.element_size()  # one read and one write of x
    print(f"\nH3 RoPE, one of q/k [1, 30272, 56, 128], R = 96, bf16: diffusers {theirs:.3f} ms, "
          f"fused {ours:.3f} ms ({moved / ours / 1e6:.0f} GB/s), {theirs / ours:.1f}x")
    assert ours < theirs

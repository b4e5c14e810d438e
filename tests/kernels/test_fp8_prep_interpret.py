"""The plain prep's one launch for short sequences (`_fp8_prep_single_kernel`) against its two-launch
prep, bit for bit, and `launch_prep`'s choice between them (the prologue always takes two launches), in
Triton's interpreter on the CPU.

Both paths share `_codes`, whose float -> e4m3 rounding in the interpreter differs from the GPU's
round-to-nearest-even, so neither is compared with the torch reference here; `test_fp8_gpu.py` and
`test_fp8_prologue_gpu.py` do that on the GPU.

Runs only where there is no CUDA GPU (there the compiled kernels are tested); `scripts/setup.sh` installs
Triton on such machines for it, since CPU builds of torch come without it.
"""
import importlib.util

import pytest
import torch
from testing import slow_beyond

if torch.cuda.is_available():
    pytest.skip("interpreter tests run where there is no CUDA GPU", allow_module_level=True)


def _interpreted_kernels():
    """prep_triton_kernels with every kernel an InterpretedFunction (conftest sets TRITON_INTERPRET on machines
    without a GPU, before anything imports Triton), or pytest.skip."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    from dit_accel.kernels.fp8_attention import prep_triton_kernels
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(prep_triton_kernels._fp8_prep_single_kernel, InterpretedFunction):
        pytest.skip("prep_triton_kernels was imported compiled, not interpreted", allow_module_level=True)
    return prep_triton_kernels


tk = _interpreted_kernels()

from dit_accel.kernels.fp8_attention.memo import BoundedMemo  # noqa: E402
from dit_accel.kernels.fp8_attention.prep import Prologue, apply_prologue, prep_triton  # noqa: E402
from testing import add_special_heads, count_launches, force_path, in_layout  # noqa: E402, slow_beyond


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """TRITON_INTERPRET=1 while a test runs: the interpreter imports parts of Triton lazily, and they
    read it too.

    And a fix: Triton 3.6's interpreter holds a scalar argument as a 1-element array and converts it to a loop
    bound with int(array), which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted to
    Python scalars"), so `range(0, S, BLOCK)` fails there. Convert through .item() instead."""
    from triton.runtime import interpreter

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


def make_inputs(b, sq, skv, h, d, layout, seed=0):
    """q, k, v [B, S, H, D] bf16 with a few 30x outliers, in `layout` (`in_layout`)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        x = torch.randn(*shape, generator=g)
        x.view(-1)[:: 97] *= 30
        return x.bfloat16()

    return in_layout(draw(b, sq, h, d), draw(b, skv, h, d), draw(b, skv, h, d), layout)


def make_prologue(seq, d, rotary, seed=0):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(seq, rotary // 2, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    wq = (torch.rand(d, generator=g) + 0.5).bfloat16()
    wk = torch.rand(d, generator=g) + 0.5  # fp32 weights are read as well
    return Prologue(wq, wk, 1e-5, cos, sin)


def run_prep(monkeypatch, q, k, v, one_launch, prologue=None, qk_int8=False):
    """prep_triton with the one- or two-launch path forced (the prologue takes two either way), its
    torch.empty outputs pre-filled with 0x7F bytes (e4m3 NaN, INT8 127, 3.4e38 as fp32), so a slot a path
    leaves unwritten shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        x.view(torch.uint8).fill_(0x7F)
        return x

    with monkeypatch.context() as m:
        force_path(m, tk, one_launch)
        launched = count_launches(m, tk)
        m.setattr(torch, "empty", poisoned)
        packed = prep_triton(q, k, v, prologue, qk_int8)
    one = one_launch and prologue is None
    assert launched == (["_fp8_prep_single_kernel"] if one else ["_fp8_prep_amax_kernel", "_fp8_prep_pack_kernel"])
    return packed


def assert_same(one, two):
    for name in ("q", "k", "v"):
        a, b = getattr(one, name), getattr(two, name)
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert torch.equal(one.descale.view(torch.int32), two.descale.view(torch.int32)), (one.descale, two.descale)


def assert_int8_qk_matches_the_spec(got, spec):
    """INT8 Q/K codes and group scales bit for bit (both round with `_int8_codes`' arithmetic, which the
    interpreter runs as the GPU does), descale rows 0 and 1 all 1."""
    for name in ("q", "k", "q_scale", "k_scale"):
        a, r = getattr(got, name), getattr(spec, name)
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert torch.equal(a.view(torch.uint8), r.view(torch.uint8)) or torch.equal(
            torch.isnan(a), torch.isnan(r)) and torch.equal(a.nan_to_num(), r.nan_to_num()), name
    assert (got.descale[:2] == 1).all()


def check_special_heads(p, b, h):
    descale = p.descale.view(3, b, h)
    assert torch.isnan(descale[0, 0, 0]) and torch.isnan(descale[1, b - 1, h - 1])
    if b * h > 1:
        assert torch.isnan(descale[2, b - 1, h - 1])
        assert descale[0, b - 1, h - 1] == 1 and (p.q.view(b, h, -1)[b - 1, h - 1].float() == 0).all()
        assert descale[2, 0, 0] == 1 and (p.v.view(b, h, -1)[0, 0].float() == 0).all()
    else:
        assert descale[2, 0, 0] == 1 and (p.v.float() == 0).all()


def with_and_without_special_heads(cases, seq):
    """Each case with and without `add_special_heads`; the slow ones (1000 rows) only with."""
    return [(*case, special) for case in cases for special in (False, True) if special or seq(case) < 1000]


@pytest.mark.parametrize("b, h, sq, skv, d, layout, special", slow_beyond(with_and_without_special_heads([
    (1, 1, 1, 1, 64, "contiguous"),
    (2, 3, 17, 65, 128, "contiguous"),
    (1, 10, 64, 129, 64, "contiguous"),
    (2, 3, 129, 17, 64, "heads-major"),
    (1, 3, 1000, 64, 128, "contiguous"),
    (2, 1, 65, 1000, 64, "contiguous"),
    (2, 3, 129, 129, 128, "qkv"),
    (1, 10, 1000, 1000, 64, "qkv"),
], seq=lambda case: max(case[2:4])), keep=3))
def test_one_launch_matches_two_launches(monkeypatch, b, h, sq, skv, d, layout, special):
    q, k, v = make_inputs(b, sq, skv, h, d, layout)
    if special:
        add_special_heads(q, k, v)
    one = run_prep(monkeypatch, q, k, v, one_launch=True)
    assert_same(one, run_prep(monkeypatch, q, k, v, one_launch=False))
    if special:
        check_special_heads(one, b, h)


@pytest.mark.parametrize("b, h, s, d, rotary, layout, special", slow_beyond([
    (1, 1, 1, 64, 64, "contiguous", False),
    (2, 3, 17, 128, 96, "qkv", True),
    (1, 10, 65, 128, 128, "qkv", False),  # a full group of 8 heads and a partial one
    (1, 3, 64, 64, 32, "heads-major", True),
], keep=2))
def test_prologue_prep_matches_the_plain_prep_of_its_spec(monkeypatch, b, h, s, d, rotary, layout, special):
    """The prologue's two launches (even with the one launch forced) against the plain prep of
    `apply_prologue`'s fp32 q and k. Both round through the interpreter's `_codes`, so only the prologue's
    fp32 arithmetic order differs: descale by an ulp or two, a rare code by one e4m3 step; v bitwise."""
    q, k, v = make_inputs(b, s, s, h, d, layout, seed=1)
    if special:
        add_special_heads(q, k, v)
    p = make_prologue(s, d, rotary)
    got = run_prep(monkeypatch, q, k, v, True, p)
    spec = run_prep(monkeypatch, apply_prologue(q, p.norm_q_weight, p), apply_prologue(k, p.norm_k_weight, p), v, False)
    finite = torch.isfinite(spec.descale)
    assert torch.equal(torch.isnan(got.descale), ~finite) and bool(finite.all()) != special
    torch.testing.assert_close(got.descale[finite], spec.descale[finite], rtol=2e-6, atol=0)
    assert torch.equal(got.v.view(torch.uint8), spec.v.view(torch.uint8))
    for t, name in enumerate(("q", "k")):
        a, r = getattr(got, name)[finite[t]].float(), getattr(spec, name)[finite[t]].float()
        step = torch.maximum(a.abs(), r.abs()).clamp(min=2.0**-6) * 2.0**-3  # one e4m3 step
        assert ((a - r).abs() <= step).all() and (a != r).float().mean() < 1e-2, name


@pytest.mark.parametrize("b, h, sq, skv, d, layout, special", slow_beyond([
    (1, 1, 1, 1, 64, "contiguous", False),
    (2, 3, 17, 65, 128, "contiguous", True),
    (1, 2, 200, 129, 64, "heads-major", True),  # a query block past Sq's last row; a 1-key scale group
    (1, 3, 300, 300, 128, "qkv", True),  # two launches
], keep=2))
def test_int8_qk_prep_matches_the_torch_spec_bit_for_bit(monkeypatch, b, h, sq, skv, d, layout, special):
    """INT8 Q/K (`prep_reference(qk_int8=True)` is the spec): one and two launches, codes and group scales bit
    for bit; an inf or NaN group (`add_special_heads`) has a NaN scale, its codes 0 where the value was not
    finite; v as the e4m3 prep packs it."""
    from dit_accel.kernels.fp8_attention.prep import prep_reference

    q, k, v = make_inputs(b, sq, skv, h, d, layout, seed=2)
    if special:
        add_special_heads(q, k, v)
    spec = prep_reference(q, k, v, qk_int8=True)
    assert spec.q_scale.shape == (b * h, -(-sq // 128) * 64) and spec.k_scale.shape == (b * h, -(-skv // 64) * 4)
    assert bool(torch.isnan(spec.q_scale).any()) == special and bool(torch.isnan(spec.k_scale).any()) == special
    for one_launch in (True, False):
        got = run_prep(monkeypatch, q, k, v, one_launch, qk_int8=True)
        assert_int8_qk_matches_the_spec(got, spec)
        plain = run_prep(monkeypatch, q, k, v, one_launch)
        assert torch.equal(got.v.view(torch.uint8), plain.v.view(torch.uint8))
        assert torch.equal(got.descale[2].nan_to_num(), plain.descale[2].nan_to_num())


def test_int8_qk_prologue_prep_matches_the_plain_int8_prep_of_its_spec(monkeypatch):
    """The prologue with INT8 Q/K (64-row programs) against the plain INT8 prep of `apply_prologue`'s fp32 q, k:
    the prologue's fp32 arithmetic order may move a scale by an ulp and a rare code by one."""
    q, k, v = make_inputs(1, 130, 130, 10, 128, "qkv", seed=3)
    p = make_prologue(130, 128, 96)
    got = run_prep(monkeypatch, q, k, v, True, p, qk_int8=True)
    spec = run_prep(monkeypatch, apply_prologue(q, p.norm_q_weight, p), apply_prologue(k, p.norm_k_weight, p), v, False,
                    qk_int8=True)
    for name in ("q", "k"):
        torch.testing.assert_close(getattr(got, f"{name}_scale"), getattr(spec, f"{name}_scale"), rtol=2e-6, atol=0)
        diff = (getattr(got, name).int() - getattr(spec, name).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-2, name
    assert torch.equal(got.v.view(torch.uint8), spec.v.view(torch.uint8))


@pytest.mark.parametrize("sq, skv, plain_launches, prologue", [
    (*case, prologue) for case in [
        (128, 128, 1),  # 1x1x128x128, the shape of the per-call cost measurement
        (1, 1, 1),
        (256, 256, 1),  # Sq_pad = Skv_pad = 256 = SINGLE_LAUNCH_MAX_S
        (17, 250, 1),  # Skv_pad 256
        (257, 257, 2),  # Sq_pad 384
        (17, 257, 2),  # Skv_pad 288
        (4096, 4096, 2),
    ] for prologue in (False, True) if case[0] == case[1] or not prologue  # the prologue: self-attention only
])
def test_one_launch_below_the_threshold_two_above(monkeypatch, sq, skv, plain_launches, prologue):
    """The plain prep takes one launch at S_pad <= SINGLE_LAUNCH_MAX_S and two above; the prologue
    takes two (and one zeroed amax buffer) at any length."""
    assert tk.SINGLE_LAUNCH_MAX_S == 256
    launches = 2 if prologue else plain_launches
    q, k, v = make_inputs(1, sq, skv, 2, 64, "contiguous")
    fields = make_prologue(sq, 64, 64) if prologue else None
    zeros, count = torch.zeros, []
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: count.append(a) or zeros(*a, **kw))
    launched = count_launches(monkeypatch, tk, run=False)
    packed = prep_triton(q, k, v, fields)
    if launches == 1:
        assert launched == ["_fp8_prep_single_kernel"] and count == []  # no zeroed amax buffer
    else:
        assert launched == ["_fp8_prep_amax_kernel", "_fp8_prep_pack_kernel"] and count == [(3, 2)]
    assert packed.descale.shape == (3, 2) and packed.q.shape[1] == -(-sq // 128) * 128


class _FakeJit:
    """Stands in for a jitted kernel: `kernel[grid](*args, **constexprs)` records a JIT launch and returns a
    compiled kernel whose `[grid](*args, *constexprs)` records a direct one (or None, as the interpreter)."""

    __name__ = "fake_kernel"
    arg_names = ["x", "n", "D", "BLOCK"]

    def __init__(self, launches, compiles=True):
        self.launches, self.compiles = launches, compiles

    def __getitem__(self, grid):
        def jit(*args, **constexprs):
            self.launches.append(("jit", grid, args, tuple(constexprs.items())))
            return _FakeCompiled(self.launches) if self.compiles else None
        return jit


class _FakeCompiled:
    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("compiled", grid, args))


def test_launch_goes_through_the_jit_once_per_spec_then_as_the_compiled_kernel(monkeypatch):
    assert isinstance(tk._compiled, BoundedMemo) and tk._compiled.limit == 1024  # what the tests below stand in for
    monkeypatch.setattr(tk, "_compiled", BoundedMemo(1024))
    launches = []
    kernel = _FakeJit(launches)
    for spec in ("a", "a", "b", "a"):
        tk._launch(kernel, (2, 3, 1), ("x", 7), dict(D=64, BLOCK=32), spec)
    assert [entry[0] for entry in launches] == ["jit", "compiled", "jit", "compiled"]
    assert launches[1] == ("compiled", (2, 3, 1), ("x", 7, 64, 32))  # constexprs passed by position, in order
    tk._launch(kernel, (2, 3, 1), ("x", 7), dict(D=128, BLOCK=32), "a")  # another constexpr: its own entry
    assert launches[-1][0] == "jit"
    tk._launch(kernel, (4, 3, 1), ("x", 7), dict(D=64, BLOCK=32), "a")  # another grid: its own entry
    assert launches[-1][:2] == ("jit", (4, 3, 1))
    launched = len(launches)
    with pytest.raises(ValueError, match="in order"):
        tk._launch(kernel, (1, 1, 1), ("x", 7), dict(BLOCK=32, D=64), "c")
    assert len(launches) == launched  # refused before anything launched


def test_launch_keeps_nothing_from_the_interpreter_and_stays_bounded(monkeypatch):
    monkeypatch.setattr(tk, "_compiled", BoundedMemo(1024))
    launches = []
    for _ in range(2):
        tk._launch(_FakeJit(launches, compiles=False), (1, 1, 1), ("x", 7), dict(D=64, BLOCK=32), "a")
    assert [entry[0] for entry in launches] == ["jit", "jit"] and tk._compiled == {}
    monkeypatch.setattr(tk, "_compiled", BoundedMemo(3))
    for spec in range(5):
        tk._launch(_FakeJit(launches), (1, 1, 1), ("x", 7), dict(D=64, BLOCK=32), spec)
    assert set(tk._compiled) == {("fake_kernel", spec, (1, 1, 1), 64, 32) for spec in (3, 4)}  # full at 3: started over


def test_prologue_eps_reaches_the_kernels_as_a_float(monkeypatch):
    """An int eps (Prologue(..., 1, ...)) would be specialized by value, outside the launch spec that keys the
    compiled launches: prep passes it as a float."""
    import dataclasses

    seen = []
    monkeypatch.setattr(tk, "_launch", lambda kernel, grid, args, constexprs, spec: seen.append(args[-1]))
    q, k, v = make_inputs(1, 40, 40, 2, 64, "contiguous")
    prep_triton(q, k, v, dataclasses.replace(make_prologue(40, 64, 64), eps=1))
    assert len(seen) == 2 and all(type(eps) is float and eps == 1.0 for eps in seen)

"""The fused prologue on the CPU path: its fp32 spec against diffusers' own QK-norm and RoPE, the
prologue op (fake shapes, CPU emulation), and `fused_prologue` on a tiny MiniMax-H3 model, eager
and compiled, with its counts. The Triton prep behind it is checked on a GPU
(tests/kernels/test_fp8_prologue_gpu.py)."""
import pytest
import torch
from diffusers.models.transformers import transformer_minimax_h3 as h3
from testing import tiny_h3_transformer

from dit_accel.attention import backends
from dit_accel.attention.backends import AttentionBackend
from dit_accel.attention.routing import use_attention_backend
from dit_accel.errors import UserError
from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention
from dit_accel.kernels.fp8_attention.op import FP8_ATTENTION, FP8_ATTENTION_PROLOGUE, prologue_op_reason
from dit_accel.kernels.fp8_attention.prep import Prologue, apply_prologue
from dit_accel.patching import fused_prologue, prologue
from dit_accel.patching.recipe import parse_recipe

LAYERS, REFINERS = 2, 2


def rotary(seq: int, dims: int, seed: int = 0):
    angles = torch.rand(seq, dims // 2, generator=torch.Generator().manual_seed(seed)) * 30
    return torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)


def test_the_spec_is_diffusers_qk_norm_then_rope_in_fp32():
    attn = h3.MiniMaxH3Attention(hidden_size=64, heads=2, dim_head=32, qk_norm_eps=1e-5)
    torch.nn.init.uniform_(attn.norm_q.weight, 0.5, 1.5)
    x = torch.randn(1, 9, 2, 32, generator=torch.Generator().manual_seed(1)) * 3
    cos, sin = rotary(9, 24)
    want = h3._apply_rotary_emb(attn.norm_q(x), cos, sin)
    got = apply_prologue(x, attn.norm_q.weight, Prologue(attn.norm_q.weight, attn.norm_k.weight, 1e-5, cos, sin))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_cpu_op_is_the_emulation_of_the_spec_and_passes_opcheck():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 40, 2, 32, generator=g).bfloat16() for _ in range(3))
    cos, sin = rotary(40, 24)
    wq, wk = torch.rand(32, generator=g) + 0.5, (torch.rand(32, generator=g) + 0.5).bfloat16()
    p = Prologue(wq, wk, 1e-5, cos, sin)
    out = FP8_ATTENTION_PROLOGUE(q, k, v, wq, wk, 1e-5, cos, sin, None, "auto")
    want = emulate_fp8_attention(apply_prologue(q, wq, p), apply_prologue(k, wk, p), v, out_dtype=torch.bfloat16)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.dit_accel.fp8_attention_prologue.default,
                          (q, k, v, wq, wk, 1e-5, cos, sin, None, "auto"))


@pytest.mark.parametrize("change, words", [
    (dict(k=torch.zeros(1, 30, 2, 32, dtype=torch.bfloat16), v=torch.zeros(1, 30, 2, 32, dtype=torch.bfloat16)),
     "self-attention only"),
    (dict(cos=torch.zeros(39, 24)), "cos and sin must be [S, R]"),
    (dict(cos=torch.zeros(40, 23), sin=torch.zeros(40, 23)), "rotary dim R must be even"),
    (dict(wq=torch.zeros(16)), "norm weights must be [32]"),
])
def test_inputs_the_prologue_cannot_take_are_named(change, words):
    args = dict(q=torch.zeros(1, 40, 2, 32, dtype=torch.bfloat16), k=torch.zeros(1, 40, 2, 32, dtype=torch.bfloat16),
                v=torch.zeros(1, 40, 2, 32, dtype=torch.bfloat16), wq=torch.ones(32), wk=torch.ones(32), eps=1e-5,
                cos=torch.zeros(40, 24), sin=torch.zeros(40, 24))
    args.update(change)
    assert words in prologue_op_reason(*args.values())
    with pytest.raises(Exception, match=words.replace("[", r"\[").replace("]", r"\]")):
        FP8_ATTENTION_PROLOGUE(*args.values(), None, "auto")


@pytest.fixture
def op_backend(monkeypatch):
    """A routed backend answered by the FP8 custom op (on the CPU: its emulation), which the prologue
    treats as one of ours."""
    backend = AttentionBackend("fp8-op", "the custom op",
                               lambda q, k, v, scale=None: FP8_ATTENTION(q, k, v, scale, "auto"),
                               lambda device: None, routed=True)
    monkeypatch.setitem(backends.BACKENDS, "fp8-op", backend)
    monkeypatch.setitem(prologue.KERNEL_VARIANTS, "fp8-op", "auto")


def bf16_tiny_h3():
    model, inputs = tiny_h3_transformer(LAYERS, REFINERS)
    model = model.to(torch.bfloat16)
    inputs = {name: x.bfloat16() if torch.is_tensor(x) and x.is_floating_point() else x for name, x in inputs.items()}
    return model, inputs


def test_blocks_take_the_prologue_and_the_refiners_without_rope_decline(op_backend):
    model, inputs = bf16_tiny_h3()
    with torch.no_grad():
        with use_attention_backend(model, "fp8-op"):
            plain = model(**inputs)[0]
        processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
        with use_attention_backend(model, "fp8-op") as routed, fused_prologue(model) as swap:
            fused = model(**inputs)[0]
    assert swap.modules == LAYERS + REFINERS
    assert swap.served_calls == LAYERS and swap.fallback_calls == {"no rotary embedding": REFINERS}
    assert routed.served_calls == LAYERS + REFINERS and routed.fallback_total == 0
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == processors  # unpatched
    # the same FP8 scheme on q/k normed and rotated in fp32 rather than bf16: close, not equal
    assert not torch.equal(fused, plain)
    assert ((fused.float() - plain.float()).norm() / plain.float().norm()) < 0.03


@pytest.mark.parametrize("trainable", ["norm_q", "norm_k"])
def test_grad_mode_with_a_trainable_norm_weight_falls_back(op_backend, trainable):
    """Grad enabled, everything frozen but the first block's QK-norm weight (so that block's q, k, v and
    hidden states need no grad): the swap hands the block to diffusers' processor, since the op has no
    backward and refuses the weight; the later blocks, whose inputs now need grad, too."""
    model, inputs = bf16_tiny_h3()
    model.requires_grad_(False)
    weight = model.get_parameter(f"transformer_blocks.0.attn.{trainable}.weight").requires_grad_(True)
    with use_attention_backend(model, "fp8-op"), fused_prologue(model) as swap:
        model(**inputs)[0].float().sum().backward()
    assert swap.served_calls == 0 and swap.fallback_calls["autograd needed"] == LAYERS
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_a_compiled_model_with_the_prologue_is_one_graph_and_keeps_counting(op_backend):
    torch._dynamo.reset()
    model, inputs = bf16_tiny_h3()
    with torch.no_grad(), use_attention_backend(model, "fp8-op") as routed, fused_prologue(model) as swap:
        eager = model(**inputs)[0]
        explanation = torch._dynamo.explain(model)(**inputs)
        compiled = torch.compile(model, fullgraph=True)
        outputs = [compiled(**inputs)[0] for _ in range(3)]
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert swap.served_calls == LAYERS * (1 + 1 + 3)  # eager, explain, three compiled calls
    assert routed.served_calls == (LAYERS + REFINERS) * (1 + 1 + 3)  # the prologue's calls counted there too
    for out in outputs:
        torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)  # inductor's bf16 outside attention


def test_context_parallel_calls_keep_diffusers_processor(op_backend):
    """Under context parallelism each rank holds a shard of the sequence: diffusers' all-to-all must run."""
    model, inputs = bf16_tiny_h3()
    with use_attention_backend(model, "fp8-op"), fused_prologue(model):
        attn = model.transformer_blocks[0].attn
        wrapper = attn.processor
        wrapper.original._parallel_config = object()
        q = torch.zeros(1, 13, 2, 32, dtype=torch.bfloat16)
        cos, sin = rotary(13, 24)
        reason = wrapper._decline_reason(attn, q, (cos, sin), None, prologue._arguments(q, q, q, wrapper.original))
    assert reason == "context parallelism"


def test_the_prologue_needs_our_attention_and_h3(op_backend):
    model, _ = bf16_tiny_h3()
    with torch.no_grad(), fused_prologue(model) as swap:  # attention left to diffusers: every call declines
        model(**bf16_tiny_h3()[1])
    assert swap.served_calls == 0 and swap.fallback_calls == {"attention is not routed to fp8": LAYERS + REFINERS}
    with pytest.raises(UserError, match="no MiniMax-H3 attention processors"):
        fused_prologue(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("text, words", [
    ("fp8+rope+prologue", r"drop \+rope"),
    ("cudnn+prologue", "needs fp8 or fp8-v1"),
])
def test_recipes_with_the_prologue(text, words):
    assert parse_recipe("fp8+compile+prologue+fp8-linear").label == "fp8+prologue+fp8-linear+compile"
    with pytest.raises(UserError, match=words):
        parse_recipe(text)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_prologue_in_a_tiny_h3_model(monkeypatch):
    """The real kernel and Triton prologue in a tiny H3 model with heads of 64: every block's attention
    takes the prologue, and the output stays close to the plain fp8 path's."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 kernel needs sm_89 or newer")
    monkeypatch.setenv("DIT_ACCEL_CROSSOVER", "off")  # the kernel is under test, not the routing
    model, inputs = tiny_h3_transformer(LAYERS, REFINERS, head_dim=64, rope_freq_dim=8)
    model = model.to("cuda", torch.bfloat16)
    inputs = {name: (x.to("cuda", torch.bfloat16) if x.is_floating_point() else x.cuda()) if torch.is_tensor(x) else x
              for name, x in inputs.items()}
    with torch.no_grad():
        with use_attention_backend(model, "fp8"):
            plain = model(**inputs)[0]
        with use_attention_backend(model, "fp8") as routed, fused_prologue(model) as swap:
            fused = model(**inputs)[0]
    assert swap.served_calls == LAYERS and swap.fallback_calls == {"no rotary embedding": REFINERS}
    assert routed.served_calls == LAYERS + REFINERS and routed.fallback_total == 0
    assert torch.isfinite(fused).all()
    assert ((fused.float() - plain.float()).norm() / plain.float().norm()) < 0.03

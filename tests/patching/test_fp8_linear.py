"""FP8 linears through torchao: which layers each family quantizes, the refusals, and the numerics.

torchao 0.18 refuses float8 on the CPU (`_check_hardware_support` asserts CUDA sm_89+), but the kernels
it calls run there: `torch._scaled_mm` has a CPU implementation in torch 2.13 that matches a float32
matmul of the dequantized operands to bf16 rounding (~3x slower than the bf16 block eagerly; torch 2.11's
CPU kernel takes per-tensor scales only, so there they skip). The CPU numerics tests lift both gates
(ours and torchao's) to run the real quantize path on a scaled-down block.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch
from diffusers.models.transformers import transformer_minimax_h3 as h3
from testing import small_block, tiny_h3_transformer

from dit_accel.adapters import adapter_for_preset
from dit_accel.adapters import BlockAdapter
from dit_accel.adapters import wan as wan_family
from dit_accel.errors import UserError
from dit_accel.loading.block import synthetic_block
from dit_accel.patching.fp8_linear import fp8_linear_unavailable_reason, plan_fp8_linears, quantize_linears

H3_FP8 = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
WAN_FP8 = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
           "ffn.net.0.proj", "ffn.net.2")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# --- selection (meta device: names and shapes only) ------------------------------------------------------
H3 = adapter_for_preset("minimax-h3")  # its policy: the FP8 rule on the rows of the family's default pass


def test_h3_real_block_selection():
    plan = plan_fp8_linears(H3.build_block(), H3)
    assert plan.chosen_names == H3_FP8
    assert [(c.name, c.in_features, c.out_features) for c in plan.chosen][-2:] == [
        ("ff.net.0.proj", 5376, 28672), ("ff.net.2", 14336, 5376)]  # SwiGLU: fused gate+up, then down
    assert [c.name for c in plan.kept] == ["adaln_proj.linear"]
    assert "runs on 1 row, not the block's 30272 sequence rows" in plan.kept[0].reason  # the timestep's row


def test_wan_real_block_selection():
    adapter = adapter_for_preset("wan")  # an instance works as well as the class
    plan = plan_fp8_linears(adapter.build_block(), adapter)
    assert plan.chosen_names == WAN_FP8
    kept = {c.name: c.reason for c in plan.kept}
    assert set(kept) == {"attn2.to_k", "attn2.to_v"}
    assert all("runs on 512 rows, not the block's 75600 sequence rows" in reason for reason in kept.values())


def test_wan_i2v_image_projections_stay():
    config = {**adapter_for_preset("wan").config, "added_kv_proj_dim": 5120, "image_dim": 1280}
    adapter = BlockAdapter(wan_family.FAMILY, config)
    plan = plan_fp8_linears(adapter.build_block(), adapter)
    assert plan.chosen_names == WAN_FP8
    kept = {c.name: c.reason for c in plan.kept}
    assert "runs on 257 rows" in kept["attn2.add_k_proj"] and "runs on 257 rows" in kept["attn2.add_v_proj"]


def test_whole_model_with_block_prefix():
    """In a model, only the blocks' linears go FP8; the token refiner's identically named ones stay."""
    model, _ = tiny_h3_transformer(num_layers=3)
    plan = plan_fp8_linears(model, H3, prefix="transformer_blocks.*.")
    assert plan.chosen_names == tuple(f"transformer_blocks.{i}.{n}" for i in range(3) for n in H3_FP8)
    kept = {c.name: c.reason for c in plan.kept}
    assert "outside the blocks" in kept["proj_in"]
    assert "outside the blocks" in kept["token_refiner.refiner_blocks.0.attn.to_q"]
    assert "runs on 1 row" in kept["transformer_blocks.1.adaln_proj.linear"]


def test_unlisted_linear_stays_with_reason():
    block = adapter_for_preset("minimax-h3").build_block()
    with torch.device("meta"):
        block.extra = torch.nn.Linear(5376, 5376)
    kept = {c.name: c.reason for c in plan_fp8_linears(block, H3).kept}
    assert kept["extra"] == "not a linear of the minimax-h3 block that the FP8 rule chose"


def test_dims_not_multiple_of_16_refused():
    with torch.device("meta"):  # hidden 40: every projection's K or N is 40
        block = h3.MiniMaxH3TransformerBlock(hidden_size=40, num_attention_heads=1, attention_head_dim=40,
                                             ffn_dim=64, time_embed_dim=16, norm_eps=1e-5, qk_norm_eps=1e-5)
    with pytest.raises(UserError, match=r"attn\.to_q \[40 -> 40\].*multiples of 16"):
        plan_fp8_linears(block, H3)


def test_policy_matching_nothing_refused():
    with pytest.raises(UserError, match="matches no nn.Linear"):
        plan_fp8_linears(adapter_for_preset("wan").build_block(), H3)


# --- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, name", [(torch.float16, "float16"), (torch.float32, "float32")])
def test_refuses_non_bf16(dtype, name):
    reason = fp8_linear_unavailable_reason("cuda", dtype)
    assert reason.startswith("FP8 linear layers need a bfloat16 block") and name in reason
    assert reason.endswith("pass --dtype bf16") and "\n" not in reason


def test_refuses_cpu():
    reason = fp8_linear_unavailable_reason(torch.device("cpu"), torch.bfloat16)
    assert "need a CUDA GPU with FP8 tensor cores" in reason and "8.9+" in reason and "\n" not in reason


def _fake_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_refuses_gpu_without_fp8(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    reason = fp8_linear_unavailable_reason(torch.device("cuda", 0), torch.bfloat16)
    assert reason.startswith("NVIDIA A100-SXM4-80GB (sm_80) has no FP8 tensor cores")


def test_refuses_without_torchao(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao...` raise ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    reason = fp8_linear_unavailable_reason(torch.device("cuda", 0), torch.bfloat16)
    assert reason is not None and reason.endswith("pip install 'dit-accel[fp8]'")


def test_accepts_fp8_gpu(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    assert fp8_linear_unavailable_reason(torch.device("cuda", 0), torch.bfloat16) is None


def test_quantize_on_cpu_refused_and_block_untouched():
    adapter, block = small_block("minimax-h3", torch.bfloat16)
    weight = block.attn.to_q.weight
    with pytest.raises(UserError, match="need a CUDA GPU"):
        quantize_linears(block, adapter)
    assert block.attn.to_q.weight is weight


# --- numerics on the CPU (torchao's real quantize path, both hardware gates lifted) ----------------------
def _run(adapter, block, seq_len=256):
    inputs = adapter.make_inputs(adapter.workload_from_seq_len(seq_len, 1), torch.device("cpu"), torch.bfloat16,
                                 torch.Generator().manual_seed(0))
    with torch.no_grad():
        return block(**inputs)


@pytest.mark.parametrize("family, names, bound", [
    ("minimax-h3", H3_FP8, 0.01),  # measured 0.4%
    # Wan's synthetic gates (scale_shift_table + a N(0, 1) temb) make the branches as large as the residual,
    # so the ~3.7% e4m3 error of each GEMM shows through more: measured 2.4%.
    ("wan", WAN_FP8, 0.04),
])
def test_quantized_block_close_to_bf16(cpu_fp8, family, names, bound):
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    adapter, block = small_block(family, torch.bfloat16)
    reference = copy.deepcopy(block)
    swap = quantize_linears(block, adapter)
    assert swap.quantized_names == names
    for name in names:
        weight = block.get_submodule(name).weight
        assert isinstance(weight, Float8Tensor) and weight.qdata.dtype == torch.float8_e4m3fn
        assert weight.scale.shape == (weight.shape[0], 1)  # one scale per output row
    assert swap.weight_bytes_after < 0.51 * swap.weight_bytes_before  # 1 byte + a row scale vs 2 bytes
    error = rel_l2(_run(adapter, block), _run(adapter, reference))
    assert 1e-4 < error < bound  # above 0: the GEMMs really ran in FP8


def test_single_linear_error_is_e4m3_sized(cpu_fp8):
    """One GEMM: ~3.7% rel L2 (3 mantissa bits on both operands), not bf16's 0.3% nor a broken scale's 100%."""
    adapter, block = small_block("minimax-h3", torch.bfloat16)
    linear = block.attn.to_q
    x = torch.randn(512, linear.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = x.float() @ linear.weight.float().t()
        quantize_linears(block, adapter)
        assert 0.02 < rel_l2(linear(x), expected) < 0.06


def test_zero_row_stays_zero(cpu_fp8):
    """torchao 0.18 divides by a per-row amax of 0 for an all-zero row (NaN); the amax floor makes it 0."""
    adapter, block = small_block("minimax-h3", torch.bfloat16)
    quantize_linears(block, adapter)
    x = torch.randn(3, block.attn.to_q.in_features, dtype=torch.bfloat16)
    x[1] = 0
    with torch.no_grad():
        y = block.attn.to_q(x)
    assert torch.isfinite(y).all() and (y[1] == 0).all()


def test_restore_gives_back_the_bf16_block(cpu_fp8):
    adapter, block = small_block("wan", torch.bfloat16)
    before = _run(adapter, block)
    swap = quantize_linears(block, adapter, keep_original=True)
    assert swap.reversible and not torch.equal(_run(adapter, block), before)
    swap.restore()
    assert type(block.attn1.to_q.weight) is torch.nn.Parameter
    assert "Float8Tensor" not in repr(block)
    assert torch.equal(_run(adapter, block), before)


def test_not_reversible_by_default(cpu_fp8):
    adapter, block = small_block("minimax-h3", torch.bfloat16)
    swap = quantize_linears(block, adapter)
    with pytest.raises(RuntimeError, match="build the block again"):
        swap.restore()


def test_summary_names_every_linear(cpu_fp8):
    adapter, block = small_block("minimax-h3", torch.bfloat16)
    swap = quantize_linears(block, adapter)
    lines = swap.summary_lines()
    assert lines[0].startswith("FP8 linears (torchao") and "6 quantized" in lines[0]
    assert sum(line.startswith("  fp8   ") for line in lines) == 6
    kept = [line for line in lines if line.startswith("  kept  ")]
    assert kept[0].startswith("  kept  adaln_proj.linear [192 -> 6912]")
    record = swap.as_dict()
    assert [c["name"] for c in record["quantized"]] == list(H3_FP8)
    assert record["kept"][0]["reason"] == swap.kept_reasons["adaln_proj.linear"]


def test_non_bf16_weight_refused(cpu_fp8):
    adapter, block = small_block("minimax-h3", torch.bfloat16)
    block.ff.net[2].to(torch.float32)
    with pytest.raises(UserError, match=r"ff\.net\.2 holds a float32 weight"):
        quantize_linears(block, adapter)


# --- GPU: the real engine -------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_reports_available():
    assert fp8_linear_unavailable_reason(torch.device("cuda"), torch.bfloat16) is None or \
        torch.cuda.get_device_capability() < (8, 9)


def _gpu_h3_block(config_overrides: dict):
    adapter = BlockAdapter(H3.spec, {**H3.config, **config_overrides})
    device = torch.device("cuda")
    if fp8_linear_unavailable_reason(device, torch.bfloat16):
        pytest.skip(fp8_linear_unavailable_reason(device, torch.bfloat16))
    return adapter, synthetic_block(adapter, 0, device, torch.bfloat16).block


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_real_h3_block_within_1_percent(compiled):
    """The real H3 block dims (5376 wide, 56 heads, FFN 14336) on 4096 rows: FP8 within 1% of bf16."""
    adapter, block = _gpu_h3_block({})
    inputs = adapter.make_inputs(adapter.workload_from_seq_len(4096, 1), torch.device("cuda"), torch.bfloat16,
                                 torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        expected = block(**inputs)
        swap = quantize_linears(block, adapter)
        run = torch.compile(block) if compiled else block
        actual = run(**inputs)
    assert swap.quantized_names == H3_FP8
    assert 1e-4 < rel_l2(actual, expected) < 0.01

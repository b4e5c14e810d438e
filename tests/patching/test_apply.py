"""apply_recipe on the CPU: each option goes in and comes out again on a block, a whole model and a pipeline-like
object, in one context; the handle's summary and notes say where the calls went."""
from __future__ import annotations

import pytest
import torch
from testing import small_block, tiny_h3_transformer

from dit_accel.patching.apply import apply_recipe, drop_compiled
from dit_accel.patching.recipe import parse_recipe


def _processors(model):
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


def _block_inputs(adapter, dtype=torch.float32):
    return adapter.make_inputs(adapter.workload_from_seq_len(64, 1), torch.device("cpu"), dtype,
                               torch.Generator().manual_seed(0))


@torch.no_grad()
def test_attention_and_rope_on_a_block_then_bit_identical(fake_backend):
    adapter, block = small_block("minimax-h3", torch.float32)
    inputs = _block_inputs(adapter)
    before = block(**inputs)
    with apply_recipe(block, parse_recipe("fake+rope"), adapter=adapter) as applied:
        during = block(**inputs)
        summary = applied.summary()
    assert applied.models == [block]
    assert summary["served_calls"] == len(fake_backend.calls) == 1
    assert summary["rope"]["served_calls"] + sum(summary["rope"]["fallback_calls"].values()) == 2  # q and k
    # On the CPU the Triton RoPE kernel is not there: diffusers' own function ran, and the notes say so.
    assert any("RoPE call(s) of fake+rope ran diffusers' own function" in note for note in applied.notes())
    torch.testing.assert_close(during, before)
    assert all("_attention_backend" not in vars(p) for p in _processors(block))
    assert torch.equal(block(**inputs), before)


@torch.no_grad()
def test_the_default_recipe_leaves_the_model_alone():
    model, inputs = tiny_h3_transformer(num_layers=2)
    processors = _processors(model)
    with apply_recipe(model, parse_recipe("bf16")) as applied:
        assert applied.attention is None and applied.summary() == {"backend": "native", "counted": False}
        assert _processors(model) == processors and applied.notes() == []


def test_fp8_linears_on_a_block_are_put_back(cpu_fp8):
    adapter, block = small_block("minimax-h3", torch.bfloat16)
    inputs = _block_inputs(adapter, torch.bfloat16)
    weight = block.attn.to_q.weight
    with torch.no_grad():
        before = block(**inputs)
        with apply_recipe(block, parse_recipe("native+fp8-linear"), adapter=adapter) as applied:
            assert block.attn.to_q.weight is not weight
            assert not torch.equal(block(**inputs), before)  # the GEMMs really ran in FP8
            assert applied.summary()["fp8_linears"][0]["quantized"]
        assert block.attn.to_q.weight is weight
        assert torch.equal(block(**inputs), before)


def test_fp8_linears_on_a_whole_model_take_its_family_from_its_config(cpu_fp8):
    model, inputs = tiny_h3_transformer(num_layers=2, head_dim=64)
    model = model.to(torch.bfloat16)
    with apply_recipe(model, parse_recipe("native+fp8-linear")) as applied:
        names = [c["name"] for c in applied.linears[0].as_dict()["quantized"]]
    assert names and all(name.startswith("transformer_blocks.") for name in names)  # the blocks' linears only
    assert type(model.transformer_blocks[0].attn.to_q.weight) is torch.nn.Parameter


def test_compile_is_undone_unless_kept():
    model, _ = tiny_h3_transformer(num_layers=1)
    with apply_recipe(model, parse_recipe("native+compile")):
        assert model._compiled_call_impl is not None
    assert model._compiled_call_impl is None
    with apply_recipe(model, parse_recipe("native+compile"), keep_compiled=True):
        compiled = model._compiled_call_impl
    assert model._compiled_call_impl is compiled is not None
    with apply_recipe(model, parse_recipe("native+max-autotune")):  # an already compiled model is not recompiled
        assert model._compiled_call_impl is compiled
    drop_compiled(_Pipeline(model, torch.nn.Linear(4, 4)))  # what generate does between recipes: compiled afresh
    assert model._compiled_call_impl is None
    with apply_recipe(model, parse_recipe("native+max-autotune"), keep_compiled=True):
        assert model._compiled_call_impl is not None and model._compiled_call_impl is not compiled
    drop_compiled(model)
    assert model._compiled_call_impl is None


class _Pipeline:
    """What apply_recipe sees of a diffusers pipeline: its components, transformers among them."""

    def __init__(self, transformer, text_encoder):
        self.components = {"transformer": transformer, "text_encoder": text_encoder}


@torch.no_grad()
def test_a_pipeline_patches_its_transformers_and_counts_calls(fake_backend):
    model, inputs = tiny_h3_transformer(num_layers=2)
    encoder = torch.nn.Linear(4, 4)
    pipe = _Pipeline(model, encoder)
    before = model(**inputs)[0]
    with apply_recipe(pipe, parse_recipe("fake"), keep_compiled=True) as applied:
        assert applied.models == [model]
        model(**inputs)
        applied.step_callback(pipe, 0, None, {})
        summary = applied.summary()
    assert summary["served_calls"] == len(fake_backend.calls) > 0 and summary["fallback_calls"] == {}
    assert torch.equal(model(**inputs)[0], before)


def test_everything_is_undone_when_the_body_raises(fake_backend):
    adapter, block = small_block("minimax-h3", torch.float32)
    with pytest.raises(RuntimeError, match="boom"):
        with apply_recipe(block, parse_recipe("fake+rope+compile"), adapter=adapter):
            raise RuntimeError("boom")
    assert block._compiled_call_impl is None
    assert all("_attention_backend" not in vars(p) for p in _processors(block))


def test_a_refused_option_leaves_nothing_behind(fake_backend):
    """+rope on a Wan block: fused_rope refuses (no MiniMax-H3 processors); the attention patch made before it
    is undone."""
    adapter, block = small_block("wan", torch.float32)
    with pytest.raises(Exception, match="MiniMax-H3"):
        with apply_recipe(block, parse_recipe("fake+rope"), adapter=adapter):
            pass
    assert all("_attention_backend" not in vars(p) for p in _processors(block))

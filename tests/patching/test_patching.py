"""patch_attention on tiny whole diffusers models (CPU): every call reached, kept blocks and steps
stay on the original backend, unpatching restores the exact output."""
from __future__ import annotations

import types

import pytest
import torch
from testing import tiny_h3_transformer
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

from dit_accel import patch_attention
from dit_accel.attention import backends
from dit_accel.attention.backends import AttentionBackend, BackendCannotServe
from dit_accel.errors import UserError

H3_LAYERS, H3_REFINER_LAYERS, WAN_LAYERS = 4, 2, 3


@pytest.fixture(scope="module")
def tiny_h3():
    return tiny_h3_transformer(H3_LAYERS, H3_REFINER_LAYERS)


@pytest.fixture(scope="module")
def tiny_wan():
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                  in_channels=4, out_channels=4, text_dim=8, freq_dim=16, ffn_dim=32,
                                  num_layers=WAN_LAYERS, rope_max_seq_len=32).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 5, 8), return_dict=False)
    return model, inputs


@torch.no_grad()
def test_every_attention_call_of_a_tiny_h3_is_routed_and_unpatch_is_exact(tiny_h3, fake_backend):
    model, inputs = tiny_h3
    before = model(**inputs)[0]
    with patch_attention(model, "fake") as patch:
        during = model(**inputs)[0]
    # Every block's self-attention and every refiner block's, once each.
    assert patch.summary()["served_calls"] == H3_LAYERS + H3_REFINER_LAYERS
    assert patch.summary()["fallback_calls"] == {}
    assert len(fake_backend.calls) == H3_LAYERS + H3_REFINER_LAYERS
    torch.testing.assert_close(during, before)
    assert torch.equal(model(**inputs)[0], before)


@torch.no_grad()
def test_every_attention_call_of_a_tiny_wan_is_routed(tiny_wan, fake_backend):
    model, inputs = tiny_wan
    before = model(**inputs)[0]
    patch = patch_attention(model, "fake")  # the plain call
    model(**inputs)
    patch.unpatch()
    assert patch.summary()["served_calls"] == 2 * WAN_LAYERS  # self- and cross-attention per block
    kinds = {q[1] == k[1] for q, k in fake_backend.calls}
    assert kinds == {True, False}  # self (Sq == Skv) and cross (Skv = text rows) both seen
    assert torch.equal(model(**inputs)[0], before)


@torch.no_grad()
def test_kept_blocks_stay_on_the_original_backend(tiny_h3, fake_backend):
    model, inputs = tiny_h3
    with patch_attention(model, "fake", keep_blocks=(0, -1)) as patch:
        model(**inputs)
    # The refiner's blocks and the middle two of the four stack blocks are routed.
    assert patch.summary()["served_calls"] == H3_LAYERS - 2 + H3_REFINER_LAYERS
    with pytest.raises(UserError, match="keep_blocks index 4 is out of range"):
        patch_attention(model, "fake", keep_blocks=(4,))


@torch.no_grad()
def test_kept_steps_fall_back_and_are_counted(tiny_wan, fake_backend):
    model, inputs = tiny_wan
    with patch_attention(model, "fake", keep_steps=(0,)) as patch:
        model(**inputs)  # step 0: kept
        patch.step_callback(None, 0, None, {})
        model(**inputs)  # step 1: routed
    summary = patch.summary()
    assert summary["served_calls"] == 2 * WAN_LAYERS
    assert summary["fallback_calls"] == {"step 0 kept on the original backend": 2 * WAN_LAYERS}


@torch.no_grad()
def test_unsupported_calls_fall_back_with_their_reason(tiny_wan, monkeypatch):
    def refuses_head_dim_16(q, k, v, scale=None):
        raise BackendCannotServe(f"head dim {q.shape[-1]} unsupported")

    monkeypatch.setitem(backends.BACKENDS, "picky",
                        AttentionBackend("picky", "test double", refuses_head_dim_16, lambda d: None, routed=True))
    model, inputs = tiny_wan
    before = model(**inputs)[0]
    with patch_attention(model, "picky") as patch:
        during = model(**inputs)[0]
    assert patch.summary()["fallback_calls"] == {"head dim 16 unsupported": 2 * WAN_LAYERS}
    assert torch.equal(during, before)  # the fallback is diffusers' own default backend


def test_a_pipeline_patches_its_transformers(tiny_h3, tiny_wan, fake_backend):
    pipeline = types.SimpleNamespace(components={"transformer": tiny_h3[0], "transformer_2": tiny_wan[0],
                                                 "vae": torch.nn.Linear(2, 2), "scheduler": object()})
    with patch_attention(pipeline, "fake") as patch, torch.no_grad():
        tiny_h3[0](**tiny_h3[1])
        tiny_wan[0](**tiny_wan[1])
    assert patch.summary()["served_calls"] == H3_LAYERS + H3_REFINER_LAYERS + 2 * WAN_LAYERS


def test_native_backends_cannot_be_gated_per_step(tiny_wan):
    with pytest.raises(UserError, match="cannot be switched per step"):
        patch_attention(tiny_wan[0], "math", keep_steps=(0,))


def test_fp8_is_refused_with_one_line_without_a_capable_gpu(tiny_wan):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine can run the FP8 kernel")
    with pytest.raises(UserError, match="unavailable here"):
        patch_attention(tiny_wan[0], "fp8")

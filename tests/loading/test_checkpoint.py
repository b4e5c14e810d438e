"""The single-block loader against the real H3 layout: only one block's tensors, bit-identical results."""
from __future__ import annotations

import json

import pytest
import torch

from dit_accel.adapters import adapter_for_config, adapter_for_preset
from dit_accel.loading.block import load_block_from_checkpoint
from dit_accel.loading.checkpoint import count_blocks, read_layout
from dit_accel.errors import UserError


def _adapter(folder):
    return adapter_for_config(json.loads((folder / "config.json").read_text()), str(folder))


def test_real_index_block_7_spans_two_shards(real_h3_weight_map):
    shards = {name for key, name in real_h3_weight_map.items() if key.startswith("transformer_blocks.7.")}
    assert shards == {"diffusion_pytorch_model-00002-of-00014.safetensors",
                      "diffusion_pytorch_model-00003-of-00014.safetensors"}


def test_layout_counts_the_blocks(tiny_h3_checkpoint):
    layout = read_layout(tiny_h3_checkpoint)
    assert count_blocks(layout, "transformer_blocks.{index}.") == 50
    assert len(layout.keys_with_prefix("transformer_blocks.7.")) == 12


def test_block_7_is_bit_identical_to_the_full_model_load(tiny_h3_checkpoint):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    adapter = _adapter(tiny_h3_checkpoint)
    loaded = load_block_from_checkpoint(adapter, tiny_h3_checkpoint, 7, torch.device("cpu"), torch.bfloat16)
    assert loaded.stats.shards == ("diffusion_pytorch_model-00002-of-00014.safetensors",
                                   "diffusion_pytorch_model-00003-of-00014.safetensors")
    assert loaded.stats.tensors == 12
    assert loaded.stats.bytes_read == loaded.param_bytes

    full = MiniMaxH3Transformer3DModel.from_pretrained(tiny_h3_checkpoint, torch_dtype=torch.bfloat16).eval()
    reference = full.transformer_blocks[7]
    ours = dict(loaded.block.named_parameters())
    for name, param in reference.named_parameters():
        assert ours[name].dtype == param.dtype, name
        assert torch.equal(ours[name], param), name

    workload = adapter.workload_from_seq_len(96, batch=2)
    inputs = adapter.make_inputs(workload, torch.device("cpu"), torch.bfloat16, torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(**inputs)
        got = loaded.block(**inputs)
    assert got.shape == (2, 96, 48)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)


def test_other_blocks_differ(tiny_h3_checkpoint):
    """Guards the test above: loading block 8 must not give block 7's weights."""
    adapter = _adapter(tiny_h3_checkpoint)
    seven = load_block_from_checkpoint(adapter, tiny_h3_checkpoint, 7, torch.device("cpu"), torch.bfloat16)
    eight = load_block_from_checkpoint(adapter, tiny_h3_checkpoint, 8, torch.device("cpu"), torch.bfloat16)
    assert not torch.equal(seven.block.attn.to_q.weight, eight.block.attn.to_q.weight)


@pytest.mark.parametrize("damage, message", [
    ("missing_shard", "shard diffusion_pytorch_model-00003-of-00014.safetensors is missing"),
    ("truncated_shard", "is truncated or not a safetensors file"),
    ("out_of_range", "block 50 is out of range"),
])
def test_damaged_checkpoints_give_one_clear_error(tiny_h3_copy, damage, message):
    adapter = _adapter(tiny_h3_copy)
    index = 7
    if damage == "missing_shard":
        (tiny_h3_copy / "diffusion_pytorch_model-00003-of-00014.safetensors").unlink()
    elif damage == "truncated_shard":
        shard = tiny_h3_copy / "diffusion_pytorch_model-00002-of-00014.safetensors"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        index = 50
    with pytest.raises(UserError, match=message) as info:
        load_block_from_checkpoint(adapter, tiny_h3_copy, index, torch.device("cpu"), torch.bfloat16)
    assert "\n" not in str(info.value)


def test_single_file_checkpoint(tmp_path, tiny_h3_config):
    """A transformer saved as one safetensors file, without an index, loads too."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel(**{**tiny_h3_config, "num_layers": 3})
    model.save_pretrained(tmp_path / "one", safe_serialization=True)
    adapter = _adapter(tmp_path / "one")
    loaded = load_block_from_checkpoint(adapter, tmp_path / "one", 2, torch.device("cpu"), torch.float32)
    assert torch.equal(loaded.block.ff.net[2].weight, model.transformer_blocks[2].ff.net[2].weight)
    with pytest.raises(UserError, match="block 3 is out of range"):
        load_block_from_checkpoint(adapter, tmp_path / "one", 3, torch.device("cpu"), torch.float32)


def test_pipeline_folder_resolves_to_its_transformer(tiny_h3_checkpoint):
    adapter = _adapter(tiny_h3_checkpoint)
    loaded = load_block_from_checkpoint(adapter, tiny_h3_checkpoint.parent, 0, torch.device("cpu"), torch.bfloat16)
    assert loaded.stats.shards == ("diffusion_pytorch_model-00001-of-00014.safetensors",)


def test_missing_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_block_from_checkpoint(adapter_for_preset("minimax-h3"), tmp_path / "nowhere", 0, torch.device("cpu"),
                                   torch.bfloat16)

"""Materialize ONE block of a model on the target device: from a checkpoint, or with synthetic weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..adapters import BlockAdapter
from ..adapters.building import synthetic_weights
from ..errors import UserError
from .checkpoint import LoadStats, count_blocks, read_layout, read_tensors, transformer_folder


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` holds: a tensor subclass's (torchao's FP8 weights) are its inner tensors' (codes, scales)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        return sum(tensor_bytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
    return tensor.numel() * tensor.element_size()


def param_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters, in the dtypes they are held in."""
    return sum(tensor_bytes(p) for p in module.parameters())


def loaded_param_bytes(module: nn.Module, adapter: BlockAdapter, dtype: torch.dtype, prefix: str = "") -> int:
    """Bytes `module`'s parameters take once loaded in the dtypes a load gives them (`dtype`, or
    float32 for `_keep_in_fp32_modules`); works on a meta-device module. `prefix` is the module's
    name in the checkpoint (a block's `transformer_blocks.N.`)."""
    return sum(p.numel() * torch.empty((), dtype=adapter.param_dtype(prefix + name, dtype)).element_size()
               for name, p in module.named_parameters())


@dataclass
class LoadedBlock:
    block: nn.Module
    index: int
    synthetic: bool
    source: str  # one line for reports: where the weights came from
    stats: LoadStats | None  # None for synthetic weights

    @property
    def param_bytes(self) -> int:
        return param_bytes(self.block)

    def as_dict(self) -> dict:
        return {"index": self.index, "synthetic": self.synthetic, "source": self.source,
                "param_bytes": self.param_bytes, "load": self.stats.as_dict() if self.stats else None}


def load_block_from_checkpoint(adapter: BlockAdapter, folder: Path, index: int, device: torch.device,
                               dtype: torch.dtype) -> LoadedBlock:
    """Block `index` read from a local diffusers checkpoint, only its own tensors, onto `device`."""
    folder = transformer_folder(folder)
    layout = read_layout(folder)
    available = count_blocks(layout, adapter.block_key_template)
    if available == 0:
        raise UserError(f"the checkpoint in {folder} holds no {adapter.display_name} block tensors (no key starts "
                        f"with {adapter.block_prefix(0)!r}); pass the folder of a {adapter.display_name} transformer "
                        f"with its weights")
    if not 0 <= index < available:
        raise UserError(f"block {index} is out of range: the checkpoint in {folder} has {available} blocks "
                        f"(0..{available - 1}); pass --block between them")
    prefix = adapter.block_prefix(index)
    keys = layout.keys_with_prefix(prefix)
    tensors, stats = read_tensors(layout, keys, device, lambda key: adapter.param_dtype(key, dtype))
    block = adapter.build_block()
    state = {key[len(prefix):]: tensor for key, tensor in tensors.items()}
    result = block.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise UserError(
            f"block {index} in {folder} does not match the {adapter.display_name} config "
            f"(missing {len(result.missing_keys)} tensors, e.g. {result.missing_keys[:1]}; unexpected "
            f"{len(result.unexpected_keys)}, e.g. {result.unexpected_keys[:1]}); check config.json")
    return LoadedBlock(block.eval(), index, False, f"checkpoint {folder}", stats)


@torch.no_grad()
def synthetic_block(adapter: BlockAdapter, index: int, device: torch.device, dtype: torch.dtype,
                    seed: int = 0) -> LoadedBlock:
    """Block with random weights of realistic scale (`adapters.building.synthetic_weights`); dtypes follow
    `_keep_in_fp32_modules` as a real load would."""
    adapter.check_block_index(index)
    prefix = adapter.block_prefix(index)
    block = synthetic_weights(adapter.build_block(), device, lambda name: adapter.param_dtype(prefix + name, dtype),
                              seed)
    return LoadedBlock(block, index, True, "synthetic weights (random, realistic scale; no checkpoint given)",
                       None)


@torch.no_grad()
def synthetic_outside(adapter: BlockAdapter, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The family's transformer without its blocks (`adapter.build_outside`), with synthetic weights
    initialized as `synthetic_block`'s, in the dtypes a load gives them."""
    return synthetic_weights(adapter.build_outside(), device, lambda name: adapter.param_dtype(name, dtype), seed)

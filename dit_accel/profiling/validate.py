"""`--validate N`: chain N real blocks (synthetic weights) and time them, to check the extrapolation."""
from __future__ import annotations

from typing import Any

import torch

from ..adapters import BlockAdapter
from ..attention.routing import use_attention_backend
from ..block_loader import param_bytes, synthetic_block
from ..extrapolate import Validation
from ..timing import time_region

# Activation headroom kept free when deciding how many distinct blocks fit: the single-block peak
# minus its weights, times this factor.
_HEADROOM = 1.5


def distinct_blocks_that_fit(n: int, block_bytes: int, activation_bytes: int, device: torch.device) -> int:
    """How many of the N blocks can be held at once (all N on a GPU with room; fewer on a small one)."""
    if device.type != "cuda":
        return n
    free_bytes, _ = torch.cuda.mem_get_info(device)
    budget_cap = torch.cuda.get_per_process_memory_fraction(device) * torch.cuda.get_device_properties(device).total_memory
    room = min(free_bytes, budget_cap - torch.cuda.memory_allocated(device)) - _HEADROOM * activation_bytes
    return max(1, min(n, int(room // block_bytes)))


def validate_chain(adapter: BlockAdapter, first_block: torch.nn.Module, inputs: dict[str, Any], n: int, *,
                   attention: str, device: torch.device, dtype: torch.dtype, block_ms: float,
                   activation_bytes: int, warmup: int = 1, runs: int = 3) -> Validation:
    """Time `n` blocks run one after another on `inputs`, all on attention backend `attention`;
    each block's output feeds the next.

    `first_block` is the profiled block; the others get fresh synthetic weights (speed does not depend
    on the values, as long as they are not zeros). When fewer than `n` fit, they are cycled through.
    """
    distinct = distinct_blocks_that_fit(n, param_bytes(first_block), activation_bytes, device)
    blocks = torch.nn.ModuleList([first_block] + [
        synthetic_block(adapter, i % adapter.num_blocks, device, dtype, seed=i).block for i in range(1, distinct)])
    hidden = inputs["hidden_states"]
    rest = {k: v for k, v in inputs.items() if k != "hidden_states"}

    def chain():
        with torch.no_grad():
            x = hidden
            for i in range(n):
                x = blocks[i % distinct](hidden_states=x, **rest)
        return x

    with use_attention_backend(blocks, attention):
        timing = time_region(chain, device=device, warmup=warmup, runs=runs)
    return Validation(n, distinct, timing.median_ms, n * block_ms)

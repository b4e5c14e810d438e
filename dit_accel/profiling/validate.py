"""`--validate N`: chain N real blocks (synthetic weights) and time them, to check the extrapolation;
with `--offload stream`, the N blocks live in host memory and stream onto the GPU."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapters import BlockAdapter
from ..attention.routing import use_attention_backend
from ..loading.block import param_bytes, synthetic_block
from .extrapolate import Validation
from ..loading.offload import StreamedRun, host_to_device_gbps, pin_to_host, stream_blocks
from ..timing import time_region
from .progress import NO_PROGRESS, SessionProgress

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


class BlockChain(nn.Module):
    """Blocks run one after another, each one's output feeding the next (a transformer's block stack)."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden_states: torch.Tensor, n: int | None = None, **rest: Any) -> torch.Tensor:
        """Runs `n` blocks (default: all), cycling through the held ones when n is larger."""
        for i in range(len(self.blocks) if n is None else n):
            hidden_states = self.blocks[i % len(self.blocks)](hidden_states=hidden_states, **rest)
        return hidden_states


def validate_chain(adapter: BlockAdapter, first_block: torch.nn.Module, inputs: dict[str, Any], n: int, *,
                   attention: str, device: torch.device, dtype: torch.dtype, block_ms: float,
                   activation_bytes: int, offload: str = "resident", warmup: int = 1, runs: int = 3,
                   progress: SessionProgress = NO_PROGRESS) -> Validation:
    """Time `n` blocks run one after another on `inputs`, all on attention backend `attention`.

    resident: `first_block` (the profiled one) and fresh synthetic blocks (speed does not depend on
    the values, as long as they are not zeros) held on the device; when fewer than `n` fit, they
    are cycled through. stream: `n` fresh synthetic blocks, each built on the device and moved to
    pinned host memory, streamed back one block at a time (`offload.stream_blocks`); the report
    compares the streamed pass with n x the resident block and says how much copying was hidden.
    """
    hidden = inputs["hidden_states"]
    rest = {k: v for k, v in inputs.items() if k != "hidden_states"}
    streamed_bytes = 0
    if offload == "stream":
        blocks = []
        with progress.stage(f"validation chain: building {n} blocks in host memory", n) as built:
            for i in range(n):  # one block on the device at a time while building
                block = synthetic_block(adapter, i % adapter.num_blocks, device, dtype, seed=i).block
                pin_to_host(block, pin=device.type == "cuda")
                blocks.append(block)
                built()
        chain = BlockChain(blocks)
        streamed_bytes = stream_blocks(chain, device)
        distinct = n
    else:
        distinct = distinct_blocks_that_fit(n, param_bytes(first_block), activation_bytes, device)
        with progress.stage(f"validation chain: building {distinct} blocks", distinct) as built:
            built()  # the profiled block is the first
            others = []
            for i in range(1, distinct):
                others.append(synthetic_block(adapter, i % adapter.num_blocks, device, dtype, seed=i).block)
                built()
        chain = BlockChain([first_block] + others)

    def run_chain():
        with torch.no_grad():
            return chain(hidden, n=n, **rest)

    with use_attention_backend(chain, attention):
        # The first streamed pass teaches diffusers the block order it prefetches in: warm up once more.
        chain_warmup = warmup + (offload == "stream")
        with progress.stage(f"validation chain: {n} blocks, warm-up and timed passes", chain_warmup + runs) as done:
            def counted():
                run_chain()
                done()
            for _ in range(chain_warmup):
                counted()
            timing = time_region(counted, device=device, warmup=0, runs=runs)
    streamed = None
    if offload == "stream":
        streamed = StreamedRun(streamed_bytes, host_to_device_gbps(device), timing.median_ms, n * block_ms,
                               f"{n} x the profiled block")
    return Validation(n, distinct, timing.median_ms, n * block_ms, streamed)

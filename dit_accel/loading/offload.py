"""`--offload stream`: transformer blocks live in pinned host memory and are streamed onto the GPU
one at a time, the next block prefetched on a side stream while the current one runs.

The engine is diffusers' group offloading (`apply_group_offloading`, block level, one block per
group, `use_stream=True`): it onloads a block before its forward, learns the execution order on
the first pass and from then on prefetches the next block on a side CUDA stream, so at most two
streamed blocks are on the GPU at once. We add what a user needs around it: parameters are put in
pinned memory *before* diffusers sees them (diffusers would otherwise keep a pinned copy beside
each pageable tensor, twice the host memory: 129 GB for the 50 H3 blocks), the host-to-device
bandwidth is measured, and `StreamedRun` says how much of the transfer the computation hid.
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..errors import UserError


def check_offload(offload: str, device: torch.device) -> None:
    """UserError when `offload` cannot run on `device` (streaming needs a CUDA side stream)."""
    if offload == "stream" and device.type != "cuda":
        raise UserError("--offload stream overlaps host-to-GPU copies with GPU work; it needs a CUDA device "
                        "(leave it out on the CPU)")


_ALIGN = 256  # bytes; every tensor of a packed module starts on this boundary


@torch.no_grad()
def pack_into_one_buffer(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Moves the tensors' data, in place, into views of one new CPU byte buffer of exactly their
    size (each start aligned to 256 bytes) and returns the buffer."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    host = torch.empty(end, dtype=torch.uint8)
    for tensor, offset in zip(tensors, offsets):
        view = host[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.data)
        tensor.data = view
    return host


@torch.no_grad()
def pin_to_host(module: nn.Module, pin: bool = True) -> int:
    """Moves every parameter and buffer of `module` to CPU memory, page-locked unless `pin` is False
    (asynchronous copies need page-locked memory); returns their bytes.

    Tensors not there yet are packed into one buffer of exactly their size and registered with
    cudaHostRegister. Why not `Tensor.pin_memory()`: torch's pinned allocator rounds every
    allocation up to a power of two, which costs the H3 block 1.88 GB of pinned memory for 1.29 GB
    of weights (94 GB for the 50 blocks). Registered memory reports `is_pinned()`, so diffusers
    uses it as it is, and a second call moves nothing.
    """
    everything = [*module.parameters(), *module.buffers()]
    on_host = (lambda t: t.device.type == "cpu" and t.is_pinned()) if pin else (lambda t: t.device.type == "cpu")
    to_move = [t for t in everything if not on_host(t)]
    if to_move:
        host = pack_into_one_buffer(to_move)
        if pin:
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0))
            # Unregistered when the module goes (before its buffers are freed), so the pages do not
            # stay locked and a later allocation at the same address can be registered again.
            weakref.finalize(module, cudart.cudaHostUnregister, host.data_ptr())
        # The buffer lives as long as the module (a list: several calls may each pack a part).
        vars(module).setdefault("_dit_accel_host_buffers", []).append(host)
    return sum(t.numel() * t.element_size() for t in everything)


def stream_blocks(model: nn.Module, device: torch.device) -> int:
    """Applies block-level group offloading to `model` (its nn.ModuleList children are the blocks):
    everything stays in pinned host memory and each block comes to `device` for its forward, the
    next one prefetched on a side stream on CUDA. Returns the bytes streamed per forward pass."""
    from diffusers.hooks import apply_group_offloading

    cuda = device.type == "cuda"
    streamed = pin_to_host(model, pin=cuda)
    apply_group_offloading(model, onload_device=device, offload_device="cpu", offload_type="block_level",
                           num_blocks_per_group=1, use_stream=cuda, non_blocking=cuda, record_stream=cuda)
    return streamed


def host_to_device_gbps(device: torch.device, nbytes: int = 1 << 28, runs: int = 3) -> float:
    """Pinned host -> `device` copy bandwidth in GB/s (median of `runs` copies of `nbytes`)."""
    source = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(runs + 1):  # the first copy warms the path up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del source, target
    return nbytes / (sorted(times[1:])[runs // 2] * 1e-3) / 1e9


@dataclass(frozen=True)
class StreamedRun:
    """One streamed pass against the same work with every block resident.

    hidden_fraction: the share of the host-to-device transfer that ran under GPU work, from
    1 - (streamed_ms - resident_ms) / transfer_ms (1: fully hidden, 0: the copies added their
    whole time), clamped to [0, 1].
    """

    streamed_bytes: int
    h2d_gbps: float
    streamed_ms: float
    resident_ms: float
    resident_source: str

    @property
    def transfer_ms(self) -> float:
        return self.streamed_bytes / (self.h2d_gbps * 1e9) * 1e3

    @property
    def slowdown(self) -> float:
        return self.streamed_ms / self.resident_ms

    @property
    def hidden_fraction(self) -> float:
        exposed = max(0.0, self.streamed_ms - self.resident_ms)
        return max(0.0, min(1.0, 1.0 - exposed / self.transfer_ms)) if self.transfer_ms > 0 else 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "transfer_ms": self.transfer_ms, "slowdown": self.slowdown,
                "hidden_fraction": self.hidden_fraction}

    def summary(self) -> str:
        return (f"streamed {self.streamed_bytes / 1e9:.1f} GB per pass at {self.h2d_gbps:.1f} GB/s "
                f"({self.transfer_ms:.0f} ms of copies): {self.streamed_ms:.0f} ms against {self.resident_ms:.0f} ms "
                f"resident ({self.resident_source}), {self.slowdown:.2f}x; {100 * self.hidden_fraction:.0f}% of the "
                f"transfer hidden under compute")

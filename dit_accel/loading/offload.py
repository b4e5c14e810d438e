"""`--offload stream`: transformer blocks live in pinned host memory and are streamed onto the GPU
one at a time, the next block prefetched on a side stream while the current one runs.

The engine is diffusers' group offloading (`apply_group_offloading`, block level, one block per
group, `use_stream=True`): it onloads a block before its forward, learns the execution order on
the first pass and from then on prefetches the next block on a side CUDA stream, so at most two
streamed blocks are on the GPU at once. Only the model's block stacks are streamed; the rest of
the model (embeddings, norms, heads: what diffusers would copy in and out synchronously on every
forward) stays on the GPU (`stream_blocks` says why). We add what a user needs around it:
parameters are put in pinned memory *before* diffusers sees them (diffusers would otherwise keep a
pinned copy beside each pageable tensor, twice the host memory: 129 GB for the 50 H3 blocks), the
host-to-device bandwidth is measured, and `StreamedRun` says how much of the transfer the
computation hid.
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import UserError
from ..seams.placement import ONLOAD_DEVICE
from .block import tensor_bytes


def check_offload(offload: str, device: torch.device) -> None:
    """UserError when `offload` cannot run on `device` (streaming needs a CUDA side stream)."""
    if offload == "stream" and device.type != "cuda":
        raise UserError("--offload stream overlaps host-to-GPU copies with GPU work; it needs a CUDA device "
                        "(leave it out on the CPU)")


_ALIGN = 256  # bytes; every tensor of a packed module starts on this boundary
_OWN_FORWARD = "_dit_accel_own_forward"  # the `OwnForward` of each block `stream_blocks` streams


class OwnForward:
    """A streamed block's own forward, inside the offload hooks diffusers wraps around it, with a place for a compiled
    version of it (`patching.apply_recipe` compiles streamed blocks here).

    Why: compiling a hooked block's whole call (`module.compile()`) or the model around it makes dynamo trace
    diffusers' hooks, guard on each block's own hook objects and recompile per block until its limit of 8, after
    which the blocks run eager (on the H200, CogVideoX's 42 streamed blocks under the full recipe took 1.8x their
    compiled time). Compiled here, the hooks stay eager around code that the blocks of one class share."""

    def __init__(self, forward):
        functools.update_wrapper(self, forward)  # signature and name: the block's own
        self.eager = self.call = forward

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    @property
    def compiled(self) -> bool:
        return self.call is not self.eager


def own_forwards(module: nn.Module) -> list[OwnForward]:
    """The `OwnForward`s of the streamed blocks in `module` (itself included)."""
    return [vars(m)[_OWN_FORWARD] for m in module.modules() if _OWN_FORWARD in vars(m)]


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

    A tensor subclass (torchao's FP8 weights) moves to the CPU whole and its inner tensors but the smallest are
    packed: the codes, not the scales (`_pinned_parts`).
    """
    everything = [*module.parameters(), *module.buffers()]
    on_host = (lambda t: t.device.type == "cpu" and t.is_pinned()) if pin else (lambda t: t.device.type == "cpu")
    to_move = []
    for tensor in everything:
        if is_traceable_wrapper_subclass(tensor) and tensor.device.type != "cpu":
            torch.utils.swap_tensors(tensor, tensor.to("cpu"))  # in place, as diffusers moves these (identity kept)
        to_move += [part for part in _pinned_parts(tensor) if not on_host(part)]
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
    return sum(tensor_bytes(t) for t in everything)


def _pinned_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """What `pin_to_host` packs of `tensor`: itself, or of a tensor subclass (torchao's FP8 weights) its inner
    tensors but the smallest (the codes, not the per-row scales). Why the scales stay pageable: torchao reports a
    weight pinned when every inner tensor is, and diffusers then keeps the parameter itself as its pinned host
    copy (`.cpu().pin_memory()` returns the same object), which its first onload swaps onto the GPU in place: the
    offload puts nothing back and every block stays on the device. With pageable scales diffusers builds a host
    copy of its own, sharing the pinned codes as they are and copying the scales (a few KB) into pinned memory."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    inner = sorted((getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]), key=tensor_bytes)
    return inner[1:]


def block_stacks(model: nn.Module) -> dict[str, nn.Module]:
    """The block stacks `stream_blocks` streams: `model`'s nn.ModuleList / nn.Sequential children (those
    diffusers' block-level offloading makes one group per block of), by name."""
    return {name: child for name, child in model.named_children() if isinstance(child, (nn.ModuleList, nn.Sequential))}


def stack_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers of `model`'s block stacks: what `stream_blocks` copies to
    the device per forward pass."""
    return sum(tensor_bytes(t) for stack in block_stacks(model).values()
               for t in [*stack.parameters(), *stack.buffers()])


@contextmanager
def _seen_as(model: nn.Module, children: dict[str, nn.Module], buffers: dict[str, torch.Tensor]):
    """`model` with only `children` as its submodules, `buffers` as its buffers and no parameters of its
    own for the duration (its real ones are put back after, even on an exception)."""
    real = {key: vars(model)[key] for key in ("_modules", "_parameters", "_buffers")}
    vars(model).update(_modules=dict(children), _parameters={}, _buffers=dict(buffers))
    try:
        yield
    finally:
        vars(model).update(real)


def stream_blocks(model: nn.Module, device: torch.device) -> int:
    """Applies block-level group offloading to `model`'s block stacks (`block_stacks`: its nn.ModuleList
    children): their blocks stay in pinned host memory and each comes to `device` for its forward, the
    next one prefetched on a side stream on CUDA. Everything else of `model` (embeddings, norms, heads,
    H3's token refiner) moves to `device` and stays there. Returns the bytes streamed per forward pass.

    Why diffusers sees only the stacks: on the whole model, block-level offloading puts every other part
    in one "unmatched" group on the model itself, built with `stream=None, non_blocking=False`; each
    forward starts by copying it in synchronously (before the first prefetch is issued) and ends by
    copying it out with `module.to("cpu")` into new pageable memory, so from the second pass on it comes
    back from pageable memory (1.8 GB for H3, with the refiner blocks, which are not a direct ModuleList).
    And with nothing outside the stacks (the `--validate N` chain) diffusers builds no such group, and with
    it no lazy prefetch hook: no block is prefetched, each copies itself on the side stream and runs with
    nothing waiting for that copy. So diffusers is shown the stacks plus an empty anchor buffer (its
    group, the lazy prefetch hook's carrier, copies nothing), the same for a chain and for a model.
    Call it once per model: diffusers refuses a second prefetch hook. diffusers' own re-application of
    group offloading (when LoRAs are loaded or QKV projections fused) would see the whole model again.
    """
    from diffusers.hooks import apply_group_offloading

    cuda = device.type == "cuda"
    stacks = block_stacks(model)
    if not stacks:
        raise UserError(f"--offload stream streams a model's nn.ModuleList of blocks, and {type(model).__name__} "
                        f"has none; leave out --offload stream")
    for stack in stacks.values():
        pin_to_host(stack, pin=cuda)
        for block in stack:  # before diffusers wraps it
            block.forward = vars(block)[_OWN_FORWARD] = OwnForward(block.forward)
    with torch.no_grad():
        for name, child in model.named_children():
            if name not in stacks:
                child.to(device)
        for tensor in [*vars(model)["_parameters"].values(), *vars(model)["_buffers"].values()]:
            if tensor is not None:
                tensor.data = tensor.data.to(device)
    with _seen_as(model, stacks, {"_dit_accel_prefetch_anchor": torch.empty(0)}):
        apply_group_offloading(model, onload_device=device, offload_device="cpu", offload_type="block_level",
                               num_blocks_per_group=1, use_stream=cuda, non_blocking=cuda, record_stream=cuda,
                               block_modules=[])
    for block in (block for stack in stacks.values() for block in stack):
        vars(block)[ONLOAD_DEVICE] = device
    return stack_bytes(model)


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

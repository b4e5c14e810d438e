"""Where a module computes, read without loading anything: its first parameter's device, or, for blocks that live in
host memory between calls (`loading.offload.stream_blocks`), the device they are streamed onto, which the offload
marks on each block (`ONLOAD_DEVICE`) so that layers below loading (the router, the counters) can read it."""
from __future__ import annotations

import torch
from torch import nn

ONLOAD_DEVICE = "_dit_accel_onload_device"  # set by `loading.offload.stream_blocks` on each block it streams


def onload_device(module: nn.Module) -> torch.device | None:
    """The device the weights of `module` (or of the streamed modules inside it) are brought to for their forward
    (between calls they live in host memory, so their parameters' device is the CPU), or None."""
    return next((vars(m)[ONLOAD_DEVICE] for m in module.modules() if ONLOAD_DEVICE in vars(m)), None)


def module_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: the one its blocks stream to, else its first parameter's (the CPU for a
    module without parameters)."""
    streamed_to = onload_device(module)
    if streamed_to is not None:
        return streamed_to
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")

"""Bytes each aten op touches in one block run, counted exactly from its tensors.

One extra, un-profiled run of the block under a TorchDispatchMode adds up, per (named range, aten
op), the bytes of every tensor the op reads and writes (inputs plus outputs, as viewed). The
profiler pass then shares those bytes among the kernels the same ops launched. Reads served from a
cache count too, so a small table gathered into a large output can run above the DRAM copy ceiling.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .ranges import active_range


def _tensor_bytes(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class _ByteCounter(TorchDispatchMode):
    def __init__(self, body_label: str):
        super().__init__()
        self.body_label = body_label
        self.bytes: dict[tuple[str, str], float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = "aten::" + func._schema.name.split("::")[-1]
        self.bytes[(active_range() or self.body_label, op)] += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return out


def count_op_bytes(step: Callable[[], object], body_label: str) -> dict[tuple[str, str], float]:
    """{(range label, 'aten::op'): bytes} for one call of `step` (run inside the ranges' `instrument`)."""
    counter = _ByteCounter(body_label)
    with counter:
        step()
    return dict(counter.bytes)

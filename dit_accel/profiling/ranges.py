"""Named ranges around a block's parts, visible to torch.profiler (record_function) and to Nsight
Systems (NVTX) under the same names, so both tools show the same per-module breakdown.

Modules are wrapped with forward hooks (the diffusers way: no model edits); functions the block calls
from its model file (attention dispatch, RoPE helpers) are wrapped by swapping the module global for
the duration of the context, and put back on exit.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Callable, Iterator

import torch
from torch import nn

from ..adapters import ModuleRange
from ..seams.model_globals import Namespace

RANGE_PREFIX = "dit-accel/"
_OPEN_LABELS: list[str] = []  # labels of the ranges open right now, innermost last


def active_range() -> str | None:
    """Label of the innermost range open right now, or None outside every range."""
    return _OPEN_LABELS[-1] if _OPEN_LABELS else None


class _Range:
    """record_function + NVTX push/pop around one region; re-entrant through a stack."""

    def __init__(self, label: str, use_nvtx: bool):
        self.label = label
        self.name = RANGE_PREFIX + label
        self.use_nvtx = use_nvtx
        self._open: list[torch.profiler.record_function] = []

    def enter(self) -> None:
        rf = torch.profiler.record_function(self.name)
        rf.__enter__()
        self._open.append(rf)
        _OPEN_LABELS.append(self.label)
        if self.use_nvtx:
            torch.cuda.nvtx.range_push(self.name)

    def exit(self) -> None:
        if self.use_nvtx:
            torch.cuda.nvtx.range_pop()
        _OPEN_LABELS.pop()
        self._open.pop().__exit__(None, None, None)


def _wrap_function(fn: Callable, region: _Range) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        region.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            region.exit()

    wrapped.__wrapped_by_dit_accel__ = fn
    return wrapped


@contextlib.contextmanager
def wrapped_functions(functions: tuple[tuple[str, str], ...], wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace each (python module, function name) global by `wrap(original)` inside the context.

    Model files call helpers such as `dispatch_attention_fn` through their module globals, so this reaches
    every call the model makes. A dotted name ("F.scaled_dot_product_attention") replaces the attribute of a
    global module (`F`) for that model file alone, through a stand-in namespace. The originals are put back on
    exit, last in first out.
    """
    swapped: list[tuple[object, str, object]] = []
    try:
        for module_name, attr in functions:
            owner = importlib.import_module(module_name)
            name, _, inner = attr.partition(".")
            original = getattr(owner, name)
            if inner:
                setattr(owner, name, Namespace(original, {inner: wrap(getattr(original, inner))}))
            else:
                setattr(owner, name, wrap(original))
            swapped.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(swapped):
            setattr(owner, name, original)


@contextlib.contextmanager
def instrument(block: nn.Module, ranges: tuple[ModuleRange, ...], *, use_nvtx: bool) -> Iterator[None]:
    """Open each range around its modules' forward and its functions' calls while inside the context."""
    handles = []
    with contextlib.ExitStack() as stack:
        try:
            for spec in ranges:
                region = _Range(spec.label, use_nvtx)
                for path in spec.modules:
                    module = block.get_submodule(path)
                    handles.append(module.register_forward_pre_hook(lambda *_, r=region: r.enter()))
                    handles.append(module.register_forward_hook(lambda *_, r=region: r.exit(), always_call=True))
                stack.enter_context(wrapped_functions(spec.functions, lambda fn, r=region: _wrap_function(fn, r)))
            yield
        finally:
            for handle in handles:
                handle.remove()


def range_label(event_name: str) -> str | None:
    """'dit-accel/ffn' -> 'ffn'; None for events that are not our ranges."""
    return event_name[len(RANGE_PREFIX):] if event_name.startswith(RANGE_PREFIX) else None

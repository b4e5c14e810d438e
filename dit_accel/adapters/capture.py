"""What a transformer's blocks see, read off the model's own forward.

A video DiT of diffusers repeats one or several kinds of block: each top-level `nn.ModuleList` of the
model whose entries share one class is a stack (`block_stacks`: HunyuanVideo's `transformer_blocks` and
`single_transformer_blocks`, Wan's `blocks`). `capture_stacks` runs the model with one block per stack
(`keep_first_blocks`) on a pass's inputs and records, for each stack's block:

- its call (positional and keyword arguments, tensors cloned): RoPE tables, masks, modulation and text rows
  are the model's own, not re-derived;
- every attention call made inside it, from `F.scaled_dot_product_attention` (where diffusers' default
  backend and the processors that call torch directly both end): shapes, mask, which attention module made
  it, and whether it is self-, joint (text rows joined to the block's rows) or cross-attention;
- the rows each of its `nn.Linear`s saw (the sequence, the text context, the timestep rows).

The forward stops once every stack's block has run. On the meta device the same run gives the shapes alone,
with no memory and no compute (`capture_stacks` on a meta model and meta inputs), where the model's forward
has no data-dependent step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..attention.key_padding import kept_lengths, shape_reason

SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a block: [batch, heads, q_len, kv_len, head_dim], made by attention module
    `module` (its path in the block); `kind` is self (queries and keys are the block's rows), joint (the
    block's rows with other rows joined, e.g. text) or cross (keys from other rows); `masked` whether a mask
    went with it and `mask_bytes` its tensor's, `key_padding` whether it is one the router serves on the kept
    keys (`attention.key_padding`, by its shape), and `kept` each batch element's (kept queries, kept keys) where
    the capture ran on data and the mask's values are key padding."""

    module: str
    kind: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    masked: bool = False
    key_padding: bool = False
    mask_bytes: int = 0
    kept: tuple[tuple[int, int], ...] | None = None

    @property
    def flops(self) -> float:
        """QK^T and PV: two GEMMs of q*kv*d multiply-adds (2*q*kv*d FLOPs) each; softmax not counted."""
        return 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim

    @property
    def label(self) -> str:
        return f"{self.module} ({self.kind})" if self.module else self.kind

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "flops": self.flops}


@dataclass
class StackCapture:
    """One stack of a transformer and what its first block saw in a pass."""

    name: str  # the ModuleList's attribute, e.g. "transformer_blocks"; checkpoint keys start with it
    num_blocks: int  # blocks of the stack in the whole model
    block_type: type  # the block's class (the block itself is not kept: its weights would stay on the device)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch: int = 1  # dim 0 of its first tensor argument
    rows: int = 0  # the block's sequence rows (dim 1 of its first tensor argument)
    attention_calls: list[AttentionCall] = field(default_factory=list)
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # each nn.Linear -> (in, out) features
    linear_rows: dict[str, int] = field(default_factory=dict)  # each nn.Linear of the block -> rows it saw

    @property
    def attention_flops(self) -> float:
        return sum(call.flops for call in self.attention_calls)


def block_stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's stacks of repeated blocks: each top-level nn.ModuleList child of two or more entries (or one,
    in a model built with one block per stack) that all share one class, in registration order (the forward's for
    every family but Wan VACE, whose VACE blocks run ahead of the Wan blocks registered before them)."""
    return [(name, child) for name, child in model.named_children()
            if isinstance(child, nn.ModuleList) and len(child) and len({type(b) for b in child}) == 1]


def keep_first_blocks(model: nn.Module) -> dict[str, int]:
    """Cut every stack of `model` down to its first block, in place; returns each stack's block count before."""
    counts = {}
    for name, stack in block_stacks(model):
        counts[name] = len(stack)
        setattr(model, name, nn.ModuleList(stack[:1]))
    return counts


class _AllStacksRan(Exception):
    """Raised once every stack's block has run: the rest of the forward is not needed."""


class _SdpaRecorder(TorchFunctionMode):
    """Records each `F.scaled_dot_product_attention` call made while a stack's block runs."""

    def __init__(self, where: list[tuple[StackCapture, str]]):
        super().__init__()
        self.where = where  # innermost last: (the stack whose block runs, the attention module running in it)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.where:
            stack, module = self.where[-1]
            call = dict(zip(SDPA_ARGUMENTS, args), **kwargs)
            q, k = call["query"], call["key"]
            batch, heads, q_len, head_dim = q.shape[0], q.shape[-3], q.shape[-2], q.shape[-1]
            kv_len = k.shape[-2]
            kind = ("cross" if kv_len != q_len else "self" if q_len == stack.rows else "joint")
            mask = call.get("attn_mask")
            key_padding = mask is not None and shape_reason(mask, q.transpose(-3, -2), k.transpose(-3, -2)) is None
            kept = kept_lengths(mask, batch, q_len) if key_padding and mask.device.type != "meta" else None
            stack.attention_calls.append(AttentionCall(
                module, kind, batch, heads, q_len, kv_len, head_dim, mask is not None, key_padding,
                mask.untyped_storage().nbytes() if mask is not None else 0, tuple(kept) if kept else None))
        return func(*args, **kwargs)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _batch_and_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """(batch, sequence rows) of a block call: dims 0 and 1 of `hidden_states` (or of its first tensor
    argument)."""
    first = kwargs.get("hidden_states")
    if first is None:
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return (int(first.shape[0]), int(first.shape[1])) if first is not None and first.dim() >= 2 else (1, 0)


@contextlib.contextmanager
def _recording(captures: list[StackCapture], blocks: list[nn.Module]) -> Iterator[None]:
    """Hooks on each stack's first block (its call, its attention modules, its linears) and the SDPA recorder."""
    where: list[tuple[StackCapture, str]] = []
    pending = {capture.name for capture in captures}
    handles = []

    def block_pre(capture: StackCapture):
        def hook(module, args, kwargs):
            capture.args, capture.kwargs = _clone(args), _clone(kwargs)
            capture.batch, capture.rows = _batch_and_rows(args, kwargs)
            where.append((capture, ""))
        return hook

    def block_post(capture: StackCapture):
        def hook(module, args, kwargs, output):
            where.pop()
            pending.discard(capture.name)
            if not pending:
                raise _AllStacksRan
        return hook

    def attention_pre(capture: StackCapture, path: str):
        def hook(module, args):
            where.append((capture, path))
        return hook

    def attention_post(module, args, output):
        where.pop()

    def linear_pre(capture: StackCapture, path: str):
        def hook(module, args):
            x = args[0]
            capture.linear_rows[path] = capture.linear_rows.get(path, 0) + x.numel() // max(1, x.shape[-1])
        return hook

    try:
        for capture, block in zip(captures, blocks):
            handles.append(block.register_forward_pre_hook(block_pre(capture), with_kwargs=True))
            handles.append(block.register_forward_hook(block_post(capture), with_kwargs=True, always_call=True))
            for path, module in block.named_modules():
                if hasattr(module, "processor"):  # a diffusers attention module
                    handles.append(module.register_forward_pre_hook(attention_pre(capture, path)))
                    handles.append(module.register_forward_hook(attention_post, always_call=True))
                elif isinstance(module, nn.Linear):
                    capture.linear_shapes[path] = (module.in_features, module.out_features)
                    handles.append(module.register_forward_pre_hook(linear_pre(capture, path)))
        with _SdpaRecorder(where):
            yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture_stacks(model: nn.Module, kwargs: dict[str, Any],
                   counts: dict[str, int] | None = None) -> list[StackCapture]:
    """Run `model(**kwargs)` (a transformer with one block per stack: `keep_first_blocks`) until every stack's
    block has run, and return what each saw, in forward order. `counts`: each stack's blocks in the whole model
    (`keep_first_blocks`' answer; default: as many as `model` holds)."""
    stacks = block_stacks(model)
    counts = counts or {name: len(stack) for name, stack in stacks}
    captures = [StackCapture(name, counts[name], type(stack[0])) for name, stack in stacks]
    with _recording(captures, [stack[0] for _, stack in stacks]):
        try:
            model(**kwargs)
        except _AllStacksRan:
            pass
    missing = [c.name for c in captures if not c.args and not c.kwargs]
    if missing:
        raise RuntimeError(f"{type(model).__name__}'s forward never ran its {', '.join(missing)}")
    return captures

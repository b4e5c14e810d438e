"""`fused_prologue`: MiniMax-H3's QK-norm and RoPE computed inside the FP8 attention's prep.

Between its projections and the attention, `MiniMaxH3AttnProcessor.__call__` runs per-head RMSNorm
on q and k (`attn.norm_q`, `attn.norm_k`), the rotary embedding on both, then
`dispatch_attention_fn`. That is three passes over q and k in bf16 (two when inductor fuses norm and
RoPE) before our prep reads them twice more. With the prologue fused, the prep reads the raw
projections and quantizes RoPE(RMSNorm(x) * w) directly (`kernels.fp8_attention.prep.Prologue`, op
`dit_accel::fp8_attention_prologue`): q and k are read twice and written once, in FP8.

The swap, like `patch_attention` and `fused_rope`:

    with patch_attention(model, "fp8"), fused_prologue(model) as prologue:
        model(...)
    print(prologue.summary())

It wraps each MiniMax-H3 attention module's processor in `FusedPrologueProcessor`, which reproduces
the processor's projections and output projection around the fused op. It serves a call only when
the attention router would have served it with our kernel (the processor's backend is our `fp8` or
`fp8-v1`, and the router would neither fall back nor route it to a faster backend), the call has
rotary embeddings and no mask, no context parallelism is on (each rank would hold a shard of the
sequence), and nothing needs autograd; every other call runs the original
processor unchanged (its projections are recomputed: fallbacks are meant to be rare) and is
counted by reason. Served calls also count as served in the router, so its totals stay complete.
Both counters are 0-d tensors on the model's device (`counts.CallCounts`), so they count inside torch.compile'd
graphs and CUDA graphs too; the wrapper itself
is traced by dynamo (the op is one opaque node).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..seams.counts import CallCounts, CountedCalls

PROCESSOR_CLASS = "MiniMaxH3AttnProcessor"  # the diffusers processor whose __call__ the wrapper reproduces
PROCESSOR_MODULE = "diffusers.models.transformers.transformer_minimax_h3"
PROCESSOR_PARAMETERS = ["self", "attn", "hidden_states", "rotary_emb", "attention_mask"]
KERNEL_VARIANTS = {"fp8": "auto", "fp8-v1": "mma_sync"}  # our routed backends -> the op's kernel variant


def _arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, processor: Any) -> dict[str, Any]:
    """The `dispatch_attention_fn` arguments the original processor would pass (all names present)."""
    return {"query": query, "key": key, "value": value, "attn_mask": None, "dropout_p": 0.0, "is_causal": False,
            "scale": None, "enable_gqa": False, "attention_kwargs": None, "backend": processor._attention_backend,
            "parallel_config": processor._parallel_config}


class FusedPrologueProcessor:
    """Stands in for one `MiniMaxH3AttnProcessor` while the prologue is fused; `original` is that
    processor, which keeps its routed `_attention_backend` and serves every call this one declines."""

    def __init__(self, original: Any, handle: "FusedPrologue"):
        self.original = original
        self.handle = handle

    @property
    def _attention_backend(self) -> Any:
        return self.original._attention_backend

    @property
    def _parallel_config(self) -> Any:
        return self.original._parallel_config

    def _decline_reason(self, attn: nn.Module, hidden_states: torch.Tensor, rotary_emb: Any, attention_mask: Any,
                        arguments: dict[str, Any]) -> str | None:
        routed = self.original._attention_backend
        variant = KERNEL_VARIANTS.get(getattr(routed, "name", None))
        if variant is None:
            return "attention is not routed to fp8"
        if rotary_emb is None or attention_mask is not None:
            return "no rotary embedding" if rotary_emb is None else "attention mask"
        if self.original._parallel_config is not None:
            return "context parallelism"  # each rank holds a shard of the sequence: diffusers' all-to-all must run
        if attn.norm_q.weight is None or attn.norm_k.weight is None or attn.norm_q.eps != attn.norm_k.eps \
                or attn.norm_q.eps is None:
            return "QK-norm without weights or one stated eps"
        if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, attn.norm_q.weight,
                                                                     attn.norm_k.weight, *rotary_emb)):
            return "autograd needed"  # the op has no backward (it refuses these inputs)
        reason = routed.decline_reason(arguments)
        if reason is not None:
            return reason
        from ..kernels.fp8_attention.op import prologue_op_reason

        q, k, v = arguments["query"], arguments["key"], arguments["value"]
        cos, sin = rotary_emb
        return prologue_op_reason(q, k, v, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps, cos, sin, variant)

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, rotary_emb: Any = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        from ..kernels.fp8_attention.op import FP8_ATTENTION_PROLOGUE

        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = query.unflatten(-1, (attn.heads, -1))
        key = key.unflatten(-1, (attn.heads, -1))
        value = value.unflatten(-1, (attn.heads, -1))
        reason = self._decline_reason(attn, hidden_states, rotary_emb, attention_mask,
                                      _arguments(query, key, value, self.original))
        self.handle.counts.count(reason)
        if reason is not None:
            return self.original(attn, hidden_states, rotary_emb, attention_mask)
        routed = self.original._attention_backend
        routed.count_served()
        cos, sin = rotary_emb
        out = FP8_ATTENTION_PROLOGUE(query, key, value, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps,
                                     cos, sin, None, KERNEL_VARIANTS[routed.name])
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


@dataclass(eq=False)
class FusedPrologue(CountedCalls):
    """A live swap: undo it with `unpatch()` (or by leaving the `with` block)."""

    modules: int = 0  # attention modules wrapped
    counts: CallCounts = field(default_factory=CallCounts)
    _wrapped: list[tuple[nn.Module, Any]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {"attention_modules": self.modules, "served_calls": self.served_calls,
                "fallback_calls": dict(self.fallback_calls)}

    def unpatch(self) -> None:
        """Put every original processor back; unpatching twice is a no-op."""
        wrapped, self._wrapped = self._wrapped, []
        for module, processor in reversed(wrapped):
            module.processor = processor

    def __enter__(self) -> "FusedPrologue":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def _check_processor_contract(processor: Any) -> None:
    parameters = list(inspect.signature(type(processor).__call__).parameters)
    if parameters != PROCESSOR_PARAMETERS:
        raise UserError(f"{PROCESSOR_MODULE}.{PROCESSOR_CLASS}.__call__ no longer takes {PROCESSOR_PARAMETERS[1:]}; "
                        "this diffusers version is unsupported by the fused prologue, so run without +prologue")


def fused_prologue(model_or_pipeline: Any) -> FusedPrologue:
    """Fuse QK-norm and RoPE into the FP8 attention's prep in every MiniMax-H3 attention module of a
    model (or a pipeline's transformers) until the handle is unpatched. Patch the attention to
    `fp8` first (the prologue serves only calls routed to our kernel). Raises UserError when the
    model has no MiniMax-H3 attention."""
    from .attention_patch import denoisers

    models = denoisers(model_or_pipeline)
    handle = FusedPrologue(counts=CallCounts.on_device_of(models[0]))
    for model in models:
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if type(processor).__name__ != PROCESSOR_CLASS or type(processor).__module__ != PROCESSOR_MODULE:
                continue
            _check_processor_contract(processor)
            handle._wrapped.append((module, processor))
            module.processor = FusedPrologueProcessor(processor, handle)
    if not handle._wrapped:
        raise UserError(f"{type(model_or_pipeline).__name__} has no MiniMax-H3 attention processors, the only ones "
                        "the fused prologue serves; drop +prologue")
    handle.modules = len(handle._wrapped)
    return handle

"""`fused_rope`: MiniMax-H3's rotary embedding sent to the fused Triton kernel, swapped in reversibly.

The kernel and its contract are `dit_accel.kernels.rope` (diffusers' `_apply_rotary_emb(x, cos,
sin)` of `transformer_minimax_h3.py`, called by `MiniMaxH3AttnProcessor.__call__` as a global of
its model file, once for the query and once for the key). This module is the policy around it.

The swap, like `patch_attention`:

    with fused_rope(transformer) as rope:   # or rope = fused_rope(transformer); ...; rope.unpatch()
        transformer(...)
    print(rope.summary())                   # served_calls, fallback_calls by reason

It replaces the `_apply_rotary_emb` global of the model file with a dispatcher: CUDA tensors the
kernel supports go to the Triton kernel, anything else (CPU tensors, other dtypes or shapes,
autograd, no Triton) to the original function, counted by reason in every live handle. Inside a
torch.compile'd graph the dispatcher steps aside, uncounted: the original is traced, and inductor
fuses it with the QK-norm before it into one kernel. The global belongs to the model file, so while a handle is
live every model of that file in the process gets the dispatcher, not only the one passed. Installs are
reference-counted across nested handles, and the original global comes back when the last one leaves
(`seams.model_globals.ModelGlobalSwap`, shared with attention routing).
"""
from __future__ import annotations

import functools
import inspect
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import torch

from ..errors import UserError
from ..kernels.rope import apply_rotary_emb_fused, is_available, unsupported_reason
from ..seams.model_globals import ModelGlobalSwap, model_file

ROPE_GLOBAL = "_apply_rotary_emb"

# Model files whose `_apply_rotary_emb(hidden_states, cos, sin)` has the contract above. Other diffusers
# files define a function of the same name with other contracts (complex freqs, interleaved pairs, q and k
# together), so the name alone is not enough.
ROPE_MODEL_FILES = ("diffusers.models.transformers.transformer_minimax_h3",)


def fallback_reason(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel cannot serve this call (it goes to diffusers' function), or None."""
    reason = unsupported_reason(x, cos, sin)
    if reason is not None:
        return reason
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        return "autograd needed"  # the kernel has no backward
    if not x.is_cuda:
        return "not a CUDA tensor"
    if cos.device != x.device or sin.device != x.device:
        return "cos/sin on another device"
    if not is_available():
        return "Triton not importable"
    return None


@dataclass(eq=False)
class FusedRope:
    """A live swap: undo it with `unpatch()` (or by leaving the `with` block). Its counters keep
    every rotary call of its model files while it is live: served by the kernel, or fallen back."""

    model_files: list[str]
    served_calls: int = 0
    fallback_calls: Counter[str] = field(default_factory=Counter)
    _modules: list[ModuleType] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {"model_files": list(self.model_files), "served_calls": self.served_calls,
                "fallback_calls": dict(self.fallback_calls)}

    def unpatch(self) -> None:
        """Leave every model file this handle joined; unpatching twice is a no-op."""
        modules, self._modules = self._modules, []
        _ROPE_SWAP.release_all(modules, self)

    def __enter__(self) -> "FusedRope":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def _make_dispatcher(original: Callable[..., torch.Tensor], users: list[FusedRope]) -> Callable[..., torch.Tensor]:
    """The replacement for a model file's `_apply_rotary_emb`; counts each call in every live handle."""
    if list(inspect.signature(original).parameters) != ["hidden_states", "cos", "sin"]:
        raise UserError(f"{original.__module__}.{ROPE_GLOBAL} no longer takes (hidden_states, cos, sin); this "
                        "diffusers version is unsupported by fused_rope, so run without it")

    @functools.wraps(original)
    def apply_rotary_emb_dispatch(hidden_states, cos, sin):
        if torch.compiler.is_compiling():
            # Inside a compiled graph inductor fuses diffusers' own RoPE into its neighbours; not counted
            # (a counter bumped in the graph would be guarded by value and recompile the model each call).
            return original(hidden_states, cos, sin)
        reason = fallback_reason(hidden_states, cos, sin)
        for user in users:
            if reason is None:
                user.served_calls += 1
            else:
                user.fallback_calls[reason] += 1
        if reason is None:
            return apply_rotary_emb_fused(hidden_states, cos, sin)
        return original(hidden_states, cos, sin)

    return apply_rotary_emb_dispatch


_ROPE_SWAP = ModelGlobalSwap(ROPE_GLOBAL, _make_dispatcher)


def _rope_model_files(model: torch.nn.Module) -> list[ModuleType]:
    """The supported model files that the attention processors under `model` call the rotary global of."""
    found: dict[str, ModuleType] = {}
    for submodule in model.modules():
        processor = getattr(submodule, "processor", None)
        module = model_file(processor, ROPE_GLOBAL) if processor is not None else None
        if module is not None and module.__name__ in ROPE_MODEL_FILES:
            found.setdefault(module.__name__, module)
    return list(found.values())


def fused_rope(model_or_pipeline: Any) -> FusedRope:
    """Send the rotary embeddings of a MiniMax-H3 model (or a pipeline's transformers) to the fused
    kernel until the returned handle is unpatched. Raises UserError when it has no such attention."""
    from .attention_patch import denoisers

    modules = {m.__name__: m for model in denoisers(model_or_pipeline) for m in _rope_model_files(model)}
    if not modules:
        raise UserError(f"{type(model_or_pipeline).__name__} has no MiniMax-H3 attention processors, the only ones "
                        "fused_rope can serve; run without fused_rope")
    handle = FusedRope(sorted(modules))
    handle._modules = _ROPE_SWAP.acquire_all(modules.values(), handle)
    return handle

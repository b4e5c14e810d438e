"""`patch_attention`: route the attention of a diffusers model or pipeline to another backend.

It builds on the one seam in `attention.routing` (each processor's `_attention_backend`, and for
custom backends a router in place of the model file's `dispatch_attention_fn`), adding what a
whole model needs: which models of a pipeline to patch (its transformers), blocks to keep on the
original backend (e.g. the first and the last), denoising steps to keep on it (a diffusers
`callback_on_step_end` advances the patch's step counter), and one summary of where every call went.

    with patch_attention(pipe, "fp8", keep_blocks=(0, -1)) as patch:
        video = pipe(prompt, callback_on_step_end=patch.step_callback).frames
    print(patch.summary())

Calls the backend cannot serve (masks, unsupported head dims, autograd, ring attention) go to
diffusers' default backend and are counted by reason. Under diffusers' Ulysses context parallelism
(`model.enable_parallelism(...)` before patching) diffusers does the all-to-alls and each rank runs
the patched backend on its heads; the FP8 kernel is also safe inside CUDA-graph capture.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..attention.routing import (AttentionBackendSwap, RoutedBackend, restore_attention_backend,
                                 set_attention_backend_by_name)
from ..errors import UserError

BLOCK_LIST_NAMES = ("transformer_blocks", "blocks", "single_transformer_blocks")


def denoisers(model_or_pipeline: Any) -> list[nn.Module]:
    """The modules to patch: the model itself, or a pipeline's transformer(s) (`transformer`,
    `transformer_2`, ... : every nn.Module component whose name starts with "transformer")."""
    if isinstance(model_or_pipeline, nn.Module):
        return [model_or_pipeline]
    components = getattr(model_or_pipeline, "components", None)
    if not isinstance(components, dict):
        raise UserError(f"cannot patch a {type(model_or_pipeline).__name__}: pass a diffusers model or pipeline")
    found = [m for name, m in sorted(components.items()) if name.startswith("transformer") and isinstance(m, nn.Module)]
    if not found:
        raise UserError(f"{type(model_or_pipeline).__name__} has no transformer component to patch")
    return found


def block_list(model: nn.Module) -> nn.ModuleList:
    """The model's stack of transformer blocks (a single block counts as a stack of one)."""
    for name in BLOCK_LIST_NAMES:
        blocks = getattr(model, name, None)
        if isinstance(blocks, nn.ModuleList):
            return blocks
    return nn.ModuleList([model])


def _kept_blocks(model: nn.Module, keep: tuple[int, ...]) -> tuple[nn.Module, ...]:
    blocks = block_list(model)
    kept = []
    for index in keep:
        if not -len(blocks) <= index < len(blocks):
            raise UserError(f"keep_blocks index {index} is out of range for {type(model).__name__}, which has "
                            f"{len(blocks)} blocks")
        kept.append(blocks[index])
    return tuple(kept)


@dataclass
class AttentionPatch:
    """A live patch: undo it with `unpatch()` (or by leaving the `with` block)."""

    backend: str
    keep_blocks: tuple[int, ...]
    keep_steps: frozenset[int]
    step: int = 0  # the denoising step running now, advanced by `step_callback`
    holding: bool = False  # whether `step` is kept on the original backend (kept in step with `step`)
    routed: list[RoutedBackend] = field(default_factory=list)  # their counters outlive the patch
    _swaps: list[AttentionBackendSwap] = field(default_factory=list)

    def hold_reason(self) -> str | None:
        # Reads the step only while holding: under torch.compile what this reads is guarded, so the steps
        # served share one graph and each kept step (its reason names it) costs one more, where reading
        # the step number on every call would cost a graph a step.
        return f"step {self.step} kept on the original backend" if self.holding else None

    def step_callback(self, pipeline: Any, step_index: int, timestep: Any, callback_kwargs: dict) -> dict:
        """diffusers `callback_on_step_end`: called after step `step_index`; the next one begins."""
        self.step = step_index + 1
        self.holding = self.step in self.keep_steps
        return callback_kwargs

    def summary(self) -> dict[str, Any]:
        """Where the attention calls went since the patch was made (routed backends count; native
        backends are set on the processors and run inside diffusers, uncounted)."""
        fallback: dict[str, int] = {}
        for routed in self.routed:
            for reason, calls in routed.fallback_calls.items():
                fallback[reason] = fallback.get(reason, 0) + calls
        return {"backend": self.backend, "counted": bool(self.routed),
                "served_calls": sum(r.served_calls for r in self.routed), "fallback_calls": fallback,
                "kept_blocks": list(self.keep_blocks), "kept_steps": sorted(self.keep_steps),
                "crossover": sorted({r.crossover_note for r in self.routed})}  # which data routed calls by shape

    def unpatch(self) -> None:
        while self._swaps:
            restore_attention_backend(self._swaps.pop())

    def __enter__(self) -> "AttentionPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


def patch_attention(model_or_pipeline: Any, backend: str = "fp8", *, keep_blocks: tuple[int, ...] = (),
                    keep_steps: tuple[int, ...] = ()) -> AttentionPatch:
    """Route every attention call of the model(s) to `backend`, but in `keep_blocks` (block indices,
    negative from the end) and during `keep_steps` (0-based denoising steps). Returns the patch.

    Calls the backend cannot take where it runs (masks it does not serve, autograd, head dims its kernel lacks) and
    calls the device's crossover (or, without one, the conservative rule) routes away fall back to diffusers' own
    backend, counted by reason in `summary()`. A backend that cannot run on the model's device at all (fp8 on the CPU
    or a GPU before sm_89, a package not installed) is refused here, before anything is patched: a UserError, one
    line saying why."""
    for name, value in (("keep_blocks", keep_blocks), ("keep_steps", keep_steps)):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise UserError(f"{name} takes a tuple of integer indices, e.g. (0, -1), not {value!r}")
    if not isinstance(backend, str):
        raise UserError(f"backend takes an attention name such as 'fp8' or 'cudnn', not {type(backend).__name__} "
                        f"{backend!r}")
    patch = AttentionPatch(backend, tuple(keep_blocks), frozenset(keep_steps), holding=0 in keep_steps)
    hold = patch.hold_reason if keep_steps else None
    try:
        for model in denoisers(model_or_pipeline):
            swap = set_attention_backend_by_name(
                model, backend, exclude=_kept_blocks(model, patch.keep_blocks), hold_reason=hold)
            patch._swaps.append(swap)
            if swap.routed is not None:
                patch.routed.append(swap.routed)
    except BaseException:
        patch.unpatch()
        raise
    return patch

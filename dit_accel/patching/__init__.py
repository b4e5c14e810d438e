"""What dit-accel swaps into diffusers models: attention backends, the fused RoPE, FP8 linears.

    from dit_accel.patching import apply_recipe, patch_attention, fused_rope, quantize_linears, parse_recipe

`attention_patch.py`: `patch_attention` (route a model's or pipeline's attention to a backend, keeping
chosen blocks and steps on the original), `AttentionPatch`, `denoisers`, `block_list`.
`rope.py`: `fused_rope` (MiniMax-H3's rotary embedding on the fused Triton kernel), `FusedRope`.
`prologue.py`: `fused_prologue` (MiniMax-H3's QK-norm and RoPE inside the FP8 attention's prep).
`fp8_linear.py`: `quantize_linears` (a block's large linears in FP8 through torchao, by the
family's policy), `fp8_linear_unavailable_reason`.
`recipe.py`: `Recipe`, `parse_recipe`: the names every command's --attn takes
(NAME[+rope | +prologue][+fp8-linear][+compile][+cache=METHOD]).
`apply.py`: `apply_recipe` (a recipe on a block, a model or a pipeline, every swap undone together),
`AppliedRecipe`.
`step_cache.py`: `apply_step_cache`, `parse_cache`, `CACHE_METHODS`: diffusers' step caches on a transformer
(`+cache=...`), every family's blocks described to them, what ran counted per step.

The swaps and counters they share live in `dit_accel.seams`. The names are imported on first use (PEP 562
`__getattr__`), not at package import: `--help` reads the recipe vocabulary (`step_cache.cache_help`) through this
package without loading torch or diffusers.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {  # public name -> the submodule defining it
    "patch_attention": "attention_patch", "AttentionPatch": "attention_patch", "denoisers": "attention_patch",
    "block_list": "attention_patch", "BLOCK_LIST_NAMES": "attention_patch",
    "fused_rope": "rope", "FusedRope": "rope",
    "fused_prologue": "prologue", "FusedPrologue": "prologue",
    "quantize_linears": "fp8_linear", "fp8_linear_unavailable_reason": "fp8_linear",
    "Recipe": "recipe", "parse_recipe": "recipe",
    "apply_recipe": "apply", "AppliedRecipe": "apply",
    "apply_step_cache": "step_cache", "parse_cache": "step_cache", "CACHE_METHODS": "step_cache",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this hook (and a monkeypatch of it sticks)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

"""Model adapters: one module per family, registered here by CLI name."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError
from .base import AttentionCall, BlockAdapter, ModuleRange, TransformerInputs, Workload
from .building import read_config
from .minimax_h3 import MiniMaxH3Adapter
from .wan import WanAdapter

ADAPTERS: dict[str, type[BlockAdapter]] = {a.family: a for a in (MiniMaxH3Adapter, WanAdapter)}
DEFAULT_FAMILY = MiniMaxH3Adapter.family

__all__ = ["ADAPTERS", "DEFAULT_FAMILY", "AttentionCall", "BlockAdapter", "ModuleRange", "TransformerInputs",
           "Workload", "adapter_for_config", "adapter_for_preset", "read_transformer_config"]


def adapter_for_preset(family: str, preset: str | None = None) -> BlockAdapter:
    """The adapter of `family` with one of its embedded configs (the first one by default)."""
    if family not in ADAPTERS:
        raise UserError(f"unknown model family {family!r}; choose one of: {', '.join(ADAPTERS)}")
    cls = ADAPTERS[family]
    preset = preset or next(iter(cls.presets))
    if preset not in cls.presets:
        raise UserError(f"unknown preset {preset!r} for {family}; choose one of: {', '.join(cls.presets)}")
    return cls(cls.presets[preset], preset=preset)


def adapter_for_config(config: dict[str, Any], source: str) -> BlockAdapter:
    """The adapter whose family made this diffusers transformer config (its `_class_name`)."""
    class_name = config.get("_class_name")
    for cls in ADAPTERS.values():
        if class_name in cls.transformer_class_names:
            return cls(config)
    known = ", ".join(name for cls in ADAPTERS.values() for name in cls.transformer_class_names)
    raise UserError(f"{source}: unknown model family {class_name!r}; dit-accel knows {known}")


def read_transformer_config(path: Path) -> dict[str, Any]:
    """A checkpoint's transformer config.json, or a UserError."""
    return read_config(path, unreadable_hint="point --checkpoint at a diffusers transformer folder",
                       invalid_hint="re-download the checkpoint's config.json")

"""Model families and their adapters: every family registered here by CLI name (`FAMILIES`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError
from . import minimax_h3, wan
from .base import BlockAdapter, ModuleRange, TransformerInputs, Workload
from .building import read_config
from .capture import AttentionCall
from .families import GENERIC_FAMILIES
from .family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (minimax_h3.FAMILY, wan.FAMILY, *GENERIC_FAMILIES)}
DEFAULT_FAMILY = minimax_h3.FAMILY.name

__all__ = ["DEFAULT_FAMILY", "FAMILIES", "AttentionCall", "BlockAdapter", "Family", "ModuleRange",
           "TransformerInputs", "Workload", "adapter_for_config", "adapter_for_preset", "read_transformer_config"]


def adapter_for_preset(family: str, preset: str | None = None) -> BlockAdapter:
    """The adapter of `family` with one of its embedded configs (the first one by default)."""
    if family not in FAMILIES:
        raise UserError(f"unknown model family {family!r}; choose one of: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    preset = preset or next(iter(spec.presets))
    if preset not in spec.presets:
        raise UserError(f"unknown preset {preset!r} for {family}; choose one of: {', '.join(spec.presets)}")
    return BlockAdapter(spec, spec.presets[preset].config, preset=preset)


def adapter_for_config(config: dict[str, Any], source: str) -> BlockAdapter:
    """The adapter whose family made this diffusers transformer config (its `_class_name`)."""
    class_name = config.get("_class_name")
    for spec in FAMILIES.values():
        if class_name == spec.transformer and (spec.accepts is None or spec.accepts(config)):
            return BlockAdapter(spec, config)
    known = ", ".join(spec.transformer for spec in FAMILIES.values())
    raise UserError(f"{source}: unknown model family {class_name!r}; dit-accel knows {known}")


def read_transformer_config(path: Path) -> dict[str, Any]:
    """A checkpoint's transformer config.json, or a UserError."""
    return read_config(path, unreadable_hint="point --checkpoint at a diffusers transformer folder",
                       invalid_hint="re-download the checkpoint's config.json")

"""The transformer's forward arguments for a pass, made from its own signature.

Each argument of a diffusers video transformer's `forward` that these rules know is made from the config and
the pass (`InputContext`): the latent video in the family's layout, one timestep, the prompt's rows and mask,
pooled text projections and embedded guidance where the config has them. A family's `inputs` hook adds or
replaces the rest (LTX's grid sizes, Cosmos's padding mask...). An argument that has no default and that
neither makes is refused in one line naming it: that is what a new family needs to be told.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..errors import UserError
from .family import Family, InputContext

GUIDANCE = 6.0  # embedded guidance (HunyuanVideo's pipeline default), x 1000 as the pipelines pass it


def _latents(family: Family, ctx: InputContext) -> torch.Tensor:
    g, channels = ctx.grid, ctx.config["in_channels"]
    if family.latents == "BCFHW":
        return ctx.randn(g.batch, channels, g.frames, g.height, g.width)
    if family.latents == "BFCHW":
        return ctx.randn(g.batch, g.frames, channels, g.height, g.width)
    if family.latents == "tokens":
        return ctx.randn(g.batch, g.frames * g.height * g.width, channels)
    raise ValueError(f"{family.name}: unknown latent layout {family.latents!r}")


def _grid_size(axis: str) -> Callable[[Family, InputContext], Any]:
    def size(family: Family, ctx: InputContext) -> int | None:
        return getattr(ctx.grid, axis) if family.latents == "tokens" else None
    return size


# forward argument -> its value for the pass (None: leave the argument to its default)
RULES: dict[str, Callable[[Family, InputContext], Any]] = {
    "hidden_states": _latents,
    "timestep": lambda f, ctx: torch.full((ctx.grid.batch,), 500.0, device=ctx.device),
    "encoder_hidden_states": lambda f, ctx: ctx.randn(ctx.grid.batch, ctx.text_rows, ctx.config[f.text_width]),
    "encoder_attention_mask": lambda f, ctx: torch.ones(ctx.grid.batch, ctx.text_rows, device=ctx.device),
    "pooled_projections": lambda f, ctx: ctx.randn(ctx.grid.batch, ctx.config["pooled_projection_dim"]),
    "guidance": lambda f, ctx: (torch.full((ctx.grid.batch,), GUIDANCE * 1000.0, device=ctx.device)
                                if ctx.config.get("guidance_embeds") else None),
    "num_frames": _grid_size("frames"),
    "height": _grid_size("height"),
    "width": _grid_size("width"),
    "return_dict": lambda f, ctx: False,
}


def forward_arguments(family: Family, ctx: InputContext) -> dict[str, Any]:
    """Keyword arguments of `family`'s transformer forward for the pass `ctx` describes; UserError naming the
    arguments that have no default and that neither the rules nor the family's hook make."""
    parameters = inspect.signature(family.transformer_class.forward).parameters
    made: dict[str, Any] = dict(family.inputs(ctx)) if family.inputs is not None else {}
    for name in parameters:
        rule = RULES.get(name)
        value = rule(family, ctx) if rule and name not in made else None
        if value is not None:
            made[name] = value
    missing = [name for name, p in parameters.items()
               if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               and p.default is p.empty and name not in made]
    if missing:
        raise UserError(f"{family.transformer}: dit-accel cannot make its forward argument(s) {', '.join(missing)}; "
                        f"the family needs an inputs hook for them (dit_accel/adapters/families.py)")
    return made

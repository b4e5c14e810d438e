"""Building a diffusers model before any weight exists, as a load would type it.

`parameters_on_meta`: modules built inside it get their parameters on the meta device (no memory,
their init runs on meta) and their computed buffers (RoPE tables) real, on the CPU. `fp32_kept`:
the dtype diffusers gives a parameter loaded with `torch_dtype=dtype` (its `_keep_in_fp32_modules`).
`synthetic_weights`: a meta model's parameters made real with random weights of realistic scale.
`read_config`: a local model's config.json. The block adapters (`base`) and the pipeline stages
(`stage_specs`) both build and type their models so.
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import UserError


def read_config(path: Path, *, unreadable_hint: str, invalid_hint: str | None = None,
                context: str = "") -> dict[str, Any]:
    """The JSON at `path`, or a UserError of one line: `context` first, then what went wrong and the hint."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"{context}cannot read {path} ({exc.strerror}); {unreadable_hint}") from exc
    except ValueError as exc:
        hint = f"; {invalid_hint}" if invalid_hint else ""
        raise UserError(f"{context}{path} is not valid JSON ({exc}){hint}") from exc


def fp32_kept(key: str, dtype: torch.dtype, keep_in_fp32: tuple[str, ...]) -> torch.dtype:
    """The dtype diffusers gives parameter `key` loaded with `torch_dtype=dtype`: float32 when a
    dot-separated part of the key is one of the model class's `_keep_in_fp32_modules`."""
    parts = key.split(".")
    return torch.float32 if any(name in parts for name in keep_in_fp32) else dtype


# torch.nn.init's in-place initializers: on a meta tensor each is a no-op that torch still runs through its Python
# decompositions (half the time of building a transformer on meta), skipped inside `parameters_on_meta`.
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, and no init: it would only run on
    meta) while their buffers are computed for real on the CPU: a model's computed buffers (RoPE tables) survive,
    which `torch.device("meta")` would leave empty."""
    register = nn.Module.register_parameter
    initializers = {name: getattr(nn.init, name) for name in _INITIALIZERS}

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    def skipped_on_meta(initializer):
        @functools.wraps(initializer)
        def initialize(tensor, *args, **kwargs):
            return tensor if tensor.is_meta else initializer(tensor, *args, **kwargs)
        return initialize

    nn.Module.register_parameter = register_on_meta
    for name, initializer in initializers.items():
        setattr(nn.init, name, skipped_on_meta(initializer))
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for name, initializer in initializers.items():
            setattr(nn.init, name, initializer)


@torch.no_grad()
def synthetic_weights(module: nn.Module, device: torch.device, dtype_of, seed: int = 0) -> nn.Module:
    """`module`'s meta parameters materialized on `device` with random weights of realistic scale
    (each submodule's own `reset_parameters` init; N(0, 1/fan_in) for parameters no submodule inits,
    e.g. Wan's `scale_shift_table`, as diffusers initializes them), each in `dtype_of(name)`.
    Buffers that hold values (not on meta) keep them, moved to `device`."""
    buffers = {name: buffer.clone() for name, buffer in module.named_buffers() if not buffer.is_meta}
    module = module.to_empty(device=device)
    for name, buffer in module.named_buffers():
        if name in buffers:
            buffer.copy_(buffers[name])
    torch.manual_seed(seed)
    initialized: set[int] = set()
    for submodule in module.modules():
        if hasattr(submodule, "reset_parameters"):
            submodule.reset_parameters()
            initialized.update(id(p) for p in submodule.parameters(recurse=False))
    for param in module.parameters():
        if id(param) not in initialized:
            param.normal_(0.0, param.shape[-1] ** -0.5)
    for name, param in module.named_parameters():
        param.data = param.data.to(dtype_of(name))
    return module.eval()

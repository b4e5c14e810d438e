"""Modular pipelines (MiniMax-H3): how to call one and read its outputs. Filled in per pipeline family."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import UserError


def is_modular(pipe: Any) -> bool:
    from diffusers import ModularPipeline

    return isinstance(pipe, ModularPipeline)


def modular_call(pipe: Any, request, generator: torch.Generator) -> Any:
    raise UserError(f"{type(pipe).__name__} is a modular pipeline, which generate does not run yet")


def modular_outputs(pipe: Any, output: Any) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    raise UserError(f"{type(pipe).__name__} is a modular pipeline, which generate does not run yet")

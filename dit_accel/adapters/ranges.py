"""The named ranges a block adapter or a pipeline stage declares (`ModuleRange`), as data:
`profiling.ranges` wraps them for the per-module breakdown and for Nsight Systems (NVTX)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleRange:
    """A named range of the block, for the per-module breakdown and for Nsight Systems (NVTX).

    `modules` are attribute paths inside the block whose forward is wrapped; `functions` are
    (python module, function name) pairs called inside the block (e.g. the attention dispatch or
    RoPE helpers of a diffusers model file), wrapped while profiling.
    """

    label: str
    modules: tuple[str, ...] = ()
    functions: tuple[tuple[str, str], ...] = ()

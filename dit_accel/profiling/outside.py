"""What a pass costs outside the block stack: the family's whole transformer built with no blocks
(`adapter.build_outside`: embeddings, refiner layers, RoPE, output norm and heads), synthetic weights,
timed on the inputs of the pass the profiled block is one block of (`adapter.make_transformer_inputs`).
The extrapolation adds its median to blocks x block time (`--outside measure`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters import BlockAdapter, Workload
from ..loading.block import loaded_param_bytes, param_bytes, synthetic_outside
from ..timing import TimingStats, time_region


@dataclass(frozen=True)
class OutsideMeasurement:
    """One pass of the zero-block transformer, eager.

    median_ms: median wall time of its forward (CUDA events on a GPU).  param_bytes: its weights in
    the dtypes a load gives them.  seq_len: the rows the pass ran (the workload's S, or the nearest
    video grid's; `layout` says which).
    """

    timing: TimingStats
    param_bytes: int
    contents: str
    seq_len: int
    layout: str
    dtype: str

    @property
    def median_ms(self) -> float:
        return self.timing.median_ms

    @property
    def source(self) -> str:
        """The Extrapolation's `outside_source` line."""
        return (f"measured: the transformer without its blocks ({self.contents}; S={self.seq_len}, {self.dtype}, "
                f"eager, synthetic weights), median of {self.timing.runs}")

    def as_dict(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "timing": self.timing.as_dict(), "param_bytes": self.param_bytes,
                "contents": self.contents, "seq_len": self.seq_len, "layout": self.layout, "dtype": self.dtype,
                "source": self.source}


def outside_weight_bytes(adapter: BlockAdapter, dtype: torch.dtype) -> int:
    """The zero-block transformer's parameters in the dtypes a load gives them, counted on meta."""
    return loaded_param_bytes(adapter.build_outside(), adapter, dtype)


def measure_outside(adapter: BlockAdapter, workload: Workload, device: torch.device, dtype: torch.dtype,
                    warmup: int = 3, runs: int = 10, seed: int = 0) -> OutsideMeasurement:
    """Median ms of the zero-block transformer's forward for `workload`'s pass (under no_grad)."""
    model = synthetic_outside(adapter, device, dtype, seed=seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = adapter.make_transformer_inputs(workload, device, dtype, generator)
    with torch.no_grad():
        timing = time_region(functools.partial(model, **inputs.kwargs), device=device, warmup=warmup, runs=runs)
    measurement = OutsideMeasurement(timing, param_bytes(model), adapter.outside_contents, inputs.seq_len,
                                     inputs.layout, str(dtype).replace("torch.", ""))
    del model, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measurement

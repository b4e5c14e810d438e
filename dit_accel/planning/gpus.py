"""GPU datasheet figures (`data/gpus.json`): dense tensor rates, memory, bandwidth, links, each with its source.

The file's "conventions" say how figures were read (dense, FP32 accumulate, per direction); a null figure has
no source and every prediction that needs it says so instead of guessing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ..errors import UserError


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    match: tuple[str, ...]  # substrings of the name torch reports for it
    sm_count: int | None
    memory_gb: float
    memory_gbps: float
    bf16_tflops: float | None  # dense, FP32 accumulate
    fp8_tflops: float | None  # dense, FP32 accumulate
    accumulate: str
    host_link: str
    host_link_gbps: float  # per direction
    nvlink_gbps: float | None  # per direction
    sources: dict[str, Any]
    arch_class: str  # its class in the table's `attainable` section (geforce, hopper, ...): "class" in the file

    def tflops(self, precision: str) -> float | None:
        return self.fp8_tflops if precision == "fp8" else self.bf16_tflops


@cache
def _data() -> dict[str, Any]:
    return json.loads((resources.files(__package__) / "data" / "gpus.json").read_text())


@cache
def datasheets() -> tuple[tuple[str, ...], dict[str, Gpu]]:
    """(the file's conventions, the GPUs by key)."""
    data = _data()
    fields = Gpu.__dataclass_fields__
    gpus = {g["key"]: Gpu(**{k: tuple(v) if k == "match" else v for k, v in g.items() if k in fields},
                          arch_class=g["class"]) for g in data["gpus"]}
    return tuple(data["conventions"]), gpus


def attainable_basis() -> dict[str, dict[str, Any]]:
    """The table's `attainable` section: per class, per kind of work (attention_bf16, attention_fp8, gemm_bf16,
    gemm_fp8), the ids of the published measurements its fraction is the median of, and why (`evidence` computes
    the fractions)."""
    return _data()["attainable"]["classes"]


def gpu_named(key: str) -> Gpu:
    gpus = datasheets()[1]
    if key not in gpus:
        raise UserError(f"unknown GPU {key!r}; the datasheet table has: {', '.join(gpus)}")
    return gpus[key]


def gpu_of_device(device_name: str) -> Gpu | None:
    """The datasheet entry of the GPU torch named `device_name` (e.g. "NVIDIA H200"), None if it has none."""
    return next((g for g in datasheets()[1].values() if any(m in device_name for m in g.match)), None)

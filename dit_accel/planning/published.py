"""Published measurements of attention and GEMM on GPUs (`data/measurements.json`, each with its source and the words
it is read from), and what they say the datasheet table's GPU classes reach: `attainable`, the fraction of a class's
dense datasheet rate that kernels written for it reach, the median over the figures `gpus.json` names for it."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..errors import UserError
from .gpus import attainable_basis, datasheets

SCHEMA = "dit-accel gpu measurements 1"
KINDS = ("attention", "gemm", "attention_share")
UNITS = {"attention": ("ms", "TFLOPS"), "gemm": ("ms", "TFLOPS"), "attention_share": ("percent",)}
LOW_PRECISION = ("fp8", "int8")  # a dtype naming either runs at the datasheet's FP8 rate


@dataclass(frozen=True)
class Measurement:
    id: str
    gpu: str
    kind: str
    what_ran: str
    dtype: str
    shape: dict[str, Any]
    value: float
    unit: str
    source: str
    quote: str
    notes: str | None = None

    @property
    def precision(self) -> str:
        return "fp8" if any(word in self.dtype.lower() for word in LOW_PRECISION) else "bf16"

    @property
    def flops(self) -> float | None:
        """The work the figure is of, where the shape gives it: attention 4·B·H·Sq·Skv·D (half if causal), GEMM
        2·M·N·K; None for a figure without a full shape (a GEMM sweep's maximum)."""
        s = self.shape
        if self.kind == "attention":
            flops = 4.0 * s["batch"] * s["heads"] * s["seq_q"] * s["seq_kv"] * s["head_dim"]
            return flops / 2 if s.get("causal") else flops
        if self.kind == "gemm" and all(isinstance(s.get(axis), int) for axis in "mnk"):
            return 2.0 * s["m"] * s["n"] * s["k"]
        return None

    @property
    def tflops(self) -> float | None:
        """The published figure as TFLOP/s (a time over its shape's work where it was published as one)."""
        if self.unit == "TFLOPS":
            return self.value
        if self.unit == "ms" and self.flops:
            return self.flops / (self.value * 1e9)
        return None

    @property
    def label(self) -> str:
        s = self.shape
        if self.kind == "attention":
            return (f"B{s['batch']} H{s['heads']} {s['seq_q']}x{s['seq_kv']} D{s['head_dim']}"
                    + (" causal" if s.get("causal") else ""))
        if self.kind == "gemm":
            return f"{s['m']}x{s['n']}x{s['k']}" if self.flops else str(s.get("m"))
        return "one block"


def measurements(data: Any = None, source: str = "data/measurements.json") -> list[Measurement]:
    """The published measurements (the package's file, or `data`), checked: UserError, one line, for an entry
    without a source or a quote, of a GPU not in the datasheet table, or of an unknown kind or unit."""
    if data is None:
        data = json.loads((resources.files(__package__) / "data" / "measurements.json").read_text())
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise UserError(f"{source} is not GPU measurement data ({SCHEMA!r})")
    gpus = datasheets()[1]
    checked = []
    for index, entry in enumerate(data.get("measurements", [])):
        where = f"{source}, measurement {index} ({entry.get('gpu')}, {entry.get('kind')})"
        if not (entry.get("source") or "").strip() or not (entry.get("quote") or "").strip():
            raise UserError(f"{where} has no source or no quote: every figure names where it was published and "
                            f"quotes it; add them or drop the entry")
        if entry.get("gpu") not in gpus:
            raise UserError(f"{where}: GPU {entry.get('gpu')!r} is not in the datasheet table (gpus.json: "
                            f"{', '.join(gpus)}); add its datasheet first")
        if entry.get("kind") not in KINDS or entry.get("unit") not in UNITS.get(entry.get("kind"), ()):
            raise UserError(f"{where}: kind must be one of {', '.join(KINDS)} with a unit of "
                            f"{UNITS.get(entry.get('kind'), ('?',))}")
        checked.append(Measurement(
            entry.get("id") or f"entry {index}", entry["gpu"], entry["kind"], entry.get("what_ran") or "",
            entry.get("dtype") or "", dict(entry.get("shape") or {}), float(entry["value"]), entry["unit"],
            entry["source"], entry["quote"], entry.get("notes")))
    return checked


@functools.cache
def attainable(arch_class: str, kind: str, precision: str) -> float | None:
    """The fraction of its dense datasheet rate that work of `kind` in `precision` reaches on a GPU of `arch_class`:
    the median of the published measurements the datasheet table names as its basis, each over its GPU's rate; None
    where the table names none (the evidence is thin)."""
    ids = attainable_basis().get(arch_class, {}).get(f"{kind}_{precision}")
    if not ids:
        return None
    by_id = {m.id: m for m in measurements()}
    gpus = datasheets()[1]
    fractions = sorted(by_id[i].tflops / gpus[by_id[i].gpu].tflops(precision) for i in ids)
    middle = len(fractions) // 2
    return fractions[middle] if len(fractions) % 2 else (fractions[middle - 1] + fractions[middle]) / 2


def in_basis(m: Measurement) -> bool:
    """Whether `m` is one of the figures its GPU class's attainable fraction is made from (then it is no check of
    the model)."""
    gpu = datasheets()[1][m.gpu]
    return m.id in attainable_basis().get(gpu.arch_class, {}).get(f"{m.kind}_{m.precision}", ())



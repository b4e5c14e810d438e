"""Published measurements on other GPUs (`data/measurements.json`), and what `plan`'s model predicts for each of them
from one measured run: the check of the other-GPU rows (`dit-accel plan RUN --check`).

The model under check is the one the plan's GPU rows use (`predict.on_other_gpu`): each kind of work keeps the
fraction of the datasheet's dense tensor rate it reached in the run, so on GPU X

    rate_X = rate measured in the run x datasheet_X / datasheet_run's GPU       (bf16 or fp8, as the work's precision)

- attention in bf16/fp16: the run's baseline attention (diffusers' default, the recipe `plan` starts from);
- attention in FP8 or INT8: our kernel, as the run measured it (a recipe with FP8 attention), else none;
- GEMM in bf16/fp16: the run's linears' GEMM rate; in FP8: the run's FP8 GEMM ceiling at that same efficiency;
- attention's share of a block (`attention_share`): the baseline block scaled part by part as the plan's GPU rows
  scale it (memory-bound parts by bandwidth), attention over the whole.
A published figure and its prediction differ by the library that ran (FA2, cuDNN, FA3), the shape and the clocks
(a GeForce card's boost runs past its datasheet's), none of which the model sees: the error says how far the
datasheet model carries, per GPU and kind.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..errors import UserError
from .gpus import Gpu, attainable_basis, datasheets
from .measured import Baseline

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


@dataclass(frozen=True)
class Check:
    """One published figure beside the model's prediction from a run: both as TFLOP/s (or percent), the
    prediction's error against the figure, and why there is none where there is none."""

    measurement: Measurement
    published: float | None
    predicted: float | None
    why_none: str | None = None
    basis: bool = False  # the figure is one its class's attainable fraction is made from: no check of the model

    @property
    def error(self) -> float | None:
        """(predicted - published) / published, for times: a predicted rate above the published one is a time
        predicted below it, so the error is of the time, as the plan's rows state theirs."""
        if self.published is None or self.predicted is None:
            return None
        if self.measurement.kind == "attention_share":
            return self.predicted - self.published  # percentage points
        return self.published / self.predicted - 1.0

    def as_dict(self) -> dict[str, Any]:
        m = self.measurement
        return {"gpu": m.gpu, "kind": m.kind, "what_ran": m.what_ran, "dtype": m.dtype, "shape": m.label,
                "published": self.published, "predicted": self.predicted, "error": self.error,
                "why_none": self.why_none, "basis": self.basis, "source": m.source}


def check(baseline: Baseline, here: Gpu | None, entries: list[Measurement] | None = None) -> list[Check]:
    """Each published measurement beside what the model predicts from `baseline` (a run's baseline, on the GPU whose
    datasheet entry is `here`)."""
    from .predict import Rates, compute_scale, on_other_gpu, predict_block

    entries = measurements() if entries is None else entries
    if here is None:
        return [Check(m, m.tflops, None, f"{baseline.device_name} is not in the datasheet table") for m in entries]
    rates = Rates.of(baseline)
    stack = baseline.stacks[0]
    blocks = predict_block(stack, baseline, frozenset(), rates)
    attention = stack.categories.get("attention", {})
    run_rates = {  # TFLOP/s the run reached, by (kind, precision)
        ("attention", "bf16"): attention["flops"] / (attention["ms"] * 1e9)
        if attention.get("ms") and attention.get("flops") else None,
        ("attention", "fp8"): _fp8_attention_rate(baseline),
        ("gemm", "bf16"): rates.bf16 * rates.gemm_efficiency,
        ("gemm", "fp8"): rates.fp8 * rates.gemm_efficiency if rates.fp8 else None,
    }
    results = []
    gpus = datasheets()[1]
    for m in entries:
        there = gpus[m.gpu]
        if m.kind == "attention_share":
            if not any((c["heads"], c["q_len"], c["kv_len"], c["head_dim"]) == (
                    m.shape.get("heads"), m.shape.get("seq_q"), m.shape.get("seq_kv"), m.shape.get("head_dim"))
                       for c in stack.attention_calls):
                results.append(Check(m, m.value, None, "the run's block makes no attention call of this shape"))
                continue
            scaled, why = on_other_gpu(blocks, here, there)
            attention_here = sum(ms for part, ms in blocks.parts.items() if part.startswith("attention"))
            share = None
            if scaled:
                share = 100.0 * attention_here * compute_scale("attention", "bf16", here, there)[0] / scaled
            results.append(Check(m, m.value, share, why))
            continue
        rate = run_rates[m.kind, m.precision]
        scale, _ = compute_scale(m.kind, m.precision, here, there)
        if rate is None:
            results.append(Check(m, m.tflops, None, f"the run measured no {m.precision} {m.kind}"))
        elif scale is None:
            results.append(Check(m, m.tflops, None, f"no dense {m.precision} rate in the datasheet table"))
        else:
            results.append(Check(m, m.tflops, rate / scale, basis=in_basis(m) and here.arch_class != there.arch_class))
    return results


def _fp8_attention_rate(baseline: Baseline) -> float | None:
    """Our FP8 attention's TFLOP/s in the run: the median over its recipes with FP8 attention (None without one)."""
    rates = sorted(m.attention_tflops for m in baseline.measured if "fp8-attention" in m.knobs and m.attention_tflops)
    return rates[len(rates) // 2] if rates else None


def evidence_note(gpu_key: str, checks: list[Check]) -> str:
    """What the published measurements say of the model on one GPU: the errors of its checks, or that none checks it
    (a thin row)."""
    mine = [c for c in checks if c.measurement.gpu == gpu_key and c.error is not None and not c.basis and
            c.measurement.kind != "attention_share"]
    if not mine:
        return "no published measurement checks this GPU's row"
    worst = max(mine, key=lambda c: abs(c.error))
    return (f"{len(mine)} published measurement(s) check it: time error {min(c.error for c in mine):+.0%} to "
            f"{max(c.error for c in mine):+.0%} (worst: {worst.measurement.kind} {worst.measurement.what_ran[:40]})")



"""What `plan`'s model predicts, from one measured run, for each published measurement on other GPUs
(`published.measurements`): the check of the other-GPU rows (`dit-accel plan RUN --check`).

The model under check is the one the plan's GPU rows use (`predict.on_other_gpu`): each kind of work keeps the
fraction of the datasheet's dense tensor rate it reached in the run on GPUs of the run's class, and on a GPU of
another class that fraction times the ratio of the two classes' attainable fractions (`published.attainable`):

- attention in bf16/fp16: the run's baseline attention (diffusers' default, the recipe `plan` starts from);
- attention in FP8 or INT8: our kernel, as the run measured it (its recipes with FP8 attention), else none;
- GEMM in bf16/fp16: the run's linears' GEMM rate; in FP8: the run's FP8 GEMM ceiling at that same efficiency;
- attention's share of a block (`attention_share`): the baseline block scaled part by part as the plan's GPU rows
  scale it, attention over the whole, where the run's block makes the figure's attention call.
A published figure and its prediction also differ by the library that ran (FA2, cuDNN, FA3), the shape and the
clocks, which the model does not see; a figure its own class's fraction is made from is marked `basis`, no check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gpus import Gpu, datasheets
from .measured import Baseline
from .published import Measurement, in_basis, measurements


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
        return {"id": m.id, "gpu": m.gpu, "kind": m.kind, "what_ran": m.what_ran, "dtype": m.dtype, "shape": m.label,
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
            f"{max(c.error for c in mine):+.0%} (worst: {worst.measurement.id})")



"""Attention backends side by side on the same tensors: time, TFLOP/s, and error against a reference.

Per shape, one set of fresh q/k/v is shared by every backend: N(0,1), with 0.1% of entries scaled 50x, with
flat softmax rows, or the q/k/v a MiniMax-H3 block feeds its attention (`INPUT_KINDS`). Each row holds the
median of `runs` timed calls after `warmup` calls, every backend timed in the same interleaved rounds
(`timing.time_interleaved`; CUDA events on a GPU); `tflops` = 4*B*H*Sq*Skv*D / median time, and
`rel_rms_err` = ||out - ref|| / ||ref|| against a reference computed in float64, or in float32 on a GPU when the
score count B*H*Sq*Skv exceeds `reference.FP64_REFERENCE_MAX_SCORES` (the `reference` field says which).
Backends with separate phases (cuDNN FP8's quantization, our kernel's prep) get two more rows, "prep alone" and
"kernel alone"; the "end to end" row always includes the prep.
"""
from __future__ import annotations

import math
import re
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import UserError
from ..timing import time_interleaved
from .backends import AttentionBackend, BackendCannotServe
from .reference import REFERENCE_CHUNK_SCORES, random_qkv, reference_attention, reference_dtype, rel_rms_err

GPU_DEFAULT_SHAPE = "1x56x30272x128"  # MiniMax-H3: one packed sequence of 30272 tokens, 56 heads x 128
CPU_DEFAULT_SHAPE = "1x2x256x64"  # scaled down so a CPU run finishes in seconds
BASELINE_BACKEND = "cudnn"  # speedups are against torch SDPA's cuDNN kernel in bf16/fp16

END_TO_END, KERNEL_ALONE, PREP_ALONE = "end to end", "kernel alone", "prep alone"


@dataclass(frozen=True)
class AttentionShape:
    """q is [batch, seq_q, heads, head_dim]; k and v are [batch, seq_kv, heads, head_dim]."""

    batch: int
    heads: int
    seq_q: int
    seq_kv: int
    head_dim: int

    @classmethod
    def parse(cls, text: str) -> "AttentionShape":
        """'1x56x30272x128' (BxHxSxD) or '1x56x4096x512x128' (BxHxSqxSkvxD)."""
        fields = text.strip().lower().split("x")
        if len(fields) not in (4, 5) or not all(re.fullmatch(r"[1-9][0-9]*", f) for f in fields):
            raise UserError(f"cannot read the shape {text!r}; write BxHxSxD like 1x56x30272x128, or BxHxSqxSkvxD")
        numbers = [int(f) for f in fields]
        batch, heads, seq_q, seq_kv, head_dim = numbers if len(numbers) == 5 else numbers[:3] + numbers[2:]
        return cls(batch, heads, seq_q, seq_kv, head_dim)

    @property
    def label(self) -> str:
        seqs = f"{self.seq_q}" if self.seq_q == self.seq_kv else f"{self.seq_q}x{self.seq_kv}"
        return f"{self.batch}x{self.heads}x{seqs}x{self.head_dim}"

    @property
    def flops(self) -> int:
        """Two matmuls of 2*Sq*Skv*D each, per batch and head."""
        return 4 * self.batch * self.heads * self.seq_q * self.seq_kv * self.head_dim

    @property
    def scores(self) -> int:
        return self.batch * self.heads * self.seq_q * self.seq_kv


def parse_shapes(text: str) -> list[AttentionShape]:
    shapes = [AttentionShape.parse(part) for part in text.split(",") if part.strip()]
    if not shapes:
        raise UserError("--shapes is empty; write BxHxSxD like 1x56x30272x128 (comma-separated for several)")
    return shapes


@dataclass
class BenchRow:
    """One measured (or skipped) backend variant at one shape. Missing numbers are None.

    status: "ok", or why the backend did not run ("unavailable: ...", "cannot serve: ...",
    "out of memory", "failed: <exception>: <its first line>"). speedup_vs_baseline: the BASELINE_BACKEND
    end-to-end median_ms divided by this row's median_ms, at the same shape.
    """

    backend: str
    timed: str
    shape: str
    status: str
    median_ms: float | None = None
    min_ms: float | None = None
    runs: int | None = None
    tflops: float | None = None
    speedup_vs_baseline: float | None = None
    rel_rms_err: float | None = None
    reference: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# --- inputs and reference -----------------------------------------------------------------------

INPUT_KINDS = {
    "normal": "N(0,1)",
    "outliers": "N(0,1) + 0.1% outliers x50",
    "flat": "N(0,1), q x 0.05: flat softmax rows",
    "block": "the q/k/v a MiniMax-H3 block feeds its attention (synthetic weights)",
}


def make_inputs(shape: AttentionShape, *, dtype: torch.dtype, device: torch.device, generator: torch.Generator,
                inputs: str = "normal") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q, k, v of `shape` in `dtype`, of one of INPUT_KINDS but "block" (`reference.random_qkv`); a
    block's own q/k/v come from the caller (`bench_shape(make_qkv=...)`: bench-attention builds the block)."""
    return random_qkv(shape.batch, shape.seq_q, shape.seq_kv, shape.heads, shape.head_dim, inputs == "outliers",
                      device=device, dtype=dtype, generator=generator, flat_rows=inputs == "flat")


# --- measuring ----------------------------------------------------------------------------------

def _poison_next_allocation(like: torch.Tensor) -> None:
    """Best effort: leave a NaN-filled free block the size of the next output in the caching allocator,
    so a kernel that skips writes shows up as NaN instead of an earlier backend's correct result."""
    torch.full_like(like, float("nan"))


def _failure(exc: Exception) -> str:
    """A row's status for a backend that raised: it cannot serve the shape, ran out of memory, or failed."""
    if isinstance(exc, BackendCannotServe):
        return f"cannot serve: {exc}"
    if isinstance(exc, torch.OutOfMemoryError):
        torch.cuda.empty_cache()
        return "out of memory"
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"failed: {type(exc).__name__}: {first_line}"


def _cases(backend: AttentionBackend, q, k, v, *, phases: bool) -> dict[str, Callable[[], object]]:
    """What to time of a backend, by row: end to end, and with `phases` for a two-phase backend its prep
    alone and its kernel alone (on inputs prepared once, here)."""
    cases = {END_TO_END: lambda: backend.run(q, k, v)}
    if phases and backend.phases is not None:
        prepared = backend.phases.prepare(q, k, v)
        cases[PREP_ALONE] = lambda: backend.phases.prepare(q, k, v)
        cases[KERNEL_ALONE] = lambda: backend.phases.kernel(prepared)
    return cases


def bench_bytes(shape: AttentionShape, dtype: torch.dtype, backends: list[AttentionBackend], device: torch.device,
                timing_only: bool = False) -> int:
    """What `bench_shape` holds at its peak, about: q, k, v and two outputs in `dtype`; the reference (its
    output, k and v of one batch element in its dtype, and one chunk of scores); a backend's packed FP8
    copies; the scores `math` materializes (with their softmax, in fp32)."""
    b, h, sq, skv, d = shape.batch, shape.heads, shape.seq_q, shape.seq_kv, shape.head_dim
    element = dtype.itemsize
    need = b * h * (2 * sq + 2 * skv) * d * element + b * h * sq * d * element  # inputs, output, its poisoned twin
    if not timing_only:
        ref = reference_dtype(shape.scores, device).itemsize
        need += b * h * sq * d * ref + 2 * h * skv * d * ref + 3 * min(REFERENCE_CHUNK_SCORES, h * sq * skv) * ref
    if any(backend.phases is not None for backend in backends):
        need += b * h * (sq + 2 * skv) * d  # e4m3 copies of q, k, v
    if any(backend.name == "math" for backend in backends):
        need += 2 * b * h * sq * skv * 4
    return need


def bench_shape(shape: AttentionShape, backends: list[AttentionBackend], *, dtype: torch.dtype, device: torch.device,
                warmup: int, runs: int, seed: int, inputs: str = "normal", timing_only: bool = False,
                make_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
                ) -> list[BenchRow]:
    """Every backend on one fresh set of inputs of `shape`; unavailable ones, and ones that raise, become rows
    saying why.

    Each backend first runs once on outputs poisoned with NaN, for its error against the reference; then every
    backend's rows (end to end, and for two-phase backends prep alone and kernel alone) are timed together in
    `runs` interleaved rounds after `warmup` calls of each (`timing.time_interleaved`), so the GPU's clock
    ramp and its L2 fall on every backend alike, not on the first ones listed. timing_only: end-to-end times
    alone (no reference, no error, no phase rows), as the crossover measurement wants them. make_qkv(shape, dtype=,
    device=, seed=): the q, k, v to time instead of random ones (a block's own)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (make_qkv(shape, dtype=dtype, device=device, seed=seed) if make_qkv is not None
               else make_inputs(shape, dtype=dtype, device=device, generator=generator, inputs=inputs))
    reference = reference_name = None
    if not timing_only:
        ref_dtype = reference_dtype(shape.scores, device)
        reference = reference_attention(q, k, v, dtype=ref_dtype)
        reference_name = str(ref_dtype).removeprefix("torch.").replace("float", "fp")

    status: dict[str, str] = {}  # backend -> why it has no timed rows
    errors: dict[str, float] = {}
    cases: dict[tuple[str, str], Callable[[], object]] = {}  # (backend, timed) -> the call
    for backend in backends:
        reason = backend.unavailable_reason(device)
        if reason is not None:
            status[backend.name] = f"unavailable: {reason}"
            continue
        try:
            if reference is not None:
                _poison_next_allocation(q)
                errors[backend.name] = rel_rms_err(backend.run(q, k, v), reference)
            for timed, call in _cases(backend, q, k, v, phases=not timing_only).items():
                cases[(backend.name, timed)] = call
        except Exception as exc:  # noqa: BLE001 (a third-party backend failing must not sink the others)
            status[backend.name] = _failure(exc)

    failed: dict[tuple[str, str], str] = {}
    stats = time_interleaved(cases, device=device, warmup=warmup, rounds=runs,
                             on_error=lambda case, exc: failed.setdefault(case, _failure(exc)))
    rows: list[BenchRow] = []
    for backend in backends:
        if backend.name in status:
            rows.append(BenchRow(backend.name, END_TO_END, shape.label, status[backend.name]))
        for (name, timed), call in cases.items():
            if name != backend.name:
                continue
            if (name, timed) in failed:
                rows.append(BenchRow(name, timed, shape.label, failed[(name, timed)]))
                continue
            t = stats[(name, timed)]
            error = errors.get(name) if timed == END_TO_END else None
            rows.append(BenchRow(name, timed, shape.label, "ok", t.median_ms, t.min_ms, t.runs,
                                 tflops=shape.flops / (t.median_ms * 1e-3) / 1e12 if timed != PREP_ALONE else None,
                                 rel_rms_err=error, reference=reference_name if error is not None else None))
    _fill_speedups(rows)
    return rows


def _fill_speedups(rows: list[BenchRow]) -> None:
    """speedup_vs_baseline of every timed row that has TFLOP/s, where the baseline ran at that shape."""
    baseline = {r.shape: r.median_ms for r in rows
                if r.backend == BASELINE_BACKEND and r.timed == END_TO_END and r.status == "ok"}
    for r in rows:
        if r.tflops is not None and r.shape in baseline:
            r.speedup_vs_baseline = baseline[r.shape] / r.median_ms


# --- the bar plot -------------------------------------------------------------------------------

def plot_tflops(rows: list[BenchRow], path: Path, title: str) -> None:
    """Bars of TFLOP/s per backend variant, grouped by shape; Agg canvas, no pyplot global state."""
    from matplotlib.figure import Figure

    timed_rows = [r for r in rows if r.tflops is not None]
    shapes = list(dict.fromkeys(r.shape for r in timed_rows))
    variants = list(dict.fromkeys(_variant_label(r) for r in timed_rows))
    figure = Figure(figsize=(max(8.0, 1.2 * len(variants) * max(1, len(shapes))), 4.5), layout="constrained")
    axes = figure.subplots()
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        heights = [next((r.tflops for r in timed_rows if r.shape == s and _variant_label(r) == variant), math.nan)
                   for s in shapes]
        axes.bar([x + i * width for x in range(len(shapes))], heights, width, label=variant)
    axes.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(shapes))], shapes)
    axes.set_ylabel("TFLOP/s (4·B·H·Sq·Skv·D / median time)")
    axes.set_title(textwrap.fill(title, 90), fontsize="small")
    axes.legend(fontsize="small")
    figure.savefig(path, dpi=120)


def _variant_label(row: BenchRow) -> str:
    return row.backend if row.timed == END_TO_END else f"{row.backend} ({row.timed})"

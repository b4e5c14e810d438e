"""What a step cache saves over a video, from the blocks the plan predicts (`plan --cache`).

A cache is a recipe's `cache=` part (`patching.step_cache`) and saves one of three things:
  - whole passes (First Block Cache, MagCache, cache-dit's DBCache): a skipped pass runs the outside of the blocks
    and the blocks the cache always computes (`kept_blocks`: First Block Cache its first, the residual it compares;
    DBCache its first `fn` and last `bn`; MagCache none, it decides before the first block); which passes a
    threshold skips depends on the weights, so the fraction is given (`--cache-skip`, e.g. from a `generate` run's
    report, whose per-step counts say it);
  - the attention modules (TaylorSeer): on a predicted step every attention module of the blocks (self and cross,
    their projections, norms and RoPE: what the cache hooks) is replaced by its Taylor series in the step, from the
    outputs it kept; the schedule is fixed by the step count, so the computed steps are counted exactly. A
    predicted module still writes its output from the kept factors, and a computed one updates them: elementwise
    passes over the module's output (`TAYLOR_BYTES`), eager (diffusers runs them outside torch.compile), at the
    run's memory-bound rate;
  - the self-attention modules (Pyramid Attention Broadcast, FasterCache): inside a timestep range, all but every
    `skip`-th forward of each returns its last output (PAB) or extrapolates from its last two (FasterCache: t +
    (t - t2) w, `FASTER_BYTES`); which forwards fall in the range depends on the pipeline's timesteps, which a block
    run lacks, so the fraction skipped is given (`--cache-skip`: 1 - the work computed a `generate` run reports).
The attention modules' share of a predicted block: every attention part; of the GEMM parts, the share of the FLOPs
(per precision) of the linears inside an attention module; of the activations' quantization, their inputs' share;
of the memory-bound work, eager: the share the measured block's module ranges put inside its attention modules
(`ATTENTION_MEMORY_RANGES`), compiled: the attention modules' share of the elements the fused chains were
modelled from (`predict.fused_elements`: of the attention linears and calls over the block's). Not modelled: the
graph breaks diffusers' cache hooks make in a compiled block (their schedule is decided outside the graph) and
their host time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..patching.step_cache import CACHE_METHODS, CacheSpec, parse_cache
from .measured import Baseline, StackBaseline
from .predict import BlockPrediction, Rates, fused_elements, linear_flops, memory_ms

# The measured block's module ranges that are memory-bound work inside an attention module (adapters' ranges).
ATTENTION_MEMORY_RANGES = ("qk-norm", "attention: elementwise (RoPE, masks)", "rope", "attention: copies and joins")
# Bytes an output element of a hooked module moves (bf16 factors, diffusers' default): a prediction writes zeros
# (2), then per order multiplies (read 2, write 2) and adds (read 4, write 2); an update of order n differences
# each order against the last (subtract: read 4, write 2; divide: read 2, write 2).
TAYLOR_PREDICT_BYTES = (2, 10)  # fixed, per order (orders 0..max_order)
TAYLOR_UPDATE_BYTES = 10  # per order above 0
# FasterCache's extrapolated output, t + (t - t2) w: subtract (read 4, write 2), scale (read 2, write 2), add (read 4,
# write 2), bf16.
FASTER_BYTES = 16


@dataclass(frozen=True)
class CachePlan:
    """A cache as the plan applies it: what a skip saves ("passes", "attention" or "self-attention"), the fraction
    of it skipped over the video, and where that fraction comes from."""

    spec: CacheSpec
    saves: str
    skipped: float
    source: str

    @property
    def label(self) -> str:
        return self.spec.label


def taylorseer_computed_steps(steps: int, interval: int, warmup: int) -> int:
    """The steps diffusers' TaylorSeer computes in full (every pass of them): the first `warmup`, then every
    `interval`-th from `warmup + 1` on (step `warmup` itself is predicted: diffusers 0.42.1's schedule)."""
    return sum(1 for step in range(steps) if step < warmup or (step - warmup - 1) % interval == 0)


def cache_plan(spec: CacheSpec, steps: int, cache_skip: float | None) -> CachePlan:
    """The plan of `spec` over `steps` steps; UserError, one line, for what cannot be predicted from a block run."""
    method = CACHE_METHODS[spec.method]
    if method.name == "taylorseer":
        computed = taylorseer_computed_steps(steps, spec.value("interval"), spec.value("warmup"))
        if cache_skip is not None:
            raise UserError(f"--cache {spec.label} skips on a fixed schedule ({computed} of {steps} steps computed); "
                            "leave out --cache-skip")
        return CachePlan(spec, "attention", 1 - computed / steps,
                         f"its schedule: {computed} of {steps} steps computed")
    if method.needs_timestep:
        if cache_skip is None:
            raise UserError(f"--cache {spec.label}: {method.title} skips self-attention forwards by the pipeline's "
                            f"timesteps, which a block run does not have: give the fraction it skips with "
                            f"--cache-skip R (1 - the work computed that generate --attn RECIPE+{spec.label} reports)")
        return CachePlan(spec, "self-attention", cache_skip, f"--cache-skip {cache_skip:g}")
    if cache_skip is None:
        raise UserError(f"--cache {spec.label}: {method.title} skips passes by a threshold, on the weights: give the "
                        f"fraction it skips with --cache-skip R (a generate run with it says, per step)")
    return CachePlan(spec, "passes", cache_skip, f"--cache-skip {cache_skip:g}")


def cache_skip_measured(summary: dict[str, Any]) -> float | None:
    """The `--cache-skip` a generate run measured, from its step cache's summary (`AppliedCache.summary`): of the
    passes, for a cache that skips them (each skipped pass leaves its hooked blocks uncomputed but `kept_blocks`), or
    of the self-attention forwards (PAB, FasterCache); None for TaylorSeer (plan counts its schedule), a calibration
    run, or a summary without per-step counts."""
    spec = parse_cache(summary["cache"].removeprefix("cache="))
    method = CACHE_METHODS[spec.method]
    steps, hooked = summary["per_step"], summary["hooked_modules"]
    if method.name == "taylorseer" or spec.calibrate or not steps or not hooked:
        return None
    full = sum(step["full"] for step in steps)
    uncomputed = full - sum(step["computed"] for step in steps)
    if method.needs_timestep:
        return uncomputed / full
    skippable, passes = hooked - kept_blocks(spec), sum(step["passes"] for step in steps)
    return uncomputed / skippable / passes if skippable > 0 and passes else None


def kept_blocks(spec: CacheSpec) -> int:
    """Blocks (of the first stack) a pass-skipping cache still runs on a skipped pass."""
    if spec.method == "dbcache":
        return spec.value("fn") + spec.value("bn")
    return {"fbc": 1, "mag": 0}[spec.method]


def _calls(stack: StackBaseline, kinds: tuple[str, ...] | None) -> list[dict]:
    """The block's attention calls of `kinds` ("self", "cross"; None: all)."""
    return [call for call in stack.attention_calls if kinds is None or call["kind"] in kinds]


def _output_elements(calls: list[dict]) -> int:
    """The attention modules' output elements of `calls`: one per query row and channel."""
    return sum(c["batch"] * c["q_len"] * c["heads"] * c["head_dim"] for c in calls)


def _in_attention(linear: dict, modules: set[str]) -> bool:
    return linear["name"].split(".")[0] in modules


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def attention_module_ms(stack: StackBaseline, block: BlockPrediction, knobs: frozenset[str],
                        kinds: tuple[str, ...] | None = None) -> float:
    """The time of `block` (`stack` under `knobs`) in its attention modules of `kinds` (None: all, what TaylorSeer
    hooks; ("self",): what PAB and FasterCache hook): see the module docstring. The attention itself by the calls'
    FLOP share, the eager memory-bound ranges by their output elements' share."""
    calls = _calls(stack, kinds)
    modules = {call["module"] for call in calls}
    inside = [lin for lin in stack.linears if _in_attention(lin, modules)]
    attention_share = _share(sum(c["flops"] for c in calls), sum(c["flops"] for c in stack.attention_calls))
    fp8 = "fp8-linear" in knobs

    def flops_share(in_fp8: bool) -> float:
        chosen = [lin for lin in stack.linears if not fp8 or lin["fp8"] == in_fp8]
        return _share(linear_flops([lin for lin in chosen if lin in inside]), linear_flops(chosen))

    quantized = [lin for lin in stack.linears if lin["fp8"]]
    input_share = _share(sum(lin["rows"] * lin["in_features"] for lin in quantized if lin in inside),
                         sum(lin["rows"] * lin["in_features"] for lin in quantized))
    if "compile" in knobs:  # the share of the elements the fused chains were modelled from (predict_block)
        memory_share = _share(fused_elements(inside, calls), fused_elements(stack.linears, stack.attention_calls))
    else:
        memory_ms = sum(c["ms"] for c in stack.categories.values() if c.get("bytes_est") and c.get("ms"))
        memory_share = min(1.0, _share(sum(stack.modules_ms.get(name, 0.0) for name in ATTENTION_MEMORY_RANGES),
                                       memory_ms)) * _share(_output_elements(calls),
                                                            _output_elements(stack.attention_calls))
    total = 0.0
    for part, ms in block.parts.items():
        bound = block.bound[part]
        if part.startswith("attention") or part == "mask check":
            total += ms * attention_share
        elif part.startswith("gemm"):
            total += ms * flops_share(bound == "fp8")
        elif part == "quantize":
            total += ms * input_share
        elif bound == "memory":
            total += ms * memory_share
    return total


def taylor_ms(stack: StackBaseline, rates: Rates, skipped: float, max_order: int) -> float:
    """A block's TaylorSeer bookkeeping per pass, averaged over the video: predictions on the skipped share, factor
    updates on the computed share, over the attention modules' outputs (one element per query row and channel)."""
    elements = _output_elements(stack.attention_calls)
    fixed, per_order = TAYLOR_PREDICT_BYTES
    nbytes = elements * (skipped * (fixed + per_order * (max_order + 1))
                         + (1 - skipped) * TAYLOR_UPDATE_BYTES * max_order)
    return memory_ms(nbytes, rates)


def cached_pass_ms(baseline: Baseline, plan: CachePlan, blocks: dict[str, BlockPrediction], knobs: frozenset[str],
                   rates: Rates) -> float:
    """A pass averaged over the video under the cache `plan`, from the knob set's predicted `blocks` (by stack)."""
    full = sum(s.num_blocks * blocks[s.stack].ms for s in baseline.stacks) + baseline.outside_ms
    if plan.saves == "passes":
        first = baseline.stacks[0]
        kept = min(kept_blocks(plan.spec), first.num_blocks) * blocks[first.stack].ms
        return (1 - plan.skipped) * full + plan.skipped * (kept + baseline.outside_ms)
    if plan.saves == "self-attention":  # PAB returns the kept output; FasterCache extrapolates it
        extra = FASTER_BYTES if plan.spec.method == "faster" else 0
        saved = sum(s.num_blocks * plan.skipped * (attention_module_ms(s, blocks[s.stack], knobs, ("self",))
                                                   - memory_ms(_output_elements(_calls(s, ("self",))) * extra, rates))
                    for s in baseline.stacks)
        return full - saved
    saved = sum(s.num_blocks * (plan.skipped * attention_module_ms(s, blocks[s.stack], knobs)
                                - taylor_ms(s, rates, plan.skipped, plan.spec.value("order")))
                for s in baseline.stacks)
    return full - saved


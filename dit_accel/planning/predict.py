"""The models that turn one measured block into predictions: each knob (FP8 attention, FP8 linears,
torch.compile) and their combinations on this GPU, streaming under a memory budget, context parallelism, and other
GPUs from their datasheets (step caches on top of them: `cached.py`).

A prediction rebuilds the block from its measured kinds of work (report.json's categories), changing only what a
knob changes, each by one stated model:
  - FP8 attention: each attention call at our kernel's rate at the nearest point this GPU's crossover data
    measured (prep included): our time there times the call's FLOPs over the point's; a call keeps its measured
    time where the data measured the baseline faster (the router sends such calls there) and where our kernel
    does not serve it (head dims other than 64 and 128). A key-padding call whose kept rows the capture read
    (`kept`) runs our kernel on those rows alone, the queries a joint mask drops at the call's measured rate (SDPA
    answers them, as in the baseline), and reads its mask once (the op's check) at the best memory-bound rate.
  - FP8 linears: the FP8 linears' FLOPs at the FP8 GEMM ceiling, the rest at the bf16 one, both at the fraction
    of its ceiling this run's linears' GEMMs reached (the GEMM time nn.Linear launched, `linear_ms`; a report from
    before it was measured: all GEMM time), other matmuls as measured; plus the activations' quantization (torchao,
    per row) at the best rate a memory-bound kind reached in this run (of the kinds holding at least 5% of their
    stack's memory-bound time, `MEMORY_RATE_MIN_SHARE`): compiled, 5 bytes an element (inductor's
    amax pass reads 2, its quantize pass reads 2 and writes 1); eager, 25, an effective figure below the 33 bytes
    torchao's own ops move (docs/plan.md's FP8-linears row says why, with the verify runs that set it).
  - torch.compile: the memory-bound kinds (norms, RoPE, modulation, copies) as fused chains, which read what the
    compute-bound ops wrote and write what they read: the distinct linear inputs, the linear outputs and the
    attention's q, k, v, 2 bytes an element, and the tensors of the matmul work no nn.Linear launched
    (convolutions, bare matmuls: their ops' bytes, `not_linear_bytes_est`; none in a report from before they were
    counted), and the masks the attention calls take (a mask built in the block is written once: HunyuanVideo
    1.5's joint mask, S^2 bytes), at that same best memory-bound rate.
Kernel gaps and unclassified time are kept as measured (the host syncs of our key-padding op included: none in the
baseline).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..attention.crossover import CONSERVATIVE_RULE
from .gpus import Gpu
from .knobs import KNOB_NAMES, KNOBS
from .measured import COMPUTE_KINDS, Baseline, StackBaseline

GIB = 2**30
SERVED_HEAD_DIMS = (64, 128)
QUANTIZE_BYTES_PER_ELEMENT = {"compiled": 5, "eager": 25}  # see the module docstring
FUSED_BYTES_PER_ELEMENT = 2  # bf16
# The memory-bound rate carried over: the best of the kinds holding at least this share of their stack's
# memory-bound time (a kind of one small kernel is no rate the block's fused chains reach: docs/plan.md's
# FP8-linears row has the run that showed it).
MEMORY_RATE_MIN_SHARE = 0.05
# Our kernel's fraction of the FP8 GEMM ceiling at B1 H56 S30272 D128 on the H200 (848 TFLOP/s over 1579, set by
# commit 2417acd; docs/benchmarks.md, "Attention at the H3 shape", has the spread of our rate there), the estimate
# where a GPU has no crossover data.
ROOFLINE_FP8_ATTENTION = 0.537
FP8_ATTENTION_ESTIMATE = (f"ESTIMATED, no crossover data for this GPU: each call our router's conservative rule serves "
                          f"at {ROOFLINE_FP8_ATTENTION:.1%} of the FP8 GEMM ceiling (our kernel's at the H3 shape, "
                          f"B1 H56 S30272 D128, on the H200); measure the crossover on this GPU (any profile-block "
                          f"run) for its own rates")
KNOB_MODELS = {knob.name: knob.model for knob in KNOBS}


@dataclass(frozen=True)
class Rates:
    """This run's ceilings and the fractions of them its kinds reached (what predictions carry over)."""

    bf16: float  # TFLOP/s
    fp8: float | None
    copy: float  # GB/s
    gemm_efficiency: float
    memory_efficiency: float
    host_link: float | None = None  # GB/s from pinned host memory, measured (None: a report from before it was)

    @classmethod
    def of(cls, baseline: Baseline) -> "Rates":
        gemm_rates, memory_rates = [], []
        for stack in baseline.stacks:
            memory_ms = sum(c["ms"] for c in stack.categories.values() if c.get("bytes_est") and c["ms"])
            for kind, c in stack.categories.items():
                if kind == "gemm" and c.get("flops") and c["ms"]:
                    gemm_rates.append(c["flops"] / (_linear_ms(c) * 1e9) / baseline.ceilings["bf16"])
                elif c.get("bytes_est") and c["ms"] and c["ms"] >= MEMORY_RATE_MIN_SHARE * memory_ms:
                    memory_rates.append(c["bytes_est"] / (c["ms"] * 1e6) / baseline.ceilings["copy"])
        return cls(baseline.ceilings["bf16"], baseline.ceilings["fp8"], baseline.ceilings["copy"],
                   min(1.0, max(gemm_rates, default=1.0)), min(1.0, max(memory_rates, default=1.0)),
                   baseline.ceilings.get("host_link"))

    def host_link_there(self, here: Gpu | None, there: Gpu | None = None) -> float:
        """GB/s a streamed block moves at from host memory on `there`: the datasheet's link times the fraction of
        this GPU's datasheet link measured here (the datasheet's alone without a measurement or a datasheet here).
        On this GPU itself (`there` None, or `here`): the measurement, else its datasheet's link."""
        if there is None:
            return self.host_link if self.host_link is not None else here.host_link_gbps
        if self.host_link is None or here is None:
            return there.host_link_gbps
        return there.host_link_gbps * self.host_link / here.host_link_gbps


@dataclass
class BlockPrediction:
    """One stack's block under a set of knobs: ms per part, each part's precision or 'memory'."""

    parts: dict[str, float]
    bound: dict[str, str]  # part -> "bf16", "fp8" (tensor-core rate) or "memory" or "host" (unchanged)

    @property
    def ms(self) -> float:
        return sum(self.parts.values())


def _kept_call(call: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The call as our kernel runs it, and the fraction of its queries a joint mask drops (SDPA answers those): a
    key-padding call whose kept rows the capture read runs on them alone (its FLOPs theirs, its lengths their mean
    over the batch); any other call as it is."""
    kept = call.get("kept")
    if not kept:
        return call, 0.0
    per_pair = 4.0 * call["heads"] * call["head_dim"]
    served = {**call, "q_len": round(sum(q for q, _ in kept) / len(kept)),
              "kv_len": round(sum(k for _, k in kept) / len(kept)), "flops": sum(per_pair * q * k for q, k in kept)}
    return served, sum(call["q_len"] - q for q, _ in kept) / (call["q_len"] * len(kept))


def _fp8_attention_ms(call: dict[str, Any], baseline_backend: str, crossover,
                      fp8_ceiling: float | None) -> float | None:
    """Our kernel's time for this call (None: not served, or routed to the baseline by the crossover or, without
    data for the call's head dim, by the router's conservative rule)."""
    if call["head_dim"] not in SERVED_HEAD_DIMS:
        return None
    if crossover is not None and call["head_dim"] in crossover.head_dims:
        seq_q, seq_kv = crossover.nearest_point(call["batch"], call["heads"], call["q_len"], call["kv_len"])
        ms = crossover.ms[call["head_dim"], seq_q, seq_kv]
        base = ms.get(baseline_backend) or ms.get("cudnn")
        if base and ms.get("fp8"):
            if ms["fp8"] >= base:  # the data measured the baseline faster: the router sends the call there
                return None
            # Our kernel's rate at that point, not its speed-up over the baseline there: the block's own baseline
            # call can run far from the data's (HunyuanVideo's masked SDPA: 383 TFLOP/s against 570 unmasked).
            point_flops = 4.0 * crossover.batch * crossover.heads * seq_q * seq_kv * call["head_dim"]
            return call["flops"] / point_flops * ms["fp8"]
    if CONSERVATIVE_RULE.pick("fp8", call["batch"], call["heads"], call["q_len"], call["kv_len"], call["head_dim"],
                              None) != "fp8":
        return None
    if fp8_ceiling:
        return call["flops"] / (ROOFLINE_FP8_ATTENTION * fp8_ceiling * 1e9)
    return None


def memory_ms(nbytes: float, rates: Rates) -> float:
    """Memory-bound work of `nbytes` at this run's best memory-bound rate."""
    return nbytes / (rates.copy * rates.memory_efficiency * 1e6)


def _linear_ms(gemm: dict[str, Any]) -> float:
    """The GEMM time the block's nn.Linear layers launched (what the linears' FLOPs ran in); all of it in a report
    from before that was measured."""
    return gemm.get("linear_ms") or gemm["ms"]


def _distinct_linear_inputs(linears: list[dict[str, Any]]) -> int:
    """Elements of the linears' inputs, counting once an input several linears share (q, k and v of one
    attention module: the same parent, rows and in features)."""
    seen = {(lin["name"].rsplit(".", 1)[0], lin["rows"], lin["in_features"]) for lin in linears if lin["rows"]}
    return sum(rows * features for _, rows, features in seen)


def linear_flops(linears: list[dict[str, Any]]) -> float:
    return sum(2.0 * lin["rows"] * lin["in_features"] * lin["out_features"] for lin in linears)


def fused_elements(linears: list[dict[str, Any]], attention_calls: list[dict[str, Any]]) -> int:
    """Elements the compiled block's fused chains read and write around `linears` and `attention_calls`: the
    linears' distinct inputs and their outputs, and the calls' q, k and v."""
    return (_distinct_linear_inputs(linears) + sum(lin["rows"] * lin["out_features"] for lin in linears)
            + sum(c["batch"] * c["heads"] * c["head_dim"] * (c["q_len"] + 2 * c["kv_len"]) for c in attention_calls))


def predict_block(stack: StackBaseline, baseline: Baseline, knobs: frozenset[str], rates: Rates,
                  crossover=None) -> BlockPrediction:
    parts: dict[str, float] = {}
    bound: dict[str, str] = {}
    attention = stack.categories.get("attention", {})
    if attention.get("ms"):
        total_flops = sum(call["flops"] for call in stack.attention_calls) or 1.0
        served = unserved = 0.0
        for call in stack.attention_calls:
            call_ms = attention["ms"] * call["flops"] / total_flops
            kept, dropped = _kept_call(call)
            fp8_ms = (_fp8_attention_ms(kept, baseline.attention_backend, crossover, rates.fp8)
                      if "fp8-attention" in knobs else None)
            if fp8_ms is None:
                unserved += call_ms
            else:
                served += fp8_ms
                if call.get("kept"):  # the dropped queries by SDPA, and the op's check of the mask
                    unserved += call_ms * dropped
                    parts["mask check"] = parts.get("mask check", 0.0) + memory_ms(call["mask_bytes"], rates)
                    bound["mask check"] = "memory"
        if served:
            parts["attention (fp8)"], bound["attention (fp8)"] = served, "fp8"
        if unserved:
            parts["attention"], bound["attention"] = unserved, "bf16"
    gemm = stack.categories.get("gemm", {})
    if gemm.get("ms"):
        if "fp8-linear" in knobs and rates.fp8:
            fp8_flops = linear_flops([lin for lin in stack.linears if lin["fp8"]])
            rest = max(0.0, gemm["flops"] - fp8_flops)
            parts["gemm (fp8)"] = fp8_flops / (rates.fp8 * rates.gemm_efficiency * 1e9)
            parts["gemm"] = rest / (rates.bf16 * rates.gemm_efficiency * 1e9) + gemm["ms"] - _linear_ms(gemm)
            bound.update({"gemm (fp8)": "fp8", "gemm": "bf16"})
            elements = sum(lin["rows"] * lin["in_features"] for lin in stack.linears if lin["fp8"])
            per_element = QUANTIZE_BYTES_PER_ELEMENT["compiled" if "compile" in knobs else "eager"]
            parts["quantize"] = memory_ms(elements * per_element, rates)
            bound["quantize"] = "memory"
        else:
            parts["gemm"], bound["gemm"] = gemm["ms"], "bf16"
    memory_kinds = {kind: c for kind, c in stack.categories.items()
                    if kind not in COMPUTE_KINDS and c.get("bytes_est") is not None}
    if "compile" in knobs and memory_kinds:
        elements = fused_elements(stack.linears, stack.attention_calls)
        other_matmuls = sum(stack.categories.get(kind, {}).get("not_linear_bytes_est", 0.0)
                            for kind in ("gemm", "conv"))  # bytes
        masks = sum(call.get("mask_bytes", 0) for call in stack.attention_calls)
        parts["fused elementwise"] = memory_ms(elements * FUSED_BYTES_PER_ELEMENT + other_matmuls + masks, rates)
        bound["fused elementwise"] = "memory"
    else:
        for kind, c in memory_kinds.items():
            parts[kind], bound[kind] = c["ms"], "memory"
    for kind, c in stack.categories.items():
        if kind not in COMPUTE_KINDS and kind not in memory_kinds and c.get("ms"):  # convolutions: tensor-core work
            parts[kind], bound[kind] = c["ms"], "bf16" if kind == "conv" else "host"
    return BlockPrediction(parts, bound)


ASSUMPTIONS = (
    "this GPU's kinds of work keep the fraction of their ceiling measured here on every other GPU of its class "
    "(compute by the datasheet's dense tensor rate, memory-bound work by its bandwidth), and on a GPU of another "
    "class that fraction times the ratio of the two classes' attainable fractions where published measurements give "
    "both (gpus.json's `attainable`: GeForce cards run attention near their FP32-accumulate rate, Hopper at ~65%); "
    "kernel gaps and host time unchanged",
    "FP8 attention elsewhere: our sm_90 kernel's efficiency carried over; on sm_89 and sm_120 (RTX 4090, 5080, "
    "5090, PRO 6000, L40S) the package runs its mma.sync kernel, which the GeForce class's FP8 attention fraction "
    "stands for (the seed's kernel of the same design and FlashInfer's, on an RTX 5080)",
    "streaming: the host link measured here (a pinned copy onto the GPU), elsewhere the datasheet's link at the "
    "fraction of this GPU's datasheet link measured here",
    "memory: every block's weights, the transformer outside them and the measured block's activations; FP8 linears "
    "keep one byte a weight; 'streamed' when two blocks, the rest and the activations fit",
    "video time: the run's steps x passes per step x the pass (blocks x block time + outside the blocks)",
)


def compute_scale(kind: str, precision: str, here: Gpu, there: Gpu) -> tuple[float | None, bool]:
    """How much longer compute-bound work of `kind` (attention, or any other tensor-core work: GEMMs, convolutions)
    in `precision` takes on `there` than here: the dense datasheet rates' ratio, times the ratio of the fractions of
    those rates such work reaches on each GPU's class (`evidence.attainable`: FP32-accumulate GeForce cards run
    attention near their rate, Hopper at ~65% of its); (None, _) without a rate; the flag says the classes'
    fractions were not both known (the rates' ratio alone: thin evidence)."""
    from .published import attainable

    rate_here, rate_there = here.tflops(precision), there.tflops(precision)
    if not rate_here or not rate_there:
        return None, True
    fraction_here, fraction_there = (attainable(gpu.arch_class, kind, precision) for gpu in (here, there))
    if here.arch_class == there.arch_class or fraction_here is None or fraction_there is None:
        return rate_here / rate_there, here.arch_class != there.arch_class
    return rate_here * fraction_here / (rate_there * fraction_there), False


def thin_evidence(block: BlockPrediction, here: Gpu, there: Gpu) -> list[str]:
    """The compute-bound parts of `block` whose scaling to `there` lacks a published attainable fraction for one of
    the two GPUs' classes (`compute_scale`'s flag): their rows carry the run's efficiency over unchanged."""
    thin = []
    for part, kind in block.bound.items():
        if kind in ("bf16", "fp8"):
            work = "attention" if part.startswith("attention") else "gemm"
            if compute_scale(work, kind, here, there)[1] and f"{work} {kind}" not in thin:
                thin.append(f"{work} {kind}")
    return thin


def on_other_gpu(block: BlockPrediction, here: Gpu, there: Gpu) -> tuple[float | None, str | None]:
    """The block's ms on `there`: each compute-bound part by `compute_scale` (the efficiency measured here carried
    over, in the ratio of the two GPU classes' attainable fractions where the published measurements give both),
    each memory-bound part by the bandwidths' ratio, the rest unchanged; (None, why) when a datasheet lacks a rate
    the block needs."""
    ms = 0.0
    for part, value in block.parts.items():
        kind = block.bound[part]
        if kind in ("bf16", "fp8"):
            scale, _ = compute_scale("attention" if part.startswith("attention") else "gemm", kind, here, there)
            if scale is None:
                missing = here if not here.tflops(kind) else there
                return None, (f"no dense {kind} rate for {missing.name} in the table (none sourced, or no {kind} "
                              f"tensor cores)")
            ms += value * scale
        elif kind == "memory":
            ms += value * here.memory_gbps / there.memory_gbps
        else:
            ms += value
    return ms, None


@dataclass
class Prediction:
    """One row of the plan: a knob set on one GPU."""

    knobs: frozenset[str]
    gpu: str
    blocks_ms: dict[str, float]  # per stack
    pass_ms: float
    video_s: float
    memory_gib: float
    fits: str
    basis: str  # "measured", "predicted from this run", "datasheet-scaled"
    note: str = ""
    measured_ms: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return " + ".join(k for k in KNOB_NAMES if k in self.knobs) or "baseline"


ALL_KNOBS = frozenset(KNOB_NAMES)  # the full recipe


def knob_sets() -> list[frozenset[str]]:
    """Every combination of the knobs, the baseline first, then by how many knobs."""
    return [frozenset(c) for n in range(len(KNOB_NAMES) + 1) for c in itertools.combinations(KNOB_NAMES, n)]


def streamed_knob_sets() -> tuple[frozenset[str], ...]:
    """The knob sets the plan predicts streaming for (and `plan --verify` streams): the baseline, our FP8 attention
    alone, and every knob (the full recipe)."""
    return frozenset(), frozenset({"fp8-attention"}), ALL_KNOBS


def block_bytes(stack: StackBaseline, knobs: frozenset[str]) -> int:
    """One block's weights; FP8 linears keep one byte a weight and a float32 scale per output row instead of two
    bytes a weight (torchao's per-row FP8 weights)."""
    if "fp8-linear" not in knobs:
        return stack.param_bytes
    return stack.param_bytes - sum(lin["in_features"] * lin["out_features"] - 4 * lin["out_features"]
                                   for lin in stack.linears if lin["fp8"])


def weights_bytes(baseline: Baseline, knobs: frozenset[str]) -> int:
    """Every block and the outside weights."""
    return baseline.outside_bytes + sum(s.num_blocks * block_bytes(s, knobs) for s in baseline.stacks)


def resident_bytes(baseline: Baseline, knobs: frozenset[str]) -> int:
    """What the whole transformer holds resident: every block and the outside weights, and the measured block's
    activations."""
    return weights_bytes(baseline, knobs) + baseline.activation_bytes


def streamed_bytes(baseline: Baseline, knobs: frozenset[str]) -> int:
    """What a streamed pass holds: two of the largest block (the one running, the next one arriving), the outside
    weights and the measured block's activations."""
    return (2 * max(block_bytes(s, knobs) for s in baseline.stacks) + baseline.outside_bytes
            + baseline.activation_bytes)


def pass_ms_of(baseline: Baseline, blocks_ms: dict[str, float]) -> float:
    """A pass of the whole transformer: every stack's blocks at its block time, and the outside of the blocks."""
    return sum(stack.num_blocks * blocks_ms[stack.stack] for stack in baseline.stacks) + baseline.outside_ms


def video_seconds(baseline: Baseline, pass_ms: float) -> float:
    return baseline.steps * baseline.passes * pass_ms / 1e3


def fits(baseline: Baseline, knobs: frozenset[str], capacity_bytes: float) -> str:
    """'model' (the whole transformer resident), 'streamed' (`streamed_bytes`) or 'no'."""
    if resident_bytes(baseline, knobs) <= capacity_bytes:
        return "model"
    if streamed_bytes(baseline, knobs) <= capacity_bytes:
        return "streamed"
    return "no"


def streamed_pass_ms(baseline: Baseline, knobs: frozenset[str], blocks_ms: dict[str, float], link_gbps: float) -> float:
    """A pass with every block copied from host memory over `link_gbps` while the one before it runs: each block
    takes the longer of its compute and its copy, and the first copy is not hidden."""
    total = baseline.outside_ms
    for stack in baseline.stacks:
        copy_ms = block_bytes(stack, knobs) / (link_gbps * 1e6)
        total += stack.num_blocks * max(blocks_ms[stack.stack], copy_ms)
    return total + block_bytes(baseline.stacks[0], knobs) / (link_gbps * 1e6)


def context_parallel_pass_ms(baseline: Baseline, blocks_ms: dict[str, float], gpus: int,
                             link_gbps: float) -> tuple[float | None, str]:
    """Ulysses over `gpus` GPUs: each block's work / gpus, plus four all-to-alls per attention call (q, k, v in,
    the output back), each GPU sending (gpus - 1) / gpus of its share, over `link_gbps`, not overlapped."""
    total = baseline.outside_ms
    for stack in baseline.stacks:
        if any(call["heads"] % gpus for call in stack.attention_calls):
            return None, f"{stack.stack}'s heads do not divide by {gpus} (Ulysses shards the heads)"
        exchange_bytes = sum(4 * call["batch"] * call["q_len"] * call["heads"] * call["head_dim"] * 2
                             * (gpus - 1) / gpus**2 for call in stack.attention_calls)
        total += stack.num_blocks * (blocks_ms[stack.stack] / gpus + exchange_bytes / (link_gbps * 1e6))
    return total, ""

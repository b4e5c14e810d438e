"""One device run: the FP8 attention inside torch.compile and CUDA graphs, on real-size blocks.

    python scripts/check_compile.py --out $OUT [--seq-len 30272] [--wan-seq-len 32760]

For the MiniMax-H3 and Wan 2.1 blocks (synthetic weights, bf16) patched with `fp8`:
  - torch._dynamo.explain of the patched block: graphs and graph breaks (no graph break at
    attention);
  - torch.compile(block, fullgraph=True): compiles, output against the eager patched block, and
    every attention call still counted by the router;
  - the compiled call captured in a torch.cuda.CUDAGraph and replayed: same output;
and the per-call host cost of one attention call at a tiny shape (1000 calls in 10 interleaved rounds):
cuDNN through torch SDPA, our backend (eager: the plain function), the custom op, and the plain function;
and the GPU time of the plain prep down its one- and two-launch paths (CUDA-graph replays, B1 D128,
S 128-2048; the prologue has only the two).
Writes $OUT/check_compile.json and prints it.
"""
import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from dit_accel.adapters import adapter_for_preset
from dit_accel.attention.backends import get_backend
from dit_accel.attention.reference import random_qkv, rel_rms_err
from dit_accel.attention.routing import use_attention_backend
from dit_accel.loading.block import synthetic_block


def block_case(family: str, seq_len: int) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16
    adapter = adapter_for_preset(family)
    block = synthetic_block(adapter, 0, device, dtype, seed=0).block
    inputs = adapter.make_inputs(adapter.workload_from_seq_len(seq_len, 1), device, dtype,
                                 torch.Generator(device=device).manual_seed(0))
    report = {"family": family, "seq_len": seq_len}
    torch._dynamo.reset()
    with torch.no_grad(), use_attention_backend(block, "fp8") as routed:
        eager = block(**inputs).clone()
        explanation = torch._dynamo.explain(block)(**inputs)
        report["explain"] = {"graphs": explanation.graph_count, "graph_breaks": explanation.graph_break_count,
                             "break_reasons": [str(b.reason)[:200] for b in explanation.break_reasons]}
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)
        start = time.perf_counter()
        out = compiled(**inputs).clone()
        torch.cuda.synchronize()
        report["fullgraph_compile_s"] = round(time.perf_counter() - start, 1)
        report["compiled_vs_eager_rel_l2"] = rel_rms_err(out, eager)
        served_before = routed.served_calls
        for _ in range(3):
            compiled(**inputs)
        torch.cuda.synchronize()
        report["served_per_compiled_call"] = (routed.served_calls - served_before) / 3
        report["fallback_calls"] = dict(routed.fallback_calls)
        # A CUDA graph of the compiled call (side stream warm-up, then capture, then replay).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(**inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = compiled(**inputs)
        graph.replay()
        torch.cuda.synchronize()
        report["cuda_graph_replay_vs_eager_rel_l2"] = rel_rms_err(static_out, eager)
        report["cuda_graph_replay_vs_compiled_max_abs"] = float((static_out - out).abs().max())
    return report


@contextlib.contextmanager
def prep_path(one_launch: bool):
    """Every plain prep_triton call in the body takes the one-launch (or the two-launch) path, whatever
    its length (`prep_triton_kernels.SINGLE_LAUNCH_MAX_S`, restored after)."""
    from dit_accel.kernels.fp8_attention import prep_triton_kernels as tk

    threshold, tk.SINGLE_LAUNCH_MAX_S = tk.SINGLE_LAUNCH_MAX_S, 1 << 30 if one_launch else 0
    try:
        yield
    finally:
        tk.SINGLE_LAUNCH_MAX_S = threshold


def per_call_cost(calls: int = 1000) -> dict:
    """Host-bound cost of one call at a tiny shape (`per_call_rounds`)."""
    q, k, v = random_qkv(1, 128, 128, 1, 128, device="cuda")
    from dit_accel.kernels.fp8_attention import fp8_attention
    from dit_accel.kernels.fp8_attention.interface import fp8_attention_packed
    from dit_accel.kernels.fp8_attention.op import FP8_ATTENTION
    from dit_accel.kernels.fp8_attention.prep import prep_triton
    from dit_accel.kernels.fp8_attention.support import can_implement

    packed = prep_triton(q, k, v)

    def two_launch_prep():  # the path above SINGLE_LAUNCH_MAX_S, at this shape: what the one launch saves
        with prep_path(one_launch=False):
            return prep_triton(q, k, v)

    candidates = {
        "cudnn (torch SDPA)": lambda: get_backend("cudnn").run(q, k, v),
        "fp8 backend (eager: the function)": lambda: get_backend("fp8").run(q, k, v),
        "fp8 op (torch.ops, what compiled graphs call)": lambda: FP8_ATTENTION(q, k, v, None, "auto"),
        "fp8_attention function": lambda: fp8_attention(q, k, v),
        "  of which checks (can_implement)": lambda: can_implement(q, k, v),
        "  of which prep (1 Triton launch, compiled kernel launched directly)": lambda: prep_triton(q, k, v),
        "  prep forced to 2 launches + zeroed amax": two_launch_prep,
        "  of which kernel launch (TVM-FFI)": lambda: fp8_attention_packed(packed),
    }
    return per_call_rounds(candidates, torch.cuda.synchronize, calls=calls)


def per_call_rounds(candidates: dict, sync, *, calls: int = 1000, rounds: int = 10, clock=time.perf_counter) -> dict:
    """Host cost per call of each candidate, in us: `rounds` interleaved rounds, each running every candidate
    calls / rounds times back to back and then `sync`; per candidate the median round, with the fastest and
    slowest. Interleaved, a drift of the host (frequency, another process) falls on every candidate alike;
    timed one after the other, it decided the comparisons (a +-30% spread across runs in the session before).
    """
    per_round = max(1, calls // rounds)
    for fn in candidates.values():  # warm-up: compiles, caches
        for _ in range(20):
            fn()
    sync()
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = clock()
            for _ in range(per_round):
                fn()
            sync()
            samples[name].append((clock() - start) / per_round * 1e6)
    return {name: {"median_us": round(sorted(us)[len(us) // 2], 1), "min_us": round(min(us), 1),
                   "max_us": round(max(us), 1)} for name, us in samples.items()}


def prep_device_time(calls: int = 20, replays: int = 5) -> dict:
    """GPU time of the plain prep per call, one launch against two (SINGLE_LAUNCH_MAX_S forced either
    way), from CUDA-graph replays of `calls` back-to-back preps (no host cost in it): what the one-launch
    path's serial row loop costs from 128 to 2048 rows."""
    from dit_accel.kernels.fp8_attention.prep import prep_triton

    result = {}
    for heads, seq in ((1, 128), (56, 128), (56, 512), (56, 1024), (56, 2048)):
        q, k, v = random_qkv(1, seq, seq, heads, 128, device="cuda")
        row = {}
        for launches in (1, 2):
            with prep_path(one_launch=launches == 1):
                prep_triton(q, k, v)  # compiles outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(calls):
                        prep_triton(q, k, v)
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                row[f"{launches} launch{'es' if launches > 1 else ''}"] = round(
                    start.elapsed_time(end) * 1e3 / (replays * calls), 1)  # us per prep
        result[f"B1 H{heads} S{seq} D128"] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=30272)
    parser.add_argument("--wan-seq-len", type=int, default=32760)
    parser.add_argument("--per-call-only", action="store_true",
                        help="only the per-call host cost and the prep's GPU time")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    families = () if args.per_call_only else (("minimax-h3", args.seq_len), ("wan", args.wan_seq_len))
    for family, seq_len in families:
        try:
            report[family] = block_case(family, seq_len)
        except Exception as exc:  # one family failing must not hide the other
            report[family] = {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        print(json.dumps({family: report[family]}, indent=1), flush=True)
    report["per_call_us"] = per_call_cost()
    report["prep_gpu_us"] = prep_device_time()
    (args.out / "check_compile.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({key: report[key] for key in ("per_call_us", "prep_gpu_us")}, indent=1))


if __name__ == "__main__":
    main()

"""Where the start-up of a compiled recipe goes, phase by phase, one fresh process per case.

    python scripts/compile_startup.py --suite DIR [--cases h3-torchao,h3-ours]   # the cases below (default:
                                                    # all), each in its own process; a line each, DIR/suite.json
    python scripts/compile_startup.py --out FILE.json [--model minimax-h3] [--seq-len N]
        [--recipe fp8+fp8-linear+compile] [--first-use] [--cprofile FILE.prof]     # one case

The suite, for the MiniMax-H3 block (S 30272) and the Wan 2.1 block at 480p (S 32760): the torch.compile +
torchao recipe (cuDNN attention) on empty caches; ours on empty caches; ours again on the caches the first
run left (a user's next run). Each block's first call there holds all a user's first compiled call pays.

One case:
In order, each timed with a wall clock (and the GPU synchronised):
  - the imports: torch, diffusers, tvm_ffi (CuTe DSL's calling convention), cutlass.cute, our op;
  - with --first-use, our FP8 attention's first eager call at a tiny shape (1x1x128x128, the head dim of the
    block), then a second: the one-time cost of the kernel's first use in a process (CuTe DSL compile of the
    kernel, Triton compile of the prep, whatever the first launch loads), apart from torch.compile;
  - the block (synthetic weights) and its inputs captured from the model's own forward;
  - the recipe applied and the block's first call (tracing, inductor, autotuning, the run), then a second,
    with torch._dynamo's own phase times and counters.
Run it in a fresh process per case: the first-use costs are per process. Point TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR, TVM_FFI_CACHE_DIR and CUTE_DSL_CACHE_DIR at an empty folder for a first run on a fresh machine,
and run again with the same folders for a user's next run. --cprofile writes the Python profile of the
first-use and first-call phases (read it with `python -m pstats`); the JSON gets its 40 costliest functions.
"""
import argparse
import cProfile
import contextlib
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - _T0


def _timed(phases: dict, name: str, fn, sync: bool = True):
    start = time.perf_counter()
    result = fn()
    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    phases[name] = round(time.perf_counter() - start, 3)
    return result


def _import_phases(phases: dict) -> None:
    phases["import torch"] = round(IMPORT_TORCH_S, 3)
    _timed(phases, "import diffusers", lambda: __import__("diffusers"), sync=False)
    had_exchange_api = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    _timed(phases, "import tvm_ffi", lambda: __import__("tvm_ffi"), sync=False)
    phases["torch had the DLPack exchange API before tvm_ffi"] = had_exchange_api
    _timed(phases, "import cutlass.cute", lambda: __import__("cutlass.cute"), sync=False)
    _timed(phases, "import our op", lambda: __import__("dit_accel.kernels.fp8_attention.op"), sync=False)


def _first_use(phases: dict, head_dim: int) -> None:
    from dit_accel.kernels.fp8_attention import fp8_attention

    q, k, v = (torch.randn(1, 128, 1, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _timed(phases, "our attention: first eager call (tiny shape)", lambda: fp8_attention(q, k, v))
    _timed(phases, "our attention: second eager call", lambda: fp8_attention(q, k, v))


def _dynamo_phases() -> dict:
    """torch._dynamo's own timers, summed over the frames compiled (seconds, those above 0.05 s)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv")
    totals = {name: sum(float(x) for x in str(value).split(",") if x.strip()) for name, value in zip(names, values)}
    return {name: round(total, 2) for name, total in totals.items() if total > 0.05}


SUITE = (  # (case, model, seq_len, recipe, caches): what a user's first and next compiled run pay
    ("h3-torchao", "minimax-h3", 30272, "cudnn+fp8-linear+compile", "h3-torchao"),
    ("h3-ours", "minimax-h3", 30272, "fp8+prologue+fp8-linear+compile", "h3-ours"),
    ("h3-ours-next-run", "minimax-h3", 30272, "fp8+prologue+fp8-linear+compile", "h3-ours"),
    ("wan-torchao", "wan", 32760, "cudnn+fp8-linear+compile", "wan-torchao"),
    ("wan-ours", "wan", 32760, "fp8+fp8-linear+compile", "wan-ours"),
    ("wan-ours-next-run", "wan", 32760, "fp8+fp8-linear+compile", "wan-ours"),
)
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR", "CUTE_DSL_CACHE_DIR")


def run_suite(folder: Path, cases: list[str]) -> None:
    """The SUITE cases named, each in its own process, with its caches under folder/caches; a line each."""
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for case, model, seq_len, recipe, caches in SUITE:
        if case not in cases:
            continue
        env = {**os.environ, **{name: str(folder / "caches" / caches / name.lower()) for name in CACHE_VARIABLES}}
        command = [sys.executable, __file__, "--out", str(folder / f"{case}.json"), "--model", model,
                   "--seq-len", str(seq_len), "--recipe", recipe]
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        (folder / f"{case}.log").write_text(done.stdout + done.stderr)
        result = json.loads((folder / f"{case}.json").read_text()) if done.returncode == 0 else {}
        results.append({"case": case, "exit": done.returncode, "process_s": round(time.perf_counter() - start, 1),
                        **result})
        phases = result.get("phases_s", {})
        print(f"{case:18} exit {done.returncode}  process {results[-1]['process_s']:6.1f} s  "
              + "  ".join(f"{name}: {value}" for name, value in phases.items() if not isinstance(value, bool)),
              flush=True)
    (folder / "suite.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", type=Path, default=None, help="run every case of the suite into this folder")
    parser.add_argument("--cases", default=",".join(case[0] for case in SUITE), help="the suite's cases to run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="minimax-h3")
    parser.add_argument("--seq-len", type=int, default=None, help="the family's default workload when not given")
    parser.add_argument("--recipe", default="fp8+fp8-linear+compile")
    parser.add_argument("--first-use", action="store_true", help="time our kernel's first eager use before the block")
    parser.add_argument("--cprofile", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a check of this script without a GPU")
    args = parser.parse_args()
    if args.suite is not None:
        unknown = set(args.cases.split(",")) - {case[0] for case in SUITE}
        if unknown:
            parser.error(f"unknown case(s) {', '.join(sorted(unknown))}")
        return run_suite(args.suite, args.cases.split(","))
    if args.out is None:
        parser.error("--out or --suite is needed")

    phases: dict = {}
    _import_phases(phases)
    from torch._dynamo.utils import counters

    from dit_accel.adapters import adapter_for_preset
    from dit_accel.loading.block import synthetic_block
    from dit_accel.patching.apply import apply_recipe
    from dit_accel.patching.recipe import parse_recipe

    device, dtype = torch.device(args.device), torch.bfloat16
    adapter = adapter_for_preset(args.model)
    workload = adapter.default_workload(1) if args.seq_len is None else adapter.workload_from_seq_len(args.seq_len, 1)
    recipe = parse_recipe(args.recipe)
    profiler = cProfile.Profile() if args.cprofile else None
    profiling = profiler if profiler is not None else contextlib.nullcontext()
    with torch.no_grad():
        if args.first_use:
            with profiling:
                _first_use(phases, adapter.config.get("attention_head_dim", 128))
        inputs = _timed(phases, "block inputs (captured)", lambda: adapter.make_inputs(
            workload, device, dtype, torch.Generator(device=device).manual_seed(0)))
        block = _timed(phases, "block built", lambda: synthetic_block(adapter, 0, device, dtype, seed=0).block)
        with apply_recipe(block, recipe, adapter=adapter):
            with profiling:
                _timed(phases, "block: first call", lambda: block(**inputs))
            _timed(phases, "block: second call", lambda: block(**inputs))
            dynamo = _dynamo_phases(), counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    report = {"model": args.model, "seq_len": workload.seq_len, "recipe": args.recipe, "phases_s": phases,
              "dynamo_phases_s": dynamo[0], "graphs": dynamo[1], "graph_breaks": dynamo[2],
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if profiler is not None:
        profiler.dump_stats(args.cprofile)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        report["cprofile_top"] = text.getvalue().splitlines()
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({key: report[key] for key in report if key != "cprofile_top"}, indent=1))


if __name__ == "__main__":
    main()

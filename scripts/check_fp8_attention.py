"""One device run for fp8_attention as it runs on this GPU: compile report of its plans, timings at the H3
shape (B1 H56 S30272 D128) beside torch SDPA (cuDNN / flash bf16), the cases timed in interleaved rounds.

    python scripts/check_fp8_attention.py --out $OUT [--budget-s 240]

Needs torch (CUDA), triton and nvidia-cutlass-dsl, and this repo installed (`pip install -e .`: the kernels
import as `dit_accel.kernels`). Correctness is the GPU tests' (`pytest tests/kernels -m gpu`; the matrix of
S 1-30272, D 64/128, B 1/2, cross-attention, outliers: tests/kernels/test_fp8_matrix_gpu.py).
Writes $OUT/check_fp8_attention.json and prints a table last; a failing case is reported on its own, cases
past the time budget as skipped. Also the helpers check_fp8_sm90 shares (ptxas report, timing, SDPA cases).
"""
import argparse
import json
import os
import subprocess
import time
from typing import Callable


def ptx_text(compiled) -> str:
    """The PTX of a compiled CuTe DSL function (CUTE_DSL_KEEP=ptx): its text, or the file it names."""
    ptx = compiled.__ptx__ or ""
    if "\n" not in ptx and os.path.isfile(ptx):
        with open(ptx) as f:
            return f.read()
    return ptx


def ptxas_report(ptx: str, arch: str, work_dir: str) -> list[str] | str:
    """ptxas -v's register and spill lines for this PTX (or the end of its output where it has none). The DSL
    may write PTX ISA 9.4; ptxas 13.0 reads 9.0 and the kernels use nothing newer."""
    path = os.path.join(work_dir, "ptxas_input.ptx.txt")
    with open(path, "w") as f:
        f.write(ptx.replace(".version 9.4", ".version 9.0", 1))
    result = subprocess.run(["ptxas", f"-arch={arch}", "-v", path, "-o", os.devnull],
                            capture_output=True, text=True, timeout=180)
    lines = [line.strip()[-120:] for line in result.stderr.splitlines() if "registers" in line or "spill" in line]
    return lines or result.stderr[-500:]


def timing_entries(cases: dict[str, Callable[[], object]], shape: str, flop: int, *, budget_s: float | None,
                   rounds: int, warmup: int, no_flop_rate: tuple[str, ...], device=None,
                   clock=time.perf_counter) -> list[dict]:
    """Report entries of the cases timed in interleaved rounds (`dit_accel.timing.time_interleaved`), one per
    case in order: what, shape, median ms, runs and TFLOP/s (but for the cases `no_flop_rate` names); a case
    that raised gets its error instead, one that found the budget spent "skipped"."""
    import torch

    from dit_accel.timing import time_interleaved

    errors = {}
    stats = time_interleaved(cases, device=torch.device("cuda") if device is None else device, warmup=warmup,
                             rounds=rounds, budget_s=budget_s, clock=clock,
                             on_error=lambda name, e: errors.__setitem__(name, f"{type(e).__name__}: {e}"[:500]))
    entries = []
    for name in cases:
        entry = {"what": name, "shape": shape}
        if name in errors:
            entry["error"] = errors[name]
        elif name not in stats:
            entry["skipped"] = "time budget"
        else:
            entry["ms"] = round(stats[name].median_ms, 3)
            entry["runs"] = stats[name].runs
            if name not in no_flop_rate:
                entry["tflops"] = round(flop / entry["ms"] / 1e9, 1)
        entries.append(entry)
    return entries


def sdpa_cases(q, k, v, label: str) -> dict[str, Callable[[], object]]:
    """Timing cases of torch SDPA on q, k, v [B, S, H, D] with the cuDNN and the flash backend, named
    f"{label} cuDNN bf16" and f"{label} flash bf16"."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
        return run

    return {f"{label} cuDNN bf16": sdpa(SDPBackend.CUDNN_ATTENTION),
            f"{label} flash bf16": sdpa(SDPBackend.FLASH_ATTENTION)}


def write_report(report: dict, out_dir: str, name: str, started: float) -> None:
    """Stamps report["wall_s"] (seconds since `started`) and writes it to out_dir/name."""
    report["wall_s"] = round(time.time() - started, 1)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(report, f, indent=1)


def print_timing(report: dict) -> None:
    """The timing entries as a table, then the run's wall time."""
    for t in report["timing"]:
        print(f"{t.get('shape', ''):<20} {t.get('what', '?'):<26} {t.get('ms', '-'):>9} ms "
              f"{t.get('tflops', '-'):>7} TFLOP/s {t.get('error', t.get('skipped', ''))}")
    print(f"wall {report['wall_s']} s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=240.0)
    return parser.parse_args(argv)


def compile_report(report: dict, ptx_dir: str) -> None:
    """fp8_attention's plans at the H3 shape (S = 30272) for both head dims: compile time and ptxas report."""
    import torch

    from dit_accel.kernels.fp8_attention import interface

    capability = torch.cuda.get_device_capability()
    arch = "sm_%d%d" % capability + ("a" if capability == (9, 0) else "")
    for d in (64, 128):
        entry = {"head_dim": d}
        try:
            t0 = time.time()
            compiled = interface._plan(d, torch.bfloat16, True, torch.device("cuda"), seqlen_kv=30272)
            entry["compile_s"] = round(time.time() - t0, 2)
            entry["ptxas"] = ptxas_report(ptx_text(compiled), arch, ptx_dir)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        report["compile"].append(entry)


def time_h3_shape(report: dict, budget_s: float) -> None:
    """Prep alone, kernel alone, prep + kernel and torch SDPA at B1 H56 S30272 D128, 20 interleaved rounds."""
    import torch

    import dit_accel.kernels.fp8_attention as fa
    from dit_accel.attention.reference import random_qkv

    b, h, s, d = 1, 56, 30272, 128
    try:
        q, k, v = random_qkv(b, s, s, h, d, False, seed=123)
        packed = fa.prep_fp8_attention(q, k, v)
        out = torch.empty_like(q)
        cases = {
            "fp8 prep alone": lambda: fa.prep_fp8_attention(q, k, v),
            "fp8 kernel alone": lambda: fa.fp8_attention_packed(packed, out=out),
            "fp8 prep + kernel": lambda: fa.fp8_attention(q, k, v),
            **sdpa_cases(q, k, v, "torch SDPA"),
        }
        report["timing"] += timing_entries(cases, f"B{b} H{h} S{s} D{d}", 4 * b * h * s * s * d, budget_s=budget_s,
                                           rounds=20, warmup=3, no_flop_rate=("fp8 prep alone",))
    except Exception as e:  # noqa: BLE001
        report["timing"].append({"error": f"{type(e).__name__}: {e}"[:1000]})


def keep_ptx_in(out_dir: str) -> str:
    """Make `out_dir` and its `ptx/`, where CuTe DSL keeps each compiled kernel's PTX; returns `ptx/`. Call it
    before cutlass is imported."""
    ptx_dir = os.path.join(out_dir, "ptx")
    os.makedirs(ptx_dir, exist_ok=True)
    os.environ.setdefault("CUTE_DSL_KEEP", "ptx")
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", ptx_dir)
    return ptx_dir


def main(argv=None):
    args = parse_args(argv)
    ptx_dir = keep_ptx_in(args.out)
    started = time.time()

    import torch

    report = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
              "torch": torch.__version__, "compile": [], "timing": []}
    compile_report(report, ptx_dir)
    time_h3_shape(report, budget_s=args.budget_s * 0.9 - (time.time() - started))
    write_report(report, args.out, "check_fp8_attention.json", started)
    print("\ncompile:", json.dumps(report["compile"]))
    print()
    print_timing(report)


if __name__ == "__main__":
    main()

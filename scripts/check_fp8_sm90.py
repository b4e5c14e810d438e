"""One device run for the Hopper FP8 attention kernel (kernel_sm90) in named configurations: compile + ptxas
report, timings beside v1 and torch SDPA (cuDNN / flash bf16), the cases timed in interleaved rounds.

    python scripts/check_fp8_sm90.py --out $OUT [--budget-s 300] [--variants default,128x2,128x2s] \
        [--head-dim 128] [--seq-lens 4096,30272] [--no-v1]
    python scripts/check_fp8_sm90.py --out $OUT --sanitize   # tiny shapes, for compute-sanitizer
    python scripts/check_fp8_sm90.py --out $OUT --profile    # B1 H56 S8192 D128, each variant once, for ncu

A variant is "default", what fp8_attention runs at each head dim and key length (`tuning.sm90_config`), or a
configuration's label "NxS[s][p[Q]][r][i][eK][wW]" (`config.Sm90Config.label`, "p" = one persistent CTA per SM):
tile_n N keys per block, S stages; "s" single-level P.V; "p" persistent CTAs ("p2": two Q stages); "r" the
tensor core's row sums; "i" INT8 Q/K (prepped as such); "eK" K n8 tiles of exp2s per row on the FMA pipe; "wW"
W consumer warpgroups.
--head-dim picks the compile report's and the timing's head dim, --seq-lens the timing's sequence lengths (B1
H56, self-attention). Correctness is the GPU tests' (`pytest tests/kernels -m gpu`). docs/kernels.md lists the
variants measured. Writes $OUT/check_fp8_sm90.json, prints a table last.
"""
import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling script's helpers
from check_fp8_attention import (  # noqa: E402
    keep_ptx_in, print_timing, ptx_text, ptxas_report, sdpa_cases, timing_entries, write_report)

DEFAULT = "default"  # the variant fp8_attention runs, resolved per head dim and key length (`resolve`)
COMPILE_REPORT_KEYS = (4096, 30272)  # key lengths whose "default" the compile report builds (both D128 plans)


def parse_variants(text: str, sm_count: int) -> list:
    """The comma-separated variants: DEFAULT or a `Sm90Config` (its label parsed, "p" as sm_count CTAs); raises
    ValueError for a label outside the grammar or a configuration the kernel refuses."""
    from dit_accel.kernels.fp8_attention.config import Sm90Config

    return [name if name == DEFAULT else Sm90Config.parse(name, sm_count) for name in text.split(",")]


def resolve(variant, head_dim: int, sm_count: int, seqlen_kv: int):
    """The configuration a variant is at this head dim and key length."""
    from dit_accel.kernels.fp8_attention.tuning import sm90_config

    return sm90_config(head_dim, sm_count, seqlen_kv) if variant == DEFAULT else variant


def variant_name(variant, head_dim: int | None = None, sm_count: int = 0, seqlen_kv: int = 0) -> str:
    """A variant's label; "default" with what it resolves to where the head dim is given ("default=128x2pr")."""
    if variant != DEFAULT:
        return variant.label()
    return DEFAULT if head_dim is None else f"{DEFAULT}={resolve(variant, head_dim, sm_count, seqlen_kv).label()}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--variants", default="default,128x2,128x2s,192x2s")
    parser.add_argument("--sanitize", action="store_true", help="tiny shapes, the first variant (compute-sanitizer)")
    parser.add_argument("--profile", action="store_true", help="B1 H56 S8192 D128, each variant once (for ncu)")
    parser.add_argument("--no-v1", action="store_true", help="time no v1 (mma.sync) kernel beside the variants")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    parser.add_argument("--seq-lens", default="30272")
    args = parser.parse_args(argv)
    try:
        parse_variants(args.variants, sm_count=1)  # the grammar and the configurations, before any GPU work
    except ValueError as e:
        parser.error(f"--variants ({DEFAULT!r} or configuration labels): {e}")
    return args


class Kernels:
    """The variants' compiled kernels, each compiled once (bf16 output), with a compile report entry each:
    head dim, LSE, label and configuration, compile time and, unless `ptxas` is off, ptxas's register and
    spill lines."""

    def __init__(self, sm_count: int, report: dict, ptx_dir: str, ptxas: bool):
        self.sm_count, self.report, self.ptx_dir, self.ptxas = sm_count, report, ptx_dir, ptxas
        self.compiled = {}

    def get(self, head_dim: int, with_lse: bool, variant, seqlen_kv: int):
        import torch

        from dit_accel.kernels.fp8_attention.compile import compile_fp8_attention

        config = resolve(variant, head_dim, self.sm_count, seqlen_kv)
        key = (head_dim, with_lse, config)
        if key not in self.compiled:
            t0 = time.time()
            self.compiled[key] = compile_fp8_attention(head_dim, torch.bfloat16, with_lse, kernel="sm90", config=config)
            entry = {"head_dim": head_dim, "lse": with_lse, "variant": config.label(),
                     "config": dataclasses.asdict(config), "compile_s": round(time.time() - t0, 2)}
            if self.ptxas:
                entry["ptxas"] = ptxas_report(ptx_text(self.compiled[key]), "sm_90a", self.ptx_dir)
            self.report["compile"].append(entry)
        return self.compiled[key]

    def run(self, packed, out, lse, variant) -> None:
        """The variant on prep's output (lse None: compiled without LSE)."""
        kernel = self.get(packed.head_dim, lse is not None, variant, packed.seqlen_kv)
        kernel(*packed.kernel_inputs(), out, lse, None, packed.head_dim ** -0.5, packed.seqlen_kv)


def sanitize(kernels: Kernels, variant) -> None:
    """Both head dims, B2 Sq300 Skv200 H2 with outliers, the variant once, for compute-sanitizer."""
    import torch

    from dit_accel.attention.reference import random_qkv, reference_attention, rel_rms_err
    from dit_accel.kernels.fp8_attention.prep import prep_triton

    for d in (64, 128):
        q, k, v = random_qkv(2, 300, 200, 2, d, True, d)
        out = torch.full_like(q, float("nan"))
        packed = prep_triton(q, k, v, qk_int8=resolve(variant, d, kernels.sm_count, 200).qk_int8)
        kernels.run(packed, out, torch.empty(2, 2, 300, device="cuda"), variant)
        torch.cuda.synchronize()
        print(f"sanitize D{d}: finite={bool(torch.isfinite(out).all())} "
              f"err_vs_fp64={100 * rel_rms_err(out, reference_attention(q, k, v)):.3f}%")


def profile(kernels: Kernels, variants: list) -> None:
    """B1 H56 S8192 D128, each variant once (for ncu)."""
    import torch

    from dit_accel.attention.reference import random_qkv
    from dit_accel.kernels.fp8_attention.prep import prep_triton

    q, k, v = random_qkv(1, 8192, 8192, 56, 128, False, 0)
    out = torch.empty_like(q)
    for variant in variants:
        packed = prep_triton(q, k, v, qk_int8=resolve(variant, 128, kernels.sm_count, 8192).qk_int8)
        kernels.run(packed, out, None, variant)
    torch.cuda.synchronize()


def compile_report(kernels: Kernels, variants: list, head_dim: int) -> None:
    """Every variant at the head dim, with LSE ("default" at both COMPILE_REPORT_KEYS); a failure is reported
    for its variant alone."""
    for variant in variants:
        for seqlen_kv in COMPILE_REPORT_KEYS if variant == DEFAULT else COMPILE_REPORT_KEYS[:1]:
            try:
                kernels.get(head_dim, True, variant, seqlen_kv)
            except Exception as e:  # noqa: BLE001
                name = variant_name(variant, head_dim, kernels.sm_count, seqlen_kv)
                kernels.report["compile"].append({"head_dim": head_dim, "lse": True, "variant": name,
                                                  "error": f"{type(e).__name__}: {e}"[:3000]})


def time_variants(kernels: Kernels, variants: list, args: argparse.Namespace, deadline: float) -> None:
    """At each --seq-lens length (B1 H56, --head-dim): prep alone, each variant's kernel alone and with prep,
    v1 and torch SDPA, 7 interleaved rounds; the budget shared out until `deadline` (time.time())."""
    import torch

    from dit_accel.attention.reference import random_qkv
    from dit_accel.kernels.fp8_attention import interface
    from dit_accel.kernels.fp8_attention.prep import prep_triton

    for s in map(int, args.seq_lens.split(",")):
        b, h, d = 1, 56, args.head_dim
        try:
            q, k, v = random_qkv(b, s, s, h, d, False, seed=123)
            named = [(variant, variant_name(variant, d, kernels.sm_count, s),
                      resolve(variant, d, kernels.sm_count, s).qk_int8) for variant in variants]
            # e4m3 (v1 and the e4m3 variants) and, where a variant takes it, INT8 Q/K
            packed = {int8: prep_triton(q, k, v, qk_int8=int8) for int8 in {False, *(int8 for *_, int8 in named)}}
            out = torch.empty_like(q)
            cases = {"prep alone": lambda: prep_triton(q, k, v)}
            if True in packed:
                cases["INT8 Q/K prep alone"] = lambda: prep_triton(q, k, v, qk_int8=True)
            for variant, name, int8 in named:
                cases[f"sm90 {name} kernel"] = lambda variant=variant, int8=int8: kernels.run(packed[int8], out, None,
                                                                                              variant)
                cases[f"sm90 {name} prep+kernel"] = lambda variant=variant, int8=int8: kernels.run(
                    prep_triton(q, k, v, qk_int8=int8), out, None, variant)
            if not args.no_v1:
                cases["v1 mma.sync kernel"] = lambda: interface.fp8_attention_packed(packed[False], out=out,
                                                                                     kernel="mma_sync")
            cases.update(sdpa_cases(q, k, v, "SDPA"))
            kernels.report["timing"] += timing_entries(
                cases, f"B{b} H{h} S{s} D{d}", 4 * b * h * s * s * d, budget_s=deadline - time.time(), rounds=7,
                warmup=1, no_flop_rate=("prep alone", "INT8 Q/K prep alone"))
        except Exception as e:  # noqa: BLE001
            kernels.report["timing"].append({"error": f"{type(e).__name__}: {e}"[:1000]})


def main(argv=None):
    args = parse_args(argv)
    ptx_dir = keep_ptx_in(args.out)
    started = time.time()

    import torch

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    variants = parse_variants(args.variants, sm_count)
    report = {"device": torch.cuda.get_device_name(), "variants": args.variants, "compile": [], "timing": []}
    kernels = Kernels(sm_count, report, ptx_dir, ptxas=not (args.sanitize or args.profile))
    if args.sanitize:
        sanitize(kernels, variants[0])
        return
    if args.profile:
        profile(kernels, variants)
        return
    compile_report(kernels, variants, args.head_dim)
    time_variants(kernels, variants, args, deadline=started + args.budget_s * 0.92)
    write_report(report, args.out, "check_fp8_sm90.json", started)
    for c in report["compile"]:
        print("compile:", json.dumps(c)[:1500])
    print()
    print_timing(report)


if __name__ == "__main__":
    main()

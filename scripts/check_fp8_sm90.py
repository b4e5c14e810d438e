"""One device run for the Hopper FP8 attention kernel (kernel_sm90): compile + ptxas report,
correctness matrix, timings at the H3 shape beside v1 and torch SDPA (cuDNN / flash bf16).

    python scripts/check_fp8_sm90.py --out $OUT [--budget-s 300] [--variants 128x2,128x3,192x2] [--seq-lens 4096,30272]
    python scripts/check_fp8_sm90.py --out $OUT --sanitize   # tiny shape, for compute-sanitizer

Variant "default" = what fp8_attention runs at each head dim and key length (`tuning.default_options`); variant
"NxS[s][p[Q]][r][eK][wW]" = tile_n N keys per block, S pipeline stages, two-level P.V accumulation
(each block's P.V added to O in fp32 by the FMA units); "s" = single-level (P.V accumulated by
the tensor core across all blocks); "p" = persistent CTAs, one per SM, walking the tiles ("p2": with two Q stages); "r" = row sums
by the tensor core (pv_row_sum); "eK" = the
exp2s of K n8 tiles per row on the FMA pipe; "wW" = W consumer warpgroups (2, or 3: 192-row tiles at
160 registers); without it, the head dim's default (3 at D = 64, 2 at D = 128).
--head-dim picks the quick check's and the timing's head dim (the correctness matrix has both, so
the first variant is compiled for both and the others for --head-dim only; --no-matrix skips it, for
timing runs); --seq-lens the timing's sequence lengths (B1 H56, self-attention).
kernels/NOTES.md lists the variants measured. The first variant is the one checked for
correctness; every variant is timed. Writes $OUT/check_fp8_sm90.json, prints a table last.
"""
import argparse
import glob
import inspect
import json
import os
import re
import subprocess
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling script's helpers
from check_fp8_attention import scored_rows, sdpa_cases, time_cases, write_report  # noqa: E402

DEFAULT = "default"  # the variant fp8_attention runs, resolved per head dim and key length (`at`)
COMPILE_REPORT_KEYS = (4096, 30272)  # key lengths whose "default" the compile report builds (both D128 plans)


class Variant(NamedTuple):
    """One kernel_sm90 configuration: the constructor's options, by their names."""
    tile_n: int
    num_stages: int
    two_level_pv: bool
    persistent_ctas: int
    q_stages: int
    pv_row_sum: bool
    fma_exp2_tiles: int
    consumer_warpgroups: int | None  # None: the head dim's default

    def label(self) -> str:
        return ("%dx%d" % (self.tile_n, self.num_stages) + ("" if self.two_level_pv else "s")
                + ("p" + ("" if self.q_stages == 1 else str(self.q_stages)) if self.persistent_ctas else "")
                + ("r" if self.pv_row_sum else "")
                + (f"e{self.fma_exp2_tiles}" if self.fma_exp2_tiles else "")
                + (f"w{self.consumer_warpgroups}" if self.consumer_warpgroups else ""))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--variants", default="default,128x2,128x2s,192x2s")
    parser.add_argument("--sanitize", action="store_true")
    parser.add_argument("--no-v1", action="store_true")
    parser.add_argument("--no-matrix", action="store_true", help="skip the correctness matrix (timing runs)")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    parser.add_argument("--seq-lens", default="30272")
    parser.add_argument("--profile", action="store_true", help="B1 H56 S8192 D128, each variant once (for ncu)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ptx_dir = os.path.join(args.out, "ptx")
    os.makedirs(ptx_dir, exist_ok=True)
    os.environ.setdefault("CUTE_DSL_KEEP", "ptx")
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", ptx_dir)
    started = time.time()
    over_budget = lambda share=1.0: time.time() - started > args.budget_s * share

    import torch

    from dit_accel.attention.reference import random_qkv, reference_attention, reference_lse, rel_rms_err
    from dit_accel.kernels.fp8_attention import interface
    from dit_accel.kernels.fp8_attention.compile import compile_fp8_attention
    from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention, lse_mismatch
    from dit_accel.kernels.fp8_attention.kernel_sm90 import Fp8AttentionSm90
    from dit_accel.kernels.fp8_attention.tuning import default_options
    from dit_accel.kernels.fp8_attention.prep import prep_triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def parse(name):  # "128x2p2re2w3" -> Variant(128, 2, True, sms, 2, True, 2, 3); no "wW": the head dim's default
        if name == DEFAULT:
            return DEFAULT
        m = re.fullmatch(r"(\d+)x(\d+)(s?)(p(\d?))?(r?)(?:e(\d+))?(?:w(\d))?", name)
        if not m:
            parser.error(f"bad variant {name!r}; default or NxS[s][p[Q]][r][eK][wW], e.g. 128x2, 192x2s, 128x2pr")
        return Variant(int(m[1]), int(m[2]), not m[3], sms if m[4] else 0, int(m[5] or 1), bool(m[6]),
                       int(m[7] or 0), int(m[8]) if m[8] else None)

    constructor_defaults = {name: p.default for name, p in inspect.signature(Fp8AttentionSm90).parameters.items()}

    def at(variant, d, seqlen_kv) -> Variant:  # the configuration a variant is at head dim d and this key length
        if variant != DEFAULT:  # (called on every timed launch: the constructor's defaults are read once, above)
            return variant
        options = {**constructor_defaults, **default_options(d, sms, seqlen_kv)}  # then what fp8_attention adds
        return Variant(**{name: options[name] for name in Variant._fields})

    variants = [parse(v) for v in args.variants.split(",")]

    def label(variant, d=None, seqlen_kv=None):  # "default" with what it resolves to where that is known
        if variant != DEFAULT:
            return variant.label()
        return DEFAULT if d is None else f"{DEFAULT}={at(variant, d, seqlen_kv).label()}"
    report = {"device": torch.cuda.get_device_name(), "variants": args.variants,
              "compile": [], "correctness": [], "timing": []}
    kernels = {}

    def get(d, with_lse, variant, seqlen_kv):
        v = at(variant, d, seqlen_kv)
        key = (d, with_lse, *v)
        if key not in kernels:
            t0 = time.time()
            kernels[key] = compile_fp8_attention(d, torch.bfloat16, with_lse, kernel="sm90", **v._asdict())
            entry = {"key": key, "compile_s": round(time.time() - t0, 2)}
            # The dump's file name is truncated, so variants share it: ptxas it right away.
            dumped = sorted(glob.glob(os.path.join(ptx_dir, "*.ptx")), key=os.path.getmtime)
            if dumped and not args.sanitize:
                # The DSL writes PTX ISA 9.4; ptxas 13.0 reads 9.0 and the kernel uses nothing newer.
                text = open(dumped[-1]).read().replace(".version 9.4", ".version 9.0", 1)
                patched = os.path.join(ptx_dir, "ptxas_input.ptx.txt")
                with open(patched, "w") as f:
                    f.write(text)
                res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", patched, "-o", os.devnull],
                                     capture_output=True, text=True, timeout=180)
                entry["ptxas"] = [l.strip()[-120:] for l in res.stderr.splitlines()
                                  if "registers" in l or "spill" in l] or res.stderr[-500:]
            report["compile"].append(entry)
        return kernels[key]

    def run(packed, out, lse, variant):
        kern = get(packed.head_dim, lse is not None, variant, packed.seqlen_kv)
        kern(packed.q, packed.k, packed.v, packed.descale, out, lse, packed.head_dim ** -0.5, packed.seqlen_kv)


    if args.sanitize:
        for d in (64, 128):
            q, k, v = random_qkv(2, 300, 200, 2, d, True, d)
            packed = prep_triton(q, k, v)
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(2, 2, 300, device="cuda")
            run(packed, out, lse, variants[0])
            torch.cuda.synchronize()
            ref = reference_attention(q, k, v)
            print(f"sanitize D{d}: finite={bool(torch.isfinite(out).all())} "
                  f"err_vs_fp64={100 * rel_rms_err(out, ref):.3f}%")
        return

    if args.profile:
        q, k, v = random_qkv(1, 8192, 8192, 56, 128, False, 0)
        packed = prep_triton(q, k, v)
        out = torch.empty_like(q)
        for variant in variants:
            run(packed, out, None, variant)
        torch.cuda.synchronize()
        return

    # ---------------------------------------------------------------- compile report
    for i, variant in enumerate(variants):
        for d in ((64, 128) if i == 0 and not args.no_matrix else (args.head_dim,)):
            try:
                for seqlen_kv in COMPILE_REPORT_KEYS:
                    get(d, True, variant, seqlen_kv)
            except Exception as e:  # noqa: BLE001
                report["compile"].append({"key": (d, True, *at(variant, d, seqlen_kv)), "error": f"{type(e).__name__}: {e}"[:3000]})

    # ---------------------------------------------------------------- quick check of every variant
    q, k, v = random_qkv(2, 1000, 700, 3, args.head_dim, True, seed=7)
    packed = prep_triton(q, k, v)
    def scheme(variant):  # what the emulation must match of a variant: its key block and its row sums
        resolved = at(variant, args.head_dim, packed.seqlen_kv)
        return resolved.tile_n, resolved.pv_row_sum

    emu = {(block_keys, rounded): emulate_fp8_attention(q, k, v, block_keys=block_keys, reverse=True,
                                                        rounded_row_sum=rounded)
           for block_keys, rounded in {scheme(variant) for variant in variants}}
    report["quick_check"] = {}
    for variant in variants:
        out = torch.full_like(q, float("nan"))
        try:
            run(packed, out, None, variant)
            torch.cuda.synchronize()
            report["quick_check"][label(variant)] = round(100 * rel_rms_err(out, emu[scheme(variant)]), 3)
        except Exception as e:  # noqa: BLE001
            report["quick_check"][label(variant)] = f"{type(e).__name__}: {e}"[:300]
    print(f"quick check, % rel RMS vs emulation (B2 Sq1000 Skv700 D{args.head_dim}, outliers):", report["quick_check"])

    # ---------------------------------------------------------------- correctness (first variant)
    main_variant = variants[0]
    cases = [(b, s, s, d, o) for s in (1, 17, 127, 128, 1000, 4096) for d in (64, 128)
             for b in (1, 2) for o in (False, True)]
    cases += [(b, s, 512, d, o) for s in (17, 1000) for d in (64, 128) for b in (1, 2) for o in (True,)]
    cases += [(1, 30272, 30272, 128, True), (1, 30272, 30272, 128, False)]
    if args.no_matrix:
        cases = []
    for i, (b, sq, skv, d, outliers) in enumerate(cases):
        row = {"B": b, "Sq": sq, "Skv": skv, "H": 3, "D": d, "outliers": outliers}
        report["correctness"].append(row)
        if over_budget(0.5):
            row["skipped"] = "time budget"
            continue
        try:
            q, k, v = random_qkv(b, sq, skv, 3, d, outliers, seed=1000 + i)
            rows = None if sq <= 1024 else scored_rows(sq, 256, seed=1000 + i)
            packed = prep_triton(q, k, v)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((b, 3, sq), float("nan"), device="cuda")
            run(packed, out, lse, main_variant)
            torch.cuda.synchronize()
            row["all_written_finite"] = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
            sub = out if rows is None else out[:, rows]
            ref = reference_attention(q, k, v, rows=rows)
            emu, emu_lse = emulate_fp8_attention(q, k, v, rows=rows, block_keys=at(main_variant, d, skv).tile_n,
                                                 rounded_row_sum=at(main_variant, d, skv).pv_row_sum,
                                                 reverse=True, return_lse=True)
            row["err_vs_fp64_pct"] = round(100 * rel_rms_err(sub, ref), 3)
            row["emulation_vs_fp64_pct"] = round(100 * rel_rms_err(emu, ref), 3)
            row["err_vs_emulation_pct"] = round(100 * rel_rms_err(sub, emu), 3)
            # LSE against the emulation's (the fp64 one of the unquantized inputs differs by
            # the logits' quantization error, tens of units with 50x outliers).
            sub_lse = lse if rows is None else lse[:, :, rows]
            row["lse_max_abs_err"] = round(float((sub_lse.double() - emu_lse).abs().max()), 4)
            row["lse_max_abs"] = round(float(emu_lse.abs().max()), 2)
            row["lse_vs_fp64_max_abs"] = round(float((sub_lse.double() - reference_lse(
                q if rows is None else q[:, rows], k)).abs().max()), 4)
            mismatch = lse_mismatch(sub_lse, emu_lse, at(main_variant, d, skv).pv_row_sum, rel=1e-3)
            row["lse_check"] = mismatch or "ok"
            row["ok"] = (row["all_written_finite"] and row["err_vs_emulation_pct"] < 3.0
                         and row["err_vs_fp64_pct"] < row["emulation_vs_fp64_pct"] + 0.5 and mismatch is None)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
        finally:
            torch.cuda.empty_cache()
    report["all_ok"] = None if args.no_matrix else all(r.get("ok", False) for r in report["correctness"])

    # ---------------------------------------------------------------- timing (B1 H56, --seq-lens)
    for s in map(int, args.seq_lens.split(",")):
        b, h, d = 1, 56, args.head_dim
        flop = 4 * b * h * s * s * d
        try:
            q, k, v = random_qkv(b, s, s, h, d, False, seed=123)
            packed = prep_triton(q, k, v)
            out = torch.empty_like(q)

            def prep_and(variant):
                def go():
                    run(prep_triton(q, k, v), out, None, variant)
                return go

            timed = [("prep alone", lambda: prep_triton(q, k, v))]
            for variant in variants:
                name = label(variant, d, s)
                timed += [(f"sm90 {name} kernel", lambda variant=variant: run(packed, out, None, variant)),
                          (f"sm90 {name} prep+kernel", prep_and(variant))]
            if not args.no_v1:
                timed.append(("v1 mma.sync kernel", lambda: interface.fp8_attention_packed(packed, out=out, kernel="mma_sync")))
            timed += sdpa_cases(q, k, v, "SDPA")
            time_cases(timed, report, f"B{b} H{h} S{s} D{d}", flop, lambda: over_budget(0.92),
                       iters=7, warmup=1, no_flop_rate="prep alone")
        except Exception as e:  # noqa: BLE001
            report["timing"].append({"error": f"{type(e).__name__}: {e}"[:1000]})

    write_report(report, args.out, "check_fp8_sm90.json", started)

    # ---------------------------------------------------------------- table
    for c in report["compile"]:
        print("compile:", json.dumps(c)[:1500])
    print(f"\ncorrectness of sm90 {label(main_variant)} (emulation: its key blocks, last to first, and row sums)")
    print(f"{'B':>2} {'Sq':>6} {'Skv':>6} {'D':>4} {'outl':>5} {'vs fp64 %':>9} {'emu %':>7} {'vs emu %':>8} {'lse err/|lse|':>17} {'written':>7} ok")
    for r in report["correctness"]:
        if "error" in r or "skipped" in r:
            print(f"{r['B']:>2} {r['Sq']:>6} {r['Skv']:>6} {r['D']:>4} {str(r['outliers']):>5} {r.get('error', r.get('skipped'))[:300]}")
            continue
        print(f"{r['B']:>2} {r['Sq']:>6} {r['Skv']:>6} {r['D']:>4} {str(r['outliers']):>5} {r['err_vs_fp64_pct']:>9} "
              f"{r['emulation_vs_fp64_pct']:>7} {r['err_vs_emulation_pct']:>8} {r['lse_max_abs_err']:>8}/{r['lse_max_abs']:<8} "
              f"{str(r['all_written_finite']):>7} {r['ok']}")
    print(f"all_ok {report['all_ok']}\n")
    for t in report["timing"]:
        print(f"{t.get('shape', ''):<20} {t.get('what', '?'):<26} {t.get('ms', '-'):>9} ms {t.get('tflops', '-'):>7} TFLOP/s {t.get('error', t.get('skipped', ''))}")
    print(f"wall {report['wall_s']} s")


if __name__ == "__main__":
    main()

"""Rates against the right ceiling, on stand-in profiles of real H200 kernel names: FP8 GEMMs and our FP8
attention against the FP8 GEMM ceiling, bf16 work against the bf16 GEMM's, a GEMM row of both split by
precision; without an FP8 ceiling, FP8 rates without a percentage and the footnote says why."""
from __future__ import annotations

import pytest
from rich.console import Console

from dit_accel.device import Ceilings
from dit_accel.profiling.classify import ATTENTION_RANGE, classify, is_fp8
from dit_accel.profiling.extrapolate import Extrapolation, StackTime
from dit_accel.profiling.profiler import BlockProfile, KernelRecord
from dit_accel.profiling.render import breakdown_table
from dit_accel.profiling.results import BackendRun
from dit_accel.timing import TimingStats

FP8_GEMM = "nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT"  # torchao's per-row FP8 linears (cuBLASLt)
BF16_GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
FP8_ATTENTION = "kernel_cutlass_kernel_dit_accelkernelsfp8_attentionkernel_sm90Fp8AttentionSm90_object_at_"
FP8_PREP = "_fp8_prep_amax_kernel"
CUDNN_ATTENTION = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0"
MUL = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
       "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, ...)")

H200 = Ceilings("bfloat16", 792.0, 4260.0, (8192, 8192, 8192), 2**31, fp8_gemm_tflops=1530.0)
NO_FP8 = Ceilings("bfloat16", 792.0, 4260.0, (8192, 8192, 8192), 2**31,
                  fp8_gemm_unavailable="NVIDIA A100 is sm_80: FP8 GEMMs need a CUDA GPU of compute capability 8.9+")


def run_of(kernels_us: list[tuple[str, str, float]], attention_flops: float, linear_flops: float,
           fp8_linear_flops: float = 0.0, block_ms: float = 10.0) -> BackendRun:
    """A recipe's run whose profile holds these (kernel, range, µs per block), classified and tagged as the
    profiler does, timed at `block_ms`."""
    kernels = [KernelRecord(name, classify(name, label), label, 1.0, us, 0.0, is_fp8(name))
               for name, label, us in kernels_us]
    profile = BlockProfile(TimingStats(block_ms, block_ms, block_ms, 1), kernels, None, 0, 1, "cuda")
    extrapolation = Extrapolation((StackTime("transformer_blocks", 50, block_ms),), 0.0, "stated", 50, 1)
    return BackendRun("recipe", profile, extrapolation, attention_flops, linear_flops,
                      fp8_linear_flops=fp8_linear_flops)


def fp8_recipe_run() -> BackendRun:
    """fp8+fp8-linear: 3 ms of FP8 GEMMs (3 TFLOP), 1 ms of bf16 GEMMs for the linears kept (0.5 TFLOP),
    4 ms of our FP8 attention (4.8 TFLOP), its prep and a multiply; 1 ms of gaps."""
    return run_of([(FP8_GEMM, "ffn", 3000.0), (BF16_GEMM, "modulation projection", 1000.0),
                   (FP8_ATTENTION, ATTENTION_RANGE, 4000.0), (FP8_PREP, ATTENTION_RANGE, 500.0),
                   (MUL, "modulation + residual (block body)", 500.0)],
                  attention_flops=4.8e12, linear_flops=3.5e12, fp8_linear_flops=3e12)


def test_fp8_work_is_rated_against_the_fp8_gemm_and_a_mixed_gemm_row_by_precision():
    rows = fp8_recipe_run().category_rows(H200)
    attention = rows["attention"]
    assert attention["precision"] == "fp8" and attention["ceiling"] == "FP8 GEMM"
    assert attention["tflops"] == pytest.approx(1200)
    assert attention["pct_of_ceiling"] == pytest.approx(100 * 1200 / 1530)
    gemm = rows["gemm"]
    assert gemm["ms"] == pytest.approx(4.0) and gemm["flops"] == 3.5e12  # the whole GEMM row, as before
    assert gemm["precision"] == "mixed" and gemm["pct_of_ceiling"] is None and gemm["tflops"] == pytest.approx(875)
    fp8, bf16 = gemm["by_precision"]["fp8"], gemm["by_precision"]["bfloat16"]
    assert (fp8["ms"], fp8["flops"], fp8["ceiling"]) == (pytest.approx(3.0), 3e12, "FP8 GEMM")
    assert fp8["tflops"] == pytest.approx(1000) and fp8["pct_of_ceiling"] == pytest.approx(100 * 1000 / 1530)
    assert (bf16["ms"], bf16["flops"], bf16["ceiling"]) == (pytest.approx(1.0), 0.5e12, "bfloat16 GEMM")
    assert bf16["tflops"] == pytest.approx(500) and bf16["pct_of_ceiling"] == pytest.approx(100 * 500 / 792)
    assert rows["quantize"]["ceiling"] == "copy" and "precision" not in rows["quantize"]


def test_bf16_work_is_rated_against_the_bf16_gemm_with_one_row_per_kind():
    rows = run_of([(BF16_GEMM, "ffn", 4000.0), (CUDNN_ATTENTION, ATTENTION_RANGE, 5000.0)],
                  attention_flops=4.8e12, linear_flops=3.5e12).category_rows(H200)
    for kind, tflops in (("attention", 960), ("gemm", 875)):
        row = rows[kind]
        assert (row["precision"], row["ceiling"]) == ("bfloat16", "bfloat16 GEMM") and "by_precision" not in row
        assert row["tflops"] == pytest.approx(tflops) and row["pct_of_ceiling"] == pytest.approx(100 * tflops / 792)


def test_all_linears_in_fp8_make_one_fp8_gemm_row():
    rows = run_of([(FP8_GEMM, "ffn", 3000.0)], attention_flops=0.0, linear_flops=3e12,
                  fp8_linear_flops=3e12).category_rows(H200)
    assert rows["gemm"]["precision"] == "fp8" and rows["gemm"]["tflops"] == pytest.approx(1000)


def render_text(table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def footnote(text: str) -> str:
    """The caption under a rendered table, its wrapped lines joined."""
    return " ".join(text.split("┘", 1)[1].split())


def test_the_table_names_each_ceiling_and_splits_the_mixed_gemm_row():
    text = render_text(breakdown_table(fp8_recipe_run(), H200))
    assert footnote(text).startswith("rates vs this device's measured ceilings: bfloat16 GEMM 792 TFLOP/s, "
                                     "FP8 GEMM 1.53e+03 TFLOP/s, copy 4.26e+03 GB/s; ")
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 2}
    assert "1.2e+03 TFLOP/s (78%)" in lines["attention (fp8)"]
    assert "875 TFLOP/s" in lines["gemm"] and "%" not in lines["gemm"].split("│")[4]  # no one ceiling for both
    assert "1e+03 TFLOP/s (65%)" in lines["of which fp8"] and "500 TFLOP/s (63%)" in lines["of which bfloat16"]
    assert "no FP8 GEMM ceiling" not in text


def test_without_an_fp8_ceiling_fp8_rates_have_no_percentage_and_the_footnote_says_why():
    run = fp8_recipe_run()
    rows = run.category_rows(NO_FP8)
    assert rows["attention"]["pct_of_ceiling"] is None and rows["attention"]["tflops"] == pytest.approx(1200)
    assert rows["gemm"]["by_precision"]["bfloat16"]["pct_of_ceiling"] == pytest.approx(100 * 500 / 792)
    text = render_text(breakdown_table(run, NO_FP8))
    assert "1.2e+03 TFLOP/s " in text and "1.2e+03 TFLOP/s (" not in text
    assert "FP8 GEMM 1" not in text
    assert footnote(text).startswith("rates vs this device's measured ceilings: bfloat16 GEMM 792 TFLOP/s, "
                                     "copy 4.26e+03 GB/s; FP8 rates without a percentage: no FP8 GEMM ceiling "
                                     "(NVIDIA A100 is sm_80: FP8 GEMMs need a CUDA GPU of compute capability 8.9+); ")
    bf16_only = render_text(breakdown_table(run_of([(BF16_GEMM, "ffn", 4000.0)], 0.0, 3.5e12), NO_FP8))
    assert "no FP8 GEMM ceiling" not in bf16_only  # nothing FP8 to rate: no word of it


def test_report_json_keeps_its_keys_and_adds_the_precisions():
    run = fp8_recipe_run().as_dict(H200)
    assert run["linear_flops"] == 3.5e12 and run["fp8_linear_flops"] == 3e12
    gemm = run["categories"]["gemm"]
    assert {"ms", "share_pct", "flops", "tflops", "pct_of_ceiling"} <= set(gemm)  # the keys a report always had
    assert set(gemm["by_precision"]) == {"fp8", "bfloat16"}
    fp8_kernels = {k["kernel"] for k in run["top_kernels"] if k["fp8"]}
    assert fp8_kernels == {FP8_GEMM, FP8_ATTENTION}  # ops.csv's rows carry the same tag


def test_the_gaps_row_is_in_both_breakdowns_and_explained_under_the_table():
    """1 ms of the 10 ms block ran no kernel: the gaps row is a kind of work and a module alike, so both add up to
    the block's time (breakdown.png's two panels share a scale), and the table's footnote says what it holds."""
    run = fp8_recipe_run()
    by_kind, by_module = run.category_rows(H200), run.module_rows()
    assert by_kind["gaps between kernels"]["ms"] == by_module["gaps between kernels"]["ms"] == pytest.approx(1.0)
    assert sum(r["ms"] for r in by_kind.values()) == pytest.approx(sum(r["ms"] for r in by_module.values())) \
        == pytest.approx(10.0)
    console = Console(width=200, record=True)
    console.print(breakdown_table(run, H200))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "gaps between kernels: timed block time in which the GPU ran none of its kernels" in text

"""`dit-accel profile-block` through click's test runner, on the CPU (scaled-down) and on a tiny checkpoint."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dit_accel.cli import main

FAST = ["--seq-len", "64", "--runs", "2", "--warmup", "1"]
OUTPUT_FILES = {"report.json", "ops.csv", "breakdown.png"}


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_default_run_on_cpu_is_scaled_down_and_labelled(tmp_path):
    out = tmp_path / "run"
    result = run_cli("profile-block", *FAST, "--out", out)
    assert result.exit_code == 0, result.output
    assert "CPU SCALED-DOWN RUN" in result.output
    assert {p.name for p in out.iterdir()} == OUTPUT_FILES
    report = json.loads((out / "report.json").read_text())
    assert report["run_kind"] == "cpu-scaled-down"
    assert report["model"]["family"] == "minimax-h3"
    assert report["model"]["num_blocks"] == 50
    run = report["runs"][0]
    assert run["backend"] == "native"
    assert run["block_ms"] > 0
    # Every category row and the gaps add up to the timed block.
    assert abs(sum(row["ms"] for row in run["categories"].values()) - run["block_ms"]) < 1e-6 * run["block_ms"] + 1e-9
    assert run["categories"]["gemm"]["ms"] > 0 and run["categories"]["attention"]["ms"] > 0
    assert {"qkv projection", "attention core", "ffn", "output projection"} <= set(run["modules"])
    e = run["extrapolation"]
    assert e["pass_ms"] == pytest.approx(50 * run["block_ms"])
    # MiniMax-H3 is guidance-distilled: one transformer pass per step.
    assert e["guidance_passes"] == 1 and "guidance-distilled" in e["passes_source"]
    assert e["video_s"] == pytest.approx(50 * 1 * e["pass_ms"] / 1e3)
    ops = (out / "ops.csv").read_text().splitlines()
    assert ops[0].startswith("backend,category,range,kernel")
    assert len(ops) > 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's ceilings")
def test_rates_name_the_ceilings_they_are_against(tmp_path):
    out = tmp_path / "run"
    result = run_cli("profile-block", *FAST, "--quiet", "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    ceilings = report["ceilings"]
    assert ceilings["fp8_gemm_tflops"] is None and "no CUDA GPU" in ceilings["fp8_gemm_unavailable"]
    footnote = (f"rates vs this device's measured ceilings: float32 GEMM {ceilings['gemm_tflops']:.3g} TFLOP/s, "
                f"copy {ceilings['copy_gbps']:.3g} GB/s; ~ = bytes")
    assert footnote in " ".join(result.output.split())
    categories = report["runs"][0]["categories"]
    for kind in ("gemm", "attention"):  # float32 work against the float32 GEMM, no FP8 anywhere
        assert (categories[kind]["precision"], categories[kind]["ceiling"]) == ("float32", "float32 GEMM")
    assert categories["norm"]["ceiling"] == "copy"
    assert report["runs"][0]["fp8_linear_flops"] == 0.0
    assert "fp8" in (out / "ops.csv").read_text().splitlines()[0].split(",")


def test_compare_attention_backends_side_by_side(tmp_path):
    out = tmp_path / "cmp"
    device = [] if torch.cuda.is_available() else ["--device", "cpu"]
    result = run_cli("profile-block", *FAST, *device, "--compare-attn", "native,math", "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [r["backend"] for r in report["runs"]] == ["native", "math"]
    assert report["runs"][0]["output_vs_reference"] is None
    assert report["runs"][1]["output_vs_reference"]["cosine"] > 0.99
    # Both backends measured on the block's own q, k, v against the same high-precision reference.
    assert report["attention_reference"] in ("float64", "float32")
    assert all(0 <= run["attention_rel_err"] < 1e-2 for run in report["runs"])
    levers = report["runs"][0]["next_levers"]
    assert levers[0]["kind"] == "gemm" and "attention" not in [lever["kind"] for lever in levers]
    assert [lever["ms"] for lever in levers] == sorted((lever["ms"] for lever in levers), reverse=True)


def test_validate_chains_real_blocks(tmp_path):
    out = tmp_path / "val"
    result = run_cli("profile-block", *FAST, "--device", "cpu", "--validate", "3", "--out", out)
    assert result.exit_code == 0, result.output
    v = json.loads((out / "report.json").read_text())["validation"]
    assert v["chained_blocks"] == 3 and v["distinct_blocks"] == 3
    assert v["measured_ms"] > 0 and v["extrapolated_ms"] > 0
    assert "3 blocks chained" in result.output


def test_checkpoint_run_reports_the_load(tiny_h3_checkpoint, tmp_path):
    out = tmp_path / "ckpt"
    result = run_cli("profile-block", "--checkpoint", tiny_h3_checkpoint, "--block", "7", "--device", "cpu",
                     *FAST, "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["run_kind"] == "cpu"
    assert report["block"]["synthetic"] is False
    assert report["block"]["load"]["shards"] == ["diffusion_pytorch_model-00002-of-00014.safetensors",
                                                 "diffusion_pytorch_model-00003-of-00014.safetensors"]
    assert report["model"]["config"]["hidden_size"] == 48


def test_wan_video_workload(tmp_path):
    out = tmp_path / "wan"
    result = run_cli("profile-block", "--model", "wan", "--device", "cpu", "--frames", "5", "--height", "64",
                     "--width", "64", "--runs", "2", "--warmup", "1", "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["workload"]["seq_len"] == 2 * 4 * 4  # 2 latent frames x (64/8/2)^2
    assert report["runs"][0]["attention_flops"] == pytest.approx(
        4 * 4 * 128 * (32 * 32 + 32 * 512))  # self + cross attention, 4 heads of 128 (scaled down)


def _damage(folder, how):
    if how == "missing shard":
        (folder / "diffusion_pytorch_model-00003-of-00014.safetensors").unlink()
    elif how == "truncated shard":
        shard = folder / "diffusion_pytorch_model-00002-of-00014.safetensors"
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "unknown family":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "_class_name": "FluxTransformer2DModel"}))


@pytest.mark.parametrize("how, extra, message", [
    ("missing folder", [], "does not exist"),
    ("missing shard", [], "is missing"),
    ("truncated shard", [], "truncated"),
    ("unknown family", [], "unknown model family 'FluxTransformer2DModel'"),
    ("block out of range", ["--block", "50"], "block 50 is out of range"),
    ("bad dtype", ["--dtype", "int8"], "unsupported dtype"),
    ("bad budget", ["--memory-budget", "lots"], "cannot read the size"),
    ("both workloads", ["--frames", "9"], "either as --seq-len"),
])
def test_bad_input_gives_one_line_and_no_partial_output(tiny_h3_copy, tmp_path, how, extra, message):
    _damage(tiny_h3_copy, how)
    checkpoint = tmp_path / "nowhere" if how == "missing folder" else tiny_h3_copy
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    result = CliRunner().invoke(main, ["profile-block", "--checkpoint", str(checkpoint), "--block", "7", "--device",
                                       "cpu", *FAST, *extra, "--out", str(outputs / "run")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert list(outputs.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_memory_budget_needs_a_gpu(tmp_path):
    result = CliRunner().invoke(main, ["profile-block", *FAST, "--memory-budget", "16GiB",
                                       "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "applies to CUDA devices only" in result.output


@pytest.mark.gpu
def test_budget_too_small_for_the_h3_block(tmp_path):
    """1 GiB cannot hold the 1.29 GB H3 block: one line, exit 2, nothing written."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    try:
        result = CliRunner().invoke(main, ["profile-block", "--memory-budget", "1GiB", "--runs", "2", "--warmup", "1",
                                           "--out", str(outputs / "run")])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert result.exit_code == 2, result.output
    assert "does not fit in the 1GiB budget" in result.output
    assert list(outputs.iterdir()) == []


def test_trace_writes_a_chrome_trace_with_the_named_ranges(tmp_path):
    out = tmp_path / "traced"
    result = run_cli("profile-block", *FAST, "--device", "cpu", "--trace", "--out", out)
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == OUTPUT_FILES | {"trace_native.json"}
    trace = json.loads((out / "trace_native.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"dit-accel/attention core", "dit-accel/ffn", "dit-accel/qkv projection"} <= names


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "0"], "--seq-len must be at least 1"),
    (["--validate", "-2"], "--validate must be at least 0"),
    (["--frames", "1", "--height", "16", "--width", "16"], "a 16x16 video gives no tokens"),
    (["--frames", "0", "--height", "64", "--width", "64"], "--frames must be at least 1"),
    (["--outside-ms", "nan"], "--outside-ms must be a finite number of at least 0, got nan"),
    (["--outside-ms", "-1"], "--outside-ms must be a finite number of at least 0, got -1"),
    (["--seed", "18446744073709551616"], "--seed must be an integer from 0 to 2^64 - 1, got 18446744073709551616"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2^64 - 1, got -1"),
    # options that would be ignored are refused instead
    (["--attn", "fp8", "--compare-attn", "native,cudnn"], "--attn fp8 and --compare-attn do not combine"),
    (["--compare-attn", "native+compile", "--compile", "max-autotune"],
     "native+compile compiles already, in mode default, and --compile asks for max-autotune: keep one"),
])
def test_bad_numbers_are_one_line_errors(tmp_path, args, message):
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--runs", "1", *args,
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and message in result.output and result.output.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_wan_extrapolates_two_passes_a_step_and_the_option_overrides(tmp_path):
    result = run_cli("profile-block", "--model", "wan", *FAST, "--out", tmp_path / "wan")
    assert result.exit_code == 0, result.output
    e = json.loads((tmp_path / "wan" / "report.json").read_text())["runs"][0]["extrapolation"]
    assert e["guidance_passes"] == 2 and "classifier-free guidance" in e["passes_source"]
    assert e["steps"] == 50 and e["steps_source"] == "WanPipeline's default num_inference_steps"
    assert e["video_s"] == pytest.approx(50 * 2 * e["pass_ms"] / 1e3)
    result = run_cli("profile-block", *FAST, "--guidance-passes", "3", "--out", tmp_path / "h3")
    e = json.loads((tmp_path / "h3" / "report.json").read_text())["runs"][0]["extrapolation"]
    assert e["guidance_passes"] == 3 and e["passes_source"] == "stated with --guidance-passes"
    assert "3 transformer pass(es) per step (stated with --guidance-passes)" in result.output
    assert e["steps"] == 50 and e["steps_source"].startswith("assumed: MiniMaxH3ModularPipeline")
    result = run_cli("profile-block", *FAST, "--steps", "8", "--out", tmp_path / "h3-8")
    e = json.loads((tmp_path / "h3-8" / "report.json").read_text())["runs"][0]["extrapolation"]
    assert e["steps"] == 8 and e["steps_source"] == "stated with --steps"
    assert e["video_s"] == pytest.approx(8 * 1 * e["pass_ms"] / 1e3)


def test_shortest_h3_sequence_runs(tmp_path):
    result = run_cli("profile-block", "--device", "cpu", "--seq-len", "1", "--runs", "1", "--warmup", "0",
                     "--out", tmp_path / "one")
    assert result.exit_code == 0, result.output


def test_rope_option_runs_beside_the_plain_backend(tmp_path):
    """`+rope` swaps in the fused RoPE for that run only; on the CPU it falls back to diffusers'
    function, so the output is bit-identical and the rows differ only in their label."""
    out = tmp_path / "rope"
    result = run_cli("profile-block", *FAST, "--device", "cpu", "--compare-attn", "native,native+rope", "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [r["backend"] for r in report["runs"]] == ["native", "native+rope"]
    assert report["runs"][1]["output_vs_reference"]["rel_l2"] == 0.0
    assert report["runs"][1]["attention_rel_err"] == report["runs"][0]["attention_rel_err"]


def test_unknown_attention_option_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["profile-block", *FAST, "--attn", "fp8+fast", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "the options are +rope" in result.output
    assert not (tmp_path / "r").exists()


def test_rope_option_also_applies_to_the_validate_chain(tmp_path):
    out = tmp_path / "rope-val"
    result = run_cli("profile-block", *FAST, "--device", "cpu", "--attn", "native+rope", "--validate", "2",
                     "--out", out)
    assert result.exit_code == 0, result.output
    assert "2 blocks chained" in result.output
    assert "RoPE call(s) of native+rope ran diffusers' own function" in result.output  # CPU tensors fall back


@pytest.mark.slow
@pytest.mark.parametrize("keep_going", [True, False])
def test_a_recipe_torch_cannot_compile_is_left_out_with_keep_going(tmp_path, monkeypatch, keep_going):
    """A compile that fails on the block (as torchao's FP8 linears on Mochi's under torch 2.11): with --keep-going
    the recipe is left out, named with the reason in the report and the notes, and the others run; without it the
    run ends in that one line, exit 2, and writes nothing."""
    from dit_accel.errors import UserError
    from dit_accel.profiling import session

    def refuse(block, inputs, mode, device, label):
        raise UserError(f"{label} on this block: torch could not compile it (a test's refusal)")

    monkeypatch.setattr(session, "_first_compiled_call", refuse)
    out = tmp_path / "run"
    args = ["profile-block", *FAST, "--device", "cpu", "--compare-attn", "native,native+compile,math",
            *(["--keep-going"] if keep_going else []), "--out", out]
    result = CliRunner().invoke(main, [str(a) for a in args])
    if not keep_going:
        assert result.exit_code == 2 and "native+compile on this block: torch could not compile it" in result.output
        assert not out.exists()
        return
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [r["backend"] for r in report["runs"]] == ["native", "math"]
    assert report["recipes_left_out"] == {"native+compile": "native+compile on this block: torch could not "
                                                            "compile it (a test's refusal)"}
    assert "native+compile left out (--keep-going)" in result.output

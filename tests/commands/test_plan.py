"""`dit-accel plan`: predictions from a saved profile-block report reproduce exactly (the models checked by hand on
a report whose numbers are round), a real report's contract (block_work, categories, ceilings) is what the models
read, and bad inputs are one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dit_accel.cli import main
from dit_accel.errors import UserError
from dit_accel.patching.step_cache import parse_cache
from dit_accel.planning.cached import cache_plan, taylorseer_computed_steps
from dit_accel.planning.gpus import datasheets, gpu_of_device

GB = 1e9


def _report(tmp_path, *, runs=None, block_work=True, run_kind="gpu"):
    """A run folder of one stack: 10 blocks of 100 ms (attention 50 at 1 TFLOP per ms... round numbers), one
    attention call and two linears (one FP8, one kept), on the H200 whose ceilings are round too."""
    categories = {
        "attention": {"ms": 50.0, "flops": 50e12},
        "gemm": {"ms": 30.0, "flops": 15e12},  # 500 TFLOP/s: half the 1000 TFLOP/s bf16 ceiling
        "norm": {"ms": 10.0, "bytes_est": 10e9},  # 1000 GB/s: a quarter of the 4000 GB/s copy ceiling
        "modulation-elementwise": {"ms": 5.0, "bytes_est": 10e9},  # 2000 GB/s: half of it, the best
        "gaps between kernels": {"ms": 5.0},
    }
    base = {"backend": "cudnn", "stack": "blocks", "block_ms": 100.0, "categories": categories, "modules": {},
            "peak_memory_bytes": 3 * GB, "attention_rel_err": 0.002, "output_vs_reference": None,
            "extrapolation": {"stacks": [{"stack": "blocks", "num_blocks": 10, "block_ms": 100.0}], "outside_ms": 0.0,
                              "outside_source": "not measured", "steps": 50, "guidance_passes": 2}}
    report = {
        "run_kind": run_kind, "header": {"model": "m"}, "dtype": "bfloat16",
        "device": {"name": "NVIDIA H200", "total_memory_gib": 139.8},
        "ceilings": {"gemm_tflops": 1000.0, "fp8_gemm_tflops": 2000.0, "copy_gbps": 4000.0},
        "blocks": {"blocks": {"param_bytes": 1 * GB}}, "memory_estimate": {"outside_bytes": 0},
        "runs": [base] + (runs or []),
        "block_work": {"blocks": {
            "attention_calls": [{"module": "attn", "kind": "self", "batch": 1, "heads": 8, "q_len": 1000,
                                 "kv_len": 1000, "head_dim": 96, "masked": False, "key_padding": False,
                                 "flops": 50e12}],
            "linears": [{"name": "attn.to_q", "rows": 1000, "in_features": 1000, "out_features": 5000, "fp8": True},
                        {"name": "proj", "rows": 1, "in_features": 10, "out_features": 10, "fp8": False}]}}
        if block_work else None,
    }
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def _plan(*args):
    return CliRunner().invoke(main, ["plan", *map(str, args)])


def test_predictions_reproduce_the_models_by_hand_and_exactly_twice(tmp_path):
    run = _report(tmp_path, runs=[{"backend": "cudnn+fp8-linear+compile", "stack": "blocks", "block_ms": 50.0,
                                   "categories": {}, "modules": {}, "extrapolation": {},
                                   "attention_rel_err": 0.002, "output_vs_reference": {"rel_l2": 0.004}}])
    first = _plan(run, "--gpu", "h100-sxm,b200", "--out", tmp_path / "a")
    assert first.exit_code == 0, first.output
    assert _plan(run, "--gpu", "h100-sxm,b200", "--out", tmp_path / "b").exit_code == 0
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan == json.loads((tmp_path / "b" / "plan.json").read_text())  # a saved report: the same predictions
    rows = {row["knobs"]: row for row in plan["knobs"]}
    assert plan["rates_here"]["gemm_efficiency"] == 0.5 and plan["rates_here"]["memory_efficiency"] == 0.5
    # head dim 96: our kernel serves no call, so FP8 attention changes nothing
    assert rows["fp8-attention"]["block_ms"] == {"blocks": 100.0}
    # FP8 linears: 10 GFLOP... 2*1000*1000*5000 = 1e10 FLOP at 2000 TFLOP/s x 0.5 = 0.01 ms; the rest
    # (15e12 - 1e10) at 1000 x 0.5 = 29.98 ms; eager quantization 1e6 elements x 25 B at 4000 GB/s x 0.5 = 0.0125 ms
    parts = rows["fp8-linear"]["parts_ms"]["blocks"]
    assert parts["gemm (fp8)"] == 0.01 and parts["gemm"] == 29.98 and parts["quantize"] == 0.01
    # compile: the memory-bound kinds become the fused traffic: linear inputs (1e6 + 10) and outputs (5e6 + 10),
    # attention q/k/v (8 x 96 x 3000 = 2.304e6) elements, 2 B each, at 2000 GB/s
    fused = rows["compile"]["parts_ms"]["blocks"]["fused elementwise"]
    assert fused == round((1e6 + 10 + 5e6 + 10 + 2.304e6) * 2 / 2000e6, 2)
    assert rows["compile"]["parts_ms"]["blocks"]["gaps between kernels"] == 5.0
    # the run measured the torchao recipe: it is shown beside the prediction, with the difference
    measured = rows["compile + fp8-linear"]["measured"]
    predicted = rows["compile + fp8-linear"]["block_ms"]["blocks"]
    assert measured["block_ms"] == {"blocks": 50.0} and measured["difference_pct"]["blocks"] == round(
        100 * (predicted / 50.0 - 1), 1)
    # video: 50 steps x 2 passes x 10 blocks x 100 ms
    assert rows["baseline"]["video_s"] == 100.0 and rows["baseline"]["basis"] == "measured"
    # other GPUs: compute parts by the datasheets' bf16 rates, memory-bound parts by their bandwidths
    gpus = datasheets()[1]
    h100, h200 = gpus["h100-sxm"], gpus["h200"]
    row = next(r for r in plan["gpus"] if r["gpu"] == "h100-sxm" and r["knobs"] == "baseline")
    assert row["block_ms"]["blocks"] == round((50 + 30) * h200.bf16_tflops / h100.bf16_tflops
                                              + 15 * h200.memory_gbps / h100.memory_gbps + 5, 2)
    assert "fp8-linear" in {e["knob"] for e in plan["ranking"]}
    assert "compile + fp8-linear" in first.output and "b200" in first.output


def test_fp8_linears_change_only_the_gemm_time_the_linears_launched(tmp_path):
    """A report whose GEMM time is 20 ms from the linears and 10 from other matmuls (linear_ms): the linears' FLOPs
    ran at 15e12 / 20 ms = 750 TFLOP/s, 0.75 of the bf16 ceiling, the efficiency the FP8 ones get; the other
    matmuls keep their 10 ms."""
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["runs"][0]["categories"]["gemm"]["linear_ms"] = 20.0
    (run / "report.json").write_text(json.dumps(report))
    result = _plan(run, "--gpu", "h200", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["rates_here"]["gemm_efficiency"] == 0.75
    parts = next(r for r in plan["knobs"] if r["knobs"] == "fp8-linear")["parts_ms"]["blocks"]
    assert parts["gemm (fp8)"] == round(1e10 / (2000 * 0.75 * 1e9), 2)
    assert parts["gemm"] == round((15e12 - 1e10) / (1000 * 0.75 * 1e9) + 10.0, 2)


def test_the_memory_bound_rate_carried_over_ignores_a_kind_too_small_to_hold_one(tmp_path):
    """A kind of 0.5 ms at 3600 GB/s beside 15 ms of memory-bound work (3% of it, as SANA-Video's one small
    "other" kernel) sets no rate: the best stays modulation's 2000 GB/s, 0.5 of the copy ceiling; at 1 ms (6%) it
    sets 0.9."""
    for ms, expected in ((0.5, 0.5), (1.0, 0.9)):
        (tmp_path / str(ms)).mkdir()
        run = _report(tmp_path / str(ms))
        report = json.loads((run / "report.json").read_text())
        report["runs"][0]["categories"]["other"] = {"ms": ms, "bytes_est": ms * 3.6 * GB}
        (run / "report.json").write_text(json.dumps(report))
        result = _plan(run, "--gpu", "h200", "--out", tmp_path / str(ms) / "p")
        assert result.exit_code == 0, result.output
        plan = json.loads((tmp_path / str(ms) / "p" / "plan.json").read_text())
        assert plan["rates_here"]["memory_efficiency"] == pytest.approx(expected)


def test_compile_fuses_around_the_convolutions_and_bare_matmuls_too(tmp_path):
    """The tensors of matmul work no nn.Linear launched (a convolution's 3 GB, a bare matmul's 1 GB) join the fused
    chains' traffic: 4 GB more at the best memory-bound rate, 2000 GB/s, is 2 ms more than without them."""
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    categories = report["runs"][0]["categories"]
    categories["gemm"]["not_linear_bytes_est"] = 1 * GB
    categories["conv"] = {"ms": 4.0, "not_linear_bytes_est": 3 * GB}
    (run / "report.json").write_text(json.dumps(report))
    result = _plan(run, "--gpu", "h200", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    parts = next(r for r in json.loads((tmp_path / "p" / "plan.json").read_text())["knobs"]
                 if r["knobs"] == "compile")["parts_ms"]["blocks"]
    assert parts["fused elementwise"] == round((1e6 + 10 + 5e6 + 10 + 2.304e6) * 2 / 2000e6 + 4 * GB / 2000e6, 2)
    assert parts["conv"] == 4.0


def test_convolutions_scale_with_the_tensor_rate_on_another_gpu(tmp_path):
    """Convolution time (no FLOPs counted) is tensor-core work: on the B200 it scales by the dense bf16 rates' ratio
    and the two classes' attainable GEMM fractions, like the GEMMs; kernel gaps stay as measured."""
    from dit_accel.planning.published import attainable

    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["runs"][0]["categories"]["conv"] = {"ms": 4.0}
    (run / "report.json").write_text(json.dumps(report))
    result = _plan(run, "--gpu", "b200", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    here, there = datasheets()[1]["h200"], datasheets()[1]["b200"]
    base = next(r for r in plan["gpus"] if r["knobs"] == "baseline")
    (tmp_path / "w").mkdir()
    assert _plan(_report(tmp_path / "w"), "--gpu", "b200", "--out", tmp_path / "q").exit_code == 0  # no conv
    plain = next(r for r in json.loads((tmp_path / "q" / "plan.json").read_text())["gpus"] if r["knobs"] == "baseline")
    added = base["block_ms"]["blocks"] - plain["block_ms"]["blocks"]
    fractions = attainable("hopper", "gemm", "bf16") / attainable("blackwell-datacenter", "gemm", "bf16")
    assert added == pytest.approx(4.0 * here.tflops("bf16") / there.tflops("bf16") * fractions, abs=0.011)


def test_another_gpu_that_holds_two_blocks_but_not_the_model_streams_them(tmp_path):
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["blocks"]["blocks"]["param_bytes"] = 2 * GB  # 10 x 2 GB + 1 GB of activations (3 GB peak): > 16 GB
    (run / "report.json").write_text(json.dumps(report))
    result = _plan(run, "--gpu", "rtx-5080", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    rows = {r["knobs"]: r for r in json.loads((tmp_path / "p" / "plan.json").read_text())["gpus"]}
    base, full = rows["baseline"], rows["compile + fp8-attention + fp8-linear"]
    assert base["fits"] == full["fits"] == "streamed"
    # a streamed pass holds two blocks (in FP8 under FP8 linears) and the activations
    fp8_block = 2 * GB - (1000 * 5000 - 4 * 5000)
    assert base["memory_gib"] == round((2 * 2 * GB + 1 * GB) / 2**30, 2)
    assert full["memory_gib"] == round((2 * fp8_block + 1 * GB) / 2**30, 2)
    # each block the longer of its compute and its copy over the card's host link, the first copy not hidden
    link = datasheets()[1]["rtx-5080"].host_link_gbps * 1e6  # bytes per ms
    for row, block_bytes in ((base, 2 * GB), (full, fp8_block)):
        copy_ms = block_bytes / link
        assert row["pass_ms"] == pytest.approx(10 * max(row["block_ms"]["blocks"], copy_ms) + copy_ms, abs=0.1)


def test_the_host_link_the_run_measured_streams_here_and_scales_the_datasheets_elsewhere(tmp_path):
    """A report whose ceilings hold a measured host link (half the H200's 64 GB/s datasheet figure): this GPU's
    streamed rows copy at it, another GPU's at its datasheet link times the same half; --host-link-gbps still wins."""
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["ceilings"]["host_link_gbps"] = 32.0
    report["blocks"]["blocks"]["param_bytes"] = 2 * GB  # streamed on the RTX 5080 (see the test above)
    (run / "report.json").write_text(json.dumps(report))
    result = _plan(run, "--gpu", "rtx-5080", "--memory-budget", "8GiB", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["rates_here"]["host_link_gbps"] == 32.0
    stream = next(r for r in plan["knobs"] if r["knobs"] == "baseline + stream under 8GiB")
    assert stream["pass_ms"] == 10 * 100.0 + 2 * GB / 32e6 and "at 32 GB/s" in stream["model"]  # 62.5 ms copies
    there = datasheets()[1]["rtx-5080"].host_link_gbps * 32.0 / datasheets()[1]["h200"].host_link_gbps
    base = next(r for r in plan["gpus"] if r["knobs"] == "baseline")
    assert base["fits"] == "streamed" and f"({there:.4g} GB/s)" in base["note"]
    copy_ms = 2 * GB / (there * 1e6)
    assert base["pass_ms"] == pytest.approx(10 * max(base["block_ms"]["blocks"], copy_ms) + copy_ms, abs=0.1)
    flagged = _plan(run, "--memory-budget", "8GiB", "--host-link-gbps", "10", "--out", tmp_path / "q")
    rows = json.loads((tmp_path / "q" / "plan.json").read_text())["knobs"]
    assert flagged.exit_code == 0 and next(r for r in rows if r["knobs"] == "baseline + stream under 8GiB")[
        "pass_ms"] == round(11 * 2 * GB / 10e6, 1)


def test_fp8_attention_follows_the_crossover_the_router_reads(tmp_path):
    """On the H200's crossover data: a long call is predicted at our kernel's measured time there, whatever the
    block's own baseline call took (a masked SDPA runs far slower than the data's); a short one (where the data
    measured cuDNN faster, so the router sends it there) keeps its time."""
    from dit_accel.attention.crossover import packaged_for_gpu

    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    calls = [{"module": "attn", "kind": "self", "batch": 1, "heads": heads, "q_len": q_len, "kv_len": q_len,
              "head_dim": 128, "masked": False, "key_padding": False, "flops": 4.0 * heads * q_len * q_len * 128}
             for heads, q_len in ((48, 30272), (56, 128))]  # the first off the grid's 56 heads, nearest its 30272
    report["block_work"]["blocks"]["attention_calls"] = calls
    report["runs"][0]["categories"]["attention"]["flops"] = sum(c["flops"] for c in calls)
    ms = packaged_for_gpu("NVIDIA H200").ms
    assert ms[128, 30272, 30272]["fp8"] < ms[128, 30272, 30272]["cudnn"] and ms[128, 128, 128]["fp8"] > \
        ms[128, 128, 128]["cudnn"]
    for attention_ms in (50.0, 100.0):
        report["runs"][0]["categories"]["attention"]["ms"] = attention_ms
        (run / "report.json").write_text(json.dumps(report))
        out = tmp_path / f"p{attention_ms:.0f}"
        result = _plan(run, "--gpu", "h200", "--out", out)
        assert result.exit_code == 0, result.output
        parts = next(r for r in json.loads((out / "plan.json").read_text())["knobs"]
                     if r["knobs"] == "fp8-attention")["parts_ms"]["blocks"]
        short_ms = attention_ms * calls[1]["flops"] / sum(c["flops"] for c in calls)
        assert parts["attention (fp8)"] == round(ms[128, 30272, 30272]["fp8"] * 48 / 56, 2)  # at the point's rate
        assert parts["attention"] == round(short_ms, 2)  # routed to cuDNN: its time, scaled as bf16 on other GPUs


def test_a_joint_key_padding_call_runs_our_kernel_on_its_kept_rows(tmp_path):
    """A joint mask keeping 27000 of 30000 queries and keys (the capture read `kept`): our kernel on 27000 x 27000
    at its rate at the nearest crossover point, the 3000 dropped queries at the call's measured 50 ms x 10%, and
    the op's check reading the 1 GB mask once at 2000 GB/s; compile writes the mask once. Without `kept` (a report
    from before the capture read it, or a mask read on meta) the call is predicted at its full shape."""
    from dit_accel.attention.crossover import packaged_for_gpu

    crossover = packaged_for_gpu("NVIDIA H200")
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    call = {"module": "attn", "kind": "joint", "batch": 1, "heads": 56, "q_len": 30000, "kv_len": 30000,
            "head_dim": 128, "masked": True, "key_padding": True, "mask_bytes": 10**9,
            "flops": 4.0 * 56 * 30000 * 30000 * 128}
    report["runs"][0]["categories"]["attention"]["flops"] = call["flops"]
    for name, kept in (("kept", [[27000, 27000]]), ("unread", None)):
        report["block_work"]["blocks"]["attention_calls"] = [{**call, "kept": kept}]
        (run / "report.json").write_text(json.dumps(report))
        assert _plan(run, "--gpu", "h200", "--out", tmp_path / name).exit_code == 0
        rows = {r["knobs"]: r["parts_ms"]["blocks"] for r in
                json.loads((tmp_path / name / "plan.json").read_text())["knobs"]}
        length = 27000 if kept else 30000
        point = crossover.nearest_point(1, 56, length, length)
        kernel_ms = length**2 / (point[0] * point[1]) * crossover.ms[128, point[0], point[1]]["fp8"]
        assert rows["fp8-attention"]["attention (fp8)"] == round(kernel_ms, 2)
        if kept:
            assert rows["fp8-attention"]["attention"] == 5.0 and rows["fp8-attention"]["mask check"] == 0.5
        else:
            assert "attention" not in rows["fp8-attention"] and "mask check" not in rows["fp8-attention"]
        fused = (1e6 + 10 + 5e6 + 10 + 56 * 128 * 90000) * 2 / 2000e6 + 10**9 / 2000e6
        assert rows["compile"]["fused elementwise"] == round(fused, 2)


def test_streaming_parallelism_and_caching_rows(tmp_path):
    run = _report(tmp_path)
    result = _plan(run, "--memory-budget", "8GiB", "--host-link-gbps", "10", "--gpus", "2", "--cache-skip", "0.5",
                   "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "p" / "plan.json").read_text())["knobs"]
    full = next(r for r in rows if r["knobs"] == "compile + fp8-attention + fp8-linear")
    stream = next(r for r in rows if r["knobs"] == "baseline + stream under 8GiB")
    # 10 x 1 GB of blocks + 3 GB - 1 GB of activations > 8 GiB
    assert stream["fits"] == "streamed"
    # each 1 GB block copies in 100 ms at 10 GB/s, longer than its compute: 10 x 100 + the first copy 100
    assert stream["pass_ms"] == 1100.0 and full["pass_ms"] < 1100
    # streamed FP8 blocks: the FP8 linear's weight one byte each and a float32 scale per output row, so a block is
    # 1 GB - (1000 x 5000 - 4 x 5000) B, copied in 99.502 ms; the pass holds two of them and the activations
    fp8_block = 1 * GB - (1000 * 5000 - 4 * 5000)
    full_stream = next(r for r in rows if r["knobs"] == "compile + fp8-attention + fp8-linear + stream under 8GiB")
    assert full_stream["pass_ms"] == round(11 * fp8_block / 10e6, 1) and full["block_ms"]["blocks"] < 99.5
    assert full_stream["memory_gib"] == round((2 * fp8_block + 2 * GB) / 2**30, 2)
    parallel = next(r for r in rows if "Ulysses over 2" in r["knobs"])
    exchange_ms = 4 * 1000 * 8 * 96 * 2 * (2 - 1) / 4 / (450 * 1e6)  # NVLink 450 GB/s per direction, H200
    assert parallel["pass_ms"] == pytest.approx(10 * (full["block_ms"]["blocks"] / 2 + exchange_ms), abs=0.1)
    cached = next(r for r in rows if r["knobs"] == "compile + fp8-attention + fp8-linear + cache=fbc")
    assert cached["video_s"] == pytest.approx(100 * (0.5 * full["pass_ms"] + 0.5 * full["block_ms"]["blocks"]) / 1e3,
                                              abs=0.1)


def test_a_streamed_pass_the_run_measured_stands_beside_the_baselines_streaming_prediction(tmp_path):
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["memory_budget"] = "8GiB"
    report["validation"] = {"whole_model": True, "residency": "streamed", "measured_ms": 1150.0,
                            "peak_memory_bytes": 5.5 * 2**30, "streamed": {"h2d_gbps": 9.5}}
    (run / "report.json").write_text(json.dumps(report))
    result = _plan(run, "--memory-budget", "8GiB", "--host-link-gbps", "10", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "p" / "plan.json").read_text())["knobs"]
    base = next(r for r in rows if r["knobs"] == "baseline + stream under 8GiB")
    # 10 blocks of 100 ms, each 1 GB copied in 100 ms at 10 GB/s, the first copy not hidden: 1100 ms
    assert base["fits"] == "streamed" and base["pass_ms"] == 1100.0
    assert base["measured"]["pass_ms"] == 1150.0 and base["measured"]["difference_pct"] == {"pass": -4.3}
    assert base["measured"]["peak_gib"] == 5.5  # the pass's measured peak beside the predicted memory
    assert "pass 1150" in result.output and "(peak 5.5)" in result.output
    # another budget than the one measured: nothing beside the prediction
    other = _plan(run, "--memory-budget", "9GiB", "--host-link-gbps", "10", "--out", tmp_path / "q")
    rows = json.loads((tmp_path / "q" / "plan.json").read_text())["knobs"]
    assert "measured" not in next(r for r in rows if r["knobs"] == "baseline + stream under 9GiB") and \
        other.exit_code == 0


def test_a_real_profile_block_report_is_what_plan_reads(tmp_path):
    """The contract: a CPU profile-block report, its device renamed to a GPU of the table, gives a full plan."""
    out = tmp_path / "cpu-run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "64", "--runs", "1", "--warmup",
                                       "1", "--compare-attn", "native,native+compile", "--out", str(out)])
    assert result.exit_code == 0, result.output
    refused = _plan(out, "--out", tmp_path / "x")
    assert refused.exit_code == 2 and "is a cpu-scaled-down run" in refused.output and not (tmp_path / "x").exists()
    report = json.loads((out / "report.json").read_text())
    report["run_kind"], report["device"]["name"], report["device"]["total_memory_gib"] = "gpu", "NVIDIA H200", 139.8
    report["ceilings"]["fp8_gemm_tflops"] = 2 * report["ceilings"]["gemm_tflops"]
    (out / "report.json").write_text(json.dumps(report))
    result = _plan(out, "--out", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert len(plan["knobs"]) == 8 and {r["gpu"] for r in plan["gpus"]} == set(datasheets()[1])
    assert next(r for r in plan["knobs"] if r["knobs"] == "compile")["measured"]["recipe"] == "native+compile"


@pytest.mark.parametrize("case, args, words", [
    ("not a run", ["--gpu", "h200"], "has no report.json"),
    ("unknown gpu", ["--gpu", "h300"], "unknown GPU 'h300'; the datasheet table has: rtx-5080"),
    ("skip 1", ["--cache-skip", "1"], "--cache-skip must be below 1"),
    ("no work", [], "predates `dit-accel plan`"),
    ("compiled first", [], "predictions start from an eager recipe"),
])
def test_bad_inputs_are_one_line(tmp_path, case, args, words):
    if case == "not a run":
        run = tmp_path / "empty"
        run.mkdir()
    elif case == "no work":
        run = _report(tmp_path, block_work=False)
    else:
        run = _report(tmp_path)
    if case == "compiled first":
        report = json.loads((run / "report.json").read_text())
        report["runs"][0]["backend"] = "cudnn+compile"
        (run / "report.json").write_text(json.dumps(report))
    result = _plan(run, *args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and words in result.output and result.output.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_every_datasheet_figure_has_a_source_and_the_h200_is_found():
    conventions, gpus = datasheets()
    assert any("dense" in line for line in conventions)
    for gpu in gpus.values():
        for figure in ("memory_gbps", "host_link_gbps"):
            assert getattr(gpu, figure) > 0
        # each figure's source: a page (its address and the words quoted) or this project's own measurement
        assert gpu.sources and all(source["quote"] and (source.get("url", "").startswith("http")
                                                        or "measured" in source) for source in gpu.sources.values())
    for key in ("rtx-5080", "rtx-5090", "rtx-pro-6000-ws", "l40s", "h100-sxm", "h200", "b200"):
        assert key in gpus
    assert gpu_of_device("NVIDIA H200").key == "h200" and gpu_of_device("Intel CPU") is None


def test_a_report_carries_the_options_that_rebuild_its_block(tmp_path):
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--model", "wan", "--seq-len", "64",
                                       "--runs", "1", "--warmup", "1", "--seed", "7", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["rerun_options"] == ["--model=wan", "--block=0", "--seq-len=64", "--batch=1", "--warmup=1",
                                       "--runs=1", "--device=cpu", "--seed=7", "--dtype=fp32"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_verify_without_a_gpu_is_one_line(tmp_path):
    result = _plan(_report(tmp_path), "--verify", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "--verify runs the knobs on this machine's GPU" in result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_gpu_verify_measures_every_knob_beside_its_prediction(tmp_path, monkeypatch):
    """A short H3 block on this GPU: profile-block, then plan --verify runs the eight knob combinations on the same
    block and inputs; every row of the plan has its measured time beside the prediction."""
    monkeypatch.chdir(tmp_path)  # the verify run goes to outputs/ under the working folder
    result = CliRunner().invoke(main, ["profile-block", "--seq-len", "4096", "--runs", "3", "--warmup", "1",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    result = _plan(tmp_path / "run", "--verify", "--gpu", "h100-sxm", "--out", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert len(plan["verified_in"]) == 1 and (tmp_path / plan["verified_in"][0]).is_dir()
    rows = [row for row in plan["knobs"] if row["basis"] == "predicted from this run"]
    assert len(rows) == 7 and all("measured" in row for row in rows)
    for row in rows:  # a loose bound on a short block; the H200 figures at full size are in docs/plan.md
        assert all(abs(d) < 50 for d in row["measured"]["difference_pct"].values()), row


def test_verify_streams_the_baseline_our_attention_and_the_full_recipe_and_says_what_it_could_not(tmp_path,
                                                                                                   monkeypatch):
    """--verify --memory-budget streams the whole transformer three times: the baseline, our FP8 attention, the full
    recipe; each pass stands beside its row's prediction (knobs and budget alike); a pass profile-block refuses (the
    block and its profiling do not fit the budget) is a note and plan.json's not_verified, and the plan is written."""
    from dit_accel.commands import plan as plan_command

    run = _report(tmp_path)
    monkeypatch.setattr(plan_command, "_verify_run", lambda run, baseline, out: run)
    monkeypatch.setattr(plan_command, "_streamed_recipes", lambda baseline: ["cudnn", "fp8", "fp8+fp8-linear+compile"])
    pass_ms = {"cudnn": 1150.0, "fp8+fp8-linear+compile": 800.0}

    def stream(run, baseline, recipe, budget, out):
        if recipe == "fp8":
            raise UserError("the block needs about 19.6 GiB: it does not fit in the 16GiB budget")
        (tmp_path / recipe).mkdir()
        streamed = _report(tmp_path / recipe)
        report = json.loads((streamed / "report.json").read_text())
        report["runs"][0]["backend"] = recipe
        report["memory_budget"] = budget.text
        report["validation"] = {"whole_model": True, "residency": "streamed", "measured_ms": pass_ms[recipe],
                                "streamed": {"h2d_gbps": 9.5}}
        (streamed / "report.json").write_text(json.dumps(report))
        return streamed

    monkeypatch.setattr(plan_command, "_verify_streaming", stream)
    result = _plan(run, "--verify", "--memory-budget", "16GiB", "--host-link-gbps", "10", "--out", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    assert "--verify could not stream the pass with fp8: the block needs about 19.6 GiB" in result.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["verified_in"] == [str(run), str(tmp_path / "cudnn" / "run"),
                                   str(tmp_path / "fp8+fp8-linear+compile" / "run")]
    assert plan["not_verified"] == ["the streamed pass with fp8 under 16GiB: the block needs about 19.6 GiB: it does "
                                    "not fit in the 16GiB budget"]
    rows = {row["knobs"]: row for row in plan["knobs"] if "stream" in row["knobs"]}
    assert list(rows) == ["baseline + stream under 16GiB", "fp8-attention + stream under 16GiB",
                          "compile + fp8-attention + fp8-linear + stream under 16GiB"]
    base = rows["baseline + stream under 16GiB"]
    assert base["measured"]["recipe"] == "cudnn, --validate model --offload stream"
    # 10 GB of blocks and 2 GB of activations fit 16 GiB resident (10 x 100 ms), but --verify streamed them: the
    # row predicts the streamed pass (each 1 GB block copied in 100 ms at 10 GB/s, the first copy not hidden)
    assert base["fits"] == "model" and base["pass_ms"] == 1100.0 and "fits resident (1000 ms a pass" in base["model"]
    assert base["measured"]["pass_ms"] == 1150.0 and base["measured"]["difference_pct"] == {"pass": -4.3}
    ours = rows["fp8-attention + stream under 16GiB"]
    alone = next(row for row in plan["knobs"] if row["knobs"] == "fp8-attention")
    assert "measured" not in ours and ours["fits"] == "model" and ours["pass_ms"] == 1100.0 > alone["pass_ms"]
    full = rows["compile + fp8-attention + fp8-linear + stream under 16GiB"]
    assert full["measured"]["recipe"] == "fp8+fp8-linear+compile, --validate model --offload stream"
    assert full["measured"]["difference_pct"]["pass"] == pytest.approx(100 * (full["pass_ms"] / 800.0 - 1), abs=0.06)


def test_verify_names_the_recipes_its_run_left_out(tmp_path, monkeypatch):
    """The verify's profile-block runs with --keep-going: a recipe torch could not compile on the block is left out
    of it, and the plan says so (a note, plan.json's not_verified) and is written, that row without a measurement."""
    from dit_accel.commands import plan as plan_command

    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["recipes_left_out"] = {"cudnn+fp8-linear+compile": "cudnn+fp8-linear+compile on this block: torch 2.11 "
                                                              "could not compile it (...)"}
    (run / "report.json").write_text(json.dumps(report))
    monkeypatch.setattr(plan_command, "_verify_run", lambda run, baseline, out: run)
    result = _plan(run, "--verify", "--out", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    assert "--verify left cudnn+fp8-linear+compile out: cudnn+fp8-linear+compile on this block" in result.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["not_verified"] == ["cudnn+fp8-linear+compile: cudnn+fp8-linear+compile on this block: torch 2.11 "
                                    "could not compile it (...)"]
    assert "measured" not in next(r for r in plan["knobs"] if r["knobs"] == "compile + fp8-linear")


def test_a_folder_that_is_not_a_run_is_refused_before_torch_loads():
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from dit_accel.cli import main; "
            "r = CliRunner().invoke(main, ['plan', '/nonexistent']); print(r.exit_code); print(r.output); "
            "print('TORCH', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("2\n") and "/nonexistent is not a folder" in done.stdout, done.stdout + done.stderr
    assert "TORCH False" in done.stdout


def test_an_out_folder_that_is_taken_is_refused_before_anything_runs(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "plan.json").write_text("{}")
    result = _plan(_report(tmp_path), "--verify", "--out", taken)
    assert result.exit_code == 2 and "is a folder that is not empty" in result.output
    assert result.output.count("\n") == 1 and (taken / "plan.json").read_text() == "{}"


def test_a_streamed_pass_that_fails_is_a_line_of_not_verified_and_the_plan_is_written(tmp_path, monkeypatch):
    """A streamed verify run that fails other than by a user's error (Allegro's full recipe on the H200: diffusers'
    offloading could not swap a compiled FP8 weight) leaves the knobs' measurements standing: one note naming the
    error, plan.json's not_verified, exit 0."""
    from dit_accel.commands import plan as plan_command

    run = _report(tmp_path)
    monkeypatch.setattr(plan_command, "_verify_run", lambda run, baseline, out: run)
    monkeypatch.setattr(plan_command, "_streamed_recipes", lambda baseline: ["fp8+fp8-linear+compile"])

    def stream(run, baseline, recipe, budget, out):
        raise RuntimeError("Cannot swap t1 because it has weakref associated with it\nmore")

    monkeypatch.setattr(plan_command, "_verify_streaming", stream)
    result = _plan(run, "--verify", "--memory-budget", "16GiB", "--host-link-gbps", "10", "--out", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    why = "failed (RuntimeError: Cannot swap t1 because it has weakref associated with it)"
    assert f"--verify could not stream the pass with fp8+fp8-linear+compile: {why}" in " ".join(result.output.split())
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["not_verified"] == [f"the streamed pass with fp8+fp8-linear+compile under 16GiB: {why}"]


def _long_call_report(tmp_path, gpu_name: str):
    """_report's run on `gpu_name`, its one attention call the H3 shape (B1 H56 S30272 D128) and a short cross-
    attention (30272 x 777)."""
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["device"]["name"] = gpu_name
    calls = [{"module": "attn", "kind": kind, "batch": 1, "heads": 56, "q_len": 30272, "kv_len": kv_len,
              "head_dim": 128, "masked": False, "key_padding": False, "flops": 4.0 * 56 * 30272 * kv_len * 128}
             for kind, kv_len in (("self", 30272), ("cross", 777))]
    report["block_work"]["blocks"]["attention_calls"] = calls
    report["runs"][0]["categories"]["attention"]["flops"] = sum(c["flops"] for c in calls)
    (run / "report.json").write_text(json.dumps(report))
    return run, calls


def test_without_crossover_data_fp8_attention_is_an_estimate_that_says_so(tmp_path):
    """A GPU with no shipped crossover data and none in the run folder: the long call at the stated fraction of the
    FP8 GEMM ceiling, the short one declined as the router's conservative rule declines it; each FP8-attention row
    says it is an estimate and from what."""
    from dit_accel.planning.predict import ROOFLINE_FP8_ATTENTION

    run, calls = _long_call_report(tmp_path, "NVIDIA L40S")
    result = _plan(run, "--gpu", "h100-sxm", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["fp8_attention_estimated"] and plan["crossover"] == "no crossover data for NVIDIA L40S"
    row = next(r for r in plan["knobs"] if r["knobs"] == "fp8-attention")
    assert row["basis"] == "predicted from this run; FP8 attention estimated" and row["model"].startswith("ESTIMATED")
    parts = row["parts_ms"]["blocks"]
    assert parts["attention (fp8)"] == round(calls[0]["flops"] / (ROOFLINE_FP8_ATTENTION * 2000.0 * 1e9), 2)
    assert parts["attention"] == round(50.0 * calls[1]["flops"] / (calls[0]["flops"] + calls[1]["flops"]), 2)
    assert "FP8 attention ESTIMATED" in " ".join(result.output.split())


def test_the_run_folders_own_crossover_data_is_what_plan_reads(tmp_path):
    """A run folder holding the crossover its GPU was measured with (profile-block copies it there): our kernel at
    its rate at the nearest point of that data (the long call; the short one routed to cuDNN), and the plan names
    it."""
    from dit_accel.attention.crossover import RUN_FILE, packaged_for_gpu

    run, calls = _long_call_report(tmp_path, "NVIDIA L40S")
    packaged = packaged_for_gpu("NVIDIA H200")
    with open(packaged.source) as file:
        data = json.load(file)
    data["device"]["gpu"] = "NVIDIA L40S"
    for point in data["points"]:  # our kernel a quarter slower than the H200 measured it (faster than cuDNN still)
        point["ms"]["fp8"] *= 1.25
    (run / RUN_FILE).write_text(json.dumps(data))
    assert _plan(run, "--gpu", "h100-sxm", "--out", tmp_path / "p").exit_code == 0
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert not plan["fp8_attention_estimated"] and plan["crossover"].startswith(
        f"crossover data of the run ({RUN_FILE}, NVIDIA L40S")
    parts = next(r for r in plan["knobs"] if r["knobs"] == "fp8-attention")["parts_ms"]["blocks"]
    assert parts["attention (fp8)"] == round(1.25 * packaged.ms[128, 30272, 30272]["fp8"], 2)


@pytest.mark.parametrize("example", ["h3-h100", "kandinsky-5-h100"])
def test_the_shipped_example_runs_plan_on_any_machine_and_say_where_they_were_measured(example, tmp_path):
    """The repository's examples/ hold real GPU runs (H100, 2026-12-07): plan reads them on a machine without a GPU,
    says first that they were measured elsewhere, routes our kernel's rates from their own crossover data, and puts
    every knob row beside its measurement."""
    folder = Path(__file__).parents[2] / "examples" / example
    result = _plan(folder, "--gpu", "rtx-5080,h200", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.startswith("note: this run was measured on another machine (NVIDIA H100 80GB HBM3, host ")
    assert ("FP8 attention: crossover data of the run (crossover.json, NVIDIA H100 80GB HBM3 (measured 2026-12-07))"
            in text)
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert not plan["fp8_attention_estimated"] and all("measured" in row for row in plan["knobs"][1:8])
    assert {row["gpu"] for row in plan["gpus"]} == {"rtx-5080", "h200"}


def test_a_run_of_this_machine_is_not_called_foreign(monkeypatch):
    import platform
    import socket

    from dit_accel.commands.plan import measured_elsewhere

    report = {"device": {"name": "NVIDIA H999"},
              "provenance": {"host": {"name": socket.gethostname(), "platform": platform.platform()},
                             "timestamp": "2026-12-07T10:00:00+00:00", "git": {"commit": "0123456789", "dirty": False}}}
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index: "NVIDIA H999")
    assert measured_elsewhere(report) is None
    report["provenance"]["host"]["platform"] = "Linux-another-kernel"
    assert measured_elsewhere(report) == ("this run was measured on another machine (NVIDIA H999, host "
                                          f"{socket.gethostname()}, 2026-12-07, dit-accel 0123456): the plan scales "
                                          "what it measured there")


def test_published_measurements_are_predicted_from_a_saved_run_exactly(tmp_path):
    """plan --check on the shipped H100 run: each published figure beside the model's prediction, which reproduces
    by hand: the RTX 5080's cuDNN attention at the run's baseline attention rate times the 5080's dense bf16 rate
    over the H100's, and the GeForce class's attainable attention fraction over Hopper's."""
    from dit_accel.planning.published import measurements

    folder = Path(__file__).parents[2] / "examples" / "h3-h100"
    result = _plan(folder, "--gpu", "rtx-5080", "--check", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    assert "Published measurements beside the model's prediction" in result.output
    checks = json.loads((tmp_path / "p" / "plan.json").read_text())["evidence"]
    assert len(checks) == len(measurements())
    report = json.loads((folder / "report.json").read_text())
    attention = report["runs"][0]["categories"]["attention"]
    gpus = datasheets()[1]
    h100, rtx5080 = gpus["h100-sxm"], gpus["rtx-5080"]
    cudnn = next(c for c in checks if c["gpu"] == "rtx-5080" and c["kind"] == "attention" and c["dtype"] == "bf16")
    # the GeForce class's attainable attention fraction: the median of the 4090's FA2 and the 5090's cuDNN and FA2
    # figures over their datasheet rates (the 5080's own figure is not in it: this is a check); Hopper's likewise
    geforce = sorted([164 / gpus["rtx-4090"].bf16_tflops, 203.61 / gpus["rtx-5090"].bf16_tflops,
                      215 / gpus["rtx-5090"].bf16_tflops])[1]
    hopper = sorted([648 / h100.bf16_tflops, 595 / h100.bf16_tflops,
                     4 * 64 * 32768**2 * 128 / 50.769e-3 / 1e12 / gpus["h200"].bf16_tflops])[1]
    expected = (attention["flops"] / (attention["ms"] * 1e9) * rtx5080.bf16_tflops * geforce
                / (h100.bf16_tflops * hopper))
    assert cudnn["predicted"] == pytest.approx(expected, rel=1e-12)
    assert cudnn["published"] == pytest.approx(26.274848309248e12 / 226.2e-3 / 1e12, rel=1e-9)  # 226.2 ms
    assert cudnn["error"] == pytest.approx(cudnn["published"] / expected - 1, rel=1e-12)
    rows = json.loads((tmp_path / "p" / "plan.json").read_text())["gpus"]
    assert rows[0]["evidence"].startswith("2 published measurement(s) check it")  # the rest are its class's basis
    assert rows[0]["evidence"].endswith("(worst: rtx-5080/attention/1)")  # named as --check's table names it
    assert abs(cudnn["error"]) < 0.15  # the RTX 5080's cuDNN attention: +9%, its share of the block within 1 point
    share = next(c for c in checks if c["kind"] == "attention_share")
    assert abs(share["error"]) < 5


def test_a_gpu_row_whose_class_has_no_published_fraction_says_its_evidence_is_thin(tmp_path):
    folder = Path(__file__).parents[2] / "examples" / "h3-h100"
    assert _plan(folder, "--gpu", "l40s", "--out", tmp_path / "p").exit_code == 0
    row = json.loads((tmp_path / "p" / "plan.json").read_text())["gpus"][0]
    assert row["thin_evidence"] == ["attention bf16"]  # the L40S: a GEMM figure, no attention one
    assert row["evidence"].endswith("thin: no published fraction for its attention bf16, the datasheet ratio alone")


@pytest.mark.parametrize("change, words", [
    (lambda e: {**e, "gpu": "rtx-9090"}, "GPU 'rtx-9090' is not in the datasheet table"),
    (lambda e: {**e, "source": ""}, "has no source or no quote"),
    (lambda e: {**e, "quote": "  "}, "has no source or no quote"),
    (lambda e: {**e, "unit": "furlongs"}, "kind must be one of"),
])
def test_a_measurement_of_an_unknown_gpu_or_without_a_source_is_refused_in_one_line(change, words):
    from dit_accel.planning import published

    data = json.loads((Path(published.__file__).parent / "data" / "measurements.json").read_text())
    data["measurements"][0] = change(data["measurements"][0])
    with pytest.raises(UserError, match=words) as error:
        published.measurements(data, "test data")
    assert "\n" not in str(error.value)


def test_every_shipped_measurement_has_a_source_a_quote_and_a_gpu_of_the_table():
    from dit_accel.planning.published import measurements

    entries = measurements()
    assert entries and all(m.source and m.quote for m in entries)
    assert all(m.tflops is not None or m.kind == "attention_share" for m in entries)


@pytest.mark.slow
def test_verify_profiles_the_runs_block_again_through_the_library_not_the_command(tmp_path, monkeypatch):
    """plan --verify's runs go through `profiling.request` (the library profile-block itself runs on), rebuilt from
    the report's `rerun`: here on the CPU, a scaled-down run profiled again with two recipes into a folder of its own
    (the GPU check before it is --verify's own)."""
    from dit_accel.commands import plan as plan_command
    from dit_accel.run_dir import read_run

    run = tmp_path / "run"
    assert CliRunner().invoke(main, ["profile-block", "--seq-len", "64", "--runs", "1", "--warmup", "0", "--out",
                                     str(run)]).exit_code == 0
    assert read_run(run)["rerun"]["seq_len"] == 64
    monkeypatch.chdir(tmp_path)
    again = plan_command._profile_again(run, None, tmp_path / "again", ["native", "math"], keep_going=True)
    report = read_run(again)
    assert [r["backend"] for r in report["runs"]] == ["native", "math"]
    assert report["rerun"] == read_run(run)["rerun"] and report["workload"] == read_run(run)["workload"]


def test_each_knob_set_is_one_recipe_and_reads_back_as_itself():
    """The knobs are declared once (`planning.knobs`): the recipe --verify runs for a set of them turns exactly that
    set, on every baseline attention; a recipe on another attention than a baseline's or ours predicts nothing."""
    from dit_accel.planning.knobs import BASELINE_ATTENTION, KNOB_NAMES, knobs_of, recipe_of
    from dit_accel.planning.predict import KNOB_MODELS, knob_sets

    assert set(KNOB_MODELS) == set(KNOB_NAMES) and len(knob_sets()) == 2 ** len(KNOB_NAMES)
    assert "cudnn" in BASELINE_ATTENTION and "native" in BASELINE_ATTENTION and "math" not in BASELINE_ATTENTION
    for baseline in BASELINE_ATTENTION:
        for knobs in knob_sets():
            assert knobs_of(recipe_of(knobs, baseline)) == knobs, (baseline, knobs)
    assert recipe_of(frozenset(KNOB_NAMES), "cudnn") == "fp8+fp8-linear+compile"
    assert recipe_of(frozenset({"compile"}), "native") == "native+compile"
    assert knobs_of("cudnn+max-autotune") == {"compile"}
    assert knobs_of("math") is None and knobs_of("fa4+compile") is None


# --- plan --cache: TaylorSeer's schedule is diffusers' own, the rows by hand, what a block run cannot predict ---


@pytest.mark.parametrize("steps, interval, warmup", [(50, 5, 3), (50, 2, 1), (30, 3, 2), (10, 1, 1), (7, 4, 5)])
def test_taylorseer_schedule_is_the_one_diffusers_runs(steps, interval, warmup):
    from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    class Counted(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Counted.calls += 1
            return x * 2

    model = torch.nn.Module()
    model.attn = Counted()
    apply_taylorseer_cache(model, TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=warmup,
                                                        cache_identifiers=["attn"]))
    _set_cache_context(model, CacheContext("cond"))  # one pass a step, as a pipeline's denoising call sets it
    for step in range(steps):
        model.attn(torch.full((2,), float(step)))
    assert Counted.calls == taylorseer_computed_steps(steps, interval, warmup)


def test_cache_rows_reproduce_the_model_by_hand(tmp_path):
    run = _report(tmp_path)
    result = CliRunner().invoke(main, ["plan", str(run), "--cache", "taylorseer:interval=2:warmup=1", "--gpu",
                                       "h100-sxm", "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    rows = {row["knobs"]: row for row in json.loads((tmp_path / "p" / "plan.json").read_text())["knobs"]}
    cached = rows["baseline + cache=taylorseer:interval=2:warmup=1"]
    # 50 steps: step 0, then 2, 4, ..., 48 computed: 25, so half the attention modules' forwards are skipped. The
    # block's attention module: all its attention (50 ms) and the GEMM time of the linear inside it (attn.to_q: all
    # but 200 of the 1e10 + 200 FLOPs); no module ranges, so none of the memory-bound time. Its Taylor bookkeeping:
    # 768000 output elements (1000 rows x 8 heads x 96), half predicted (2 + 10 x 2 B), half updated (10 B), at the
    # run's best memory-bound rate (2000 GB/s).
    attention_ms = 50 + 30 * 1e10 / (1e10 + 200)
    taylor_ms = 768000 * (0.5 * 22 + 0.5 * 10) / 2000e6
    pass_ms = 1000 - 10 * (0.5 * attention_ms - taylor_ms)
    assert cached["pass_ms"] == round(pass_ms, 1)
    assert cached["video_s"] == round(100 * pass_ms / 1e3, 1)
    assert "25 of 50 steps computed (50% skipped)" in cached["model"]
    full = rows["compile + fp8-attention + fp8-linear + cache=taylorseer:interval=2:warmup=1"]
    assert full["pass_ms"] < rows["compile + fp8-attention + fp8-linear"]["pass_ms"]


def test_verify_runs_the_video_under_a_fixed_schedule_cache_beside_its_prediction(tmp_path, monkeypatch):
    """plan --cache taylorseer --verify runs the whole video under the cache with the baseline and with the full
    recipe (profile-block --validate model --cache, through the library), each measured pass beside its row's
    prediction with the graphs compiled during it; a video that fails is a note and a not_verified line."""
    from dit_accel.commands import plan as plan_command

    run = _report(tmp_path)
    monkeypatch.setattr(plan_command, "_verify_run", lambda run, baseline, out: run)
    monkeypatch.setattr(plan_command, "_runs_here", lambda name, baseline, skipped: True)
    asked = []

    def video(run, baseline, out, recipes, **more):
        asked.append((recipes, more))
        (recipe,) = recipes
        if recipe == "cudnn":
            folder = tmp_path / "video-cudnn"
            folder.mkdir()
            report = json.loads((_report(folder) / "report.json").read_text())
            report["validation"] = {"video": {"cache": more["cache"].label, "pass_ms": 800.0, "graphs_compiled": 0,
                                              "work_computed": 0.5}}
            (folder / "run" / "report.json").write_text(json.dumps(report))
            return folder / "run"
        raise RuntimeError("compiled video failed\nsecond line")

    monkeypatch.setattr(plan_command, "_profile_again", video)
    result = _plan(run, "--cache", "taylorseer:interval=2:warmup=1", "--verify", "--gpu", "h200",
                   "--out", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    assert [(r, m["validate"], m["cache"].label) for r, m in asked] == [
        (["cudnn"], "model", "cache=taylorseer:interval=2:warmup=1"),
        (["fp8+fp8-linear+compile"], "model", "cache=taylorseer:interval=2:warmup=1")]
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["verified_in"] == [str(run), str(tmp_path / "video-cudnn" / "run")]
    assert plan["not_verified"] == ["the video under cache=taylorseer:interval=2:warmup=1 with "
                                    "fp8+fp8-linear+compile: failed (RuntimeError: compiled video failed)"]
    rows = {row["knobs"]: row for row in plan["knobs"]}
    base = rows["baseline + cache=taylorseer:interval=2:warmup=1"]
    assert base["measured"] == {"recipe": "cudnn, --validate model --cache taylorseer:interval=2:warmup=1",
                                "run": str(tmp_path / "video-cudnn" / "run"), "pass_ms": 800.0,
                                "graphs_compiled": 0, "work_computed": 0.5,
                                "difference_pct": {"pass": round(100 * (base["pass_ms"] / 800.0 - 1), 1)}}
    assert "measured" not in rows["compile + fp8-attention + fp8-linear + cache=taylorseer:interval=2:warmup=1"]
    assert "--verify could not run the video under cache=taylorseer:interval=2:warmup=1 with fp8+fp8-linear+compile" \
        in " ".join(result.output.split())


def test_verify_runs_no_video_under_a_threshold_cache_and_says_why(tmp_path, monkeypatch):
    from dit_accel.commands import plan as plan_command

    run = _report(tmp_path)
    monkeypatch.setattr(plan_command, "_verify_run", lambda run, baseline, out: run)
    monkeypatch.setattr(plan_command, "_profile_again", lambda *a, **k: pytest.fail("no video runs"))
    result = _plan(run, "--cache", "fbc", "--cache-skip", "0.3", "--verify", "--out", tmp_path / "plan")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["not_verified"] == ["cache=fbc: First Block Cache skips by a threshold: measure it with generate "
                                    "--attn RECIPE+cache=fbc"]


def test_a_threshold_cache_takes_the_fraction_given(tmp_path):
    run = _report(tmp_path)
    result = CliRunner().invoke(main, ["plan", str(run), "--cache", "mag", "--cache-skip", "0.4", "--gpu", "h100-sxm",
                                       "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    rows = {row["knobs"]: row for row in json.loads((tmp_path / "p" / "plan.json").read_text())["knobs"]}
    # MagCache decides before the first block: a skipped pass runs only the outside (0 ms here)
    assert rows["baseline + cache=mag"]["pass_ms"] == 600.0
    result = CliRunner().invoke(main, ["plan", str(run), "--cache", "dbcache:fn=2:bn=1", "--cache-skip", "0.4",
                                       "--gpu", "h100-sxm", "--out", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output
    rows = {row["knobs"]: row for row in json.loads((tmp_path / "q" / "plan.json").read_text())["knobs"]}
    # cache-dit's DBCache still runs its first 2 and last 1 blocks (100 ms each) on a skipped pass
    assert rows["baseline + cache=dbcache:fn=2:bn=1"]["pass_ms"] == 0.6 * 1000 + 0.4 * 300


def test_pab_and_faster_cache_skip_the_self_attention_modules_by_the_fraction_given(tmp_path):
    """The block's one attention call is self-attention: PAB at --cache-skip 0.4 saves 40% of the attention module's
    time in every block (as TaylorSeer's model counts it: its attention and the GEMM time of attn.to_q), FasterCache
    the same less its extrapolation, 16 bytes an output element (1000 x 8 x 96) at 2000 GB/s."""
    run = _report(tmp_path)
    rows = {}
    for method in ("pab", "faster"):
        result = CliRunner().invoke(main, ["plan", str(run), "--cache", method, "--cache-skip", "0.4", "--gpu",
                                           "h100-sxm", "--out", str(tmp_path / method)])
        assert result.exit_code == 0, result.output
        rows |= {row["knobs"]: row for row in json.loads((tmp_path / method / "plan.json").read_text())["knobs"]}
    attention_ms = 50 + 30 * 1e10 / (1e10 + 200)
    assert rows["baseline + cache=pab"]["pass_ms"] == round(1000 - 10 * 0.4 * attention_ms, 1)
    assert "returns its last output" in rows["baseline + cache=pab"]["model"]
    faster_ms = 1000 - 10 * 0.4 * (attention_ms - 768000 * 16 / 2000e6)
    assert rows["baseline + cache=faster"]["pass_ms"] == round(faster_ms, 1)
    assert "--cache-skip 0.4 (40% skipped)" in rows["baseline + cache=faster"]["model"]


@pytest.mark.parametrize("text, skip, words", [
    ("pab", None, "skips self-attention forwards by the pipeline's timesteps, which a block run does not have: give "
                  "the fraction it skips with --cache-skip R"),
    ("fbc", None, "give the fraction it skips with --cache-skip R"),
    ("taylorseer", 0.3, "leave out --cache-skip"),
])
def test_what_a_block_run_cannot_predict_is_one_line(tmp_path, text, skip, words):
    run = _report(tmp_path)
    skip_option = ["--cache-skip", str(skip)] if skip else []
    result = CliRunner().invoke(main, ["plan", str(run), "--cache", text, *skip_option, "--out", str(tmp_path / "p")])
    assert result.exit_code == 2 and result.output.startswith("error: ") and words in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "p").exists()


@pytest.mark.parametrize("cache, hooked, per_step, expected", [
    # First Block Cache on 10 blocks, 2 passes a step: a skipped pass still computes the first block (9 of 10 left)
    ("cache=fbc:0.1", 10, [(2, 20), (2, 11), (2, 2)], 3 / 6),
    # cache-dit's DBCache (fn=1) on the tiny Wan's 2 blocks, as test_step_cache counts it: 8 of 12 passes skipped
    ("cache=dbcache:0.5:fn=1:warmup=2", 2, [(2, 4), (2, 4), (2, 2), (2, 2), (2, 2), (2, 2)], 8 / 12),
    ("cache=mag", 4, [(1, 4), (1, 0), (1, 4), (1, 0)], 2 / 4),  # MagCache skips whole passes
    ("cache=pab", 30, [(2, 60), (2, 30), (2, 30)], 60 / 180),  # PAB: of the self-attention forwards
    ("cache=taylorseer", 30, [(2, 60), (2, 0)], None),  # plan counts its schedule
    ("cache=mag:calibrate", 4, [(1, 4), (1, 4)], None),  # a calibration skips nothing
])
def test_a_generate_runs_cache_summary_gives_the_skip_fraction_plan_takes(cache, hooked, per_step, expected):
    from dit_accel.planning.cached import cache_skip_measured

    summary = {"cache": cache, "hooked_modules": hooked,
               "per_step": [{"passes": p, "computed": c, "full": p * hooked} for p, c in per_step]}
    assert cache_skip_measured(summary) == (None if expected is None else pytest.approx(expected))


def test_the_plan_of_a_cache_names_its_schedule():
    plan = cache_plan(parse_cache("taylorseer"), 50, None)  # diffusers' defaults: interval 5, warmup 3
    assert plan.saves == "attention" and plan.skipped == pytest.approx(1 - 13 / 50)


# --- plan --cache-run: a generate run's passes, cached or not, beside their predictions ---------------------------

def _generate_run(tmp_path, runs, *, frames=17, device="NVIDIA H200"):
    """A generate run folder of 50 steps at `frames` x 480x832: each run (label, transformer ms a step, step cache
    summary or None)."""
    report = {"device": {"name": device}, "request": {"frames": frames, "height": 480, "width": 832, "steps": 50},
              "runs": [{"attention": label, "stages": {"transformer_ms_per_step": [step_ms] * 50},
                        "graphs_compiled": 0, "attention_patch": {"step_cache": [cache]} if cache else {}}
                       for label, step_ms, cache in runs]}
    folder = tmp_path / "generate"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def _block_of_the_video(tmp_path):
    run = _report(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["rerun_options"] = ["--model=wan", "--frames=17", "--height=480", "--width=832"]
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_a_generate_runs_passes_are_set_beside_their_predictions(tmp_path):
    """Each run of a generate run predicted: uncached from the recipe's pass, First Block Cache from the skip it
    measured (half its passes: 25 steps of the 50 ran the first block alone), MagCache's calibration as skipping
    nothing, a recipe with no knob set said."""
    fbc = {"cache": "cache=fbc:0.2", "method": "First Block Cache", "hooked_modules": 10, "passes": 100,
           "work_computed": 0.55, "per_step": [{"passes": 2, "computed": 20 if i % 2 else 2, "full": 20}
                                               for i in range(50)]}
    calibration = {**fbc, "cache": "cache=mag:calibrate", "method": "MagCache", "work_computed": 1.0,
                   "per_step": [{"passes": 2, "computed": 20, "full": 20}] * 50}
    folder = _generate_run(tmp_path, [("cudnn", 2000.0, None), ("cudnn+cache=fbc:0.2", 1200.0, fbc),
                                      ("cudnn+cache=mag:calibrate", 2100.0, calibration), ("fa4", 1800.0, None)])
    result = _plan(_block_of_the_video(tmp_path), "--cache-run", folder, "--gpu", "h200", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    rows = {row["knobs"]: row for row in json.loads((tmp_path / "p" / "plan.json").read_text())["knobs"]}
    uncached = rows["baseline (whole video)"]
    assert uncached["pass_ms"] == 1000.0 and uncached["measured"]["pass_ms"] == 1000.0  # 2000 ms a step, 2 passes
    assert uncached["measured"]["difference_pct"] == {"pass": 0.0}
    cached = rows["baseline + cache=fbc:0.2"]
    # half the passes skipped, each running the first block (100 ms) and the outside (0): 0.5 x 1000 + 0.5 x 100
    assert cached["pass_ms"] == 550.0 and "--cache-skip 0.5 (50% skipped)" in cached["model"]
    assert cached["measured"] == {"recipe": "cudnn+cache=fbc:0.2, generate", "run": str(folder), "pass_ms": 600.0,
                                  "graphs_compiled": 0, "difference_pct": {"pass": -8.3}}
    assert rows["baseline + cache=mag:calibrate"]["pass_ms"] == 1000.0  # a calibration skips nothing
    assert rows["baseline + cache=mag:calibrate"]["measured"]["difference_pct"] == {"pass": -4.8}
    assert rows["fa4"]["basis"] == "not predicted" and rows["fa4"]["measured"]["pass_ms"] == 900.0


@pytest.mark.parametrize("change, message", [
    ({"frames": 21}, "ran 21 frames of 480x832 over 50 steps and the block was profiled for 17 frames of 480x832"),
    ({"device": "NVIDIA H100 80GB HBM3"}, "ran on NVIDIA H100 80GB HBM3 and the block on NVIDIA H200"),
])
def test_a_generate_run_of_another_video_or_gpu_is_refused(tmp_path, change, message):
    folder = _generate_run(tmp_path, [("cudnn", 2000.0, None)], **change)
    result = _plan(_block_of_the_video(tmp_path), "--cache-run", folder, "--out", tmp_path / "p")
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1
    assert not (tmp_path / "p").exists()
    (tmp_path / "again").mkdir()
    result = _plan(_block_of_the_video(tmp_path / "again"), "--cache-run", tmp_path, "--out", tmp_path / "p")
    assert result.exit_code == 2 and "is not a dit-accel generate run folder" in result.output


def test_a_generate_run_without_transformer_times_is_refused(tmp_path):
    folder = _generate_run(tmp_path, [("cudnn", 0.0, None)])
    result = _plan(_block_of_the_video(tmp_path), "--cache-run", folder, "--out", tmp_path / "p")
    assert result.exit_code == 2 and "'s cudnn run has no transformer time per step" in result.output

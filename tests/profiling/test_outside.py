"""The transformer's parts outside the blocks: the zero-block model of each
family, its inputs for the block profile's workload, its measurement and `profile-block --outside measure`."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dit_accel.adapters import adapter_for_preset
from dit_accel.cli import main
from dit_accel.loading.block import synthetic_outside
from dit_accel.profiling import memory
from dit_accel.profiling.outside import measure_outside, outside_weight_bytes

CPU = torch.device("cpu")
FAMILIES = ("minimax-h3", "wan")


def _scaled_down(family):
    adapter = adapter_for_preset(family)
    return adapter.scaled_down()


def _shapes(module):
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_zero_block_transformer_is_the_full_model_without_its_blocks(family):
    adapter = _scaled_down(family)
    outside = adapter.build_outside()
    blocks = adapter.block_key_template.split(".")[0]  # transformer_blocks / blocks
    assert len(getattr(outside, blocks)) == 0
    with torch.device("meta"):
        full = adapter.transformer_class(**{k: v for k, v in adapter.config.items() if not k.startswith("_")})
    assert len(getattr(full, blocks)) == adapter.num_blocks > 0
    kept = {name: shape for name, shape in _shapes(full).items() if not name.startswith(blocks + ".")}
    assert _shapes(outside) == kept
    if family == "minimax-h3":  # the refiner is outside the 50 blocks: it stays
        assert len(outside.token_refiner.refiner_blocks) == adapter.config["num_refiner_layers"] == 2
    # Computed buffers (the RoPE tables) are real, not left empty on meta, and survive materializing.
    model = synthetic_outside(adapter, CPU, torch.float32)
    reference = adapter.transformer_class(**{**{k: v for k, v in adapter.config.items() if not k.startswith("_")},
                                             "num_layers": 0})
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, dict(reference.named_buffers())[name], msg=name)
    assert all(not p.is_meta and torch.isfinite(p).all() and p.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_its_forward_runs_on_the_inputs_of_the_block_workload(family):
    adapter = _scaled_down(family)
    workload = adapter.workload_from_seq_len(1024, 1)
    model = synthetic_outside(adapter, CPU, torch.float32)
    inputs = adapter.make_transformer_inputs(workload, CPU, torch.float32, torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(**inputs.kwargs)
    c = adapter.config
    if family == "minimax-h3":  # packed rows: exactly the block's S, and one output row per video / audio row
        assert inputs.seq_len == workload.seq_len == 1024
        assert inputs.kwargs["position_ids"].shape == (workload.seq_len, 3)
        video, audio = output
        assert video.shape == (1, workload.rows["video"], c["in_channels"] * 4)
        assert audio.shape == (1, workload.rows["audio"], c["audio_in_channels"])
    else:  # a latent is a whole grid: S=1024 on the 80-wide frame gives the nearest one, 13 x 80
        assert inputs.seq_len == 13 * 80 and "nearest" in inputs.layout
        (sample,) = output
        assert sample.shape == inputs.kwargs["hidden_states"].shape


def test_the_default_workloads_run_the_designed_grids():
    h3 = adapter_for_preset("minimax-h3")
    inputs = h3.make_transformer_inputs(h3.workload_from_seq_len(30272, 1), torch.device("meta"),
                                        torch.bfloat16, None)
    assert inputs.seq_len == 30272 and "31 x 22 x 40" in inputs.layout  # 121 frames at 704x1280
    assert inputs.kwargs["hidden_states"].shape == (1, 27280, 96)
    wan = adapter_for_preset("wan")
    for workload in (wan.workload_from_seq_len(75600, 1), wan.workload_from_video(81, 720, 1280, 1)):
        inputs = wan.make_transformer_inputs(workload, torch.device("meta"), torch.bfloat16, None)
        assert inputs.seq_len == 75600 and "exact" in inputs.layout
        assert inputs.kwargs["hidden_states"].shape == (1, 16, 21, 90, 160)  # 81 frames at 720x1280


def test_measure_outside_and_the_memory_estimate_count_its_weights():
    adapter = _scaled_down("minimax-h3")
    workload = adapter.workload_from_seq_len(256, 1)
    measured = measure_outside(adapter, workload, CPU, torch.float32, warmup=1, runs=2)
    assert measured.median_ms > 0 and measured.timing.runs == 2 and measured.seq_len == 256
    assert measured.param_bytes == outside_weight_bytes(adapter, torch.float32) > 0
    assert "refiner" in measured.source and measured.source.startswith("measured: the transformer without its blocks")
    from dit_accel.patching.recipe import parse_recipe
    from dit_accel.profiling.session import ProfileSettings

    def estimate(on):
        return memory.estimate_session(ProfileSettings(adapter, workload, torch.float32, CPU, (parse_recipe("native"),),
                                                       measure_outside=on))
    # Every run builds the transformer without its blocks (with one block per stack) to capture the block's
    # inputs from its own forward: the estimate counts its weights whether or not it is also timed.
    off, on = estimate(False), estimate(True)
    assert off.outside_bytes == on.outside_bytes == measured.param_bytes
    assert on.total_bytes == off.total_bytes


def test_profile_block_outside_measure_adds_it_to_every_extrapolation(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "256", "--outside", "measure",
                                       "--runs", "2", "--warmup", "1", "--compare-attn", "native,math",
                                       "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    outside = report["outside"]
    assert outside["median_ms"] > 0 and outside["seq_len"] == 256 and outside["param_bytes"] > 0
    for run in report["runs"]:
        e = run["extrapolation"]
        assert e["outside_ms"] == outside["median_ms"]
        assert e["outside_source"].startswith("measured: the transformer without its blocks")
        assert "median of 2" in e["outside_source"]
        assert e["pass_ms"] == pytest.approx(50 * run["block_ms"] + e["outside_ms"])
    assert report["memory_estimate"]["outside_bytes"] == outside["param_bytes"]


def test_outside_measure_and_outside_ms_conflict_in_one_line(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--outside", "measure", "--outside-ms",
                                       "3", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--outside-ms" in lines[0], result.stderr
    assert result.stdout == ""
    assert not out.exists()

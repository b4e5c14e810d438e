"""`dit-accel profile-block --model NAME` for every family, scaled down on the CPU, through the command line: a
block of each stack built, its inputs captured, each recipe run (a routed test double beside diffusers' default),
the per-module breakdown with every matmul and attention kernel in a named range, the extrapolation over every
stack, the router's refusals counted; and `dit-accel models`."""
from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from testing import every_family

from dit_accel.adapters import FAMILIES, adapter_for_preset
from dit_accel.cli import main

FAST = ("--device", "cpu", "--runs", "1", "--warmup", "0", "--quiet")


def _run(tmp_path, *args):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", *FAST, *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text()), list(csv.DictReader((out / "ops.csv").open())), result


@pytest.mark.parametrize("name", every_family())
def test_every_family_profiles_a_block_of_each_stack(name, tmp_path, fake_backend):
    adapter = adapter_for_preset(name)
    # the routed backend first: the block's ranges are derived while its swaps are in place
    report, ops, result = _run(tmp_path, "--model", name, "--compare-attn", "fake,native")
    stacks = [stack for stack, _ in adapter.stacks]
    assert [(run["stack"], run["backend"]) for run in report["runs"]] == [(s, r) for s in stacks
                                                                         for r in ("fake", "native")]
    extrapolation = report["runs"][0]["extrapolation"]
    assert [s["stack"] for s in extrapolation["stacks"]] == stacks
    assert extrapolation["num_blocks"] == sum(count for _, count in adapter.stacks)
    assert all(run["attention_flops"] > 0 and run["linear_flops"] > 0 for run in report["runs"])
    body = adapter.body_label
    # Every matmul and attention kernel of the block runs inside a named range, not in the block body nor in
    # the attention module's leftovers.
    unnamed = [(op["range"], op["kernel"]) for op in ops if op["stage"] == "block"
               and op["category"] in ("gemm", "attention") and op["range"] in (body, "attention (other)")]
    assert not unnamed, unnamed
    # The attention modules' own tensor work is named by kind (copies and joins, elementwise, norms): what stays
    # "attention (other)" is only work of no named kind (views, slices). (Its share is not asserted: on a CPU
    # these tiny ops' times are mostly host noise.)
    rest = {op["category"] for op in ops if op["range"] == "attention (other)"}
    assert rest <= {"other"}, rest
    # A routed backend reaches every attention call of every family, through diffusers' dispatch or (CogVideoX,
    # Mochi, Allegro) torch's SDPA in the processor's file, masked text padding included (HunyuanVideo,
    # HunyuanVideo 1.5, Motif-Video, LTX-Video, Allegro); the report counts them for one block call.
    calls = {run["stack"]: run["attention_calls"] for run in report["runs"] if run["backend"] == "fake"}
    assert all(c["served"] > 0 and c["fallback"] == {} for c in calls.values()), calls
    assert all(run["attention_calls"] is None for run in report["runs"] if run["backend"] == "native")
    assert len(fake_backend.calls) >= sum(c["served"] for c in calls.values())


def test_a_stack_can_be_named_and_validate_n_needs_one(tmp_path):
    report, _, _ = _run(tmp_path, "--model", "hunyuan-video", "--block", "single_transformer_blocks.2")
    assert [run["stack"] for run in report["runs"]] == ["single_transformer_blocks"]
    assert report["blocks"]["single_transformer_blocks"]["index"] == 2
    result = CliRunner().invoke(main, ["profile-block", *FAST, "--model", "hunyuan-video", "--validate", "4",
                                       "--out", str(tmp_path / "v")])
    assert result.exit_code == 2 and "name one stack with --block" in result.output
    result = CliRunner().invoke(main, ["profile-block", *FAST, "--model", "hunyuan-video", "--block", "nope",
                                       "--out", str(tmp_path / "n")])
    assert result.exit_code == 2 and "has no block stack 'nope'" in result.output


@pytest.mark.slow
def test_a_sectioned_video_costs_each_section_its_steps(tmp_path):
    """HunyuanVideo FramePack makes 129 frames as 4 sections of 33, each denoised by its own 50 steps: one pass
    is one section behind its packed history, and the video costs 200 steps of it. --seq-len cannot say a
    section: refused in one line."""
    report, _, _ = _run(tmp_path, "--model", "hunyuan-video-framepack", "--frames", "129", "--height", "64",
                        "--width", "64", "--compare-attn", "native")
    assert report["workload"]["sections"] == 4 and report["workload"]["rows"]["history"] == 40
    extrapolation = report["runs"][0]["extrapolation"]
    assert extrapolation["steps"] == 200 and "each of the video's 4 sections" in extrapolation["steps_source"]
    result = CliRunner().invoke(main, ["profile-block", *FAST, "--model", "helios", "--seq-len", "1000",
                                       "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "not --seq-len" in result.output and not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def models_rows():
    """`models --json`, run once for the tests that read it (it builds every family's transformer on meta)."""
    result = CliRunner().invoke(main, ["models", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.slow
def test_models_lists_every_family(models_rows):
    assert [row["family"] for row in models_rows] == list(FAMILIES)
    by_family = {row["family"]: row for row in models_rows}
    assert by_family["hunyuan-video"]["stacks"] == {"transformer_blocks": 20, "single_transformer_blocks": 40}
    assert by_family["wan"]["fp8_attention"] == "yes" and by_family["sana-video"]["fp8_attention"].startswith("no")


@pytest.mark.slow
def test_models_reads_at_80_columns_and_never_cuts_a_name(monkeypatch, models_rows):
    """The table was ~150 columns wide and cut preset names with "…" at 100; the default view is now a few lines per
    family: at 80 columns no line past the width, no ellipsis, and every family, preset and stack name whole on one
    line."""
    width = 80
    from rich.console import Console

    from dit_accel.commands import models

    narrow = Console(width=width, record=True, highlight=False)
    monkeypatch.setattr(models, "console", narrow)
    assert CliRunner().invoke(main, ["models"]).exit_code == 0
    text = narrow.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width and "…" not in text
    for row in models_rows:
        for name in (row["family"], *row["presets"], *row["stacks"]):
            assert any(name in line for line in lines), name

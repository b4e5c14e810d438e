"""`dit-accel compare RUN_A RUN_B` on two real CPU profile-block runs, and its one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dit_accel.cli import main

FAST = ["--seq-len", "64", "--runs", "2", "--warmup", "1", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """native and math attention on the same scaled-down block: two saved run folders."""
    root = tmp_path_factory.mktemp("compare")
    folders = []
    for attn in ("native", "math"):
        out = root / attn
        result = CliRunner().invoke(main, ["profile-block", *FAST, "--attn", attn, "--out", str(out)])
        assert result.exit_code == 0, result.output
        folders.append(out)
    return folders


def compare(*args):
    return CliRunner().invoke(main, ["compare", *map(str, args)])


@pytest.mark.slow
def test_two_runs_side_by_side(two_runs):
    a, b = two_runs
    result = compare(a, b)
    assert result.exit_code == 0, result.output
    out = result.output
    for title in ("By kind of work (ms per block)", "By module (ms per block)", "Block and whole model"):
        assert title in out
    assert "A ms (native)" in out and "B ms (math)" in out
    assert "attention core" in out and "gemm" in out and "per video (extrapolated)" in out
    assert "scaled-down CPU run" in out  # both are
    ra, rb = (json.loads((f / "report.json").read_text())["runs"][0] for f in two_runs)
    assert f"{ra['block_ms'] / rb['block_ms']:.2f}x" in out  # the block speed-up, A over B
    assert f"{ra['categories']['attention']['ms']:.2f}" in out
    assert "differ in" not in out  # same model, workload, dtype and device


def test_backend_picks_a_run_of_a_compare_attn_report(two_runs, tmp_path):
    out = tmp_path / "both"
    result = CliRunner().invoke(main, ["profile-block", *FAST, "--compare-attn", "native,math", "--out", str(out)])
    assert result.exit_code == 0, result.output
    result = compare(out, two_runs[0], "--backend-a", "math")
    assert result.exit_code == 0, result.output
    assert "A ms (math)" in result.output
    result = compare(out, two_runs[0], "--backend-a", "fa4")
    assert result.exit_code == 2 and "has no run with attention 'fa4'; it has native, math" in result.output


def _saved(tmp_path, name, report):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_reports_from_before_the_precisions_and_with_an_fp8_split_compare(two_runs, tmp_path):
    """A report written before rows had precisions and ceilings by name, against one whose GEMM row is split
    into FP8 and bf16 work (an FP8-linear recipe on a GPU): compare reads the rows' ms, which both have."""
    old, new = (json.loads((folder / "report.json").read_text()) for folder in two_runs)
    for run in old["runs"]:
        run.pop("fp8_linear_flops")
        for row in run["categories"].values():
            for key in ("precision", "ceiling"):
                row.pop(key, None)
    for key in ("fp8_gemm_tflops", "fp8_gemm_unavailable"):
        old["ceilings"].pop(key)
    gemm = new["runs"][0]["categories"]["gemm"]
    gemm.update(precision="mixed", ceiling=None, pct_of_ceiling=None, by_precision={
        "fp8": {"ms": 0.75 * gemm["ms"], "share_pct": 1.0, "precision": "fp8", "flops": 1.0, "tflops": 1.0,
                "pct_of_ceiling": 65.0, "ceiling": "FP8 GEMM"},
        "bfloat16": {"ms": 0.25 * gemm["ms"], "share_pct": 1.0, "precision": "bfloat16", "flops": 1.0,
                     "tflops": 1.0, "pct_of_ceiling": 63.0, "ceiling": "bfloat16 GEMM"}})
    result = compare(_saved(tmp_path, "old", old), _saved(tmp_path, "new", new))
    assert result.exit_code == 0, result.output
    assert f"{old['runs'][0]['categories']['gemm']['ms']:.2f}" in result.output
    assert f"{gemm['ms']:.2f}" in result.output


def _damaged(tmp_path, how):
    folder = tmp_path / how.replace(" ", "-")
    if how == "missing folder":
        return folder
    folder.mkdir()
    if how == "truncated report":
        (folder / "report.json").write_text('{"runs": [{"backend": "nat')
    elif how == "not profile-block":
        (folder / "report.json").write_text(json.dumps({"stages": {"denoise_ms": 3.0}, "runs": []}))
    return folder


@pytest.mark.parametrize("how, message", [
    ("missing folder", "is not a folder"),
    ("no report", "has no report.json: it is not a profile-block run folder"),
    ("truncated report", "cannot read"),
    ("not profile-block", "is not a profile-block report"),
])
def test_a_folder_that_is_not_a_run_is_one_line(two_runs, tmp_path, how, message):
    bad = _damaged(tmp_path, how)
    for args in ((bad, two_runs[0]), (two_runs[0], bad)):  # as RUN_A and as RUN_B
        result = compare(*args)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_compare_module_imports_no_torch():
    code = "import sys, dit_accel.commands.compare; print('torch' in sys.modules or 'diffusers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


"""`generate --ulysses N`: the one-line refusals on any machine, the head-count check on a tiny Wan
pipeline, and (two or more GPUs) a torchrun run whose video matches the single-GPU one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dit_accel.cli import main
from dit_accel.errors import UserError
from dit_accel.pipelines.pipeline_folder import inspect_pipeline_folder, load_pipeline
from dit_accel.pipelines.parallel import apply_ulysses


@pytest.mark.parametrize("args, message", [
    (["--ulysses", "2"], "needs 2 processes, one per GPU: run `torchrun --nproc-per-node 2"),
    (["--ulysses", "0"], "--ulysses must be at least 1"),
    (["--ulysses", "2", "--offload", "stream"], "--ulysses and --offload stream do not combine"),
    (["--ulysses", "2", "--device", "cuda:1"], "leave out --device"),
])
def test_ulysses_refusals_are_one_line_and_write_nothing(tiny_wan, tmp_path, args, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and message in result.output and result.output.count("\n") == 1
    assert not out.exists()


def test_a_taken_output_folder_is_refused_before_the_ranks_start(tiny_wan, tmp_path, monkeypatch):
    """Every rank checks --out before waiting for the others (only rank 0 writes), so no rank hangs."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun, but the check comes first
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--out", str(taken), "--ulysses", "2"])
    assert result.exit_code == 2 and "is a folder that is not empty" in result.output
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]


def test_ulysses_degree_must_divide_the_heads(tiny_wan):
    pipe = load_pipeline(inspect_pipeline_folder(tiny_wan), device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(UserError, match="splits the 2 attention heads"):
        apply_ulysses(pipe, 3)


def _frames(path: Path) -> np.ndarray:
    reader = imageio.get_reader(str(path))
    try:
        return np.stack([frame.astype(np.float32) for frame in reader])
    finally:
        reader.close()


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["bf16", "fp8"])
def test_ulysses_on_two_gpus_matches_one_gpu(tiny_wan, tmp_path, attn):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    if attn == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 kernel needs sm_89 or newer")
    common = ["generate", "--pipeline", str(tiny_wan), "--dtype", "bf16", "--attn", attn, "--no-warmup"]
    single, split = tmp_path / "one", tmp_path / "two"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "dit_accel", *common, "--device", "cuda:0", "--out", str(single)],
                   check=True, env=env, timeout=600)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "dit_accel",
                          *common, "--ulysses", "2", "--out", str(split)], env=env, timeout=600,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((split / "report.json").read_text())
    assert report["ulysses_degree"] == 2 and "Ulysses x2" in report["header"]["parallel"]
    if attn == "fp8":
        patch = report["runs"][0]["attention_patch"]
        assert patch["served_calls"] > 0, patch
    a, b = _frames(single / "video.mp4"), _frames(split / "video.mp4")
    assert a.shape == b.shape
    assert np.abs(a - b).mean() < 2.0  # 8-bit video levels; bf16 reductions differ in order across GPUs

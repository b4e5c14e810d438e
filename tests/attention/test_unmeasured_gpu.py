"""A GPU the project has shipped no crossover data for, on the CPU: the conservative rule the router follows until
the crossover is measured, the measurement made once and cached under its key (device, torch, cuDNN, kernel), a
corrupt or foreign cache refused in one line and measured again, and what profile-block and plan do with it.

The CPU stands in for such a GPU: `ROUTED_DEVICE_TYPES` admits it, a routed test double stands in for our kernel
(`fake_fp8`), and the CPU's small grid is measured."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from testing import RecordingSdpa, wan_block_and_inputs

from dit_accel.attention import backends, crossover
from dit_accel.attention.backends import AttentionBackend
from dit_accel.attention.bench import AttentionShape
from dit_accel.attention.crossover import (CONSERVATIVE_RULE, ConservativeRule, CrossoverGrid, crossover_for,
                                          measure_here)
from dit_accel.attention.routing import use_attention_backend
from dit_accel.cli import main

CPU = torch.device("cpu")
BF16 = torch.bfloat16
SMALL_GRID = CrossoverGrid(1, 2, (16, 64), (16, 64), (32,))


@pytest.fixture
def cpu_as_unmeasured_gpu(monkeypatch):
    """Calls on the CPU routed as on a GPU without shipped data; a small grid; no DIT_ACCEL_CROSSOVER."""
    monkeypatch.delenv(crossover.ENV_VAR, raising=False)
    monkeypatch.setattr(crossover, "ROUTED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setitem(crossover.GRIDS, "cpu", SMALL_GRID)


@pytest.fixture
def fake_fp8(monkeypatch):
    kernel = RecordingSdpa()
    monkeypatch.setitem(backends.BACKENDS, "fp8", AttentionBackend("fp8", "test double", kernel, lambda d: None,
                                                                   routed=True))
    return kernel


# --- the rule ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, picks", [
    ((1, 56, 30272, 30272, 128), "fp8"),  # MiniMax-H3's self-attention
    ((1, 40, 75600, 75600, 128), "fp8"),  # Wan 720p's self-attention
    ((1, 56, 8192, 8192, 64), "fp8"),  # 56 x 8192 query rows, 8192 keys: the rule's corner
    ((2, 28, 8192, 8192, 128), "fp8"),  # the same rows as B2 H28
    ((1, 56, 8191, 8192, 128), "native"),  # one query row short
    ((1, 56, 4096, 30272, 128), "native"),  # 56 x 4096 rows: won on both GPUs (1.17-1.31x), but not by enough
    ((1, 56, 30272, 8191, 128), "native"),  # one key short
    ((1, 56, 30272, 777, 128), "native"),  # a text cross-attention (the H100's 0.62x call)
    ((1, 56, 129, 129, 128), "native"),  # one tile and a row (0.44x)
    ((1, 56, 1, 4097, 128), "native"),  # one query row over 4097 keys (0.25x)
    ((1, 32, 47616, 512, 64), "native"),  # Kandinsky 5's visual cross-attention
    ((1, 32, 512, 512, 64), "native"),  # Kandinsky 5's text block
])
def test_the_conservative_rule_serves_long_calls_only(shape, picks):
    batch, heads, seq_q, seq_kv, head_dim = shape
    assert CONSERVATIVE_RULE.pick("fp8", batch, heads, seq_q, seq_kv, head_dim, BF16) == picks
    assert CONSERVATIVE_RULE.pick("fp8-v1", batch, heads, seq_q, seq_kv, head_dim, BF16) == picks.replace(
        "fp8", "fp8-v1")
    assert CONSERVATIVE_RULE.pick("fa4", batch, heads, seq_q, seq_kv, head_dim, BF16) is None  # not our kernel


def test_the_rule_holds_on_every_shipped_crossover():
    """Wherever the rule serves a grid point, our kernel was measured fastest there; wherever it was measured
    slower, the rule declines (the rule may decline a point the kernel wins: it is conservative)."""
    packaged = sorted((crossover.resources.files(crossover.__package__) / crossover.DATA_PACKAGE_DIR).iterdir(),
                      key=lambda e: e.name)
    tables = [crossover.Crossover.from_data(json.loads(e.read_text()), e.name) for e in packaged
              if e.name.endswith(".json")]
    assert tables
    for table in tables:
        for head_dim in table.head_dims:
            for seq_q in table.seq_q:
                for seq_kv in table.seq_kv:
                    rule = CONSERVATIVE_RULE.pick("fp8", table.batch, table.heads, seq_q, seq_kv, head_dim, BF16)
                    if rule == "fp8":
                        assert table.pick("fp8", table.batch, table.heads, seq_q, seq_kv, head_dim, BF16) == "fp8", (
                            table.key["gpu"], head_dim, seq_q, seq_kv)


def test_a_gpu_without_data_routes_by_the_rule(cpu_as_unmeasured_gpu, fake_fp8, monkeypatch):
    """Wan's block (20 video rows, 7 text rows, 2 heads), the rule scaled to it: the self-attention (20 keys, 40 query
    rows) is served, the cross-attention to 7 text keys goes to diffusers' default, counted under the rule's
    reason."""
    monkeypatch.setattr(crossover, "CONSERVATIVE_RULE", ConservativeRule(min_seq_kv=16, min_query_rows=32))
    block, inputs = wan_block_and_inputs()
    with torch.no_grad(), use_attention_backend(block, "fp8") as routed:
        block(*inputs)
    reason = ConservativeRule.reason("native")
    assert routed.served_calls == 1 and routed.fallback_calls == {reason: 1}
    assert [k_shape[1] for _, k_shape in fake_fp8.calls] == [20]
    assert "routed by the conservative rule" in routed.crossover_note


def test_the_rule_explains_itself_without_times():
    entry = CONSERVATIVE_RULE.explain("fp8", AttentionShape(1, 56, 30272, 777, 128), BF16)
    assert entry["picks"] == "native" and entry["backend_ms"] is None and entry["nearest_point"] == "none (the rule)"
    assert CONSERVATIVE_RULE.explain("fa4", AttentionShape(1, 56, 30272, 777, 128), BF16) is None


# --- the measurement and its cache -----------------------------------------------------------------------

def test_the_crossover_is_measured_once_and_cached_under_its_key(cpu_as_unmeasured_gpu, fake_fp8):
    first = measure_here(CPU)
    assert first.seconds is not None and first.replaced is None and first.table is not None
    path = crossover.cache_file(crossover.device_key(CPU))
    assert path.is_file() and path.parent.name == "crossover"
    key = crossover.device_key(CPU)
    assert path.name.startswith("cpu_torch-") and f"_cudnn-{key['cudnn']}".lower() in path.name
    assert path.name.endswith(f"_kernel-{crossover.kernel_fingerprint()}.json")
    data = json.loads(path.read_text())
    assert data["kernel"]["fingerprint"] == crossover.kernel_fingerprint() and data["measured_at"]
    assert data["device"] == crossover.device_key(CPU) and len(data["points"]) == len(SMALL_GRID.shapes())
    assert first.note.startswith("crossover data measured on this machine") and "measured now in" in first.note
    second = measure_here(CPU)
    assert second.seconds is None and second.note.startswith("crossover data measured on this machine")
    table, note = crossover_for(CPU)
    assert isinstance(table, crossover.Crossover) and note == second.note
    path.unlink()


def test_the_measurement_can_be_skipped(cpu_as_unmeasured_gpu, fake_fp8):
    skipped = measure_here(CPU, skip=True)
    assert skipped.seconds is None and skipped.table is None and "conservative rule" in skipped.note
    assert not crossover.cache_file(crossover.device_key(CPU)).exists()


def test_nothing_is_measured_where_our_kernel_cannot_run(cpu_as_unmeasured_gpu):
    measured = measure_here(CPU)  # the real fp8 backend needs a CUDA GPU
    assert measured.seconds is None and "conservative rule" in measured.note


@pytest.mark.parametrize("spoil, words", [
    (lambda data: "{not json", "cannot be read"),
    (lambda data: json.dumps({**data, "points": data["points"][1:]}), "cannot be read"),
    (lambda data: json.dumps({**data, "device": {**data["device"], "gpu": "NVIDIA H999"}}),
     "was measured for NVIDIA H999"),
    (lambda data: json.dumps({**data, "kernel": {"fingerprint": "0123456789ab"}}), "kernel 0123456789ab"),
])
def test_a_corrupt_or_foreign_cache_is_refused_in_one_line_and_measured_again(cpu_as_unmeasured_gpu, fake_fp8,
                                                                             spoil, words):
    measure_here(CPU)
    path = crossover.cache_file(crossover.device_key(CPU))
    path.write_text(spoil(json.loads(path.read_text())))
    table, note = crossover_for(CPU)
    assert table is CONSERVATIVE_RULE  # never routed by a file it cannot trust
    again = measure_here(CPU)
    assert again.seconds is not None and words in again.replaced and "\n" not in again.replaced
    assert str(path) in again.replaced
    assert json.loads(path.read_text())["kernel"]["fingerprint"] == crossover.kernel_fingerprint()
    path.unlink()


@pytest.mark.slow
def test_profile_block_measures_it_first_and_keeps_it_in_the_run(cpu_as_unmeasured_gpu, fake_fp8, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--attn", "fp8", "--runs", "1", "--warmup", "0", "--seq-len",
                                       "64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["crossover"]["measured_now_s"] is not None and report["crossover"]["file"] == crossover.RUN_FILE
    assert report["header"]["attention routing"].startswith("crossover data measured on this machine")
    assert json.loads((out / crossover.RUN_FILE).read_text())["device"] == crossover.device_key(CPU)
    skipped = tmp_path / "skipped"
    crossover.cache_file(crossover.device_key(CPU)).unlink()
    result = CliRunner().invoke(main, ["profile-block", "--attn", "fp8", "--runs", "1", "--warmup", "0", "--seq-len",
                                       "64", "--skip-crossover", "--out", str(skipped)])
    assert result.exit_code == 0, result.output
    report = json.loads((skipped / "report.json").read_text())
    assert report["crossover"]["measured_now_s"] is None and report["crossover"]["file"] is None
    assert "conservative rule" in report["header"]["attention routing"]
    assert not (skipped / crossover.RUN_FILE).exists()

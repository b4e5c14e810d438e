"""bench-attention: shapes, the reference, the measured rows, and the command end to end on the CPU
(through click, writing its three files), plus the real thing on a GPU where there is one."""
from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from dit_accel.attention import backends, reference
from dit_accel.attention import bench
from dit_accel.attention.backends import AttentionBackend, BackendCannotServe, TwoPhases
from dit_accel.attention.bench import AttentionShape, bench_shape, parse_shapes
from dit_accel.attention.reference import reference_attention, reference_dtype
from dit_accel.cli import main
from dit_accel.errors import UserError

CPU = torch.device("cpu")


def test_shapes_parse_self_and_cross_attention():
    assert parse_shapes("1x56x30272x128, 2x4x100x7x64") == [
        AttentionShape(1, 56, 30272, 30272, 128), AttentionShape(2, 4, 100, 7, 64)]
    assert AttentionShape.parse("1x56x30272x128").flops == 4 * 56 * 30272**2 * 128
    assert AttentionShape.parse("2x4x100x7x64").label == "2x4x100x7x64"


@pytest.mark.parametrize("text", ["1x56x30272", "1x0x8x64", "axbxcxd", "1x2x3x4x5x6", ""])
def test_bad_shapes_are_user_errors(text):
    with pytest.raises(UserError, match="BxHxSxD"):
        parse_shapes(text)


def test_reference_is_chunked_fp64_attention(monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_CHUNK_SCORES", 3 * 2 * 11)  # force several query chunks
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 3, 8, generator=generator, dtype=torch.float64) for n in (13, 11, 11))
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(reference_attention(q, k, v, dtype=torch.float64), expected, rtol=1e-12, atol=1e-12)


def test_reference_dtype_is_fp32_only_for_big_gpu_shapes():
    h3 = AttentionShape.parse("1x56x30272x128")
    assert reference_dtype(h3.scores, torch.device("cuda")) == torch.float32
    assert reference_dtype(h3.scores, CPU) == torch.float64
    assert reference_dtype(AttentionShape.parse("1x2x256x64").scores, torch.device("cuda")) == torch.float64


def test_outliers_scale_one_entry_in_a_thousand():
    shape = AttentionShape.parse("1x2x500x100")
    q_plain, q_outliers = (bench.make_inputs(shape, dtype=torch.float32, device=CPU, inputs=inputs,
                                             generator=torch.Generator().manual_seed(0))[0]
                           for inputs in ("normal", "outliers"))
    scaled = q_outliers != q_plain
    assert scaled.sum().item() == 100  # 1e-3 of 2*500*100 entries
    torch.testing.assert_close(q_outliers[scaled], 50 * q_plain[scaled])


def test_rows_for_available_unavailable_unservable_and_two_phase_backends():
    def sdpa(q, k, v, scale=None):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              scale=scale).transpose(1, 2)

    def refuses(q, k, v, scale=None):
        raise BackendCannotServe("head dim 64 not served")

    def crashes(q, k, v, scale=None):
        raise RuntimeError("graph build failed\nlong details")

    two_phase = AttentionBackend("halves", "", lambda q, k, v, scale=None: sdpa(q, k, v, scale).half().float(),
                                 lambda d: None,
                                 phases=TwoPhases(lambda q, k, v, scale=None: (q.half(), k.half(), v.half()),
                                                  lambda p: sdpa(*(t.float() for t in p)).half().float()))
    candidates = [backends.BACKENDS["math"], backends.BACKENDS["fa4"],
                  AttentionBackend("picky", "", refuses, lambda d: None),
                  AttentionBackend("broken", "", crashes, lambda d: None),
                  two_phase,
                  AttentionBackend("cudnn", "stand-in baseline", sdpa, lambda d: None)]
    rows = bench_shape(AttentionShape.parse("1x2x64x32x64"), candidates, dtype=torch.float32, device=CPU,
                       warmup=1, runs=10, seed=0)
    by_key = {(r.backend, r.timed): r for r in rows}

    assert by_key["math", "end to end"].rel_rms_err < 1e-6 and by_key["math", "end to end"].reference == "fp64"
    assert by_key["fa4", "end to end"].status == "unavailable: fa4 needs a CUDA GPU"
    assert by_key["picky", "end to end"].status == "cannot serve: head dim 64 not served"
    assert by_key["broken", "end to end"].status == "failed: RuntimeError: graph build failed"
    assert 1e-5 < by_key["halves", "end to end"].rel_rms_err < 1e-2  # fp16 rounding shows
    assert by_key["halves", "prep alone"].tflops is None and by_key["halves", "prep alone"].median_ms > 0
    kernel_alone = by_key["halves", "kernel alone"]
    assert kernel_alone.tflops > 0 and kernel_alone.rel_rms_err is None
    assert by_key["cudnn", "end to end"].speedup_vs_baseline == 1.0
    baseline_ms = by_key["cudnn", "end to end"].median_ms
    assert kernel_alone.speedup_vs_baseline == pytest.approx(baseline_ms / kernel_alone.median_ms)
    assert all(r.runs == 10 for r in rows if r.status == "ok")


def test_cpu_run_through_the_cli_writes_report_csv_and_plot(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", "--shapes", "1x2x128x32,1x1x64x96x32",
                                       "--backends", "math,native,fa4", "--outliers", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "NOT representative" in result.output and "fa4 needs a CUDA GPU" in result.output
    assert "1x2x128x32 (1 of 2): the reference" in result.output and "1x1x64x96x32: done in" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "results.csv", "tflops.png"]
    report = json.loads((out / "report.json").read_text())
    assert report["cpu_run_not_representative"] is True and report["device"]["kind"] == "cpu"
    assert report["settings"]["shapes"] == ["1x2x128x32", "1x1x64x96x32"] and report["settings"]["outliers"] is True
    ok_rows = [r for r in report["rows"] if r["status"] == "ok"]
    assert {(r["backend"], r["shape"]) for r in ok_rows} == {(b, s) for b in ("math", "native")
                                                             for s in ("1x2x128x32", "1x1x64x96x32")}
    assert all(r["rel_rms_err"] < 0.02 and r["reference"] == "fp64" and r["tflops"] > 0 for r in ok_rows)
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(report["rows"]) == 6
    assert (out / "tflops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_default_is_the_scaled_down_shape(tmp_path):
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", "--backends", "math",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "report.json").read_text())["settings"]["shapes"] == [bench.CPU_DEFAULT_SHAPE]


@pytest.mark.parametrize("args, message", [
    (["--shapes", "1x2x128"], "cannot read the shape"),
    (["--backends", "math,flash3"], "unknown attention backend 'flash3'"),
    # a size no machine here holds: refused before anything is allocated, with the longest that fits
    (["--shapes", "1x56x100000000x128", "--backends", "native"], "the longest that fits here is 1x56x"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_no_folder(tmp_path, args, message):
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", *args, "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_gpu_run_small_shape_every_backend(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["bench-attention", "--shapes", "1x8x2048x128", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "report.json").read_text())["rows"]
    baseline = next(r for r in rows if r["backend"] == "cudnn" and r["timed"] == "end to end")
    assert baseline["status"] == "ok" and baseline["speedup_vs_baseline"] == 1.0
    for r in rows:
        if r["status"] == "ok" and r["rel_rms_err"] is not None:
            assert r["rel_rms_err"] < (0.1 if "fp8" in r["backend"] else 0.01), r


def test_flat_inputs_give_near_uniform_softmax_rows():
    shape = AttentionShape.parse("1x2x64x512x64")
    q, k, _ = bench.make_inputs(shape, dtype=torch.float32, device=CPU, inputs="flat",
                                generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / 8.0, dim=-1)
    assert probs.max() < 1.5 / 512  # every key near 1/512
    q_normal, k_normal, _ = bench.make_inputs(shape, dtype=torch.float32, device=CPU, inputs="normal",
                                              generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(q, 0.05 * q_normal)  # same draw, q scaled
    torch.testing.assert_close(k, k_normal)


def test_block_inputs_are_the_h3_blocks_own_qkv_and_other_shapes_are_refused():
    """On the CPU the scaled-down H3 block (4 heads of 128) feeds its attention; the shape must match."""
    from dit_accel.commands.bench_attention import block_qkv

    shape = AttentionShape.parse("1x4x96x128")
    q, k, v = block_qkv(shape, dtype=torch.float32, device=CPU, seed=0)
    assert q.shape == k.shape == v.shape == (1, 96, 4, 128)
    assert torch.isfinite(q).all() and not torch.equal(q, k)
    with pytest.raises(UserError, match="Bx4xSx128"):
        block_qkv(AttentionShape.parse("1x2x96x64"), dtype=torch.float32, device=CPU, seed=0)


def test_bench_attention_on_block_inputs_end_to_end(tmp_path):
    out = tmp_path / "block"
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", "--shapes", "1x4x64x128", "--inputs",
                                       "block", "--backends", "math,native", "--runs", "10", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["inputs"] == "block" and report["settings"]["outliers"] is False
    ok = [r for r in report["rows"] if r["status"] == "ok"]
    assert {r["backend"] for r in ok} == {"math", "native"} and all(r["rel_rms_err"] < 0.01 for r in ok)  # bf16


def test_fa3_fp8_prep_gives_our_per_head_codes_in_fa3s_layout():
    """FA3 FP8's quantization (its prep in the bench) is the same per-(batch, head) e4m3 scheme as ours."""
    from dit_accel.attention.backends import _fa3_fp8_quantize
    from dit_accel.kernels.fp8_attention.prep import prep_reference

    q, k, v = bench.make_inputs(AttentionShape.parse("2x3x40x24x64"), dtype=torch.bfloat16, device=CPU,
                                inputs="outliers", generator=torch.Generator().manual_seed(1))
    fa3 = _fa3_fp8_quantize(q, k, v)
    ours = prep_reference(q, k, v)
    assert fa3.q.dtype == torch.float8_e4m3fn and fa3.q.shape == q.shape and fa3.descale.shape == (3, 2, 3)
    torch.testing.assert_close(fa3.descale.reshape(3, -1), ours.descale, rtol=0, atol=0)
    ours_q = ours.q[:, :40].view(2, 3, 40, 64).transpose(1, 2)  # [B*H, Sq_pad, D] -> [B, Sq, H, D]
    assert torch.equal(fa3.q.view(torch.uint8), ours_q.contiguous().view(torch.uint8))


def test_only_unavailable_backends_is_one_line_and_writes_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    out = tmp_path / "outputs" / "run"
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", "--backends", "fp8", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: no backend asked for can run on cpu (fp8: ")
    assert result.output.count("\n") == 1
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_outliers_flag_with_another_input_kind_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", "--backends", "math", "--inputs", "flat",
                                       "--outliers", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and result.output.startswith("error: --outliers is --inputs outliers")
    assert not (tmp_path / "run").exists()


def test_backends_are_timed_in_interleaved_rounds():
    """Each backend runs once for its error, then once per warm-up call, then round after round of an untimed
    and a timed call of every backend in turn: no backend gets all its runs first."""
    calls = []

    def recording(name):
        def run(q, k, v, scale=None):
            calls.append(name)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  scale=scale).transpose(1, 2)
        return AttentionBackend(name, "", run, lambda d: None)

    rows = bench_shape(AttentionShape.parse("1x2x64x32"), [recording("a"), recording("b")], dtype=torch.float32,
                       device=CPU, warmup=1, runs=3, seed=0)
    assert [r.runs for r in rows] == [3, 3]
    assert calls == ["a", "b"] + ["a", "b"] + ["a", "a", "b", "b"] * 3

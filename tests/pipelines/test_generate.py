"""`make-tiny-pipeline` and `generate` end to end on the CPU, through the CLI: a tiny random Wan
pipeline built offline, its video read back, the report, the --compare path and the one-line errors."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from testing import compare_with_fake_fp8, compare_with_the_fp8_kernel, invoke_cli, read_video_frames

from dit_accel.cli import main
from dit_accel.pipelines.tiny_wan import DEFAULTS as WAN_DEFAULTS



def test_tiny_wan_folder_is_a_diffusers_pipeline(tiny_wan):
    index = json.loads((tiny_wan / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    for component in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (tiny_wan / component).is_dir()
    assert json.loads((tiny_wan / "dit_accel.json").read_text())["frames"] == WAN_DEFAULTS["frames"]


def test_generate_writes_a_playable_video_and_a_report(tiny_wan, tmp_path):
    out = tmp_path / "run"
    result = invoke_cli("generate", "--pipeline", str(tiny_wan), "--out", str(out), "--prompt", "a cat at night",
                        "--seed", "3")
    assert result.exit_code == 0, result.output
    assert "Stage times" in result.output and "VAE decode" in result.output
    frames = read_video_frames(out / "video.mp4")
    assert len(frames) == WAN_DEFAULTS["frames"]
    assert frames[0].shape == (WAN_DEFAULTS["height"], WAN_DEFAULTS["width"], 3)
    report = json.loads((out / "report.json").read_text())
    stages = report["runs"][0]["stages"]
    assert len(stages["step_ms"]) == WAN_DEFAULTS["steps"]
    assert stages["transformer_calls_per_step"] == [2] * WAN_DEFAULTS["steps"]  # guidance: 2 passes a step
    assert stages["text_encoding_ms"] > 0 and stages["vae_decode_ms"] > 0
    assert all(ms > 0 for ms in stages["step_ms"])
    assert stages["denoise_ms"] + stages["text_encoding_ms"] + stages["vae_decode_ms"] <= stages["total_ms"]
    assert report["request"]["seed"] == 3 and report["comparisons"] == []
    # the pipeline's own attention in its dtype (fp32 on the CPU): named native, not bf16
    assert report["runs"][0]["attention"] == "native" and "native attention, ms" in result.output
    assert report["outputs"][0]["frames"] == WAN_DEFAULTS["frames"]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "video.mp4"]


def test_options_override_the_tiny_defaults(tiny_wan, tmp_path):
    out = tmp_path / "run"
    result = invoke_cli("generate", "--pipeline", str(tiny_wan), "--out", str(out), "--frames", "5", "--height", "32",
                        "--width", "48", "--steps", "2", "--guidance", "1.0", "--no-warmup")
    assert result.exit_code == 0, result.output
    assert "5 frames of 32x48 " in result.output  # height x width, as everywhere else
    frames = read_video_frames(out / "video.mp4")
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
    stages = json.loads((out / "report.json").read_text())["runs"][0]["stages"]
    assert stages["transformer_calls_per_step"] == [1, 1]  # guidance 1: no unconditional pass


def test_compare_reports_quality_and_speedup(tiny_wan, tmp_path, monkeypatch, fake_backend):
    """The --compare path on the CPU: two runs with the same seed, PSNR/SSIM, speed-up, two videos.

    The FP8 kernel needs a GPU, so `fp8` is served here by the routed test backend `fake` (it records
    each call and answers with torch SDPA) through the real patching seam. What this proves: the fp8
    run's attention went through the patch (calls served and recorded), the bf16 run was not patched,
    and the comparison is reported. It says nothing about the FP8 kernel's accuracy: the fake computes
    what native attention computes, so the videos are expected to be (nearly) identical."""
    out = tmp_path / "run"
    report, patch = compare_with_fake_fp8(tiny_wan, out, monkeypatch)
    # Every attention call of the fp8 run (and none of the bf16 run: no warm-up) reached the fake.
    assert patch["served_calls"] > 0 and len(fake_backend.calls) == patch["served_calls"]
    comparison = report["comparisons"][0]
    assert len(comparison["psnr_db_per_frame"]) == len(comparison["ssim_per_frame"]) == WAN_DEFAULTS["frames"]
    assert comparison["ssim_min"] > 0.9
    assert comparison["psnr_db_min"] is None or comparison["psnr_db_min"] > 30  # None: identical (inf)
    assert comparison["denoise_speedup"] > 0 and comparison["median_step_speedup"] > 0
    for name in ("video_bf16.mp4", "video_fp8.mp4"):
        assert len(read_video_frames(out / name)) == WAN_DEFAULTS["frames"]


def test_the_comparison_reports_the_median_step_beside_the_sums():
    """One stalled step in the reference run (measured on the H200: 64 ms among 6-8 ms ones) carries the sum
    of the steps, not the median step's speed-up."""
    from dit_accel.pipelines.generate_report import compare_runs
    from dit_accel.pipelines.running import RunResult
    from dit_accel.pipelines.stage_timer import StageTimes

    frames = np.random.default_rng(0).random((3, 8, 8, 3))
    reference = RunResult("bf16", frames, 16.0, StageTimes(step_ms=[6.3, 6.8, 64.1, 7.6], total_ms=130.0))
    candidate = RunResult("fp8", frames, 16.0, StageTimes(step_ms=[9.6, 9.9, 10.0, 9.5], total_ms=85.0))
    comparison = compare_runs(reference, candidate)
    assert comparison["median_step_speedup"] == pytest.approx(7.2 / 9.75)
    assert comparison["denoise_speedup"] == pytest.approx(84.8 / 39.0)
    assert comparison["total_speedup"] == pytest.approx(130.0 / 85.0)


def test_the_quality_table_says_when_identical_frames_are_left_out_of_the_psnr_mean():
    import numpy as np
    from rich.console import Console

    from dit_accel.commands.generate import _quality_table
    from dit_accel.pipelines.quality import compare_videos

    reference = np.random.default_rng(0).random((3, 16, 16, 3))
    video = reference.copy()
    video[1] += 0.1  # PSNR 20 dB; frames 0 and 2 identical
    console = Console(width=120)
    with console.capture() as captured:
        console.print(_quality_table(compare_videos(video, reference), "bf16", "fp8"))
    mean_row = next(line for line in captured.get().splitlines() if "mean" in line)
    assert "20.00 (2 identical, not counted)" in mean_row


def test_fp8_on_the_cpu_is_one_line_and_writes_nothing(tiny_wan, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "outputs" / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--out", str(out), "--attn", "fp8",
                                       "--device", "cpu"])
    assert result.exit_code == 2
    assert result.output.startswith("error: --attn fp8 cannot run here") and result.output.count("\n") == 1
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_a_missing_ffmpeg_plugin_is_one_line_before_anything_runs(tiny_wan, tmp_path, monkeypatch):
    """imageio imports without imageio-ffmpeg and fails only when the writer opens, after the runs:
    generate asks first, in one line, and writes nothing."""
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # `import imageio_ffmpeg` raises ImportError

    def must_not_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the MP4 writer was checked")

    monkeypatch.setattr("dit_accel.pipelines.pipeline_folder.load_pipeline", must_not_load)
    out = tmp_path / "outputs" / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--out", str(out), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert result.output == "error: writing MP4 needs imageio and imageio-ffmpeg: pip install 'dit-accel[generate]'\n"
    assert not out.parent.exists() or not any(out.parent.iterdir())


@pytest.mark.parametrize("option", ["--frames", "--height", "--width", "--steps"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_size_or_step_count_below_one_is_a_one_line_error(tiny_wan, tmp_path, option, value):
    """0 is a value given, not "use the default": it is refused, not silently replaced."""
    out = tmp_path / "outputs" / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--out", str(out), option, value])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {option} must be at least 1, got {value}\n"
    assert not out.parent.exists() or not any(out.parent.iterdir())


class _Vae(torch.nn.Module):
    def decode(self, x):
        return x + 1


def test_the_decode_wrapper_restores_exactly_what_the_instance_held():
    """detach() puts back an instance's own `decode` (another wrapper, a hook) and removes only its own."""
    from types import SimpleNamespace

    from dit_accel.pipelines.stage_timer import StageTimer

    hooked, plain = _Vae(), _Vae()
    seen = []

    def earlier_wrapper(x):  # set on the instance before the timer, e.g. by another tool
        seen.append(x)
        return _Vae.decode(hooked, x)

    hooked.decode = earlier_wrapper
    for vae in (hooked, plain):
        timer = StageTimer(SimpleNamespace(vae=vae), torch.device("cpu"), steps_from_callback=False)
        with timer:
            assert vae.decode is not earlier_wrapper and vae.decode(1) == 2
        assert timer.times.vae_decode_ms > 0
    assert seen == [1]  # the timer's wrapper called the earlier one
    assert vars(hooked)["decode"] is earlier_wrapper
    assert "decode" not in vars(plain) and plain.decode.__func__ is _Vae.decode


def _broken_copies(tiny_wan: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Bad pipeline folders and the words their error must contain."""
    no_index = root / "no_index"
    shutil.copytree(tiny_wan, no_index)
    (no_index / "model_index.json").unlink()
    unknown = root / "unknown_class"
    shutil.copytree(tiny_wan, unknown)
    index = json.loads((unknown / "model_index.json").read_text())
    (unknown / "model_index.json").write_text(json.dumps({**index, "_class_name": "NoSuchPipeline"}))
    no_vae = root / "no_vae"
    shutil.copytree(tiny_wan, no_vae)
    shutil.rmtree(no_vae / "vae")
    modular = root / "modular"
    shutil.copytree(tiny_wan, modular)
    (modular / "model_index.json").write_text(json.dumps({**index, "_class_name": "MiniMaxH3ModularPipeline"}))
    a_file = root / "a_file"
    a_file.write_text("not a folder")
    return {"missing": (root / "does_not_exist", "does not exist"), "no index": (no_index, "no model_index.json"),
            "unknown class": (unknown, "NoSuchPipeline"),
            "missing component": (no_vae, "lacks the component folder(s) vae"),
            "a file": (a_file, "is a file"),
            "modular class in model_index.json": (modular, "rename the file to modular_model_index.json")}


def test_bad_pipeline_folders_are_one_line_errors(tiny_wan, tmp_path):
    out_root = tmp_path / "outputs"
    for case, (folder, words) in _broken_copies(tiny_wan, tmp_path / "bad").items():
        result = CliRunner().invoke(main, ["generate", "--pipeline", str(folder), "--out", str(out_root / "run")])
        assert result.exit_code == 2, (case, result.output)
        assert result.output.startswith("error: ") and words in result.output, (case, result.output)
        assert result.output.count("\n") == 1, (case, result.output)
    assert not out_root.exists()


def test_make_tiny_pipeline_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    result = CliRunner().invoke(main, ["make-tiny-pipeline", "wan", str(tmp_path / "taken")])
    assert result.exit_code == 2 and "not an empty folder" in result.output


def test_make_tiny_pipeline_puts_a_presets_transformer_in_the_tiny_pipeline(tmp_path, monkeypatch):
    """--transformer PRESET: the preset's transformer (here a small stand-in preset: a real one is GBs) with random
    weights of realistic scale in bf16, the text encoder as wide as the preset's text width, the pipeline's own
    video size and steps left to generate; it runs end to end."""
    from dit_accel.adapters import FAMILIES
    from dit_accel.adapters.family import Preset

    config = {**FAMILIES["wan"].presets["wan2.1-t2v-1.3b"].config, "num_layers": 1, "num_attention_heads": 2,
              "attention_head_dim": 32, "ffn_dim": 64, "text_dim": 48, "freq_dim": 32}
    monkeypatch.setitem(FAMILIES["wan"].presets, "small", Preset(config, "a test's"))
    folder = tmp_path / "wan-small"
    result = invoke_cli("make-tiny-pipeline", "wan", str(folder), "--transformer", "small")
    assert result.exit_code == 0, result.output
    assert "small's transformer" in result.output and "WanPipeline's own video size and steps" in result.output
    written = json.loads((folder / "dit_accel.json").read_text())
    assert written == {"family": "wan", "seed": 0, "transformer": "small"}
    saved = json.loads((folder / "transformer" / "config.json").read_text())
    assert saved["num_layers"] == 1 and saved["text_dim"] == 48
    assert json.loads((folder / "text_encoder" / "config.json").read_text())["d_model"] == 48
    from safetensors import safe_open

    with safe_open(next((folder / "transformer").glob("*.safetensors")), "pt") as weights:
        assert weights.get_tensor("blocks.0.attn1.to_q.weight").dtype == torch.bfloat16
    out = tmp_path / "run"
    result = invoke_cli("generate", "--pipeline", str(folder), "--frames", "5", "--height", "32", "--width", "32",
                        "--steps", "2", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert len(json.loads((out / "report.json").read_text())["runs"][0]["stages"]["step_ms"]) == 2


@pytest.mark.parametrize("family, preset, words", [
    ("wan", "wan2.2-ti2v-5b", "its latents have 48 channels"),
    ("wan", "nonesuch", "wan has no such preset; choose one of: wan2.1-14b"),
    ("h3", "anything", "MiniMax-H3's transformer is 65 GB"),
])
def test_make_tiny_pipeline_refuses_a_transformer_it_cannot_take_in_one_line(tmp_path, family, preset, words):
    result = CliRunner().invoke(main, ["make-tiny-pipeline", family, str(tmp_path / "p"), "--transformer", preset])
    assert result.exit_code == 2 and result.output.startswith("error: ") and words in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "p").exists()


@pytest.mark.gpu
def test_generate_on_the_gpu_in_bf16_and_fp8(tiny_wan, tmp_path, monkeypatch):
    """On an sm_89+ GPU: the tiny pipeline in bf16 against fp8 attention (the real kernel)."""
    report, fp8_run = compare_with_the_fp8_kernel(tiny_wan, tmp_path / "run", monkeypatch)
    assert report["comparisons"][0]["ssim_mean"] > 0.5
    # Every attention call went to the FP8 kernel (the tiny pipeline's head dim, 64, is one it takes).
    assert fp8_run["attention_patch"]["served_calls"] > 0
    assert fp8_run["attention_patch"]["fallback_calls"] == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_offload_stream_on_the_cpu_is_one_line_and_writes_nothing(tiny_wan, tmp_path):
    result = invoke_cli("generate", "--pipeline", str(tiny_wan), "--offload", "stream", "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and result.output.startswith("error: --offload stream")
    assert not (tmp_path / "r").exists()


@pytest.mark.gpu
def test_generate_with_streamed_transformer_matches_resident(tiny_wan, tmp_path):
    """--offload stream: same seed, same video as the resident run; the report gives the streamed bytes."""
    resident, streamed = tmp_path / "resident", tmp_path / "streamed"
    for out, offload in ((resident, "resident"), (streamed, "stream")):
        result = invoke_cli("generate", "--pipeline", str(tiny_wan), "--out", str(out), "--device", "cuda",
                            "--dtype", "bf16", "--offload", offload)
        assert result.exit_code == 0, result.output
    report = json.loads((streamed / "report.json").read_text())
    assert report["offload"] == "stream"
    assert report["streaming"]["streamed_bytes_per_pass"] > 0 and report["streaming"]["h2d_gbps"] > 1
    a, b = read_video_frames(resident / "video.mp4"), read_video_frames(streamed / "video.mp4")
    assert len(a) == len(b)
    assert max(float(np.abs(x.astype(np.float32) - y.astype(np.float32)).mean()) for x, y in zip(a, b)) < 1.0


def test_bench_attention_and_generate_reports_carry_provenance(tmp_path, tiny_wan):
    from click.testing import CliRunner as Runner

    from dit_accel.cli import main as cli_main

    bench = tmp_path / "bench"
    result = Runner().invoke(cli_main, ["bench-attention", "--device", "cpu", "--backends", "math",
                                        "--out", str(bench)])
    assert result.exit_code == 0, result.output
    gen = tmp_path / "gen"
    result = Runner().invoke(cli_main, ["generate", "--pipeline", str(tiny_wan), "--no-warmup", "--steps", "1",
                                        "--seed", "7", "--out", str(gen)])
    assert result.exit_code == 0, result.output
    for folder, seed in ((bench, 0), (gen, 7)):
        p = json.loads((folder / "report.json").read_text())["provenance"]
        assert p["seed"] == seed and p["versions"]["torch"] and p["versions"]["python"] and p["timestamp"]


def test_fp8_linears_on_the_cpu_are_refused_before_the_pipeline_loads(tiny_wan, tmp_path, monkeypatch):
    """--linear fp8 cannot run on a CPU: one line, before anything is loaded (not after the reference ran)."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    from dit_accel.pipelines import pipeline_folder

    def must_not_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the FP8-linear refusal")

    monkeypatch.setattr(pipeline_folder, "load_pipeline", must_not_load)
    out = tmp_path / "outputs" / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--linear", "fp8", "--device", "cpu",
                                       "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: native+fp8-linear: FP8 linear layers need a CUDA GPU") and \
        result.output.count("\n") == 1, result.output
    assert not out.parent.exists() or not any(out.parent.iterdir())

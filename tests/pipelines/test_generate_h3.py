"""`make-tiny-pipeline h3` and `generate` end to end on the CPU, through the CLI: a tiny random MiniMax-H3
modular pipeline built offline (no torchvision), its video and soundtrack read back, the report, the
--compare path through the real patching seam, and the one-line errors for bad folders and requests."""
from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import imageio.v2 as imageio
import pytest
from click.testing import CliRunner
from testing import compare_with_fake_fp8, compare_with_the_fp8_kernel, invoke_cli

from dit_accel.cli import main
from dit_accel.pipelines.tiny_h3 import AUDIO_VAE_CONFIG, DEFAULTS as H3_DEFAULTS, TRANSFORMER_CONFIG

FPS = 24  # MiniMax-H3's fixed frame rate
# Each transformer pass runs one attention per block and per text-refiner block.
ATTENTION_CALLS_PER_STEP = TRANSFORMER_CONFIG["num_layers"] + TRANSFORMER_CONFIG["num_refiner_layers"]


def _read_video(path: Path) -> tuple[list, dict]:
    reader = imageio.get_reader(str(path))
    try:
        return [frame for frame in reader], reader.get_meta_data()
    finally:
        reader.close()


def test_tiny_h3_folder_is_a_modular_pipeline_that_points_at_itself(tiny_h3):
    index = json.loads((tiny_h3 / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline" and index["_blocks_class_name"] == "MiniMaxH3Blocks"
    components = ("text_encoder", "tokenizer", "processor", "transformer", "vae", "audio_vae", "scheduler",
                  "audio_scheduler")
    for name in components:
        assert (tiny_h3 / name).is_dir(), name
        # Saved in a staging folder, then renamed: the index names the final folder, not the staging one.
        assert index[name][2]["pretrained_model_name_or_path"] == str(tiny_h3.resolve()), name
    assert [p.name for p in tiny_h3.parent.iterdir()] == ["h3"]  # no staging folder left behind
    text_config = json.loads((tiny_h3 / "text_encoder" / "config.json").read_text())["text_config"]
    assert text_config["num_hidden_layers"] == 51  # H3 reads hidden_states[50]
    assert json.loads((tiny_h3 / "dit_accel.json").read_text())["frames"] == H3_DEFAULTS["frames"]


def test_the_prompt_processor_loads_back_and_tags_tokens_as_qwen3vl_does(tiny_h3):
    """The stand-in for Qwen3VLProcessor: 0 for text, 1 for the image pad token, 2 for the video pad token."""
    from dit_accel.pipelines.tiny_h3 import IMAGE_PAD, VIDEO_PAD, H3PromptProcessor

    processor = H3PromptProcessor.from_pretrained(str(tiny_h3 / "processor"))
    tokenizer = processor.tokenizer
    ids = tokenizer("a cat", add_special_tokens=False)["input_ids"] + tokenizer.convert_tokens_to_ids(
        [IMAGE_PAD, VIDEO_PAD])
    assert processor.create_mm_token_type_ids([ids]) == [[0, 0, 1, 2]]


def test_generate_writes_a_playable_video_with_sound_and_a_report(tiny_h3, tmp_path):
    out = tmp_path / "run"
    result = invoke_cli("generate", "--pipeline", str(tiny_h3), "--out", str(out), "--prompt", "a cat at night")
    assert result.exit_code == 0, result.output
    assert "Stage times" in result.output and "VAE decode" in result.output and "audio decode" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["audio.wav", "report.json", "video.mp4"]

    frames, meta = _read_video(out / "video.mp4")
    assert len(frames) == H3_DEFAULTS["frames"]
    assert frames[0].shape == (H3_DEFAULTS["height"], H3_DEFAULTS["width"], 3)
    assert meta["fps"] == FPS and meta["audio_codec"] == "aac"  # the soundtrack is muxed in
    rate = AUDIO_VAE_CONFIG["sampling_rate"]
    with wave.open(str(out / "audio.wav")) as sound:
        assert sound.getnchannels() == 2 and sound.getframerate() == rate
        assert abs(sound.getnframes() / rate - H3_DEFAULTS["frames"] / FPS) < 0.05  # as long as the video

    report = json.loads((out / "report.json").read_text())
    assert report["pipeline"]["class"] == "MiniMaxH3ModularPipeline"
    stages = report["runs"][0]["stages"]
    assert len(stages["step_ms"]) == H3_DEFAULTS["steps"]
    assert stages["transformer_calls_per_step"] == [1] * H3_DEFAULTS["steps"]  # guidance-distilled: one pass
    assert stages["steps_from"].startswith("one transformer call per step")
    assert stages["text_encoding_ms"] > 0 and stages["vae_decode_ms"] > 0 and stages["audio_decode_ms"] > 0
    assert all(ms > 0 for ms in stages["step_ms"])
    assert (stages["text_encoding_ms"] + stages["denoise_ms"] + stages["vae_decode_ms"] + stages["audio_decode_ms"]
            <= stages["total_ms"])
    assert report["runs"][0]["audio"]["channels"] == 2
    assert report["outputs"][0]["frames"] == H3_DEFAULTS["frames"]
    assert report["outputs"][0]["audio"]["file"] == "audio.wav"
    assert report["files"] == ["video.mp4", "audio.wav", "report.json"]


def test_compare_sends_every_h3_attention_call_to_the_patched_backend(tiny_h3, tmp_path, monkeypatch, fake_backend):
    """--compare bf16 on the CPU, with `fp8` served by the recording test backend `fake` through the real
    patching seam (the FP8 kernel needs a GPU): the patch finds the modular pipeline's transformer, and every
    attention call of the fp8 run (blocks and text refiner, every step) reaches the backend, none falls back."""
    report, patch = compare_with_fake_fp8(tiny_h3, tmp_path / "run", monkeypatch)
    assert patch["served_calls"] == len(fake_backend.calls) == ATTENTION_CALLS_PER_STEP * H3_DEFAULTS["steps"]
    assert len(report["comparisons"][0]["psnr_db_per_frame"]) == H3_DEFAULTS["frames"]
    assert report["comparisons"][0]["ssim_min"] > 0.9
    assert report["files"] == ["video_bf16.mp4", "audio_bf16.wav", "video_fp8.mp4", "audio_fp8.wav", "report.json"]


def _broken_copies(tiny_h3: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Bad H3 folders and the words their error must contain."""
    no_processor = root / "no_processor"
    shutil.copytree(tiny_h3, no_processor)
    shutil.rmtree(no_processor / "processor")
    # Its index still names the intact original folder: the loader must read the copy's own files and fail.
    no_weights = root / "no_transformer_weights"
    shutil.copytree(tiny_h3, no_weights)
    (no_weights / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    renamed_index = root / "renamed_index"
    shutil.copytree(tiny_h3, renamed_index)
    (renamed_index / "modular_model_index.json").rename(renamed_index / "model_index.json")
    return {"missing component": (no_processor, "lacks the component folder(s) processor that its t2va workflow"),
            "missing weights": (no_weights, "cannot load transformer of the pipeline"),
            "index under the other name": (renamed_index, "rename the file to modular_model_index.json")}


def test_bad_h3_folders_are_one_line_errors(tiny_h3, tmp_path):
    out_root = tmp_path / "outputs"
    for case, (folder, words) in _broken_copies(tiny_h3, tmp_path / "bad").items():
        result = CliRunner().invoke(main, ["generate", "--pipeline", str(folder), "--out", str(out_root / "run")])
        assert result.exit_code == 2, (case, result.output)
        assert result.output.startswith("error: ") and words in result.output, (case, result.output)
        assert result.output.count("\n") == 1, (case, result.output)
    assert not out_root.exists() or not any(out_root.iterdir())  # a load error leaves nothing behind


@pytest.mark.parametrize("options, words", [
    (["--frames", "48"], "refused the request: MiniMax-H3 generates between 5.0 and 15.0 seconds"),
    (["--height", "48"], "refused the request: `height` and `width` must be multiples of 32"),
    (["--guidance", "5"], "guidance-distilled and takes no guidance scale"),
])
def test_requests_h3_refuses_are_one_line_errors(tiny_h3, tmp_path, options, words):
    out = tmp_path / "outputs" / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_h3), "--out", str(out), *options])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and words in result.output and result.output.count("\n") == 1
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_the_wav_holds_the_channels_interleaved_as_16_bit_samples(tmp_path):
    import numpy as np

    from dit_accel.pipelines.video_io import write_wav

    audio = np.array([[0.5, -1.0, 2.0], [0.0, 0.25, -3.0]])  # 2 channels x 3 samples; out of range is clipped
    info = write_wav(tmp_path / "a.wav", audio, 8000)
    assert info["channels"] == 2 and info["samples"] == 3 and info["seconds"] == 3 / 8000
    with wave.open(str(tmp_path / "a.wav")) as sound:
        assert (sound.getnchannels(), sound.getsampwidth(), sound.getframerate()) == (2, 2, 8000)
        samples = np.frombuffer(sound.readframes(3), dtype="<i2")
    assert samples.tolist() == [16384, 0, -32767, 8192, 32767, -32767]


@pytest.mark.gpu
def test_generate_h3_on_the_gpu_in_bf16_and_fp8(tiny_h3, tmp_path, monkeypatch):
    """On an sm_89+ GPU: the tiny H3 pipeline in bf16 against fp8 attention (the real kernel), every call served."""
    report, fp8_run = compare_with_the_fp8_kernel(tiny_h3, tmp_path / "run", monkeypatch)
    # Head dim 64 is one the kernel takes: no call falls back.
    assert fp8_run["attention_patch"]["served_calls"] == ATTENTION_CALLS_PER_STEP * H3_DEFAULTS["steps"]
    assert fp8_run["attention_patch"]["fallback_calls"] == {}
    assert report["comparisons"][0]["ssim_mean"] > 0.5

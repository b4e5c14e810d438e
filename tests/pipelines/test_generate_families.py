"""`make-tiny-pipeline` and `generate` end to end on the CPU, through the CLI, for the families beyond Wan and
H3 that `generate` runs through its generic DiffusionPipeline path: SkyReels-V2 (Wan's parts, its own
transformer) and CogVideoX (T5, its own VAE, guidance batched into one pass, torch SDPA called directly)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from testing import compare_with_fake_fp8, invoke_cli, read_video_frames

from dit_accel.pipelines import tiny_cogvideox, tiny_skyreels_v2
from dit_accel.pipelines.tiny_wan import TRANSFORMER_CONFIG as WAN_TRANSFORMER_CONFIG

# What each tiny family is, and what its runs must show.
#   passes_per_step: transformer calls a denoising step with guidance (SkyReels-V2 runs the conditional and the
#     unconditional pass one after the other, as Wan; CogVideoX stacks them into one pass on a batch of two).
#   attention_calls_per_pass: self- and cross-attention in every block (Wan's layout), or one joint
#     text+video attention a block (CogVideoX's).
FAMILIES = {
    "skyreels-v2": SimpleNamespace(
        pipeline="SkyReelsV2Pipeline", transformer="SkyReelsV2Transformer3DModel", vae="AutoencoderKLWan",
        text_encoder="UMT5EncoderModel", defaults=tiny_skyreels_v2.DEFAULTS, passes_per_step=2,
        attention_calls_per_pass=2 * WAN_TRANSFORMER_CONFIG["num_layers"]),
    "cogvideox": SimpleNamespace(
        pipeline="CogVideoXPipeline", transformer="CogVideoXTransformer3DModel", vae="AutoencoderKLCogVideoX",
        text_encoder="T5EncoderModel", defaults=tiny_cogvideox.DEFAULTS, passes_per_step=1,
        attention_calls_per_pass=tiny_cogvideox.TRANSFORMER_CONFIG["num_layers"]),
}


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each family's tiny folder, built once through `make-tiny-pipeline`, with what the command printed."""
    root = tmp_path_factory.mktemp("family_pipelines")
    built = {}
    for family in FAMILIES:
        result = invoke_cli("make-tiny-pipeline", family, str(root / family))
        assert result.exit_code == 0, result.output
        built[family] = (root / family, result.output)
    return built


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_folder_is_a_diffusers_pipeline_of_the_real_classes(tiny_folders, family):
    folder, printed = tiny_folders[family]
    facts = FAMILIES[family]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == facts.pipeline
    assert index["transformer"] == ["diffusers", facts.transformer]
    assert index["vae"] == ["diffusers", facts.vae]
    assert index["text_encoder"] == ["transformers", facts.text_encoder]
    for component in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (folder / component).is_dir(), component
    assert json.loads((folder / "dit_accel.json").read_text()) == {"family": family, "seed": 0, **facts.defaults}
    d = facts.defaults
    assert f"tiny random {facts.pipeline} (transformer " in printed
    assert f"{d['frames']} frames at {d['height']}x{d['width']}, {d['steps']} steps" in printed


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_writes_a_playable_video_and_a_report(tiny_folders, family, tmp_path):
    folder, _ = tiny_folders[family]
    facts, d = FAMILIES[family], FAMILIES[family].defaults
    out = tmp_path / "run"
    result = invoke_cli("generate", "--pipeline", str(folder), "--out", str(out), "--prompt", "a dog in the rain")
    assert result.exit_code == 0, result.output
    assert "Stage times" in result.output and "VAE decode" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "video.mp4"]
    frames = read_video_frames(out / "video.mp4")
    assert len(frames) == d["frames"] and frames[0].shape == (d["height"], d["width"], 3)

    report = json.loads((out / "report.json").read_text())
    assert report["pipeline"]["class"] == facts.pipeline
    assert report["request"]["guidance"] == d["guidance"] > 1  # guidance on: an unconditional pass too
    stages = report["runs"][0]["stages"]
    assert len(stages["step_ms"]) == d["steps"] and all(ms > 0 for ms in stages["step_ms"])
    assert stages["transformer_calls_per_step"] == [facts.passes_per_step] * d["steps"]
    assert stages["text_encoding_ms"] > 0 and stages["vae_decode_ms"] > 0
    assert stages["denoise_ms"] + stages["text_encoding_ms"] + stages["vae_decode_ms"] <= stages["total_ms"]
    assert report["outputs"][0]["frames"] == d["frames"]


@pytest.mark.parametrize("family", FAMILIES)
def test_compare_routes_every_attention_call(tiny_folders, tmp_path, monkeypatch, fake_backend, family):
    """A routed backend reaches every attention call of both pipelines: SkyReels-V2's processors call diffusers'
    `dispatch_attention_fn` (self and cross attention in each block, both guidance passes), CogVideoX's call
    torch's `F.scaled_dot_product_attention` themselves (one joint attention a block, the guidance batched)."""
    folder, _ = tiny_folders[family]
    facts, d = FAMILIES[family], FAMILIES[family].defaults
    out = tmp_path / "run"
    report, patch = compare_with_fake_fp8(folder, out, monkeypatch)
    assert patch["served_calls"] == d["steps"] * facts.passes_per_step * facts.attention_calls_per_pass
    assert len(fake_backend.calls) == patch["served_calls"]
    comparison = report["comparisons"][0]
    assert len(comparison["psnr_db_per_frame"]) == d["frames"]
    assert comparison["ssim_min"] > 0.9  # the fake computes what native attention computes
    for name in ("video_bf16.mp4", "video_fp8.mp4"):
        assert len(read_video_frames(out / name)) == d["frames"]

"""The pipeline's other stages: VAE decode, audio decode, text encoding, measured at the
workload's size with synthetic weights (scaled down on the CPU), and the whole-video table."""
from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from testing import DATA

from dit_accel.adapters import adapter_for_preset
from dit_accel.adapters import minimax_h3 as h3_adapter
from dit_accel.adapters.stage_specs import STAGE_KEYS, StageSkip, StageSpec
from dit_accel.cli import main
from dit_accel.commands.options import STAGE_CHOICES
from dit_accel.errors import UserError
from dit_accel import headroom
from dit_accel.profiling import memory
from dit_accel.profiling.classify import classify
from dit_accel.profiling import stage_profile as stages_module
from dit_accel.profiling.stage_profile import measure_stage

CPU = torch.device("cpu")
PUBLIC_VAE_CONFIG = DATA / "h3_vae_config.json"  # the public vae/config.json, copied
FAST = ["--seq-len", "256", "--runs", "2", "--warmup", "1"]


def _scaled_down(family):
    adapter = adapter_for_preset(family)
    return adapter.scaled_down()


def _stage(family, key, scaled_down=True, **kw):
    adapter = _scaled_down(family) if scaled_down else adapter_for_preset(family)
    workload = adapter.default_workload(1, scaled_down=scaled_down)
    return adapter.pipeline_stages(workload, (key,), scaled_down=scaled_down, **kw)[0]


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_stage_names_agree_with_the_cli():
    assert STAGE_CHOICES == STAGE_KEYS


def test_the_embedded_h3_vae_config_is_the_public_one():
    public = json.loads(PUBLIC_VAE_CONFIG.read_text())
    kept = {k: v for k, v in public.items() if k not in ("_diffusers_version", "latents_mean", "latents_std")}
    assert h3_adapter.H3_VAE_CONFIG == kept


def test_h3_vae_decode_geometry_at_the_seeds_size():
    spec = _stage("minimax-h3", "vae", scaled_down=False)
    # 121 frames at 704x1280: 31 latent frames of 44 x 80; 6 clips of 7 latent frames, 4 x 7 tiles of 256 px.
    assert "1 x 24 x 31 x 44 x 80" in spec.workload and "6 clip(s) x 28 tile(s)" in spec.workload
    assert "1797 rows" in spec.workload and spec.attention_routed
    model = spec.build()
    assert model.encoder is None and model.quant_conv is None  # decode never runs them
    assert len(model.decoder.transformer_blocks) == 36
    assert sum(p.numel() for p in model.parameters()) > 2e9  # the 36-layer ViT decoder, on meta


def test_h3_vae_attention_flops_match_the_calls_the_decode_makes(monkeypatch):
    from diffusers.models.autoencoders import autoencoder_kl_minimax_h3 as h3_vae

    spec = _stage("minimax-h3", "vae")
    calls = []
    original = h3_vae.dispatch_attention_fn

    def counting(query, key, value, **kw):
        b, s, h, d = query.shape
        calls.append(4.0 * b * h * s * key.shape[1] * d)
        assert d == 64  # heads of 64, as in the real decoder
        return original(query, key, value, **kw)

    monkeypatch.setattr(h3_vae, "dispatch_attention_fn", counting)
    measure_stage(spec, ["native"], device=CPU, dtype=torch.float32, warmup=0, runs=1)
    layers = h3_adapter.H3_VAE_SCALED_DOWN["decoder_num_layers"]  # one clip, one tile: one call per layer a run
    assert len(calls) % layers == 0 and sum(calls[:layers]) == pytest.approx(spec.attention_flops)


def test_h3_vae_stage_runs_with_each_recipe_attention():
    spec = _stage("minimax-h3", "vae")
    m = measure_stage(spec, ["native", "math"], device=CPU, dtype=torch.float32, warmup=1, runs=2)
    assert [r.backend for r in m.runs] == ["native", "math"]
    assert m.output_shape[:2] == (1, 3) and m.output_shape[-2:] == (64, 64)
    assert m.runs[1].output_vs_first["cosine"] > 0.9999
    assert m.flops["gemm"] > 0 and m.flops["attention"] > 0
    categories = m.runs[0].profile.by_category()
    assert categories["attention"]["time_us"] > 0 and categories["gemm"]["time_us"] > 0
    assert {"attention core", "ffn", "qkv projection"} <= set(m.runs[0].profile.by_range())


@pytest.mark.slow
def test_wan_vae_stage_is_measured_once_its_attention_not_patched():
    spec = _stage("wan", "vae")
    assert not spec.attention_routed and "not diffusers' dispatch_attention_fn" in spec.attention_note
    m = measure_stage(spec, ["native", "math"], device=CPU, dtype=torch.float32, warmup=0, runs=1)
    assert [r.backend for r in m.runs] == [None]
    assert m.run_for("math") is m.runs[0]
    assert m.flops["conv"] > 0 and m.runs[0].profile.by_category()["conv"]["time_us"] > 0
    assert m.output_shape == (1, 3, 5, 64, 64)


def test_skipped_stages_say_why():
    audio = _stage("minimax-h3", "audio")
    assert isinstance(audio, StageSkip) and "audio_vae/config.json" in audio.reason
    text = _stage("minimax-h3", "text")
    assert isinstance(text, StageSkip) and "--text-encoder-config" in text.reason
    assert isinstance(_stage("wan", "audio"), StageSkip)


def test_conv_kernels_are_convolution_not_attention():
    for name in ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64",
                 "void implicit_convolve_sgemm<float, float>", "aten::mkldnn_convolution", "aten::slow_conv3d_forward"):
        assert classify(name) == "conv", name
    assert classify("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_whole_video_table_on_the_cpu(tmp_path):
    out = tmp_path / "run"
    result = run_cli("profile-block", *FAST, "--stages", "all", "--compare-attn", "native,math", "--out", out)
    assert result.exit_code == 0, result.output
    assert "Whole video" in result.output and "VAE decode" in result.output
    assert {p.name for p in out.iterdir()} == {"report.json", "ops.csv", "breakdown.png", "whole_video.csv"}
    report = json.loads((out / "report.json").read_text())
    assert report["outside"] is not None  # --stages measures outside the blocks for a whole pass
    (vae,) = report["stages"]
    assert vae["stage"] == "vae" and [r["backend"] for r in vae["runs"]] == ["native", "math"]
    assert {s["stage"] for s in report["stages_skipped"]} == {"text", "audio"}
    for video, run in zip(report["whole_video"], report["runs"]):
        assert video["denoising_s"] == pytest.approx(run["extrapolation"]["video_s"])
        vae_s = next(r["ms"] for r in vae["runs"] if r["backend"] == video["recipe"]) / 1e3
        assert video["stage_s"] == {"text": None, "vae": pytest.approx(vae_s), "audio": None}
        assert video["total_s"] == pytest.approx(video["denoising_s"] + vae_s)
    rows = list(csv.DictReader((out / "whole_video.csv").open()))
    assert [r["recipe"] for r in rows] == ["native", "math"] and rows[0]["text_encoding_s"] == ""
    ops = list(csv.DictReader((out / "ops.csv").open()))
    assert {r["stage"] for r in ops} == {"block", "vae"}


@pytest.mark.parametrize("family, model_type", [("minimax-h3", "qwen3_vl"), ("wan", "umt5")])
def test_text_encoder_from_a_local_config(tmp_path, family, model_type):
    """A decoder-only language model (H3's Qwen3-VL) and an encoder-decoder one, of which the encoder
    alone runs (Wan's umT5), both scaled down on the CPU."""
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    spec = _stage(family, "text", text_encoder_config=folder)
    assert isinstance(spec, StageSpec) and "2 layers" in spec.model_name
    model = spec.build()
    # scaled down, the FFN width too (T5 calls it d_ff): hidden 256 x FFN 512 at most, the vocabulary aside
    assert max(p.numel() for name, p in model.named_parameters() if "embed" not in name) <= 256 * 512
    m = measure_stage(spec, ["native"], device=CPU, dtype=torch.float32, warmup=0, runs=1)
    assert m.runs[0].ms > 0 and m.flops["gemm"] > 0


def test_stage_errors_are_one_line(tmp_path):
    result = run_cli("profile-block", *FAST, "--stages", "vae,decoder", "--out", tmp_path / "a")
    assert result.exit_code == 2 and "--stages takes a comma-separated list" in result.output
    result = run_cli("profile-block", *FAST, "--text-encoder-config", tmp_path, "--out", tmp_path / "b")
    assert result.exit_code == 2 and "add --stages text" in result.output
    result = run_cli("profile-block", *FAST, "--stages", "text", "--text-encoder-config", tmp_path / "none",
                     "--out", tmp_path / "c")
    assert result.exit_code == 2 and "cannot read" in result.output
    assert not any(tmp_path.glob("[abc]"))


def test_a_stage_too_large_is_refused_in_one_line(tmp_path, monkeypatch):
    huge = dataclasses.replace(_stage("minimax-h3", "vae"), activation_bytes=lambda e: 2**50)
    from dit_accel import adapters

    family = dataclasses.replace(h3_adapter.FAMILY, vae_stage=lambda adapter, workload, scaled_down: huge)
    monkeypatch.setitem(adapters.FAMILIES, "minimax-h3", family)
    out = tmp_path / "run"
    result = run_cli("profile-block", *FAST, "--stages", "vae", "--out", out)
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert line.startswith("error: the VAE decode stage") and "\n" not in line
    assert "drop vae from --stages" in line and "does not fit" in line
    assert not out.exists()


def test_the_stage_check_passes_what_fits(monkeypatch):
    from dit_accel.profiling.session import ProfileSettings
    from dit_accel.patching.recipe import parse_recipe

    adapter = _scaled_down("minimax-h3")
    workload = adapter.workload_from_seq_len(256, 1)
    settings = ProfileSettings(adapter, workload, torch.float32, CPU, (parse_recipe("native"),),
                               stages=tuple(adapter.pipeline_stages(workload, ("vae",), scaled_down=True)))
    monkeypatch.setattr(headroom, "host_available_bytes", lambda: 64 * 2**30)
    memory.check_fits(settings)
    monkeypatch.setattr(headroom, "host_available_bytes", lambda: 300 * 2**20)
    with pytest.raises(UserError, match="VAE decode stage"):
        memory._check_stages(settings, 0, 260 * 2**20, "x", None)


@pytest.mark.gpu
def test_gpu_h3_vae_decode_at_full_size_with_fp8_attention(tmp_path, monkeypatch):
    """The real-size H3 VAE decode (36 layers, heads of 64) with cuDNN and with our FP8 attention in
    its decoder: every decoder attention call served by the kernel, the decoded video close."""
    # The kernel is under test: the measured crossover routes these 1797-row calls to diffusers' backend.
    monkeypatch.setenv("DIT_ACCEL_CROSSOVER", "off")
    spec = _stage("minimax-h3", "vae", scaled_down=False)
    m = measure_stage(spec, ["cudnn", "fp8"], device=torch.device("cuda"), dtype=torch.bfloat16, warmup=1, runs=2)
    fp8 = m.runs[1]
    assert fp8.served_calls > 0 and not fp8.fallback_calls
    assert fp8.output_vs_first["rel_l2"] < 0.05
    assert m.runs[0].profile.peak_memory_bytes < 40 * 2**30


def test_a_clip_chunked_decode_is_profiled_one_clip_at_a_time(monkeypatch):
    """The H3 VAE decode of 2 clips: the profiler attributes one clip x 2, and that counts the same
    attention calls as profiling the whole decode; the timing stays the whole decode's."""
    monkeypatch.setattr(h3_adapter, "SCALED_DOWN_LATENTS", (12, 4, 4))  # 12 + 3 tokens: 2 clips of 7 frames
    spec = _stage("minimax-h3", "vae")
    assert spec.profile_parts == 2 and spec.profile_unit is not None and "one clip of 2" in spec.notes[0]
    counting, counted_frames = [], []  # counted_frames: latent frames of each decode the FLOP counter saw

    def recording_call(model, z):
        if counting:
            counted_frames.append(z.shape[2])
        return h3_call(model, z)

    def flagged_count_flops(fn):
        counting.append(True)
        try:
            return count_flops(fn)
        finally:
            counting.pop()

    h3_call, count_flops = spec.call, stages_module.count_flops
    monkeypatch.setattr(stages_module, "count_flops", flagged_count_flops)
    spec = dataclasses.replace(spec, call=recording_call)
    whole = dataclasses.replace(spec, profile_unit=None, profile_parts=1)
    clip_measured, decode_measured = (measure_stage(s, ["native"], device=CPU, dtype=torch.float32, warmup=0, runs=1)
                                      for s in (spec, whole))
    assert counted_frames == [7, 12]  # one clip's latents x 2, then the whole decode's
    by_clip, by_decode = clip_measured.runs[0], decode_measured.runs[0]

    def attention_calls(run):
        return sum(k.calls for k in run.profile.kernels if k.category == "attention")

    assert attention_calls(by_decode) > 0
    assert attention_calls(by_clip) == pytest.approx(attention_calls(by_decode))
    # The FLOPs are counted on one clip too, x 2: the clips' decoder calls are the same GEMMs.
    assert clip_measured.flops["gemm"] > 0
    assert clip_measured.flops == pytest.approx(decode_measured.flops, rel=1e-6)

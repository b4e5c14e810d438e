"""Step caches (`+cache=...`, `patching.step_cache`) on the CPU: every served family's scaled-down transformer runs
each method of diffusers' hooks for a few steps (or is refused in one line, with its reason), what ran is counted per
step, the hooks and registrations come off completely (outputs bit-identical to the uncached model's), the block
metadata is derived from each block's own forward, bad parameters are one line, and a compiled model does not
recompile from step to step."""
from __future__ import annotations

import contextlib

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from testing import every_family, tiny_h3_transformer

from dit_accel.adapters import adapter_for_preset
from dit_accel.adapters.building import synthetic_weights
from dit_accel.adapters.capture import block_stacks
from dit_accel.adapters.stage_specs import build_on_meta
from dit_accel.cli import main
from dit_accel.errors import UserError
from dit_accel.patching import step_cache
from dit_accel.patching.recipe import parse_recipe
from dit_accel.patching.step_cache import CACHE_METHODS, apply_step_cache, block_metadata, parse_cache
from dit_accel.planning.cached import cache_skip_measured

CPU = torch.device("cpu")
STEPS = 6
BLOCKS = 3  # a stack cut to its first blocks: a head, a middle and a tail for the block caches
# What each method is expected to compute of the work it hooks over STEPS single-pass steps, timesteps 999 down by
# 150: First Block Cache at 0.5 on random weights skips every pass after the first but for the head block; TaylorSeer
# computes steps 0, 2, 4 (warmup 1, interval 2); PAB and FasterCache skip every other pass while the timestep is in
# diffusers' default range (steps 3 and 5 here).
METHODS = {"fbc:0.5": None, "taylorseer:interval=2:warmup=1": 0.5, "pab": 4 / 6, "faster": 4 / 6}
# Refused, and why (diffusers' limits, said in one line): Cosmos's block returns one value or two by a flag;
# FasterCache looks for attention modules under names Kandinsky's are not under.
REFUSED = {("cosmos", "fbc:0.5"): "by the case", ("cosmos-predict2.5", "fbc:0.5"): "by the case",
           ("kandinsky-5", "faster"): "are not under the names", ("kandinsky-6", "faster"): "are not under the names"}


def _tiny(family: str):
    """`family`'s scaled-down transformer, each stack cut to BLOCKS blocks, with synthetic weights, and a pass's
    inputs."""
    adapter = adapter_for_preset(family).scaled_down()
    meta = build_on_meta(adapter.transformer_class, adapter.config)
    for name, stack in block_stacks(meta):
        setattr(meta, name, nn.ModuleList(stack[:BLOCKS]))
    model = synthetic_weights(meta, CPU, lambda name: torch.float32)
    inputs = adapter.make_transformer_inputs(adapter.default_workload(1, scaled_down=True), CPU, torch.float32,
                                             torch.Generator().manual_seed(0))
    return adapter, model, inputs.kwargs


def _first(output):
    output = output[0] if isinstance(output, tuple) else output
    return output.sample if hasattr(output, "sample") else output


def _steps(model, kwargs, applied, timestep, *, contexts: bool):
    outputs = []
    with torch.no_grad():
        for step in range(STEPS):
            timestep[0] = 999 - 150 * step
            with model.cache_context("cond") if contexts else contextlib.nullcontext():
                outputs.append(_first(model(**kwargs)))
            applied.step_done()
    return outputs


@pytest.mark.parametrize("family", every_family())
def test_every_family_runs_each_cache_or_is_refused_and_comes_back_bit_identical(family):
    adapter, model, kwargs = _tiny(family)
    with torch.no_grad():
        before = _first(model(**kwargs))
    for text, expected in METHODS.items():
        timestep = [999]
        try:
            applied = apply_step_cache(model, parse_cache(text), what=family, steps=STEPS, timestep=lambda: timestep[0],
                                       passes_per_step=1)
        except UserError as error:
            assert (family, text) in REFUSED and REFUSED[family, text] in str(error), str(error)
            assert "\n" not in str(error)
            continue
        assert (family, text) not in REFUSED
        try:
            outputs = _steps(model, kwargs, applied, timestep, contexts=False)  # the pipelines that set none
        finally:
            applied.undo()
        summary = applied.summary()
        assert summary["passes"] == STEPS and [s["passes"] for s in summary["per_step"]] == [1] * STEPS
        assert summary["per_step"][0]["computed"] == summary["hooked_modules"]  # the first step runs in full
        if expected is None:  # First Block Cache: the head block always, the rest only in the first pass
            hooked = summary["hooked_modules"]
            assert [s["computed"] for s in summary["per_step"]] == [hooked] + [1] * (STEPS - 1)
        else:
            assert summary["work_computed"] == pytest.approx(expected, abs=1e-4), (text, summary)
        assert torch.isfinite(outputs[-1]).all()
        assert not any(hasattr(m, "_diffusers_hook") and m._diffusers_hook.hooks for m in model.modules())
        with torch.no_grad():
            assert torch.equal(_first(model(**kwargs)), before), text  # nothing left on the model


def test_the_pipelines_contexts_keep_guided_passes_apart():
    """Two passes a step (a guided pipeline), each in its own cache context: First Block Cache decides each pass
    against the same pass of the step before, so each skips after its own first."""
    _, model, kwargs = _tiny("wan")
    applied = apply_step_cache(model, parse_cache("fbc:0.5"), what="wan", steps=STEPS)
    try:
        with torch.no_grad():
            for _ in range(3):
                for context in ("cond", "uncond"):
                    with model.cache_context(context):
                        model(**kwargs)
                applied.step_done()
    finally:
        applied.undo()
    assert [s["computed"] for s in applied.steps] == [2 * BLOCKS, 2, 2] and applied.steps[0]["passes"] == 2


def test_first_block_cache_keeps_what_each_comparison_measured():
    """First Block Cache's comparisons are kept: one a pass after the first, each the change from the last computed
    pass, and a pass skipped exactly where its change was under the threshold; the summary gives their spread."""
    _, model, kwargs = _tiny("wan")
    hidden = kwargs["hidden_states"]
    noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
    applied = apply_step_cache(model, parse_cache("fbc:0.1"), what="wan", steps=STEPS)
    try:
        with torch.no_grad():
            for size in (0, 0.02, 0.04, 0.5, 0.52, 0.1):  # small moves, a jump, small, a jump from the last computed
                with model.cache_context("cond"):
                    model(**{**kwargs, "hidden_states": hidden + size * noise})
                applied.step_done()
        changes, summary = applied.changes(), applied.summary()
    finally:
        applied.undo()
    computed = [s["computed"] == BLOCKS for s in applied.steps]
    assert computed == [True, False, False, True, False, True]  # both verdicts met
    assert computed[1:] == [change > 0.1 for change in changes]
    assert summary["changes"] == {"compared": 5, "min": round(min(changes), 4),
                                  "median": round(sorted(changes)[2], 4), "max": round(max(changes), 4)}


def test_block_metadata_is_read_from_each_blocks_forward():
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformerBlock
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformerBlock
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    h3 = block_metadata(MiniMaxH3TransformerBlock)
    assert (h3.return_hidden_states_index, h3.return_encoder_hidden_states_index) == (0, None)
    ltx2 = block_metadata(LTX2VideoTransformerBlock)  # returns (hidden_states, audio_hidden_states)
    assert (ltx2.return_hidden_states_index, ltx2.return_encoder_hidden_states_index) == (0, 1)
    assert ltx2.encoder_hidden_states_argument_name == "audio_hidden_states"
    assert ltx2._get_parameter_from_args_kwargs("encoder_hidden_states", (), {"audio_hidden_states": 7}) == 7
    hunyuan = block_metadata(HunyuanVideoTransformerBlock)
    assert hunyuan.encoder_hidden_states_argument_name == "encoder_hidden_states"


def test_registrations_are_put_back():
    from diffusers.hooks._helpers import TransformerBlockRegistry
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    TransformerBlockRegistry._register()
    before = dict(TransformerBlockRegistry._registry)
    for family in ("minimax-h3", "wan"):
        _, model, _ = _tiny(family)
        applied = apply_step_cache(model, parse_cache("fbc"), what=family, steps=STEPS)
        assert MiniMaxH3TransformerBlock in TransformerBlockRegistry._registry or family == "wan"
        applied.undo()
    assert TransformerBlockRegistry._registry == before and MiniMaxH3TransformerBlock not in before
    assert TransformerBlockRegistry._registry[WanTransformerBlock] is before[WanTransformerBlock]


@pytest.mark.slow
@pytest.mark.parametrize("text, settled", [("fbc:0.5", 2), ("taylorseer:interval=2:warmup=1", 5)])
def test_a_compiled_model_under_a_cache_does_not_recompile_from_step_to_step(text, settled):
    """torch.compile over a transformer with a cache on: its first computed and first cached passes compile their
    graphs (First Block Cache: by the second step; TaylorSeer: by its fifth, after a full cycle of computed and
    predicted steps), then every step reuses them; the counters add none."""
    torch._dynamo.reset()
    model, inputs = tiny_h3_transformer(3)
    applied = apply_step_cache(model, parse_cache(text), what="H3", steps=10)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    try:
        with torch.no_grad():
            frames = []
            for _ in range(10):
                with model.cache_context("cond"):
                    compiled(**inputs)
                applied.step_done()
                frames.append(counter.frame_count)
    finally:
        applied.undo()
        torch._dynamo.reset()
    assert frames[settled - 1:] == [frames[settled - 1]] * (11 - settled), frames
    assert applied.summary()["work_computed"] < 1


def test_the_timestep_is_read_off_the_device_once_a_timestep():
    """PAB's and FasterCache's hooks get the pipeline's timestep as a number, read once per timestep tensor (not
    once per hooked forward: each read of a GPU tensor is a sync); anything else goes through as it is."""
    timestep = torch.tensor(500.0)
    current = [timestep]
    read = step_cache.timestep_on_host(lambda: current[0])
    assert read() == 500.0 and isinstance(read(), float)
    timestep.fill_(10.0)  # the same tensor: its number was already read
    assert read() == 500.0
    current[0] = torch.tensor(400.0)
    assert read() == 400.0
    for other in (300, torch.tensor([1.0, 2.0])):
        current[0] = other
        assert read() is other


@pytest.mark.slow
def test_a_compiled_pipeline_under_pab_does_not_recompile_per_step(tmp_path, tiny_wan):
    """The timestep's memo stays out of dynamo's trace: traced, it recompiled the compiled blocks at every step."""
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--attn", "native+compile+cache=pab",
                                       "--steps", "6", "--out", str(out)])
    assert result.exit_code == 0, result.output
    import json

    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert run["attention_patch"]["step_cache"][0]["work_computed"] < 1 and run["graphs_compiled"] == 0


def test_mag_cache_calibrates_then_skips_with_its_ratios():
    _, model, kwargs = _tiny("wan")
    timestep = [999]
    applied = apply_step_cache(model, parse_cache("mag:calibrate"), what="wan", steps=STEPS)
    _steps(model, kwargs, applied, timestep, contexts=True)
    applied.undo()
    assert len(applied.calibration) == STEPS and applied.summary()["work_computed"] == 1.0
    applied = apply_step_cache(model, parse_cache("mag:threshold=0.5"), what="wan", steps=STEPS,
                               mag_ratios=applied.calibration)
    _steps(model, kwargs, applied, timestep, contexts=True)
    applied.undo()
    assert applied.summary()["work_computed"] < 1
    with pytest.raises(UserError, match="run the same pipeline with cache=mag:calibrate first"):
        apply_step_cache(model, parse_cache("mag"), what="wan", steps=STEPS)


def test_a_cache_that_follows_the_timestep_needs_a_pipeline():
    _, model, _ = _tiny("wan")
    with pytest.raises(UserError, match="runs with a pipeline"):
        apply_step_cache(model, parse_cache("pab"), what="wan")


@pytest.mark.parametrize("text, words", [
    ("fp8+cache=nope", "unknown step cache 'nope'"),
    ("fp8+cache=fbc:x", "threshold takes a number, not 'x'"),
    ("fp8+cache=fbc:-0.1", "threshold must be at least 0"),
    ("fp8+cache=taylorseer:interval=0", "interval must be at least 1"),
    ("fp8+cache=taylorseer:warmup=0", "warmup must be at least 1"),  # diffusers would predict step 0 from nothing
    ("fp8+cache=taylorseer:depth=2", "taylorseer has no parameter 'depth'"),
    ("fp8+cache=fbc:0.1:0.2", "write parameters as NAME=VALUE after the first"),
    ("fp8+cache=fbc+cache=pab", "names 2 step caches"),
    ("fp8+cache=pab:skip=2:skip=3", "sets skip twice"),
])
def test_bad_cache_parameters_are_one_line(text, words):
    with pytest.raises(UserError, match=words) as error:
        parse_recipe(text)
    assert "\n" not in str(error.value)


def test_labels_are_canonical_and_every_method_is_in_the_help():
    assert parse_recipe("fp8+cache=fbc:threshold=0.12+compile").label == "fp8+compile+cache=fbc:0.12"
    assert parse_recipe("native+cache=taylorseer:interval=3").cache.value("warmup") == 3  # the default
    help_text = step_cache.cache_help()
    assert all(name in help_text for name in CACHE_METHODS)


def test_the_commands_refuse_a_cache_where_it_cannot_work(tmp_path, tiny_wan):
    """profile-block times one pass of one block (one line naming generate); bench-attention takes no options."""
    result = CliRunner().invoke(main, ["profile-block", "--attn", "native+cache=fbc", "--seq-len", "64", "--out",
                                       str(tmp_path / "a")])
    assert result.exit_code == 2 and "run it with dit-accel generate" in result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "a").exists()
    result = CliRunner().invoke(main, ["bench-attention", "--backends", "native+cache=fbc", "--out",
                                       str(tmp_path / "b")])
    assert result.exit_code == 2 and "bench-attention times attention alone" in result.output
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--attn", "native+cache=mag",
                                       "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "cache=mag:calibrate first" in result.output and not (tmp_path / "c").exists()


def test_generate_runs_several_caches_against_one_reference_in_one_call(tmp_path, tiny_wan, monkeypatch):
    """Several --attn, one call: each run in order after the reference, each compared against it (a table, and
    report.json's comparisons); MagCache's calibration earlier in the list serves its cached run after it."""
    import json

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the ratios it keeps stay with this test

    out = tmp_path / "run"
    recipes = ["native+cache=mag:calibrate", "native+cache=mag", "native+cache=fbc:0.5"]
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--attn", ",".join(recipes),
                                       "--compare", "native", "--steps", "4", "--no-warmup", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [run["attention"] for run in report["runs"]] == ["native", *recipes]
    assert [(c["reference"], c["candidate"]) for c in report["comparisons"]] == [("native", r) for r in recipes]
    assert report["runs"][2]["attention_patch"]["step_cache"][0]["calibration"] is None  # read, not measured
    assert report["runs"][1]["attention_patch"]["step_cache"][0]["calibration"]  # measured, then kept
    calibration = report["comparisons"][0]  # skips nothing: the reference's video, bit for bit
    assert calibration["identical_frames"] == len(calibration["psnr_db_per_frame"]) > 0
    assert len([f for f in report["files"] if f.endswith(".mp4")]) == 4
    assert "each attention against native" in result.output


@pytest.mark.parametrize("args, message", [
    (["--attn", "native,native+cache=fbc,native"], "--attn names native twice; name each once"),
    (["--attn", "native+cache=fbc,native", "--compare", "native"], "leave it out of --attn"),
])
def test_generate_refuses_a_recipe_named_twice(tmp_path, tiny_wan, args, message):
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), *args, "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and message in result.output and not (tmp_path / "r").exists()


def test_generate_reports_what_the_cache_skipped_beside_the_uncached_run(tmp_path, tiny_wan):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--attn", "native+cache=fbc:0.5",
                                       "--compare", "native", "--steps", "4", "--no-warmup", "--out", str(out)])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads((out / "report.json").read_text())
    cache = report["runs"][1]["attention_patch"]["step_cache"][0]
    assert cache["cache"] == "cache=fbc:0.5" and len(cache["per_step"]) == 4 and cache["work_computed"] < 1
    assert report["comparisons"][0]["psnr_db_mean"] > 20  # the video against the uncached run's
    text = " ".join(result.output.split())
    assert "First Block Cache over 8 transformer passes" in text
    assert f"to predict it: plan RUN --cache fbc:0.5 --cache-skip {cache_skip_measured(cache):.3f}" in text
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "video_native+cache-fbc-0.5.mp4",
                                                     "video_native.mp4"]


@pytest.mark.parametrize("cache, hint", [("fbc", "changed by less than its threshold, 0.05"),
                                         ("dbcache:0.2", "changed by less than its threshold, 0.2"),
                                         ("mag:calibrate", None), ("taylorseer", None)])
def test_a_threshold_cache_that_skipped_nothing_says_which_parameter_decides(cache, hint):
    """A threshold cache that skipped nothing names its threshold and what raising it does; a calibration and a
    fixed schedule (which skip nothing only by their schedule) do not."""
    from dit_accel.commands.generate import _cache_line

    ran = {"cache": f"cache={cache}", "method": "m", "passes": 8, "work_computed": 1.0, "hooked_modules": 3,
           "per_step": [{"passes": 2, "computed": 6, "full": 6}] * 4}
    line = _cache_line(f"native+cache={cache}", ran, 0)
    assert "steps with work skipped: none" in line
    assert (hint in line) if hint else "(it skips where" not in line


def test_a_threshold_caches_line_sets_the_changes_it_measured_against_its_threshold():
    from dit_accel.commands.generate import _cache_line

    changes = {"compared": 6, "min": 0.0612, "median": 0.0956, "max": 0.1389}
    none_skipped = [{"passes": 2, "computed": 6, "full": 6}] * 4
    ran = {"cache": "cache=fbc", "method": "m", "passes": 8, "work_computed": 1.0, "hooked_modules": 3,
           "per_step": none_skipped, "changes": changes}
    assert ("less than its threshold, 0.05; the changes it measured ran 0.061 to 0.139, median 0.096: a larger one "
            "skips more") in _cache_line("native+cache=fbc", ran, 0)
    skipped = {**ran, "cache": "cache=fbc:0.1", "work_computed": 0.5,
               "per_step": [{"passes": 2, "computed": 2, "full": 6}] * 4}
    line = _cache_line("native+cache=fbc:0.1", skipped, 0)
    assert "; the changes it measured ran 0.061 to 0.139, median 0.096, against its threshold, 0.1;" in line
    assert "(it skips where" not in line


# --- the peer: cache-dit's DBCache, on a whole pipeline -------------------------------------------------------------

def _wan_video(pipe, **kwargs):
    return pipe("a cat", num_frames=9, height=64, width=64, num_inference_steps=6, output_type="np",
                generator=torch.Generator().manual_seed(0), **kwargs).frames


def test_cache_dit_dbcache_counts_what_it_skipped_and_comes_off_bit_identical(tiny_wan):
    """cache-dit's DBCache through apply_recipe on the tiny WanPipeline: after its warm-up steps it computes the
    first block of each pass alone (fn=1, a threshold random weights stay under), counted per step as the other
    caches are; taken off, the pipeline's video is bit-identical to before."""
    import numpy as np
    from diffusers import WanPipeline

    from dit_accel.patching.apply import apply_recipe

    pipe = WanPipeline.from_pretrained(str(tiny_wan))
    before = _wan_video(pipe)
    with apply_recipe(pipe, parse_recipe("native+cache=dbcache:0.5:fn=1:warmup=2"), steps=6) as applied:
        _wan_video(pipe, callback_on_step_end=applied.step_callback)
    summary = applied.summary()["step_cache"][0]
    assert summary["method"] == "cache-dit DBCache" and summary["hooked_modules"] == 2  # the tiny Wan's blocks
    assert [s["computed"] for s in summary["per_step"]] == [4, 4, 2, 2, 2, 2]  # 2 passes a step (the guidance)
    # each pass after the warm-up compared (cache-dit's own record), every change under the threshold it skipped at
    assert summary["changes"]["compared"] == 8 and summary["changes"]["max"] < 0.5
    assert np.array_equal(_wan_video(pipe), before)


def test_cache_dit_dbcache_needs_a_pipeline_and_its_package():
    _, model, _ = _tiny("wan")
    with pytest.raises(UserError, match="goes on a whole pipeline: run it with dit-accel generate"):
        apply_step_cache(model, parse_cache("dbcache"), what="wan", steps=STEPS)


def test_cache_dit_missing_is_one_line_naming_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cache_dit", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install 'dit-accel\[cache-dit\]'") as error:
        step_cache.make_config(parse_cache("dbcache"), None, steps=STEPS, timestep=None)
    assert "\n" not in str(error.value)

"""`--validate model`: the whole transformer (its parts outside the
blocks with the blocks put in as its block stack) timed against blocks x block + outside; the streamed
model's output; the memory check that refuses a resident model too large for the room."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from dit_accel.adapters import BlockAdapter, adapter_for_preset
from dit_accel.cli import main
from dit_accel.errors import UserError
from dit_accel.loading.block import param_bytes, synthetic_block, synthetic_outside
from dit_accel.patching.recipe import parse_recipe
from dit_accel.planning.cached import taylorseer_computed_steps
from dit_accel import headroom
from dit_accel.profiling import memory
from dit_accel.profiling.extrapolate import Validation
from dit_accel.profiling.session import ProfileSettings
from dit_accel.profiling.validate import build_stack, session_bytes_used, validate_chain

CPU = torch.device("cpu")
FAST = ["--seq-len", "64", "--runs", "2", "--warmup", "1"]


def _small(family, num_layers=3):
    adapter = adapter_for_preset(family)
    return BlockAdapter(adapter.spec, {**adapter.scaled_down_config(), "num_layers": num_layers}, preset=adapter.preset)


def _stack_name(adapter):
    return adapter.block_key_template.split(".")[0]


def test_the_ratio_is_measured_over_blocks_times_block_plus_outside():
    v = Validation(chained_blocks=50, distinct_blocks=50, measured_ms=4700.0, block_ms=91.0, outside_ms=20.0,
                   outside_source="stated")
    assert v.extrapolated_ms == 50 * 91.0 + 20.0
    assert v.ratio == pytest.approx(4700.0 / 4570.0) and v.error_pct == pytest.approx(100 * (4700 / 4570 - 1))
    d = v.as_dict()
    assert d["whole_model"] and d["residency"] == "resident" and d["extrapolated_ms"] == 4570.0
    chain = Validation(chained_blocks=50, distinct_blocks=50, measured_ms=4700.0, block_ms=91.0)
    assert not chain.whole_model and chain.extrapolated_ms == 50 * 91.0


@pytest.mark.parametrize("family", ["minimax-h3", "wan"])
def test_the_model_holds_every_block_and_the_parts_outside_and_runs_them_all(family):
    adapter = _small(family)
    first = synthetic_block(adapter, 0, CPU, torch.float32).block
    stack = build_stack(adapter, first, adapter.num_blocks, device=CPU, dtype=torch.float32, activation_bytes=0,
                        whole_model=True)
    blocks = getattr(stack.model, _stack_name(adapter))
    assert stack.blocks is blocks and len(blocks) == stack.distinct == 3 and blocks[0] is first
    outside = synthetic_outside(adapter, CPU, torch.float32)
    assert param_bytes(stack.model) == param_bytes(outside) + sum(param_bytes(b) for b in blocks)
    if family == "minimax-h3":
        assert len(stack.model.token_refiner.refiner_blocks) == 2
    calls = []
    for block in blocks:
        block.register_forward_hook(lambda module, args, output: calls.append(module))
    workload = adapter.workload_from_seq_len(1024, 1)
    inputs = adapter.make_transformer_inputs(workload, CPU, torch.float32, torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = stack.model(**inputs.kwargs)
    assert calls == list(blocks)  # each block once, in order
    assert all(torch.isfinite(o).all() for o in output)


def test_the_streamed_model_gives_the_resident_output():
    adapter = _small("minimax-h3")
    workload = adapter.workload_from_seq_len(128, 1)
    inputs = adapter.make_transformer_inputs(workload, CPU, torch.float32, torch.Generator().manual_seed(0))

    def output(offload):
        first = synthetic_block(adapter, 0, CPU, torch.float32, seed=0).block
        stack = build_stack(adapter, first, adapter.num_blocks, device=CPU, dtype=torch.float32, activation_bytes=0,
                            offload=offload, whole_model=True)
        with torch.no_grad():
            return stack, stack.model(**inputs.kwargs)

    resident_stack, resident = output("resident")
    streamed_stack, streamed = output("stream")
    assert resident_stack.streamed_bytes == 0
    assert streamed_stack.streamed_bytes == sum(param_bytes(b) + sum(t.numel() * t.element_size() for t in b.buffers())
                                                for b in streamed_stack.blocks)  # the parts outside stay on the device
    assert all(getattr(b, "_diffusers_hook", None) is not None for b in streamed_stack.blocks)
    for r, s in zip(resident, streamed):
        assert torch.equal(r, s)


def test_the_pass_peak_counts_of_the_sessions_tensors_only_what_the_pass_uses():
    """The session holds the profiled block and its inputs through --validate: a streamed stack's fresh blocks and
    the whole model's own inputs leave them unused, a resident chain runs on both."""
    adapter = _small("minimax-h3")
    first = synthetic_block(adapter, 0, CPU, torch.float32).block
    inputs = adapter.make_inputs(adapter.workload_from_seq_len(64, 1), CPU, torch.float32,
                                 torch.Generator().manual_seed(0))
    leaves = [t for v in inputs.values() for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    input_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves}.values())
    assert input_bytes > 0
    resident = build_stack(adapter, first, 3, device=CPU, dtype=torch.float32, activation_bytes=0)
    streamed = build_stack(adapter, first, 3, device=CPU, dtype=torch.float32, activation_bytes=0, offload="stream")
    assert session_bytes_used(resident, first, inputs, CPU) == param_bytes(first) + input_bytes
    assert session_bytes_used(resident, first, {}, CPU) == param_bytes(first)  # the whole model: its own inputs
    assert session_bytes_used(streamed, first, inputs, CPU) == input_bytes
    elsewhere = {**inputs, "elsewhere": torch.empty(64, device="meta")}  # not on the pass's device
    assert session_bytes_used(streamed, first, elsewhere, CPU) == input_bytes
    model = build_stack(adapter, first, 3, device=CPU, dtype=torch.float32, activation_bytes=0, whole_model=True,
                      offload="stream")
    assert session_bytes_used(model, first, {}, CPU) == 0


def test_validate_model_runs_the_backend_in_the_blocks_only(fake_backend):
    adapter = _small("minimax-h3")
    workload = adapter.workload_from_seq_len(64, 1)
    first = synthetic_block(adapter, 0, CPU, torch.float32).block
    inputs = adapter.make_inputs(workload, CPU, torch.float32, torch.Generator().manual_seed(0))
    v = validate_chain(adapter, first, inputs, adapter.num_blocks, recipe=parse_recipe("fake"), device=CPU,
                       dtype=torch.float32, block_ms=2.0, activation_bytes=0, whole_model=workload, outside_ms=1.5,
                       outside_source="stated", warmup=1, runs=2)
    # 3 blocks x (1 warm-up + 2 runs); the refiner's attention keeps diffusers' default, as measured outside.
    assert len(fake_backend.calls) == 3 * 3
    assert v.whole_model and v.chained_blocks == 3 and v.pass_seq_len == 64
    assert v.extrapolated_ms == 3 * 2.0 + 1.5 and v.ratio == v.measured_ms / 7.5
    assert v.peak_memory_bytes is None  # a CPU run


@pytest.mark.slow
def test_profile_block_validate_model_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "32", "--runs", "1",
                                       "--warmup", "0", "--validate", "model", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    v, run = report["validation"], report["runs"][0]
    assert report["outside"] is not None  # --validate model measured outside the blocks
    assert v["whole_model"] and v["chained_blocks"] == v["distinct_blocks"] == 50 and v["residency"] == "resident"
    assert v["block_ms"] == run["block_ms"] and v["outside_ms"] == report["outside"]["median_ms"]
    assert v["extrapolated_ms"] == pytest.approx(run["extrapolation"]["pass_ms"])
    assert v["ratio"] == pytest.approx(v["measured_ms"] / (50 * v["block_ms"] + v["outside_ms"]))
    text = " ".join(result.output.split())  # rich wraps the lines at the terminal's width
    assert "the whole transformer (50 blocks and the parts outside them, resident" in text
    assert "--validate model measures it in this session" in text


@pytest.mark.slow
def test_validate_model_with_a_cache_runs_the_whole_video_on_the_caches_schedule(tmp_path):
    """--validate model --cache taylorseer: the whole transformer through every step of the video (H3: one pass a
    step) under the cache, after a warm-up of its first cycle (step 0 computed, 1 predicted, 2 computed): each step
    its attention modules' forwards as diffusers' schedule computes them, nothing compiled, a pass averaged over the
    video as the measurement."""
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "32", "--runs", "1",
                                       "--warmup", "0", "--steps", "5", "--validate", "model",
                                       "--cache", "taylorseer:interval=2:warmup=1", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    v = json.loads((out / "report.json").read_text())["validation"]
    video = v["video"]
    hooked = video["hooked_modules"]
    assert hooked == 50  # H3's one attention module a block
    computed = [step < 1 or (step - 2) % 2 == 0 for step in range(5)]  # steps 0, 2 and 4
    assert sum(computed) == taylorseer_computed_steps(5, 2, 1)
    assert video["computed_per_step"] == [hooked if c else 0 for c in computed]
    assert (video["steps"], video["passes_per_step"], video["warmup_steps"], video["graphs_compiled"]) == (5, 1, 3, 0)
    assert video["work_computed"] == pytest.approx(3 / 5)
    assert v["measured_ms"] == pytest.approx(video["pass_ms"]) == pytest.approx(1e3 * video["seconds"] / 5)
    assert v["error_pct"] is None and v["ratio"] == pytest.approx(v["measured_ms"] / v["extrapolated_ms"])
    text = " ".join(result.output.split())
    assert "the whole video under cache=taylorseer:interval=2:warmup=1: 5 steps x 1 pass(es)" in text
    assert "per step 50, 0, 50, 0, 50" in text and "graphs compiled during the timed video: 0" in text


@pytest.mark.parametrize("args, message", [
    (["--cache", "taylorseer"], "--cache taylorseer runs the whole video in the --validate model pass: add "
                                "--validate model"),
    (["--validate", "model", "--cache", "pab"], "--cache pab: Pyramid Attention Broadcast skips by the pipeline's "
                                                "timesteps"),
    (["--validate", "model", "--cache", "fbc:0.1"], "--cache fbc: First Block Cache skips by a threshold"),
    (["--validate", "model", "--cache", "taylorseer:every=2"], "cache=taylorseer:every=2: taylorseer has no "
                                                               "parameter 'every'"),
])
def test_a_cache_the_video_cannot_run_is_one_line(tmp_path, args, message):
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", *FAST, *args, "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and result.output.startswith(f"error: {message}"), result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "r").exists()


def test_a_cached_video_runs_resident():
    """(On a GPU: the CPU refuses --offload stream first.)"""
    from dit_accel.patching.step_cache import parse_cache
    from dit_accel.profiling.request import check_video_cache

    with pytest.raises(UserError, match="--cache taylorseer runs the whole video with the blocks resident .* drop "
                                        "--offload stream"):
        check_video_cache(parse_cache("taylorseer"), True, "stream")


@pytest.mark.parametrize("args, measured", [([], True), (["--outside-ms", "5"], False)])
def test_validate_model_measures_outside_unless_it_is_stated(tmp_path, monkeypatch, args, measured):
    from dit_accel.profiling import session

    seen = []

    def stop(settings, run_dir, progress):
        seen.append(settings)
        raise UserError("stopped by the test")

    monkeypatch.setattr(session, "run_session", stop)
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", *FAST, "--validate", "model", *args,
                                       "--out", str(tmp_path / "run")])
    assert "stopped by the test" in result.output
    (settings,) = seen
    assert settings.validate_model and settings.validate_blocks == settings.adapter.num_blocks == 50
    assert settings.measure_outside is measured and settings.outside_ms == (None if measured else 5.0)


def _full_h3_settings(offload):
    adapter = adapter_for_preset("minimax-h3")
    return ProfileSettings(adapter, adapter.default_workload(1), torch.bfloat16,
                           torch.device("cuda"), (parse_recipe("native"),), measure_outside=True,
                           validate_blocks=adapter.num_blocks, validate_model=True, offload=offload)


def test_the_full_size_resident_model_is_refused_on_16_gib_and_fits_streamed_or_on_an_h200(monkeypatch):
    budget = 16 * memory.GiB
    monkeypatch.setattr(memory, "memory_room", lambda device, b=None, text=None: (budget, "the 16GiB budget"))
    with pytest.raises(UserError) as refused:
        memory.check_fits(_full_h3_settings("resident"), budget, "16GiB")
    message = str(refused.value)
    assert "\n" not in message and "add --offload stream" in message and "the whole transformer (50 blocks" in message
    resident = memory.estimate_session(_full_h3_settings("resident"))
    # ~66 GB of weights: 50 blocks of 1.29 GB and the parts outside them.
    assert 64e9 < resident.weights_bytes + resident.validate_bytes + resident.outside_bytes < 68e9
    streamed = memory.check_fits(_full_h3_settings("stream"), budget, "16GiB")
    assert streamed.validate_bytes == streamed.weights_bytes and streamed.total_bytes < budget
    monkeypatch.setattr(memory, "memory_room", lambda device, b=None, text=None: (139 * memory.GiB, "H200 free"))
    assert memory.check_fits(_full_h3_settings("resident")).total_bytes < 139 * memory.GiB


def test_a_resident_model_too_large_for_the_host_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    adapter = adapter_for_preset("minimax-h3")
    adapter = adapter.scaled_down()
    settings = ProfileSettings(adapter, adapter.workload_from_seq_len(64, 1), torch.float32, CPU,
                               (parse_recipe("native"),), measure_outside=True, validate_blocks=50, validate_model=True)
    e = memory.estimate_session(settings)
    held = (e.weights_bytes + e.outside_bytes + e.validate_bytes) * (1 + memory.MARGIN) + memory.FIXED_BYTES
    monkeypatch.setattr(headroom, "host_available_bytes", lambda: math.floor(held) - 1)
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", *FAST, "--validate", "model",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert "the whole transformer (50 blocks and the parts outside them) resident" in result.output
    assert "drop --validate model" in result.output and "--offload stream" not in result.output  # CPU: no streaming
    assert not (tmp_path / "run").exists()


def test_validate_takes_a_count_or_model(tmp_path):
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--validate", "all",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert result.output == "error: --validate takes a number of blocks or model, got all\n"


@pytest.mark.gpu
def test_the_full_size_h3_transformer_matches_its_extrapolation_on_the_gpu(tmp_path):
    """The whole H3 transformer at S = 30272 in bf16 (66 GB resident): measured within 5% of 50 x block +
    outside."""
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--validate", "model", "--runs", "3", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    v = json.loads((out / "report.json").read_text())["validation"]
    assert v["whole_model"] and v["chained_blocks"] == 50 and v["peak_memory_bytes"] > 64e9
    assert abs(v["ratio"] - 1) < 0.05


def test_a_streamed_fp8_linear_pass_counts_its_blocks_in_fp8(monkeypatch):
    """--validate model --offload stream with FP8 linears in the first recipe streams FP8 blocks: the estimate's
    streamed block is the chosen linears in e4m3 with per-row fp32 scales and the rest as loaded (Wan 2.1 14B:
    0.40 of 0.70 GB), so the full recipe's streamed Wan 720p session fits a 16 GiB budget as the baseline's does."""
    from dit_accel.patching.fp8_linear import plan_fp8_linears

    budget = 16 * memory.GiB
    monkeypatch.setattr(memory, "memory_room", lambda device, b=None, text=None: (budget, "the 16GiB budget"))
    adapter = adapter_for_preset("wan")

    def settings(recipe):
        return ProfileSettings(adapter, adapter.default_workload(1), torch.bfloat16, torch.device("cuda"),
                               (parse_recipe(recipe),), measure_outside=True, validate_blocks=adapter.num_blocks,
                               validate_model=True, offload="stream")

    plain, full = (memory.check_fits(settings(r), budget, "16GiB") for r in ("cudnn", "fp8+fp8-linear+compile"))
    chosen = plan_fp8_linears(adapter.build_block(), adapter).chosen
    assert plain.validate_bytes == plain.weights_bytes == full.weights_bytes
    assert full.validate_bytes == plain.weights_bytes - sum(c.in_features * c.out_features - 4 * c.out_features
                                                            for c in chosen)
    assert 0.5 < full.validate_bytes / plain.weights_bytes < 0.65 and full.total_bytes < budget

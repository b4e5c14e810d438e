"""Every registered family through the generic path, scaled down on the CPU: its stacks, the block's inputs
captured from the model's own forward, its attention calls, its FP8 linears by the rule, its ranges; and
MiniMax-H3 and Wan with the same attention and linear FLOPs as the hand-written adapters they replaced."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from testing import every_family

from dit_accel.adapters import Family, adapter_for_config, adapter_for_preset
from dit_accel.adapters.family import InputContext, LatentGrid, Preset
from dit_accel.adapters.inputs import forward_arguments
from dit_accel.adapters.linears import RULE
from dit_accel.errors import UserError
from dit_accel.loading.block import synthetic_block
from dit_accel.patching.fp8_linear import plan_fp8_linears, quantize_linears
from dit_accel.profiling.validate import BlockChain

CPU = torch.device("cpu")
TEXT_ALONE = {("kandinsky-5", "text_transformer_blocks"), ("kandinsky-6", "video_text_transformer_blocks"),
              ("kandinsky-6", "audio_text_transformer_blocks")}  # stacks whose blocks see the prompt's rows alone


@pytest.mark.parametrize("name", every_family())
def test_the_family_derives_its_stacks_inputs_calls_linears_and_ranges(name):
    adapter = adapter_for_preset(name).scaled_down()
    workload = adapter.default_workload(1, scaled_down=True)
    captures = adapter.capture(workload, CPU, torch.float32)
    assert [c.name for c in captures] == [stack for stack, _ in adapter.stacks]
    for capture in captures:
        stack = adapter.for_stack(capture.name)
        assert capture.num_blocks == stack.num_blocks > 1 and capture.rows > 0
        inputs = stack.make_inputs(workload, CPU, torch.float32, torch.Generator().manual_seed(0))
        block = synthetic_block(stack, 0, CPU, torch.float32).block
        with torch.no_grad():
            output = block(**inputs)
            # --validate N's chain: each block's output fed to the next through the stack's own argument
            rest = {k: v for k, v in inputs.items() if k != stack.sequence_argument}
            chained = BlockChain([block, block], stack.sequence_argument)(inputs[stack.sequence_argument], **rest)
        hidden = output[0] if isinstance(output, tuple) else output
        assert hidden.shape == inputs[stack.sequence_argument].shape and torch.isfinite(hidden).all()
        assert chained.shape == hidden.shape and torch.isfinite(chained).all()
        # The attention calls the block made, each with its FLOPs; SANA-Video's self-attention is linear
        # (matmuls, no softmax): its one call is the cross-attention.
        assert capture.attention_calls and all(call.flops > 0 for call in capture.attention_calls)
        assert {call.kind for call in capture.attention_calls} <= {"self", "joint", "cross"}
        # Every linear of the block is chosen or kept with a reason, by the rule; a stack on the text alone
        # (Kandinsky 5's and 6's text blocks: no video rows) keeps them all.
        policy = stack.fp8_linears
        text_alone = (name, capture.name) in TEXT_ALONE
        assert bool(policy.fp8) != text_alone and set(policy.fp8) | set(policy.kept) == set(capture.linear_shapes)
        assert all(reason for reason in policy.kept.values())
        labels = {r.label: r for r in stack.module_ranges}
        assert labels["attention core"].functions and "qkv projection" in labels
        for spec in stack.module_ranges:
            for path in spec.modules:
                block.get_submodule(path)  # every range names modules the block has


@pytest.mark.parametrize("name", every_family())
def test_the_block_inputs_are_captured_and_run_in_bf16(name):
    """In the dtype a GPU run uses: inputs the model casts to its own dtype from ours (HunyuanVideo 1.5's time
    projection follows the timestep's dtype) must be made in it, as the pipeline makes them."""
    adapter = adapter_for_preset(name).scaled_down()
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), CPU, torch.bfloat16,
                                 torch.Generator().manual_seed(0))
    block = synthetic_block(adapter, 0, CPU, torch.bfloat16).block
    with torch.no_grad():
        output = block(**inputs)
    hidden = output[0] if isinstance(output, tuple) else output
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(hidden).all()


@pytest.mark.parametrize("name", every_family())
def test_the_pipeline_facts_say_where_they_came_from(name):
    facts = adapter_for_preset(name).facts
    frames, height, width = facts.video
    assert frames > 1 and height >= 64 and width >= 64 and facts.video_source
    assert facts.steps >= 1 and facts.steps_source and 1 <= facts.passes_per_step <= 4 and facts.passes_source
    assert facts.text_rows > 0 and facts.text_rows_source and all(f > 0 for f in facts.vae_factors)


def test_h3_attention_and_linear_flops_are_the_hand_written_adapters():
    """At S = 30272 the H3 block's self-attention is 4 S^2 x 56 x 128 (26.27 TFLOP) and its linears see every
    row but the AdaLN projection, which sees the one timestep's: what the hand-written adapter declared."""
    adapter = adapter_for_preset("minimax-h3")
    workload = adapter.workload_from_seq_len(30272, 1)
    calls = adapter.attention_calls(workload)
    assert [(c.kind, c.q_len, c.kv_len, c.heads, c.head_dim) for c in calls] == [("self", 30272, 30272, 56, 128)]
    assert sum(c.flops for c in calls) == pytest.approx(26.27e12, rel=1e-3)
    block = adapter.build_block()
    rows = {name: 1 if name.startswith("adaln_proj") else 30272
            for name, module in block.named_modules() if isinstance(module, nn.Linear)}
    expected = sum(2.0 * rows[name] * m.in_features * m.out_features
                   for name, m in block.named_modules() if isinstance(m, nn.Linear))
    assert sum(adapter.flops_per_linear(block, workload).values()) == expected


def test_wan_attention_and_linear_flops_are_the_hand_written_adapters():
    """Wan 2.1 14B at 81 frames of 720x1280 (S = 75600): self-attention over S and cross-attention to the
    512 text rows, 40 heads of 128; the cross-attention's keys and values see the text rows only."""
    adapter = adapter_for_preset("wan")
    workload = adapter.workload_from_video(81, 720, 1280, 1)
    calls = adapter.attention_calls(workload)
    assert [(c.module, c.kind, c.q_len, c.kv_len) for c in calls] == [("attn1", "self", 75600, 75600),
                                                                     ("attn2", "cross", 75600, 512)]
    assert sum(c.flops for c in calls) == 4.0 * 40 * 128 * (75600 * 75600 + 75600 * 512)
    block = adapter.build_block()
    rows = {name: 512 if name.startswith(("attn2.to_k", "attn2.to_v")) else 75600
            for name, module in block.named_modules() if isinstance(module, nn.Linear)}
    expected = sum(2.0 * rows[name] * m.in_features * m.out_features
                   for name, m in block.named_modules() if isinstance(m, nn.Linear))
    assert sum(adapter.flops_per_linear(block, workload).values()) == expected


def test_hunyuan_video_has_two_stacks_and_joint_attention_over_video_and_text():
    adapter = adapter_for_preset("hunyuan-video")
    assert adapter.stacks == [("transformer_blocks", 20), ("single_transformer_blocks", 40)]
    workload = adapter.default_workload(1)  # 129 frames of 720x1280: 33 x 45 x 80 patches
    assert workload.seq_len == 33 * 45 * 80 and workload.rows["text"] == 256
    for stack in ("transformer_blocks", "single_transformer_blocks"):
        (call,) = adapter.for_stack(stack).attention_calls(workload)
        assert (call.kind, call.q_len, call.heads, call.head_dim) == ("joint", 118800 + 256, 24, 128)
        assert call.masked  # the text rows' padding mask: calls our kernel refuses and the router counts
    assert "transformer_blocks.{index}." == adapter.block_key_template
    assert adapter.for_stack("single_transformer_blocks").block_key_template == "single_transformer_blocks.{index}."


def test_ltx2_runs_four_forwards_a_step_and_its_audio_beside_the_video():
    """LTX2Pipeline's defaults turn on classifier-free, spatio-temporal and modality-isolation guidance: four
    forwards a step. Every block attends over the audio stream too: 126 rows for 121 frames at 24 fps (25 audio
    latents a second), its own self- and cross-attention and the two cross-modal calls."""
    adapter = adapter_for_preset("ltx-2")
    facts = adapter.facts
    assert facts.passes_per_step == 4 and "stg_scale 1.0" in facts.passes_source
    assert "modality_scale 3.0" in facts.passes_source and facts.steps == 30
    workload = adapter.default_workload(1)  # 121 frames of 512x768: 16 x 16 x 24 latents, patch 1
    assert workload.seq_len == 16 * 16 * 24 and (workload.rows["text"], workload.rows["audio"]) == (1024, 126)
    assert adapter.workload_from_video(100, 512, 768, 1).rows["audio"] == 104  # the pipeline's, from 100 frames
    # The audio is as long as the video, but the FP8 rule's second capture (twice the video rows) keeps it as it
    # was: a linear on the audio's 126 rows stays in bf16, the video's query into the audio goes FP8.
    kept, fp8 = adapter.fp8_linears.kept, adapter.fp8_linears.fp8
    assert "audio_attn1.to_q" in kept and "audio_ff.net.0.proj" in kept and "audio_to_video_attn.to_q" in fp8
    calls = [(c.kind, c.q_len, c.kv_len, c.heads, c.head_dim) for c in adapter.attention_calls(workload)]
    assert ("self", 6144, 6144, 32, 128) in calls and ("cross", 6144, 1024, 32, 128) in calls
    assert {("cross", 126, 1024, 32, 64), ("cross", 6144, 126, 32, 64), ("cross", 126, 6144, 32, 64)} <= set(calls)
    assert any(c[1:3] == (126, 126) for c in calls)  # the audio's self-attention


def test_kandinsky5_profiles_its_visual_blocks_and_keeps_its_text_blocks_linears():
    """Kandinsky 5.0 names what the generic rules assume otherwise: its forward runs 2 text blocks before the 32
    visual ones (the visual stack is profiled first), its blocks take their rows as `x` / `visual_embed`, its
    config gives model_dim and RoPE axes, not heads (28 heads of 64, from its attention calls), and its text
    blocks see no video rows: the FP8 rule keeps all their linears, and `+fp8-linear` plans none."""
    adapter = adapter_for_preset("kandinsky-5")
    assert adapter.stack == "visual_transformer_blocks" and adapter.stacks[0] == ("text_transformer_blocks", 2)
    assert adapter.attention_heads == (28, 64) and adapter.hidden_size == 1792
    text = adapter.for_stack("text_transformer_blocks")
    assert (adapter.sequence_argument, text.sequence_argument) == ("visual_embed", "x")
    workload = adapter.default_workload(1)  # 121 frames of 512x768: 31 x 32 x 48 patches
    calls = [(c.kind, c.q_len, c.kv_len, c.heads, c.head_dim) for c in adapter.attention_calls(workload)]
    assert calls == [("self", 47616, 47616, 28, 64), ("cross", 47616, 512, 28, 64)]
    assert not text.fp8_linears.fp8
    assert all("see no video rows" in why for why in text.fp8_linears.kept.values())
    small = text.scaled_down()
    block = synthetic_block(small, 0, CPU, torch.bfloat16).block  # its modulation kept in float32, as diffusers does
    plan = plan_fp8_linears(block, small)
    assert plan.chosen == () and len(plan.kept) == len(small.fp8_linears.kept)  # no refusal: nothing to swap
    with pytest.raises(UserError, match="CUDA GPU"):  # where FP8 GEMMs cannot run, refused like any stack
        quantize_linears(block, small)
    from dit_accel.patching import fp8_linear

    with pytest.MonkeyPatch.context() as patch:  # where they can (a GPU for bf16): nothing swapped, no refusal
        patch.setattr(fp8_linear, "fp8_linear_unavailable_reason",
                      lambda device, dtype: None if dtype == torch.bfloat16 else "not bf16")
        swap = quantize_linears(block, small)
    assert swap.quantized == () and len(swap.kept) == len(plan.kept)


def test_the_wan_derived_families_say_what_their_pipelines_pass():
    """Wan VACE: a second stack of 8 VACE blocks beside the 40 Wan ones, fed the control latents (96 channels);
    ChronoEdit: an edit is 5 frames (its pipeline forces them without temporal reasoning), with the CLIP image
    rows in every cross-attention; EasyAnimate: the 256 prompt rows its encode_prompt pads to."""
    vace = adapter_for_preset("wan-vace")
    assert vace.stacks == [("blocks", 40), ("vace_blocks", 8)]
    assert {r.label for r in vace.for_stack("vace_blocks").module_ranges} >= {"block linears", "qkv projection"}
    chrono = adapter_for_preset("chronoedit")
    workload = chrono.default_workload(1)  # 5 frames of 480x832: 2 x 30 x 52 patches
    assert chrono.facts.video == (5, 480, 832) and workload.seq_len == 2 * 30 * 52
    calls = [(c.kind, c.kv_len) for c in chrono.attention_calls(workload)]
    assert calls == [("self", 3120), ("cross", 257), ("cross", 512)]
    easy = adapter_for_preset("easyanimate").facts
    assert (easy.text_rows, easy.vae_factors, easy.passes_per_step) == (256, (4, 8), 2)


@pytest.mark.parametrize("name", ["hunyuan-video-framepack", "helios"])
def test_a_sectioned_pipelines_pass_is_one_section_behind_its_history(name):
    """FramePack and Helios denoise one section of 9 latent frames at a time behind the history their checkpoints
    pack ahead of it (2 full-size latent frames, 2 at 2x, 16 at 4x downsampling): the workload's rows are what
    the model's own forward hands its blocks, at a size whose coarse history is padded (6 x 10 latents), and the
    video's frames only say how many sections there are."""
    adapter = adapter_for_preset(name)
    full = adapter.default_workload(1)
    expected = {"hunyuan-video-framepack": (32400, 2 * 45 * 80 + 1 * 23 * 40 + 4 * 12 * 20, 4),  # 129 x 720x1280
                "helios": (8640, 2 * 24 * 40 + 1 * 12 * 20 + 4 * 6 * 10, 4)}[name]  # 132 x 384x640
    assert (full.rows["video"], full.rows["history"], full.sections) == expected
    assert full.seq_len == full.rows["video"] + full.rows["history"]
    small = adapter.scaled_down()
    workload = small.workload_from_video(34, 48, 80, 1)  # 2 sections of 33 frames
    assert workload.sections == 2 and workload.rows["history"] == 2 * 3 * 5 + 1 * 2 * 3 + 4 * 1 * 2
    capture = small.stack_capture(workload, CPU, torch.float32)
    assert capture.rows == workload.seq_len


def test_wan_animate_costs_a_segment_per_76_frames_each_behind_its_reference_frame():
    """WanAnimatePipeline makes a video as segments of 77 frames sharing one frame with the last (77, 78, 153 and
    160 frames: 1, 2, 2 and 3 segments, as counted from its own transformer calls); a pass is one segment's 20
    latent frames behind the reference image's (21 x 45 x 80 patches at 720x1280), whatever the video's length.
    Its face adapter, a second stack of 8 blocks that are themselves attention modules, is split into their
    projections and core like any attention."""
    adapter = adapter_for_preset("wan-animate")
    assert [adapter.workload_from_video(f, 720, 1280, 1).sections for f in (77, 78, 153, 160)] == [1, 2, 2, 3]
    workload = adapter.default_workload(1)
    assert workload.seq_len == 21 * 45 * 80 and adapter.stacks == [("blocks", 40), ("face_adapter", 8)]
    labels = {r.label for r in adapter.for_stack("face_adapter").module_ranges}
    assert {"qkv projection", "attention core", "output projection"} <= labels and "cross-attention" not in labels
    small = adapter.scaled_down()
    capture = small.stack_capture(small.default_workload(1, scaled_down=True), CPU, torch.float32)
    assert capture.rows == small.default_workload(1, scaled_down=True).seq_len


def test_cosmos_runs_without_torchvision():
    """Cosmos' transformer resizes its padding mask with torchvision, which dit-accel does not depend on: its
    inputs hook gives the module that one call where torchvision is missing, as torchvision runs it (nearest
    neighbour: each output pixel the input pixel its scaled position falls in)."""
    from diffusers.models.transformers import transformer_cosmos

    adapter = adapter_for_preset("cosmos")
    workload = adapter.default_workload(1)  # 93 frames of 704x1280: 24 x 44 x 80 patches
    assert workload.seq_len == 24 * 44 * 80 and (adapter.facts.steps, adapter.facts.passes_per_step) == (35, 2)
    calls = [(c.kind, c.q_len, c.kv_len, c.heads, c.head_dim) for c in adapter.attention_calls(workload)]
    assert calls == [("self", 84480, 84480, 16, 128), ("cross", 84480, 512, 16, 128)]
    transforms = transformer_cosmos.transforms
    mask = torch.arange(48.0).reshape(1, 1, 6, 8)
    resized = transforms.functional.resize(mask, [3, 4], interpolation=transforms.InterpolationMode.NEAREST)
    torch.testing.assert_close(resized, mask[:, :, ::2, ::2])


def test_cosmos_predict2_and_predict25_share_a_class_and_a_checkpoint_finds_its_own():
    """Predict2.5's transformer is Predict2's class with a cross-attention projection: its prompt rows come in as
    Cosmos-Reason1's hidden states of every layer (28 x 3584 = 100352 wide), projected to 1024. A config names
    its family by that projection; its pipeline runs 36 steps with guidance, no frame rate."""
    predict2, predict25 = adapter_for_preset("cosmos"), adapter_for_preset("cosmos-predict2.5")
    for adapter in (predict2, predict25):
        assert adapter_for_config(adapter.config, "a checkpoint").family == adapter.family
    assert predict25.config["crossattn_proj_in_channels"] == 28 * 3584
    assert (predict25.facts.steps, predict25.facts.passes_per_step, predict25.facts.video) == (36, 2, (93, 704, 1280))
    small = predict25.scaled_down()
    workload = small.default_workload(1, scaled_down=True)
    inputs = small.make_transformer_inputs(workload, CPU, torch.float32, torch.Generator().manual_seed(0))
    assert "fps" not in inputs.kwargs
    assert inputs.kwargs["encoder_hidden_states"].shape[-1] == small.config["crossattn_proj_in_channels"]


def test_the_rule_is_stated_and_keeps_text_and_timestep_linears():
    assert "sequence rows" in RULE and "grow with the video" in RULE and "multiples of 16" in RULE
    policy = adapter_for_preset("hunyuan-video").fp8_linears
    assert "ff.net.0.proj" in policy.fp8 and "ff_context.net.0.proj" in policy.kept  # video FFN / text FFN
    assert "norm1.linear" in policy.kept  # the AdaLN modulation runs on the timestep row


def test_the_sequence_is_the_rows_that_grow_with_the_video_not_the_widest():
    """HunyuanVideo 1.5's forward cannot run on meta: its policy comes from the scaled-down CPU pass, where the
    text side (the prompt's rows, byT5 glyph and image tokens) outnumbers the video's rows. Its video linears
    still go FP8, their rows growing with the video; the text side's, the same at every video size, stay."""
    adapter = adapter_for_preset("hunyuan-video-1.5")
    video = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
    text = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff_context.net.0.proj",
            "ff_context.net.2")
    policy = adapter.fp8_linears
    assert policy.fp8 == video
    assert "runs on 1 row, not the block's" in policy.kept["norm1.linear"]
    default, doubled = adapter.shape_captures(1, 2)
    assert all(default.linear_rows[name] > default.linear_rows["attn.to_q"] for name in text)  # text is widest
    assert all(doubled.linear_rows[name] == 2 * default.linear_rows[name] for name in video)
    assert all(doubled.linear_rows[name] == default.linear_rows[name] for name in text + ("norm1.linear",))
    rows, sequence = default.linear_rows["attn.add_q_proj"], default.linear_rows["attn.to_q"]
    for name in text:
        assert policy.kept[name].startswith(f"runs on {rows} rows, not the block's {sequence} sequence rows: "
                                            f"{rows} at every video size (text, timestep or pooled rows)")


def test_the_features_the_rule_reads_are_the_full_size_blocks():
    """Mochi's policy too comes from the scaled-down CPU pass, whose FFN ([256 -> 1364]) is no multiple of 16; the
    block it quantizes is full size ([3072 -> 16384]), whose FFN goes FP8."""
    policy = adapter_for_preset("mochi").fp8_linears
    assert {"ff.net.0.proj", "ff.net.2"} <= set(policy.fp8)


@pytest.mark.parametrize("name, rounds", [("wan", True), ("skyreels-v2", True), ("kandinsky-6", True),
                                          ("hunyuan-video", False), ("ltx-2", False)])
def test_a_frame_count_off_the_vaes_grid_runs_as_the_pipeline_rounds_it(name, rounds):
    """Wan's pipelines (and those built on them) turn 100 frames into 101 before the latents are made; the
    others run (100 - 1) // 4 + 1 latent frames, as the workload did for every family before."""
    adapter = adapter_for_preset(name)
    _, height, width = adapter.facts.video
    asked, on_grid = (adapter.workload_from_video(frames, height, width, 1) for frames in (100, 101))
    assert adapter.facts.rounds_frames is rounds
    assert (asked.rows == on_grid.rows) is rounds and (asked.video_grid[0] == 26) is rounds
    assert ("rounds 100 frames to 101" in asked.source) is rounds
    if name == "kandinsky-6":  # its audio follows the rounded clip: ceil(101 / 24 fps * 44100 Hz / 1024 hop)
        assert asked.rows["audio"] == 182


def test_more_video_scales_the_video_rows_alone():
    adapter = adapter_for_preset("wan")
    workload = adapter.default_workload(1)  # 81 frames of 720x1280: 21 x 45 x 80 patches
    doubled = adapter.more_video(workload, 2)
    assert doubled.video_grid == (42, 45, 80) and doubled.rows == {**workload.rows, "video": 2 * 21 * 45 * 80}
    assert doubled.seq_len == 2 * workload.seq_len and adapter.more_video(workload, 1) is workload
    packed = adapter_for_preset("minimax-h3").default_workload(1)  # video, audio and text rows in one sequence
    doubled = adapter_for_preset("minimax-h3").more_video(packed, 2)
    assert doubled.rows == {**packed.rows, "video": 2 * packed.rows["video"]}
    assert doubled.seq_len == packed.seq_len + packed.rows["video"]


def test_an_unknown_class_and_a_forward_it_cannot_feed_are_one_line_each(monkeypatch):
    with pytest.raises(UserError, match="unknown model family 'FooTransformer3DModel'"):
        adapter_for_config({"_class_name": "FooTransformer3DModel"}, "/models/foo")

    class NeedsFlowMap(nn.Module):
        def forward(self, hidden_states, timestep, flow_map, return_dict=True):
            return hidden_states

    import diffusers

    monkeypatch.setattr(diffusers, "NeedsFlowMap", NeedsFlowMap, raising=False)
    family = Family("flow", "Flow", "NeedsFlowMap", None, {"x": Preset({"in_channels": 4}, "test")}, {},
                    video=(9, 64, 64), vae_factors=(4, 8))
    ctx = InputContext({"in_channels": 4}, LatentGrid(1, 3, 8, 8), 16, CPU, torch.float32, torch.Generator())
    with pytest.raises(UserError) as refused:
        forward_arguments(family, ctx)
    message = str(refused.value)
    assert "flow_map" in message and "\n" not in message and "inputs hook" in message


def test_an_attention_modules_rest_is_split_by_kind():
    from dit_accel.adapters.ranges import ATTENTION_REST, range_of_kind

    assert range_of_kind(ATTENTION_REST, "copy") == range_of_kind(ATTENTION_REST, "gather-index") \
        == "attention: copies and joins"
    assert range_of_kind(ATTENTION_REST, "modulation-elementwise") == "attention: elementwise (RoPE, masks)"
    assert range_of_kind(ATTENTION_REST, "other") == ATTENTION_REST
    assert range_of_kind("ffn", "copy") == "ffn"

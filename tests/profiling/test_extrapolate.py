from dit_accel.profiling.extrapolate import Extrapolation, StackTime, Validation


def test_whole_model_arithmetic():
    e = Extrapolation(stacks=(StackTime("transformer_blocks", 50, 91.0),), outside_ms=12.0, outside_source="stated",
                      steps=40, guidance_passes=2)
    assert e.pass_ms == 50 * 91.0 + 12.0
    assert e.step_ms == 2 * (50 * 91.0 + 12.0)
    assert abs(e.video_s - 40 * 2 * 4562.0 / 1e3) < 1e-9
    text = " ".join(e.assumptions())
    assert "50 x 91.00 ms" in text and "12.00 ms per pass (stated)" in text and "40 denoising steps" in text
    d = e.as_dict()
    assert d["video_s"] == e.video_s and d["steps"] == 40


def test_validation_ratio():
    v = Validation(chained_blocks=50, distinct_blocks=50, measured_ms=4702.0, block_ms=91.0)
    assert abs(v.ratio - 4702.0 / 4550.0) < 1e-12
    assert abs(v.error_pct - 100 * (4702.0 / 4550.0 - 1)) < 1e-9



def test_several_stacks_add_up():
    """HunyuanVideo-like: 20 dual-stream blocks and 40 single-stream ones, each stack at its own block time."""
    stacks = (StackTime("transformer_blocks", 20, 12.0), StackTime("single_transformer_blocks", 40, 8.0))
    e = Extrapolation(stacks=stacks, outside_ms=3.0, outside_source="measured", steps=50, guidance_passes=1)
    assert e.num_blocks == 60 and e.blocks_ms == 20 * 12.0 + 40 * 8.0 and e.pass_ms == e.blocks_ms + 3.0
    text = " ".join(e.assumptions())
    assert "20 x 12.00 ms (transformer_blocks) + 40 x 8.00 ms (single_transformer_blocks)" in text
    assert e.as_dict()["stacks"] == [{"stack": "transformer_blocks", "num_blocks": 20, "block_ms": 12.0},
                                     {"stack": "single_transformer_blocks", "num_blocks": 40, "block_ms": 8.0}]

from dit_accel.profiling.extrapolate import Extrapolation, Validation


def test_whole_model_arithmetic():
    e = Extrapolation(num_blocks=50, block_ms=91.0, outside_ms=12.0, outside_source="stated", steps=40,
                      guidance_passes=2)
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


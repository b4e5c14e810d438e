"""GPU checks of the Hopper FP8 attention kernel against the float64 emulation of its scheme
(128-key blocks, last to first) and the fp64 reference. Skipped without an sm_90 GPU."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from dit_accel.kernels.fp8_attention.emulation import (  # noqa: E402
    emulate_fp8_attention, random_qkv, reference_attention, rel_rms_error)
from dit_accel.kernels.fp8_attention.interface import (  # noqa: E402
    fp8_attention_packed, prep_fp8_attention)




@pytest.mark.parametrize("b,sq,skv,d,outliers", [
    (1, 1, 1, 64, False), (2, 17, 17, 128, True), (1, 127, 127, 64, True), (2, 128, 128, 128, False),
    (1, 1000, 1000, 128, True), (2, 1000, 512, 64, True), (1, 4096, 4096, 128, False)])
def test_sm90_matches_emulation(b, sq, skv, d, outliers):
    q, k, v = random_qkv(b, sq, skv, 3, d, outliers, seed=sq + d)
    packed = prep_fp8_attention(q, k, v)
    out = torch.full_like(q, float("nan"))
    out, lse = fp8_attention_packed(packed, return_lse=True, out=out, kernel="sm90")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    emu, emu_lse = emulate_fp8_attention(q, k, v, return_lse=True, block_keys=128, reverse=True)
    ref = reference_attention(q, k, v)
    assert rel_rms_error(out, emu) < 0.01
    assert rel_rms_error(out, ref) < rel_rms_error(emu, ref) + 0.005
    assert float((lse.double() - emu_lse).abs().max() / emu_lse.abs().max().clamp_min(1.0)) < 2e-3

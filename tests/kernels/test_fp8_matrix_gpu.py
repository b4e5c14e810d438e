"""The correctness matrix of what fp8_attention runs on this GPU (kernel "auto": sm90 in `tuning.sm90_config`'s
configuration on sm_90, v1 elsewhere), against the float64 emulation of that kernel's scheme and the fp64
reference: S 1 to 30272, D 64 and 128, B 1 and 2, self- and cross-attention, N(0,1) and 0.1% outliers of 50x.
Outputs and LSE are poisoned with NaN before each launch, so a row left unwritten fails. The S = 30272 cases
are a test of their own (slow: tens of seconds). Skipped without a CUDA GPU with FP8 mma.sync (sm_89+)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 mma.sync (sm_89+)", allow_module_level=True)

from dit_accel.attention.reference import random_qkv, reference_attention, rel_rms_err  # noqa: E402
from dit_accel.kernels.fp8_attention import interface  # noqa: E402
from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention, lse_mismatch  # noqa: E402
from dit_accel.kernels.fp8_attention.support import resolve_kernel  # noqa: E402
from dit_accel.kernels.fp8_attention.tuning import sm90_config  # noqa: E402

HEADS = 3
SCORED_ROWS = 512  # query rows scored past 1024 (fp64 reference and emulation of all rows would take minutes)
EMULATION_BAR = 0.03  # relative RMS error against the emulation of the kernel's own scheme
FP64_MARGIN = 0.005  # error against fp64 at most the emulation's plus half a percentage point
LSE_REL = 1e-3  # `lse_mismatch`'s relative bound on every row

SELF = [(b, s, s, d, outliers) for s in (1, 17, 127, 128, 1000, 4096) for d in (64, 128) for b in (1, 2)
        for outliers in (False, True)]
CROSS = [(b, s, 512, d, outliers) for s in (17, 1000) for d in (64, 128) for b in (1, 2) for outliers in (False, True)]


def scored_rows(seq_len: int, count: int, seed: int) -> torch.Tensor:
    """The sorted query rows a long case is scored on: `count` of `seq_len`, drawn from `seed`, so a run scores
    the same rows every time (with 50x outliers the rows drawn decide the error figure)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randperm(seq_len, generator=generator, device="cuda")[:count].sort().values


def emulation_scheme(head_dim: int, seqlen_kv: int) -> dict:
    """The emulation's options for the kernel "auto" runs here: sm90, its configuration's key blocks, last to
    first, and row sums (the tensor core's are of the rounded P); v1, 32-key strips first to last."""
    device = torch.device("cuda", torch.cuda.current_device())
    if resolve_kernel("auto", torch.cuda.get_device_capability(device)) != "sm90":
        return {}
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    config = sm90_config(head_dim, sm_count, seqlen_kv)
    return dict(block_keys=config.tile_n, reverse=True, rounded_row_sum=config.pv_row_sum)


def check_case(b: int, sq: int, skv: int, d: int, outliers: bool, seed: int) -> None:
    q, k, v = random_qkv(b, sq, skv, HEADS, d, outliers, seed=seed)
    packed = interface.prep_fp8_attention(q, k, v)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, HEADS, sq), float("nan"), device="cuda")
    # What fp8_attention_packed launches, with an LSE poisoned too (it would allocate an empty one).
    compiled = interface._plan(d, q.dtype, True, q.device, skv)
    compiled(*packed.kernel_inputs(), out, lse, None, d ** -0.5, packed.seqlen_kv)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "a row left unwritten (NaN) or non-finite"

    rows = None if sq <= 1024 else scored_rows(sq, SCORED_ROWS, seed)
    scheme = emulation_scheme(d, skv)
    emu, emu_lse = emulate_fp8_attention(q, k, v, rows=rows, return_lse=True, **scheme)
    ref = reference_attention(q, k, v, rows=rows)
    scored, scored_lse = (out, lse) if rows is None else (out[:, rows], lse[:, :, rows])
    err, err_emu = rel_rms_err(scored, ref), rel_rms_err(emu, ref)
    assert rel_rms_err(scored, emu) < EMULATION_BAR, (rel_rms_err(scored, emu), err, err_emu)
    assert err < err_emu + FP64_MARGIN, (err, err_emu)
    # The LSE against the emulation's (the fp64 one of the unquantized inputs differs by the logits'
    # quantization error, tens of units with 50x outliers).
    mismatch = lse_mismatch(scored_lse, emu_lse, scheme.get("rounded_row_sum", False), rel=LSE_REL)
    assert mismatch is None, mismatch


@pytest.mark.parametrize("b,sq,skv,d,outliers", SELF + CROSS)
def test_fp8_attention_matches_its_emulation_and_fp64(b, sq, skv, d, outliers):
    check_case(b, sq, skv, d, outliers, seed=1000 + sq + skv + d + 10 * b + outliers)


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_attention_at_the_h3_sequence_length(d, outliers):
    """S = 30272 (MiniMax-H3's): about 240 key blocks, where single-level accumulation drifts off the
    emulation; D = 128 runs one CTA per tile here, D = 64 persistent CTAs."""
    check_case(1, 30272, 30272, d, outliers, seed=30272 + d + outliers)

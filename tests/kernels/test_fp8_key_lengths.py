"""Per-element key lengths (`fp8_attention(key_lengths=)`): batch element b attends its first key_lengths[b] keys,
read on the device. The emulation's contract (each element as if given its kept keys alone, an element with none
zero rows and an LSE of -inf, lengths past the keys clamped), the op's checks, both kernels compiled with it on the
CPU; on the GPU (marked `gpu`), every kernel bit for bit against the same kernel on each element's kept keys."""
import math
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dit_accel.attention.reference import random_qkv, reference_attention, rel_rms_err
from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention
from dit_accel.kernels.fp8_attention.op import FP8_ATTENTION
from dit_accel.kernels.fp8_attention.support import Fp8AttentionUnsupported
from dit_accel.kernels.fp8_attention.tuning import PV_ROW_SUM_BY_HEAD_DIM

SEQ_KV = 300
LENGTHS = [217, 0, 300, 999]  # a tail inside a block, none, all, past the end (clamped)


def _inputs(device: str, head_dim: int = 64, seq_kv: int = SEQ_KV, key_lengths: list[int] = LENGTHS):
    """q, k, v for len(key_lengths) elements, with each element's dropped keys zeroed (as `key_padding` hands them
    over), and the lengths as int32 on the device."""
    q, k, v = random_qkv(len(key_lengths), 70, seq_kv, 2, head_dim, outliers=True, seed=7, device=device)
    lengths = torch.tensor(key_lengths, dtype=torch.int32, device=device)
    dropped = torch.arange(seq_kv, device=device)[None, :, None, None] >= lengths[:, None, None, None]
    return q, k.masked_fill(dropped, 0), v.masked_fill(dropped, 0), lengths


def _each_on_its_kept_keys(attention, q, k, v, lengths):
    """attention(q_b, k_b, v_b) on each element's first min(length, S) keys, [B, Sq, H, D] (and LSE [B, H, Sq]); an
    element with none: zeros and -inf, as torch's SDPA answers a row every key of which is masked."""
    outs, lses = [], []
    for b, length in enumerate(lengths.tolist()):
        kept = min(length, k.shape[1])
        if kept == 0:
            outs.append(torch.zeros_like(q[b:b + 1]))
            lses.append(torch.full((1, q.shape[2], q.shape[1]), -math.inf, dtype=torch.float64, device=q.device))
            continue
        out, lse = attention(q[b:b + 1], k[b:b + 1, :kept], v[b:b + 1, :kept])
        outs.append(out)
        lses.append(lse.double())
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("order", ["v1", "sm90"])
def test_the_emulation_attends_each_elements_kept_keys_alone(order):
    """What the emulation gives each element on its kept keys: in v1's strips and in the sm90 kernel's 128-key
    blocks taken last to first (its first blocks, past the length, all -inf); the output bit for
    bit, the float64 LSE to its last bits (its sums run over the blocks' zeros)."""
    options = {"v1": {}, "sm90": dict(block_keys=128, reverse=True)}[order]
    q, k, v, lengths = _inputs("cpu")
    out, lse = emulate_fp8_attention(q, k, v, return_lse=True, key_lengths=lengths, **options)
    expected, expected_lse = _each_on_its_kept_keys(
        lambda *qkv: emulate_fp8_attention(*qkv, return_lse=True, **options), q, k, v, lengths)
    assert torch.equal(out, expected)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=0)
    assert bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all())


def test_the_op_takes_key_lengths_on_the_cpu_and_under_fake_tensors():
    q, k, v, lengths = _inputs("cpu")
    out = FP8_ATTENTION(q, k, v, None, "auto", lengths)
    assert torch.equal(out, emulate_fp8_attention(q, k, v, out_dtype=q.dtype, key_lengths=lengths))
    torch.library.opcheck(FP8_ATTENTION, (q, k, v, None, "auto", lengths))
    with FakeTensorMode() as mode:
        fake = FP8_ATTENTION(*(mode.from_tensor(t) for t in (q, k, v)), None, "auto", mode.from_tensor(lengths))
    assert fake.shape == q.shape


@pytest.mark.parametrize("lengths, problem", [
    (torch.tensor(LENGTHS), "int32"),  # int64
    (torch.tensor(LENGTHS[:2], dtype=torch.int32), "int32 \\[4\\]"),
    (torch.tensor(LENGTHS * 2, dtype=torch.int32)[::2], "contiguous"),
])
def test_key_lengths_the_kernel_cannot_read_are_refused_in_one_line(lengths, problem):
    q, k, v, _ = _inputs("cpu")
    with pytest.raises(Fp8AttentionUnsupported, match=problem):
        FP8_ATTENTION(q, k, v, None, "auto", lengths)
    with FakeTensorMode() as mode, pytest.raises(Fp8AttentionUnsupported, match=problem):
        FP8_ATTENTION(*(mode.from_tensor(t) for t in (q, k, v, )), None, "auto", mode.from_tensor(lengths))


COMPILE = r"""
import json, torch
from dit_accel.kernels.fp8_attention.compile import compile_fp8_attention
from dit_accel.kernels.fp8_attention.tuning import sm90_config
loads = {}
for name, kernel, config in [("sm90", "sm90", sm90_config(128, 132, 30272)),
                             ("sm90 persistent", "sm90", sm90_config(64, 132, 30272)),
                             ("v1", "mma_sync", None)]:
    for with_lengths in (False, True):
        head_dim = 64 if "persistent" in name else 128
        ptx = compile_fp8_attention(head_dim, torch.bfloat16, True, kernel=kernel, config=config,
                                    with_key_lengths=with_lengths).__ptx__ or ""
        loads[f"{name} {with_lengths}"] = ptx.count("ld.global")
print(json.dumps(loads))
"""


@pytest.mark.slow
def test_both_kernels_compile_with_key_lengths(tmp_path):
    """On the CPU for sm_90a: each kernel variant compiled with key lengths reads them from global memory (more
    global loads than without)."""
    pytest.importorskip("cutlass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    import json

    loads = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("sm90", "sm90 persistent", "v1"):
        assert loads[f"{name} True"] > loads[f"{name} False"], loads


# --- on the GPU ----------------------------------------------------------------------------------------------

KERNELS = {"sm90": dict(kernel="sm90"), "v1": dict(kernel="mma_sync")}


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_each_kernel_with_key_lengths_is_itself_on_the_kept_keys(kernel, head_dim):
    """Bit for bit the same kernel's output and LSE on each element's kept keys (every length here takes the same
    plan: `tuning.persistent_pays`), within 1% of the emulation with the same key lengths, and no further from
    float64 than it (outliers in q, k, v: the per-head scales' worst case)."""
    from dit_accel.kernels.fp8_attention import fp8_attention

    options = KERNELS[kernel]
    if options["kernel"] == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernel needs sm_90")
    q, k, v, lengths = _inputs("cuda", head_dim, 4096 + 200, [4096 + 77, 0, 4096 + 200, 5000])
    out, lse = fp8_attention(q, k, v, return_lse=True, key_lengths=lengths, **options)
    expected, expected_lse = _each_on_its_kept_keys(
        lambda *qkv: fp8_attention(*qkv, return_lse=True, **options), q, k, v, lengths)
    assert torch.equal(out, expected)
    assert torch.equal(lse.double(), expected_lse)
    sm90 = options["kernel"] == "sm90"
    emulated = emulate_fp8_attention(q, k, v, out_dtype=q.dtype, key_lengths=lengths, block_keys=128 if sm90 else 32,
                                     reverse=sm90, rounded_row_sum=sm90 and PV_ROW_SUM_BY_HEAD_DIM[head_dim])
    assert rel_rms_err(out, emulated) < 0.01
    for b in (0, 2, 3):
        kept = min(int(lengths[b]), k.shape[1])
        truth = reference_attention(q[b:b + 1], k[b:b + 1, :kept], v[b:b + 1, :kept])
        assert rel_rms_err(out[b:b + 1], truth) < rel_rms_err(emulated[b:b + 1], truth) + 0.005


@pytest.mark.gpu
@torch.no_grad()
def test_key_lengths_the_kernels_cannot_take_are_refused_in_one_line():
    """With INT8 Q/K (its running max's step would follow a block past the length), and at an address the compiled
    kernels do not assume (a view 4 bytes into a tensor)."""
    from dit_accel.kernels.fp8_attention import fp8_attention

    q, k, v, lengths = _inputs("cuda", 128)
    with pytest.raises(Fp8AttentionUnsupported, match="16-byte aligned"):
        fp8_attention(q, k, v, key_lengths=torch.cat([lengths[:1], lengths])[1:])
    if torch.cuda.get_device_capability() == (9, 0):  # INT8 Q/K runs on the sm90 kernel alone
        with pytest.raises(Fp8AttentionUnsupported, match="qk_int8=False"):
            fp8_attention(q, k, v, qk_int8=True, key_lengths=lengths)

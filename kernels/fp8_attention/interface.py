"""Host entry point: checks torch tensors (`support.can_implement`), preps them, compiles once
per plan, launches.

    out = fp8_attention(q, k, v)                      # [B, S, H, D] bf16/fp16 CUDA -> same
    out, lse = fp8_attention(q, k, v, return_lse=True)
    packed = prep_fp8_attention(q, k, v)              # prep alone (quantize + pack)
    out = fp8_attention_packed(packed, out_dtype=q.dtype)  # kernel alone
    out = fp8_attention(q, k, v, kernel="mma_sync")   # force v1 (comparison); default "auto"
    out = fp8_attention(q_raw, k_raw, v, prologue=Prologue(wq, wk, eps, cos, sin))
                                                      # QK-norm + RoPE fused into prep (MiniMax-H3)
    out = fp8_attention(q, k, v, qk_int8=True)        # INT8 Q/K with per-thread group scales (sm_90 only)
    out = fp8_attention(q, k, v, key_lengths=lengths) # element b attends its first lengths[b] keys (int32 [B])

Kernel choice ("auto"): sm_90 -> `kernel_sm90` (TMA + FP8 wgmma, warp-specialized, in the configuration
`tuning.sm90_config` gives its head dim and key length); sm_89 and sm_120 -> v1 `kernel_mma_sync`.
Both read the same prep output.

Inputs may be non-contiguous [B, S, H, D] views as long as the head dim is contiguous
(stride 1): prep reads them through their strides. The output is a fresh contiguous
[B, Sq, H, D] tensor in the input dtype (or `out=`, which must be contiguous).
"""
import dataclasses
import math

import torch

from .memo import BoundedMemo
from .prep import PackedQKV, Prologue, launch_spec, prep_reference, prep_triton, prep_triton_with_spec, prologue_reason
from .support import (Fp8AttentionUnsupported, check_can_implement, check_qk_int8, device_capability,
                      key_lengths_reason, on_device, resolve_kernel)
from .tuning import persistent_pays, sm90_config

_plans: dict = {}
# (prep.launch_spec, kernel) of inputs fp8_attention checked and took: a call like one before skips the checks
# (~4 us of host time).
_passed_checks = BoundedMemo(1024)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, prologue: Prologue | None,
           qk_int8: bool = False) -> None:
    check_can_implement(q, k, v, kernel)
    if qk_int8:  # before any prep: the kernel that would take it is known from the device
        check_qk_int8(resolve_kernel(kernel, device_capability(q.device)))
    reason = None if prologue is None else prologue_reason(q, k, prologue)
    if reason is not None:
        raise Fp8AttentionUnsupported(reason)


def prep_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, use_triton: bool = True,
                       prologue: Prologue | None = None, qk_int8: bool = False) -> PackedQKV:
    """Prep alone: checks the inputs (`support.can_implement`), quantizes and packs them (Triton,
    or torch if asked), after the prologue if one is given; with qk_int8, Q and K as INT8 block codes."""
    _check(q, k, v, "auto", prologue, qk_int8)
    return (prep_triton if use_triton else prep_reference)(q, k, v, prologue, qk_int8)


def _plan(head_dim: int, out_dtype: torch.dtype, with_lse: bool, device: torch.device, seqlen_kv: int,
          kernel: str = "auto", qk_int8: bool = False, with_key_lengths: bool = False):
    """Compiled kernel for this plan key; batch, heads and sequence lengths are dynamic, but on sm_90 the key
    length picks one of two plans (`tuning.persistent_pays`). The key holds what picks the sm90 configuration
    (`tuning.sm90_config`: head dim, device, that choice), not the configuration itself, which is built only
    when a plan is compiled (the lookup runs on every call)."""
    if device.index is None:  # "cuda" is the current device: one plan per physical device (its SM count)
        device = torch.device(device.type, torch.cuda.current_device())
    key = (head_dim, out_dtype, with_lse, device, kernel, qk_int8, with_key_lengths,
           persistent_pays(head_dim, seqlen_kv))
    plan = _plans.get(key)
    if plan is None:
        from .compile import compile_fp8_attention

        variant = resolve_kernel(kernel, device_capability(device))
        if qk_int8:
            check_qk_int8(variant)
        if variant == "sm90":
            sm_count = torch.cuda.get_device_properties(device).multi_processor_count
            config = dataclasses.replace(sm90_config(head_dim, sm_count, seqlen_kv), qk_int8=qk_int8)
            plan = _plans[key] = compile_fp8_attention(head_dim, out_dtype, with_lse, kernel=variant, config=config,
                                                       with_key_lengths=with_key_lengths)
        else:  # v1 has no length-dependent options: one compile serves both keys
            plan = compile_fp8_attention(head_dim, out_dtype, with_lse, kernel=variant,
                                         with_key_lengths=with_key_lengths)
            for persistent in (False, True):
                _plans[key[:-1] + (persistent,)] = plan
    return plan


def fp8_attention_packed(packed: PackedQKV, *, out_dtype: torch.dtype = torch.bfloat16,
                         scale: float | None = None, return_lse: bool = False,
                         out: torch.Tensor | None = None, kernel: str = "auto",
                         key_lengths: torch.Tensor | None = None):
    """Kernel alone on prep's output. Returns out [B, Sq, H, D] (and lse [B, H, Sq] fp32).
    kernel: "auto" (sm_90: wgmma kernel, else v1), "mma_sync" (v1) or "sm90". key_lengths: see `fp8_attention`."""
    b, h, sq, d = packed.batch, packed.heads, packed.seqlen_q, packed.head_dim
    device = packed.q.device
    if out is None:
        out = torch.empty(b, sq, h, d, dtype=out_dtype, device=device)
    elif out.shape != (b, sq, h, d) or out.dtype != out_dtype or not out.is_contiguous():
        raise Fp8AttentionUnsupported(f"fp8_attention: out must be contiguous {out_dtype} {(b, sq, h, d)}")
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=device) if return_lse else None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    reason = key_lengths_reason(key_lengths, out)
    if reason is None and key_lengths is not None and key_lengths.data_ptr() % 16:  # the compiled kernels assume it
        reason = "fp8_attention: key_lengths must start 16-byte aligned (a fresh tensor does; a view at an offset not)"
    if reason is None and key_lengths is not None and packed.qk_int8:
        reason = "fp8_attention: key_lengths take e4m3 Q/K; pass qk_int8=False"  # (its per-block max step, unmodelled)
    if reason is not None:
        raise Fp8AttentionUnsupported(reason)
    compiled = _plan(d, out_dtype, return_lse, device, packed.seqlen_kv, kernel, packed.qk_int8,
                     key_lengths is not None)
    with on_device(device):  # the launch goes to this device's current stream
        compiled(*packed.kernel_inputs(), out, lse, key_lengths, scale, packed.seqlen_kv)
    return (out, lse) if return_lse else out


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  return_lse: bool = False, kernel: str = "auto", prologue: Prologue | None = None,
                  qk_int8: bool = False, key_lengths: torch.Tensor | None = None):
    """softmax(q k^T * scale) v with FP8 (e4m3) Q, K, V, P; q, k, v [B, S, H, D] on CUDA.

    scale defaults to 1/sqrt(D). With `prologue`, q and k are raw projections and the attention
    takes RoPE(RMSNorm(x) * w) of them (`prep.Prologue`). qk_int8: Q and K as INT8 codes with a scale per
    64 rows (the sm_90 kernel only; prep's contract). key_lengths: int32 [B] on q's device, or None: batch element
    b attends its first key_lengths[b] keys alone (clamped to 0 .. Skv; read on the device, so no host sync;
    prep's FP8 scales still come from all of k and v, so a caller dropping keys should zero them), an element
    with none gets zero rows and an LSE of -inf, as torch's SDPA gives a row every key of which is masked.
    Raises Fp8AttentionUnsupported for inputs it cannot take; a (batch, head) whose q, k or v holds inf or NaN
    comes out NaN, as in torch's attention.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        _check(q, k, v, kernel, prologue, qk_int8)  # raises, naming the argument that is not a tensor
    spec = launch_spec(q, k, v, prologue)
    if (spec, kernel, qk_int8) not in _passed_checks:  # the checks read only what the spec holds
        _check(q, k, v, kernel, prologue, qk_int8)
        _passed_checks.remember((spec, kernel, qk_int8))
    packed = prep_triton_with_spec(q, k, v, prologue, spec, qk_int8)
    return fp8_attention_packed(packed, out_dtype=q.dtype, scale=scale, return_lse=return_lse,
                                kernel=kernel, key_lengths=key_lengths)

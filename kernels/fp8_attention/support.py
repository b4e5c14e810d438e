"""What FP8 attention can serve, in one place: the kernel variants and `can_implement`.

As in CUTLASS's FMHA example, `can_implement` answers before anything is prepped or compiled:
None if the inputs can be served, else the reason, phrased as what to change. It reads only
tensor metadata (rank, shape, stride, dtype, device) and the device's capability, so it never
synchronises with the GPU. The kernel constructors read the same SUPPORTED_HEAD_DIMS
(`check_head_dim`), and `resolve_kernel` is the variant check of the packed entry point.
"""
import contextlib
import functools

import torch

from .layout import SUPPORTED_HEAD_DIMS

KERNELS = ("mma_sync", "sm90")  # v1 mma.sync (sm_89, sm_90, sm_120); TMA + wgmma (sm_90a only)
KERNEL_CHOICES = ("auto", *KERNELS)  # what fp8_attention(kernel=...) takes; "auto" picks by device
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MIN_CAPABILITY = (8, 9)  # mma.sync with e4m3 operands: sm_89, sm_90, sm_120
WGMMA_CAPABILITY = (9, 0)  # kernel_sm90: FP8 wgmma exists on sm_90a alone


class Fp8AttentionUnsupported(ValueError):
    """fp8_attention cannot take these inputs; the message says what to change."""


def device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability, asked once per device in eager calls (it costs microseconds);
    under torch.compile tracing it is asked directly (dynamo traces it; it warns on cached functions)."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(device)
    return _cached_capability(device)


@functools.cache
def _cached_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def on_device(device: torch.device):
    """Context in which launches (Triton's, the compiled kernel's) go to `device`'s current stream:
    `torch.cuda.device(device)` when another device is current, else nothing (entering it costs ~2 us
    of host time per call, as much as a tenth of a tiny call)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def head_dim_reason(head_dim: int) -> str | None:
    """Why head_dim cannot be served, or None (both kernels take SUPPORTED_HEAD_DIMS)."""
    if head_dim in SUPPORTED_HEAD_DIMS:
        return None
    return f"fp8_attention: head dim {head_dim} unsupported; use {' or '.join(map(str, SUPPORTED_HEAD_DIMS))}"


def check_head_dim(head_dim: int) -> None:
    """Raises Fp8AttentionUnsupported unless head_dim is one the kernels are written for."""
    reason = head_dim_reason(head_dim)
    if reason is not None:
        raise Fp8AttentionUnsupported(reason)


def kernel_reason(kernel: str, capability: tuple[int, int]) -> str | None:
    """Why the variant `kernel` cannot run on a device of this capability, or None."""
    if kernel not in KERNEL_CHOICES:
        return f"fp8_attention: kernel={kernel!r}; use one of {KERNEL_CHOICES}"
    if kernel == "sm90" and capability != WGMMA_CAPABILITY:
        return f"fp8_attention: kernel='sm90' needs sm_90 (wgmma), this is sm_{capability[0]}{capability[1]}"
    return None


def check_qk_int8(variant: str) -> None:
    """Raises Fp8AttentionUnsupported unless the resolved kernel variant can take INT8 Q/K (the sm90 kernel)."""
    if variant != "sm90":
        raise Fp8AttentionUnsupported("fp8_attention: INT8 Q/K runs on the sm_90 kernel only; pass qk_int8=False")


def resolve_kernel(kernel: str, capability: tuple[int, int]) -> str:
    """The variant that serves `kernel` on this device ("auto": the wgmma kernel on sm_90,
    which it needs as sm_90a, v1 everywhere else); raises Fp8AttentionUnsupported if none."""
    reason = kernel_reason(kernel, capability)
    if reason is not None:
        raise Fp8AttentionUnsupported(reason)
    if kernel == "auto":
        return "sm90" if capability == WGMMA_CAPABILITY else "mma_sync"
    return kernel


def tensors_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, any_head_dim: bool = False) -> str | None:
    """None if q, k, v are [B, Sq, H, D], [B, Skv, H, D] x 2 bf16/fp16 tensors the scheme takes, else
    why not: rank, dtype, head-dim stride, matching shapes (no GQA), head dim (unless `any_head_dim`:
    the CPU emulation takes any), batch, heads and sequence lengths, shared dtype and device, in that
    order. Reads only metadata, so it runs the same on real and fake tensors and dynamo can trace it."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            return f"fp8_attention: {name} is a {type(x).__name__}; pass a torch.Tensor [B, S, H, D]"
        if x.dim() != 4:
            return f"fp8_attention: {name} must be [B, S, H, D], got shape {tuple(x.shape)}"
        if x.dtype not in SUPPORTED_DTYPES:
            return f"fp8_attention: {name} is {x.dtype}; pass bfloat16 or float16"
        if x.stride(-1) != 1:
            return f"fp8_attention: {name} has head-dim stride {x.stride(-1)}; pass a view whose last dim is contiguous"
    b, sq, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        return (f"fp8_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                "[B, Sq, H, D], [B, Skv, H, D], [B, Skv, H, D] (no GQA)")
    reason = None if any_head_dim else head_dim_reason(d)
    if reason is not None:
        return reason
    if min(b, h, sq, k.shape[1]) < 1:  # an empty grid is no launch the kernels can make
        return "fp8_attention: batch, heads and sequence lengths must be >= 1"
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return "fp8_attention: q, k, v must share dtype and device"
    return None


def can_implement(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto") -> str | None:
    """None if fp8_attention(q, k, v, kernel=kernel) can serve these [B, S, H, D] tensors, else
    why not: the tensors (`tensors_reason`), a CUDA device with FP8 mma.sync, and the kernel
    variant, checked in that order (the first failure is the one reported)."""
    reason = tensors_reason(q, k, v)
    if reason is not None:
        return reason
    if not q.is_cuda:
        return f"fp8_attention: inputs are on {q.device}; move q, k, v to a CUDA device"
    capability = device_capability(q.device)
    if capability < MIN_CAPABILITY:
        return f"fp8_attention: sm_{capability[0]}{capability[1]} has no FP8 mma.sync; needs sm_89 or newer"
    return kernel_reason(kernel, capability)


def key_lengths_reason(key_lengths: torch.Tensor | None, q: torch.Tensor) -> str | None:
    """Why `key_lengths` cannot be fp8_attention's per-element key lengths for q [B, Sq, H, D], or None: a
    contiguous int32 [B] tensor on q's device (metadata only; the kernels also assume its address 16-byte aligned,
    which `interface` checks on real tensors)."""
    if key_lengths is None:
        return None
    if key_lengths.dtype != torch.int32 or key_lengths.shape != (q.shape[0],) or key_lengths.device != q.device \
            or not key_lengths.is_contiguous():
        return (f"fp8_attention: key_lengths must be contiguous int32 [{q.shape[0]}] on {q.device}, got "
                f"{key_lengths.dtype} {list(key_lengths.shape)} on {key_lengths.device}")
    return None


def check_can_implement(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto") -> None:
    """Raises Fp8AttentionUnsupported with `can_implement`'s reason, if there is one."""
    reason = can_implement(q, k, v, kernel)
    if reason is not None:
        raise Fp8AttentionUnsupported(reason)

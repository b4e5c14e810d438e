"""The FP8 attention as a torch custom op, `torch.ops.dit_accel.fp8_attention`, so that
`torch.compile` (fullgraph too) and CUDA graphs see one opaque node instead of tracing our
Python launch path (Triton launches and a compiled CuTe DSL function, which dynamo cannot trace).

    out = torch.ops.dit_accel.fp8_attention(q, k, v, scale, "auto")   # or FP8_ATTENTION(...)
    out = FP8_ATTENTION(q, k, v, scale, "auto", key_lengths)   # element b: its first key_lengths[b] keys
    out = FP8_ATTENTION_PROLOGUE(q_raw, k_raw, v, wq, wk, eps, cos, sin, scale, "auto")
          # MiniMax-H3: RoPE(RMSNorm(x) * w) of q and k fused into the prep (`prep.Prologue`)

q [B, Sq, H, D], k and v [B, Skv, H, D], bf16 or fp16, head dim contiguous; out is a fresh
contiguous [B, Sq, H, Dv] tensor in q's dtype. `scale` None means 1/sqrt(D). `key_lengths` None, or int32 [B]
on q's device (`fp8_attention(key_lengths=)`: read on the device, no host sync). `variant` is the kernel
`fp8_attention(kernel=...)` takes: "auto", "mma_sync" or "sm90". (It is not named `kernel`:
inductor's FallbackKernel.create(kernel, ...) takes the op's arguments as keywords, and an op
argument named `kernel` fails lowering with "got multiple values for argument 'kernel'".)

Implementations, one per device (the same e4m3 scheme on both):
  - CUDA: `fp8_attention` (Triton prep + CuTe DSL kernel). No host sync and no host reads of
    device data, so it can be captured in a CUDA graph.
  - CPU: `emulate_fp8_attention`, the float64 emulation of every rounding the kernel does. Slow
    but exact to the scheme; it exists so the CPU tests can compile and run patched models.
  - fake (meta / FakeTensor, what torch.compile traces): shapes and dtypes only. It also raises
    `Fp8AttentionUnsupported` for inputs the device's implementation would refuse, so a bad call
    fails at trace time rather than inside a compiled graph.
  The same for `fp8_attention_prologue`.

Forward only: a call with grad enabled and an input that requires grad raises `Fp8AttentionNoGrad`
(a RuntimeError) at once, instead of returning an output whose backward would be silently wrong; at
trace time (torch.compile, torch.export) the fake raises it, which they report as their own error
with it as the cause. So a graph that holds the op is compiled or exported under torch.no_grad() or
torch.inference_mode(), or with inputs that do not require grad. Callers that may need gradients
(the attention router, the prologue swap) check the same condition first and fall back.

Defined with `torch.library.Library` (schema, then one Python function per dispatch key and a fake),
not `torch.library.custom_op`: the latter puts a Python autograd kernel in front of every call, about three
times our dispatch cost on a CPU under `torch.no_grad()` (docs/notes/per-call-host-cost.md has the figures).
`FP8_ATTENTION` is the OpOverload, the cheapest way to call it from Python.
"""
from typing import Optional

import torch

from .interface import fp8_attention
from .prep import Prologue, apply_prologue, prologue_reason
from .support import KERNEL_CHOICES, Fp8AttentionUnsupported, can_implement, key_lengths_reason, tensors_reason


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str = "auto") -> Optional[str]:
    """Why the op's implementation for q's device cannot take these inputs, or None.

    CUDA: `support.can_implement` (the kernel's own limits: head dim, sm_89+, the variant).
    CPU (and meta): the emulation's, which are the same but for the head dim (any) and the device.
    Both read only metadata (rank, shape, stride, dtype, device), never tensor data, so this
    runs the same on real and fake tensors, never syncs, and dynamo can trace it.
    """
    if q.device.type not in ("cpu", "meta"):
        return can_implement(q, k, v, variant)
    if variant not in KERNEL_CHOICES:
        return f"fp8_attention: kernel variant {variant!r}; use one of {KERNEL_CHOICES}"
    return tensors_reason(q, k, v, any_head_dim=True)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str,
           key_lengths: torch.Tensor | None = None) -> None:
    reason = unsupported_reason(q, k, v, variant) or key_lengths_reason(key_lengths, q)
    if reason is not None:
        raise Fp8AttentionUnsupported(reason)


class Fp8AttentionNoGrad(RuntimeError):
    """The op was asked for a result autograd could differentiate; it has no backward."""


def refuse_grad(*tensors: torch.Tensor) -> None:
    """Raises Fp8AttentionNoGrad if autograd could ask these tensors for a gradient the ops cannot give."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise Fp8AttentionNoGrad("dit_accel's FP8 attention ops have no backward: call them under torch.no_grad() "
                                 "(or torch.inference_mode()) or on inputs that do not require grad")


SCHEMAS = {
    "fp8_attention": "fp8_attention(Tensor q, Tensor k, Tensor v, float? scale=None, str variant='auto', "
                     "Tensor? key_lengths=None) -> Tensor",
    "fp8_attention_prologue": "fp8_attention_prologue(Tensor q, Tensor k, Tensor v, Tensor norm_q_weight, "
                              "Tensor norm_k_weight, float eps, Tensor cos, Tensor sin, float? scale=None, "
                              "str variant='auto') -> Tensor",
}


def _fp8_attention_cuda(q, k, v, scale=None, variant="auto", key_lengths=None):
    """CUDA: prep + kernel (the public `fp8_attention`, which checks the inputs), asynchronous,
    graph-capturable."""
    refuse_grad(q, k, v)
    return fp8_attention(q, k, v, scale=scale, kernel=variant, key_lengths=key_lengths)


def _fp8_attention_cpu(q, k, v, scale=None, variant="auto", key_lengths=None):
    """CPU: the float64 emulation of the kernel's scheme (the kernel variant does not change it)."""
    from .emulation import emulate_fp8_attention

    refuse_grad(q, k, v)
    _check(q, k, v, variant, key_lengths)
    return emulate_fp8_attention(q, k, v, scale, out_dtype=q.dtype, key_lengths=key_lengths).contiguous()


def _fp8_attention_fake(q, k, v, scale=None, variant="auto", key_lengths=None):
    """Shapes and dtypes only: [B, Sq, H, Dv] contiguous in q's dtype, on q's device."""
    refuse_grad(q, k, v)
    _check(q, k, v, variant, key_lengths)
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


def _fp8_attention_prologue_cuda(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, scale=None, variant="auto"):
    """CUDA: the attention of RoPE(RMSNorm(q) * wq), RoPE(RMSNorm(k) * wk) and v, the prologue in the prep."""
    refuse_grad(q, k, v, norm_q_weight, norm_k_weight, cos, sin)
    prologue = Prologue(norm_q_weight, norm_k_weight, eps, cos, sin)
    return fp8_attention(q, k, v, scale=scale, kernel=variant, prologue=prologue)


def prologue_op_reason(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, variant="auto") -> Optional[str]:
    """Why the prologue op's implementation for q's device cannot take these inputs, or None
    (`unsupported_reason`, then `prep.prologue_reason`). Metadata only, like `unsupported_reason`."""
    return unsupported_reason(q, k, v, variant) or prologue_reason(q, k, Prologue(norm_q_weight, norm_k_weight, eps,
                                                                                  cos, sin))


def _check_prologue(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, variant) -> Prologue:
    refuse_grad(q, k, v, norm_q_weight, norm_k_weight, cos, sin)
    reason = prologue_op_reason(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, variant)
    if reason is not None:
        raise Fp8AttentionUnsupported(reason)
    return Prologue(norm_q_weight, norm_k_weight, eps, cos, sin)


def _fp8_attention_prologue_cpu(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, scale=None, variant="auto"):
    """CPU: the prologue's fp32 spec, then the float64 emulation of the kernel's scheme."""
    from .emulation import emulate_fp8_attention

    prologue = _check_prologue(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, variant)
    q, k = apply_prologue(q, norm_q_weight, prologue), apply_prologue(k, norm_k_weight, prologue)
    return emulate_fp8_attention(q, k, v, scale, out_dtype=v.dtype).contiguous()


def _fp8_attention_prologue_fake(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, scale=None, variant="auto"):
    _check_prologue(q, k, v, norm_q_weight, norm_k_weight, eps, cos, sin, variant)
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


def _register() -> torch.library.Library:
    """Both ops, pt2-compliant (their implementations and fakes keep torch.compile's contract), with an
    implementation per device and a fake. Kept alive by the module: a Library unregisters when freed."""
    library = torch.library.Library("dit_accel", "FRAGMENT")
    for name, cuda, cpu, fake in (
            ("fp8_attention", _fp8_attention_cuda, _fp8_attention_cpu, _fp8_attention_fake),
            ("fp8_attention_prologue", _fp8_attention_prologue_cuda, _fp8_attention_prologue_cpu,
             _fp8_attention_prologue_fake)):
        library.define(SCHEMAS[name], tags=(torch.Tag.pt2_compliant_tag,))
        library.impl(name, cuda, "CUDA")
        library.impl(name, cpu, "CPU")
        torch.library.register_fake(f"dit_accel::{name}", fake, lib=library)
    return library


# A second import of this file (the repo's kernels/ folder imported under its own name, or
# importlib.reload) finds the ops registered by the first and uses them; a reload keeps the first
# run's Library alive.
_LIBRARY = globals().get("_LIBRARY") if hasattr(torch.ops.dit_accel, "fp8_attention") else _register()

FP8_ATTENTION = torch.ops.dit_accel.fp8_attention.default
"""The op's OpOverload: the cheapest way to call it from Python."""
FP8_ATTENTION_PROLOGUE = torch.ops.dit_accel.fp8_attention_prologue.default

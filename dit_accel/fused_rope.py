"""`fused_rope`: MiniMax-H3's rotary embedding as one Triton kernel, swapped in reversibly.

Why: diffusers' `_apply_rotary_emb` in `transformer_minimax_h3.py` runs in bf16 as several
elementwise kernels plus two `cat`s: 6.9 ms of a 91 ms H3 block on an H200 at S = 30272, where
reading q and k once and writing them once is about 0.5 ms of memory traffic. The kernel here
does that one read and one write: on one H200 (torch 2.11, Triton 3.6), one of q/k [1, 30272, 56,
128] in bf16 took 0.31 ms against diffusers' 2.96 ms (2.8 TB/s; a plain copy of it takes 0.21 ms).

The contract (diffusers' function, which `MiniMaxH3AttnProcessor.__call__` calls as a global of
its model file, once for the query and once for the key):

    out = f(x, cos, sin)     x [B, S, H, D], any strides with stride(-1) == 1
                             cos, sin [S, R] (float32 in H3), R even, R <= D
    out[..., :R] = x[..., :R] * cos + cat(-x2, x1) * sin    (x1, x2: halves of x[..., :R])
    out[..., R:] = x[..., R:]                              (a new contiguous tensor)

Accuracy: `rope_reference` and the kernel do the arithmetic in float32 and round once to x's
dtype. diffusers rounds cos/sin to bf16 first and rounds each product and the sum to bf16, so it
is slightly less accurate (and for float32 x it is the reference exactly). The kernel matches
`rope_reference`, not diffusers' bf16 arithmetic: it is launched without FMA contraction so each
product is rounded as torch rounds it, and on the H200 it gave the reference bit for bit in bf16,
fp16 and fp32 (its GPU test allows one ulp).

The swap, like `patch_attention`:

    with fused_rope(transformer) as rope:   # or rope = fused_rope(transformer); ...; rope.unpatch()
        transformer(...)
    print(rope.summary())                   # served_calls, fallback_calls by reason

It replaces the `_apply_rotary_emb` global of the model file with a dispatcher: CUDA tensors it
supports go to the Triton kernel, anything else (CPU tensors, other dtypes or shapes, autograd,
torch.compile tracing, no Triton) to the original function, counted by reason. The global belongs
to the model file, so while a handle is live every model of that file in the process gets the
dispatcher, not only the one passed. Installs are reference-counted across nested handles, and the
original global comes back when the last one leaves.
"""
from __future__ import annotations

import functools
import inspect
import sys
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import torch

from .errors import UserError

ROPE_GLOBAL = "_apply_rotary_emb"

# Model files whose `_apply_rotary_emb(hidden_states, cos, sin)` has the contract above. Other diffusers
# files define a function of the same name with other contracts (complex freqs, interleaved pairs, q and k
# together), so the name alone is not enough.
ROPE_MODEL_FILES = ("diffusers.models.transformers.transformer_minimax_h3",)

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --- the contract, in torch ---------------------------------------------------------------------

def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' `_apply_rotary_emb` contract computed in float32 (or wider, for float64 x) and
    rounded once to x.dtype: what `apply_rotary_emb_fused` gives. Slightly more accurate than
    diffusers in bf16, which rounds cos/sin, each product and the sum to bf16."""
    rotary = cos.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    x_rot = x[..., :rotary].to(compute)
    x1, x2 = x_rot.chunk(2, dim=-1)
    cos = cos.to(compute)[None, :, None, :]
    sin = sin.to(compute)[None, :, None, :]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous
    out[..., :rotary] = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin  # the one rounding
    out[..., rotary:] = x[..., rotary:]
    return out


# --- the Triton kernel (Triton is imported on the first CUDA call, never at import time) ---------

triton = tl = None  # bound by `_triton_kernel()`; the annotations below stay strings until then


def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, S, H, BH,
                 stride_xb, stride_xs, stride_xh, stride_cs, stride_cr, stride_ss, stride_sr,
                 D: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """One program: BLOCK_S rows of one (b, h). Each x element is loaded once: the two halves of
    the rotary channels, then the pass-through channels (copied in x's dtype, bit for bit)."""
    pid = tl.program_id(0)
    bh = pid % BH  # the fastest grid index, so programs running together share cos/sin rows in L2
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = (pid // BH) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = (rows < S)[:, None]
    rows = rows.to(tl.int64)[:, None]
    x_row = x_ptr + b * stride_xb + h * stride_xh + rows * stride_xs
    out_row = out_ptr + ((b * S + rows) * H + h) * D  # contiguous [B, S, H, D]

    j = tl.arange(0, BLOCK_HALF)[None, :]
    m = row_ok & (j < HALF)
    x1 = tl.load(x_row + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + j, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + rows * stride_cs + j * stride_cr, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + rows * stride_cs + (HALF + j) * stride_cr, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + rows * stride_ss + j * stride_sr, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + rows * stride_ss + (HALF + j) * stride_sr, mask=m, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_row + j, (x1 * c1 - x2 * s1).to(out_ty), mask=m)
    tl.store(out_row + HALF + j, (x2 * c2 + x1 * s2).to(out_ty), mask=m)

    if BLOCK_PASS > 0:  # channels 2 * HALF .. D pass through
        p = tl.arange(0, BLOCK_PASS)[None, :]
        mp = row_ok & (p < D - 2 * HALF)
        tl.store(out_row + 2 * HALF + p, tl.load(x_row + 2 * HALF + p, mask=mp), mask=mp)


@functools.cache
def _triton_kernel():
    """The jitted kernel, or None where Triton cannot be imported (cached either way)."""
    global triton, tl
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton.jit(_rope_kernel)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def apply_rotary_emb_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope_reference` in one Triton launch, for CUDA tensors (see `fallback_reason` for what it serves).

    Launch shape: a 1-D grid of cdiv(S, BLOCK_S) * B * H programs; program p handles rows
    [(p // (B*H)) * BLOCK_S, +BLOCK_S) of head (b, h) = divmod(p % (B*H), H), all D channels, with
    BLOCK_S * D ~ 2048 elements per program (16 rows at D = 128) and 4 warps: within 2% of the best
    of BLOCK_S 4..64 x 2..8 warps tried at the H3 shape on an H200.
    """
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("apply_rotary_emb_fused needs Triton, which cannot be imported here")
    batch, seq, heads, dim = x.shape
    rotary = cos.shape[-1]
    out = torch.empty((batch, seq, heads, dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_s = max(1, 2048 // _next_power_of_2(dim))
    grid = (triton.cdiv(seq, block_s) * batch * heads,)
    with torch.cuda.device(x.device):
        kernel[grid](x, cos, sin, out, seq, heads, batch * heads,
                     x.stride(0), x.stride(1), x.stride(2),
                     cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                     D=dim, HALF=rotary // 2, BLOCK_S=block_s, BLOCK_HALF=_next_power_of_2(rotary // 2),
                     BLOCK_PASS=_next_power_of_2(dim - rotary), num_warps=4,
                     enable_fp_fusion=False)  # no FMA: round each product as torch does, to match the reference
    return out


def fallback_reason(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel cannot serve this call (it goes to diffusers' function), or None."""
    if x.dim() != 4 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[1]:
        return "shape (want x [B, S, H, D], cos and sin [S, R])"
    rotary = cos.shape[1]
    if rotary == 0 or rotary % 2 or rotary > x.shape[-1]:
        return "rotary dim R odd, zero or above head dim"
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype}"
    if not (cos.is_floating_point() and sin.is_floating_point()):
        return "cos/sin not floating point"
    if x.stride(-1) != 1:
        return "innermost stride != 1"
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        return "autograd needed"  # the kernel has no backward
    if not x.is_cuda:
        return "not a CUDA tensor"
    if cos.device != x.device or sin.device != x.device:
        return "cos/sin on another device"
    if torch.compiler.is_compiling():
        return "torch.compile tracing"
    if _triton_kernel() is None:
        return "Triton not importable"
    return None


# --- the swap -------------------------------------------------------------------------------------

@dataclass(eq=False)
class FusedRope:
    """A live swap: undo it with `unpatch()` (or by leaving the `with` block). Its counters keep
    every rotary call of its model files while it is live: served by the kernel, or fallen back."""

    model_files: list[str]
    served_calls: int = 0
    fallback_calls: Counter[str] = field(default_factory=Counter)
    _modules: list[ModuleType] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {"model_files": list(self.model_files), "served_calls": self.served_calls,
                "fallback_calls": dict(self.fallback_calls)}

    def unpatch(self) -> None:
        """Leave every model file this handle joined; unpatching twice is a no-op."""
        while self._modules:
            _release(self._modules.pop(), self)

    def __enter__(self) -> "FusedRope":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


@dataclass
class _Installed:
    original: Callable[..., torch.Tensor]
    dispatcher: Callable[..., torch.Tensor]
    users: list[FusedRope]


_installed: dict[str, _Installed] = {}


def _make_dispatcher(original: Callable[..., torch.Tensor], users: list[FusedRope]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def apply_rotary_emb_dispatch(hidden_states, cos, sin):
        reason = fallback_reason(hidden_states, cos, sin)
        for user in users:
            if reason is None:
                user.served_calls += 1
            else:
                user.fallback_calls[reason] += 1
        if reason is None:
            return apply_rotary_emb_fused(hidden_states, cos, sin)
        return original(hidden_states, cos, sin)

    return apply_rotary_emb_dispatch


def _acquire(module: ModuleType, user: FusedRope) -> None:
    installed = _installed.get(module.__name__)
    if installed is None:
        original = getattr(module, ROPE_GLOBAL)
        if list(inspect.signature(original).parameters) != ["hidden_states", "cos", "sin"]:
            raise UserError(f"{module.__name__}.{ROPE_GLOBAL} no longer takes (hidden_states, cos, sin); this "
                            "diffusers version is unsupported by fused_rope, so run without it")
        users: list[FusedRope] = []
        installed = _Installed(original, _make_dispatcher(original, users), users)
        _installed[module.__name__] = installed
        setattr(module, ROPE_GLOBAL, installed.dispatcher)
    installed.users.append(user)


def _release(module: ModuleType, user: FusedRope) -> None:
    installed = _installed[module.__name__]
    installed.users.remove(user)
    if not installed.users:
        del _installed[module.__name__]
        if getattr(module, ROPE_GLOBAL) is installed.dispatcher:  # someone else patched over us: leave theirs
            setattr(module, ROPE_GLOBAL, installed.original)


def _rope_model_files(model: torch.nn.Module) -> list[ModuleType]:
    """The supported model files that the attention processors under `model` call the rotary global of."""
    found: dict[str, ModuleType] = {}
    for submodule in model.modules():
        processor = getattr(submodule, "processor", None)
        if processor is None:
            continue
        module = sys.modules.get(type(processor).__call__.__module__)
        if module is not None and module.__name__ in ROPE_MODEL_FILES and callable(getattr(module, ROPE_GLOBAL, None)):
            found.setdefault(module.__name__, module)
    return list(found.values())


def fused_rope(model_or_pipeline: Any) -> FusedRope:
    """Send the rotary embeddings of a MiniMax-H3 model (or a pipeline's transformers) to the fused
    kernel until the returned handle is unpatched. Raises UserError when it has no such attention."""
    from .patching import denoisers

    modules = {m.__name__: m for model in denoisers(model_or_pipeline) for m in _rope_model_files(model)}
    if not modules:
        raise UserError(f"{type(model_or_pipeline).__name__} has no MiniMax-H3 attention processors, the only ones "
                        "fused_rope can serve; run without fused_rope")
    handle = FusedRope(sorted(modules))
    try:
        for module in modules.values():
            _acquire(module, handle)
            handle._modules.append(module)
    except BaseException:
        handle.unpatch()
        raise
    return handle

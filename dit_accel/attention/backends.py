"""The attention backends dit-accel knows, as data: one `AttentionBackend` entry per CLI name.

Every backend has the same direct callable, `run(q, k, v, scale=None)`, on tensors laid out
[B, S, H, D] (diffusers' layout for `dispatch_attention_fn`), returning [B, Sq, H, D] in q's dtype.
That is what `bench-attention` times and what `routing` calls inside models.

How a backend runs inside a diffusers model is one of three things:
  - `diffusers_backend` is set: diffusers runs it itself (`_native_cudnn`, ...); routing only sets
    the processors' `_attention_backend`.
  - `routed` is True: diffusers' backend enum is closed, so `routing` plugs `run` in through its seam.
  - neither: benchmark only (cudnn-fp8 wants pre-quantized inputs and has no place in a model).

Invariants: optional packages (flash-attn-4, cudnn frontend, the CuTe DSL kernel) are imported only
inside `run` and the phase callables, never at import time; `unavailable_reason(device)` answers
without importing them. A backend that is available but cannot serve particular tensors (head
dim, dtype) raises `BackendCannotServe`, which the benchmark records and the router falls back on.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import UserError

AttentionFn = Callable[..., torch.Tensor]
"""run(q, k, v, scale=None) -> out; q [B, Sq, H, D], k and v [B, Skv, H, D], out [B, Sq, H, D]."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: per-tensor scales map each tensor's amax onto it."""


class BackendCannotServe(ValueError):
    """The backend is installed and the device fits, but these tensors are outside what it serves."""


@dataclass(frozen=True)
class TwoPhases:
    """A backend whose input preparation (quantization, layout) can be timed apart from its kernel.

    `kernel(prepare(q, k, v, scale))` equals the backend's `run(q, k, v, scale)`.
    """

    prepare: Callable[..., Any]
    kernel: Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    description: str
    run: AttentionFn
    unavailable_reason: "Requirement"
    diffusers_backend: str | None = None
    routed: bool = False
    phases: TwoPhases | None = None
    # Metadata-only: why `run` cannot serve these q/k/v (None: it can). A routed backend that has it also
    # serves calls under a key-padding mask (`key_padding`), which must know before it runs.
    serves_reason: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "str | None"] | None = None
    # run(q, k, v, scale, key_lengths): batch element b attends its first key_lengths[b] keys (int32 [B], read
    # on the device), or None; what serves a boolean key-padding mask without reading it on the host.
    run_key_lengths: Callable[..., torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.diffusers_backend is not None and self.routed:
            raise ValueError(f"backend {self.name!r}: diffusers runs it or our router does, not both")

    @property
    def in_models(self) -> str:
        """How it runs inside diffusers models, in words."""
        if self.diffusers_backend is not None:
            return f"diffusers backend {self.diffusers_backend}"
        return "routed by dit_accel.attention.routing" if self.routed else "benchmark only"


# --- availability -------------------------------------------------------------------------------

Requirement = Callable[[torch.device], "str | None"]
"""A check of one requirement: None when met, else why not, in words."""


def _needs_cuda(min_capability: tuple[int, int], what: str) -> Requirement:
    def check(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"{what} needs a CUDA GPU"
        capability = torch.cuda.get_device_capability(device)
        if capability < min_capability:
            return (f"{what} needs compute capability >= {min_capability[0]}.{min_capability[1]} "
                    f"(this GPU: {capability[0]}.{capability[1]})")
        return None

    return check


def _needs_module(module: str, install_hint: str) -> Requirement:
    """`module` must be importable; found without importing it (only its parents get imported)."""

    def check(device: torch.device) -> str | None:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a missing parent package
            found = False
        return None if found else f"{module} is not importable ({install_hint})"

    return check


def _requirements(*checks: Requirement) -> Requirement:
    """The first unmet requirement's reason, in order (the device first: the most useful message)."""

    def unavailable_reason(device: torch.device) -> str | None:
        return next((reason for check in checks if (reason := check(device)) is not None), None)

    return unavailable_reason


_runs_anywhere: Requirement = _requirements()


# --- torch SDPA ---------------------------------------------------------------------------------

TORCH_SDPA_KERNELS: dict[str, SDPBackend | None] = {
    "native": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
"""The backends that are torch SDPA, by name: the kernel each forces (None: torch picks)."""


def _torch_sdpa(forced: SDPBackend | None) -> AttentionFn:
    """torch SDPA on [B, S, H, D] views (as diffusers' native backends call it), optionally forced."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        context = sdpa_kernel(forced) if forced is not None else contextlib.nullcontext()
        with context:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return out.transpose(1, 2)

    return run


def _torch_sdpa_backend(name: str, description: str, requirement: Requirement,
                        diffusers_backend: str) -> AttentionBackend:
    """A torch SDPA backend: the kernel `TORCH_SDPA_KERNELS[name]` forces, run by diffusers as `diffusers_backend`."""
    return AttentionBackend(name, description, _torch_sdpa(TORCH_SDPA_KERNELS[name]), requirement,
                            diffusers_backend=diffusers_backend)


# --- flash-attn-4 (CuTe DSL) --------------------------------------------------------------------

def _fa4_serves_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """flash_attn.cute.flash_attn_func takes fp16/bf16, head dims <= 256 and multiples of 8."""
    head_dim = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"fa4 takes fp16/bf16, not {q.dtype}"
    if head_dim > 256 or head_dim % 8 or v.shape[-1] % 8:
        return f"fa4 takes head dims <= 256 that are multiples of 8, not {head_dim}"
    return None


def _fa4_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    reason = _fa4_serves_reason(q, k, v)
    if reason is not None:
        raise BackendCannotServe(reason)
    from flash_attn.cute import flash_attn_func

    result = flash_attn_func(q, k, v, softmax_scale=scale)
    return result[0] if isinstance(result, tuple) else result  # (out, lse) in the releases read


# --- ours: the CuTe DSL FP8 kernel --------------------------------------------------------------

@functools.cache
def _fp8_op():
    """The FP8 kernel's op module (its entry points and checks), imported at the first call that needs it, so
    the kernel package stays optional, and only then: an import statement in `_fp8_run` costs ~1 us a call."""
    from ..kernels.fp8_attention import op

    return op


class _Fp8CannotServe:
    """Context: the kernel's Fp8AttentionUnsupported (head dim, dtype, device) as our BackendCannotServe.
    A class, not a @contextmanager generator, which costs ~1 us more on every call; stateless, so one
    instance serves every call."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if kind is not None and issubclass(kind, _fp8_op().Fp8AttentionUnsupported):
            raise BackendCannotServe(str(exc)) from exc
        return False


_FP8_CANNOT_SERVE = _Fp8CannotServe()


def _fp8_serves_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel: str = "auto") -> str | None:
    """The kernel's own limits (`can_implement`: tensors, a CUDA device with FP8 MMA, the variant), metadata only."""
    from ..kernels.fp8_attention.op import can_implement

    return can_implement(q, k, v, kernel)


def _fp8_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
             key_lengths: torch.Tensor | None = None, *, kernel: str = "auto") -> torch.Tensor:
    """Prep (quantize + pack) and kernel. Traced by torch.compile, the custom op
    `torch.ops.dit_accel.fp8_attention`: one opaque node, refused at trace time from the tensors'
    metadata alone (`can_implement`: CUDA tensors only; the op's CPU emulation is for tests). Eager,
    what the op's CUDA implementation runs, called directly: the same checks and launches (CUDA graphs
    capture them as they are), without the dispatcher's ~10 us of host time per call. Either way, as in
    the op, inputs autograd could ask a gradient of are refused first (`Fp8AttentionNoGrad`; the router
    declines such calls before they get here). key_lengths: `fp8_attention`'s (element b attends its first
    key_lengths[b] keys)."""
    if torch.compiler.is_compiling():  # imported here: dynamo warns on functools.cache functions it traces
        from ..kernels.fp8_attention.op import FP8_ATTENTION, refuse_grad

        refuse_grad(q, k, v)
        reason = _fp8_serves_reason(q, k, v, kernel=kernel)
        if reason is not None:
            raise BackendCannotServe(reason)
        return FP8_ATTENTION(q, k, v, scale, kernel, key_lengths)
    op = _fp8_op()
    op.refuse_grad(q, k, v)
    with _FP8_CANNOT_SERVE:
        return op.fp8_attention(q, k, v, scale=scale, kernel=kernel, key_lengths=key_lengths)


@dataclass(frozen=True)
class Fp8Prepared:
    """Prep's packed e4m3 q/k/v and descales, with what the kernel alone still needs."""

    packed: Any
    out_dtype: torch.dtype
    scale: float | None
    kernel: str


def _fp8_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                 kernel: str = "auto", qk_int8: bool = False) -> Fp8Prepared:
    from ..kernels.fp8_attention import prep_fp8_attention

    with _FP8_CANNOT_SERVE:
        return Fp8Prepared(prep_fp8_attention(q, k, v, qk_int8=qk_int8), q.dtype, scale, kernel)


def _fp8_kernel(prepared: Fp8Prepared) -> torch.Tensor:
    from ..kernels.fp8_attention import fp8_attention_packed

    with _FP8_CANNOT_SERVE:
        return fp8_attention_packed(prepared.packed, out_dtype=prepared.out_dtype, scale=prepared.scale,
                                    kernel=prepared.kernel)


def _fp8_backend(name: str, kernel: str, description: str) -> "AttentionBackend":
    """Our FP8 kernel as a backend; `kernel` as fp8_attention takes it ("auto", "mma_sync", "sm90")."""
    run = functools.partial(_fp8_run, kernel=kernel)
    return AttentionBackend(
        name, description, run,
        _requirements(_needs_cuda((8, 9), "the FP8 kernel"),
                      _needs_module("dit_accel.kernels.fp8_attention", "pip install -e .[kernels]"),
                      _needs_module("cutlass.cute", "pip install nvidia-cutlass-dsl")),
        routed=True,
        phases=TwoPhases(prepare=functools.partial(_fp8_prepare, kernel=kernel), kernel=_fp8_kernel),
        serves_reason=functools.partial(_fp8_serves_reason, kernel=kernel), run_key_lengths=run)


# --- FlashAttention-3 (the fa3-fwd package, sm_90a): bf16, and FP8 with its own quantization --------

def _fa3_flash_attn_func():
    from fa3_fwd_interface import flash_attn_func

    return flash_attn_func


def _fa3_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FlashAttention-3's forward in bf16/fp16."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendCannotServe(f"fa3 takes fp16/bf16, not {q.dtype}")
    result = _fa3_flash_attn_func()(q, k, v, softmax_scale=scale)
    return result[0] if isinstance(result, tuple) else result


@dataclass(frozen=True)
class Fa3Fp8Inputs:
    """e4m3 q/k/v [B, S, H, D] with FA3's per-(batch, head) fp32 descales [B, H] (amax / 448)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale: torch.Tensor  # [3, B, H]: q, k, v
    scale: float | None
    out_dtype: torch.dtype


def _fa3_fp8_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> Fa3Fp8Inputs:
    """FA3 FP8's inputs: the same per-(batch, head) e4m3 codes as our prep (round to nearest of x * 448 /
    amax), in FA3's [B, S, H, D] layout. This is FA3 FP8's prep, timed as such."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendCannotServe(f"fa3-fp8 outputs fp16/bf16 like its input, not {q.dtype}")
    from ..kernels.fp8_attention.prep import head_amax, quantize, scales_from_amax

    amax = torch.stack([head_amax(x) for x in (q, k, v)])
    descale, quant = scales_from_amax(amax)
    codes = [quantize(x, quant[i]).contiguous() for i, x in enumerate((q, k, v))]
    return Fa3Fp8Inputs(*codes, descale.view(3, q.shape[0], q.shape[2]), scale, q.dtype)


def _fa3_fp8_kernel(inputs: Fa3Fp8Inputs) -> torch.Tensor:
    """FA3's FP8 forward (P.V accumulated in the FP8 wgmma accumulator across key blocks), output in
    the input dtype."""
    d = inputs.descale
    result = _fa3_flash_attn_func()(inputs.q, inputs.k, inputs.v, softmax_scale=inputs.scale,
                                     q_descale=d[0], k_descale=d[1], v_descale=d[2])
    out = result[0] if isinstance(result, tuple) else result
    return out.to(inputs.out_dtype)


# --- SageAttention2 (benchmark only): INT8 Q/K, FP8 P.V, its sm_90 kernel ------------------------

SAGE2_HEAD_DIMS = (64, 128)  # its kernel's; it pads others up to them, which would time padded work


@dataclass(frozen=True)
class Sage2Inputs:
    """SageAttention2's quantized inputs, as its `sageattn_qk_int8_pv_fp8_cuda_sm90` makes them by default: Q and
    K in INT8 with per-thread scales after K smoothing (K minus its mean over the keys), V in e4m3 with
    per-channel scales (its keys padded to a multiple of 128)."""

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    scale: float
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype


def _sage2_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> Sage2Inputs:
    """SageAttention2's prep, step by step as its sm_90 entry point takes it (NHD layout: [B, S, H, D])."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendCannotServe(f"sage2 takes fp16/bf16, not {q.dtype}")
    if q.shape[-1] not in SAGE2_HEAD_DIMS or k.shape[-1] != q.shape[-1]:
        raise BackendCannotServe(f"sage2's kernel takes head dims {SAGE2_HEAD_DIMS}, not {q.shape[-1]}")
    from sageattention.core import per_channel_fp8, per_thread_int8_triton

    q, k, v = (x.contiguous() for x in (q, k, v))
    q_int8, q_scale, k_int8, k_scale = per_thread_int8_triton(q, k, k.mean(dim=1, keepdim=True), tensor_layout="NHD",
                                                              BLKQ=64, WARPQ=16, BLKK=128, WARPK=128)
    v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, -v.shape[1] % 128))
    v_fp8, v_scale, _ = per_channel_fp8(v, tensor_layout="NHD", smooth_v=False)
    return Sage2Inputs(q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale,
                       q.shape[-1] ** -0.5 if scale is None else scale, tuple(q.shape), q.dtype)


def _sage2_kernel(inputs: Sage2Inputs) -> torch.Tensor:
    """SageAttention2's sm_90 kernel (INT8 Q.K, FP8 P.V accumulated in fp32 with an fp32 buffer every few key
    blocks: its "fp32+fp32"), V's scales fused, non-causal, no LSE."""
    from sageattention import sm90_compile

    out = torch.empty(inputs.out_shape, dtype=inputs.out_dtype, device=inputs.q.device)
    sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
        inputs.q, inputs.k, inputs.v, out, inputs.q_scale, inputs.k_scale, inputs.v_scale,
        0, 0, 3, inputs.scale, 0)  # NHD layout, not causal, per-thread Q/K scales, no LSE
    return out


def _needs_sm90_exactly(what: str) -> Requirement:
    """A kernel built for sm_90 alone (SageAttention2's sm90 extension): newer GPUs cannot load it."""
    at_least = _needs_cuda((9, 0), what)

    def check(device: torch.device) -> str | None:
        reason = at_least(device)
        if reason is None and torch.cuda.get_device_capability(device) != (9, 0):
            return f"{what} is built for sm_90 (Hopper) only"
        return reason

    return check


# --- cuDNN FP8 through the cudnn frontend (benchmark only) --------------------------------------

@dataclass(frozen=True)
class CudnnFp8Inputs:
    """Per-tensor e4m3 q/k/v ([B, S, H, D], contiguous) and their fp32 descales (amax / 448), on the GPU."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    attn_scale: float
    out_dtype: torch.dtype


def _quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * 448/amax in e4m3, amax/448 as a [1,1,1,1] fp32 tensor); stays on the device, no host sync."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    x_e4m3 = (x.float() * (E4M3_MAX / amax)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x_e4m3.contiguous(), (amax / E4M3_MAX).reshape(1, 1, 1, 1)


def _cudnn_fp8_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float | None = None) -> CudnnFp8Inputs:
    if q.shape[-1] % 16 or q.shape[-1] > 256:
        raise BackendCannotServe(f"cuDNN FP8 attention takes head dims <= 256 that are multiples of 16, "
                                 f"not {q.shape[-1]}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendCannotServe(f"cudnn-fp8 here outputs fp16/bf16 like its input, not {q.dtype}")
    (q8, qd), (k8, kd), (v8, vd) = (_quantize_e4m3(t) for t in (q, k, v))
    attn_scale = scale if scale is not None else q.shape[-1] ** -0.5
    return CudnnFp8Inputs(q8, k8, v8, qd, kd, vd, attn_scale, q.dtype)


class _CudnnUid:
    """Tensor ids of the cuDNN FP8 forward graph's variant pack."""

    Q, K, V, OUT, Q_DESCALE, K_DESCALE, V_DESCALE, S_DESCALE, S_SCALE, O_SCALE, O_AMAX = range(11)


@functools.lru_cache(maxsize=16)
def _cudnn_fp8_graph(b: int, h: int, s_q: int, s_kv: int, d: int, attn_scale: float, device_index: int):
    """Build (once per shape) the cuDNN FP8 SDPA forward graph, BSHD strides, e4m3 output.

    Hopper's cuDNN FP8 SDPA writes e4m3 only (bf16/fp16 output needs Blackwell). P is quantized to
    e4m3 with scale 448 (softmax values are <= 1), so S's descale is 1/448. Each output row is a
    convex combination of V's rows, so |O| <= amax(V): O's scale is 1 / V's descale, given at run
    time. Returns (graph, handle, workspace, constant scale tensors).
    """
    import cudnn

    handle = cudnn.create_handle()
    io_type = cudnn.data_type.FP8_E4M3
    graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

    def bshd(uid: int, s: int):
        return graph.tensor(uid=uid, dim=(b, h, s, d), stride=(s * h * d, d, h * d, 1), data_type=io_type)

    def scalar(uid: int):
        return graph.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)

    u = _CudnnUid
    o, _stats, _amax_s, amax_o = graph.sdpa_fp8(
        q=bshd(u.Q, s_q), k=bshd(u.K, s_kv), v=bshd(u.V, s_kv),
        descale_q=scalar(u.Q_DESCALE), descale_k=scalar(u.K_DESCALE), descale_v=scalar(u.V_DESCALE),
        descale_s=scalar(u.S_DESCALE), scale_s=scalar(u.S_SCALE), scale_o=scalar(u.O_SCALE),
        generate_stats=False, attn_scale=attn_scale, use_causal_mask=False,
    )
    o.set_uid(u.OUT).set_output(True).set_dim((b, h, s_q, d)).set_stride((s_q * h * d, d, h * d, 1))
    o.set_data_type(io_type)
    amax_o.set_uid(u.O_AMAX).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
    amax_o.set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    device = torch.device("cuda", device_index)
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
    constants = {
        u.S_SCALE: torch.full((1, 1, 1, 1), E4M3_MAX, dtype=torch.float32, device=device),
        u.S_DESCALE: torch.full((1, 1, 1, 1), 1 / E4M3_MAX, dtype=torch.float32, device=device),
    }
    return graph, handle, workspace, constants


def _cudnn_fp8_kernel(inputs: CudnnFp8Inputs) -> torch.Tensor:
    """cuDNN's e4m3 output, dequantized to the input dtype (one elementwise pass, timed with the kernel)."""
    import cudnn

    b, s_q, h, d = inputs.q.shape
    graph, handle, workspace, constants = _cudnn_fp8_graph(
        b, h, s_q, inputs.k.shape[1], d, inputs.attn_scale, inputs.q.device.index or 0)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(inputs.q.device).cuda_stream)
    out_e4m3 = torch.empty(b, s_q, h, d, dtype=torch.float8_e4m3fn, device=inputs.q.device)
    o_amax = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=inputs.q.device)
    u = _CudnnUid
    variant_pack = {
        u.Q: inputs.q, u.K: inputs.k, u.V: inputs.v,
        u.Q_DESCALE: inputs.q_descale, u.K_DESCALE: inputs.k_descale, u.V_DESCALE: inputs.v_descale,
        u.O_SCALE: 1.0 / inputs.v_descale, u.OUT: out_e4m3, u.O_AMAX: o_amax, **constants,
    }
    graph.execute(variant_pack, workspace, handle=handle)
    return (out_e4m3.float() * inputs.v_descale.reshape(1)).to(inputs.out_dtype)


# --- the registry -------------------------------------------------------------------------------

_FA3_REQUIREMENTS = _requirements(_needs_cuda((9, 0), "FlashAttention-3"),
                                  _needs_module("fa3_fwd_interface", "pip install 'dit-accel[peers]'"))

BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend
    for backend in (
        _torch_sdpa_backend("native", "diffusers' default: torch SDPA picks its kernel", _runs_anywhere, "native"),
        _torch_sdpa_backend("flash", "torch SDPA forced to its FlashAttention-2 kernel",
                            _needs_cuda((8, 0), "torch SDPA flash"), "_native_flash"),
        _torch_sdpa_backend("cudnn", "torch SDPA forced to cuDNN attention (bf16/fp16)",
                            _needs_cuda((8, 0), "torch SDPA cuDNN"), "_native_cudnn"),
        _torch_sdpa_backend("efficient", "torch SDPA forced to its memory-efficient kernel",
                            _needs_cuda((5, 0), "torch SDPA efficient"), "_native_efficient"),
        _torch_sdpa_backend("math", "torch SDPA forced to its math path (materializes the S x S scores)",
                            _runs_anywhere, "_native_math"),
        AttentionBackend(
            "fa4", "flash-attn-4 (CuTe DSL), flash_attn.cute.flash_attn_func, bf16/fp16",
            _fa4_run,
            _requirements(_needs_cuda((9, 0), "fa4"),
                          _needs_module("flash_attn.cute", "pip install flash-attn-4")),
            routed=True, serves_reason=_fa4_serves_reason),
        AttentionBackend(
            "fa3", "FlashAttention-3 forward (fa3-fwd), bf16/fp16",
            _fa3_run, _FA3_REQUIREMENTS, routed=True),
        AttentionBackend(
            "fa3-fp8",
            "FlashAttention-3 FP8 forward (fa3-fwd), per-(batch, head) e4m3 scales, its quantization as prep",
            lambda q, k, v, scale=None: _fa3_fp8_kernel(_fa3_fp8_quantize(q, k, v, scale)), _FA3_REQUIREMENTS,
            phases=TwoPhases(prepare=_fa3_fp8_quantize, kernel=_fa3_fp8_kernel)),
        _fp8_backend("fp8", "auto", "ours: CuTe DSL FP8 attention, prep included (sm_90: wgmma kernel; else v1)"),
        _fp8_backend("fp8-v1", "mma_sync", "ours, v1: the mma.sync FP8 kernel (sm_89/sm_90/sm_120), prep included"),
        AttentionBackend(
            "fp8-int8qk", "ours with INT8 Q/K (a scale per group of the rows one kernel thread holds: 2 query rows, "
            "16 of 64 keys; V and P e4m3), sm_90 kernel, prep included",
            lambda q, k, v, scale=None: _fp8_kernel(_fp8_prepare(q, k, v, scale, kernel="sm90", qk_int8=True)),
            _requirements(_needs_sm90_exactly("the INT8 Q/K kernel"),
                          _needs_module("dit_accel.kernels.fp8_attention", "pip install -e .[kernels]"),
                          _needs_module("cutlass.cute", "pip install nvidia-cutlass-dsl")),
            phases=TwoPhases(prepare=functools.partial(_fp8_prepare, kernel="sm90", qk_int8=True), kernel=_fp8_kernel)),
        AttentionBackend(
            "sage2",
            "SageAttention2's sm_90 kernel: INT8 Q/K (per-thread scales, K smoothed), FP8 P.V with an fp32 buffer; "
            "its quantization as prep",
            lambda q, k, v, scale=None: _sage2_kernel(_sage2_quantize(q, k, v, scale)),
            _requirements(_needs_sm90_exactly("SageAttention2's sm90 kernel"),
                          _needs_module("sageattention", "build SageAttention2 from its sources: PyPI stops at 1.0.6")),
            phases=TwoPhases(prepare=_sage2_quantize, kernel=_sage2_kernel)),
        AttentionBackend(
            "cudnn-fp8", "cuDNN FP8 SDPA (cudnn frontend), per-tensor e4m3 scales, e4m3 output dequantized",
            lambda q, k, v, scale=None: _cudnn_fp8_kernel(_cudnn_fp8_quantize(q, k, v, scale)),
            _requirements(_needs_cuda((9, 0), "cuDNN FP8 attention"),
                          _needs_module("cudnn", "pip install nvidia-cudnn-frontend")),
            phases=TwoPhases(prepare=_cudnn_fp8_quantize, kernel=_cudnn_fp8_kernel)),
    )
}


def get_backend(name: str) -> AttentionBackend:
    """The backend called `name`; a UserError listing the known names otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UserError(f"unknown attention backend {name!r}; pick one of: {', '.join(BACKENDS)}") from None

"""Compiles one FP8 attention kernel variant (`support.KERNELS`: "mma_sync", v1
`Fp8AttentionMmaSync`; "sm90", `Fp8AttentionSm90`) for one plan. The same code path runs on the
GPU (interface) and on CPU machines (tests, with CUTE_DSL_ARCH set), so a CPU compile proves
the GPU one.

Every sequence-length, batch and head dimension is dynamic: one compiled kernel serves all
shapes with the same head_dim, output dtype and LSE choice.
"""
import torch

from .kernel_mma_sync import Fp8AttentionMmaSync
from .support import KERNELS

TORCH_TO_CUTLASS = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32",
                    torch.float8_e4m3fn: "Float8E4M3FN"}


def fake_tensor(dtype: torch.dtype, rank: int):
    """Compile-time stand-in for `to_cute(t)`: gmem, 16-byte aligned base, every extent and
    every stride but the last (which is 1) dynamic. Needs no GPU."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(getattr(cutlass, TORCH_TO_CUTLASS[dtype]), shape, stride, assumed_align=16)


def to_cute(t: torch.Tensor):
    """The runtime view matching `fake_tensor`: dynamic layout, innermost stride 1."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)


def cute_arguments(q, k, v, descale, out, lse, softmax_scale: float, seqlen_kv: int, stream: int):
    """The compiled kernel's argument list, from torch CUDA tensors packed by prep."""
    import cuda.bindings.driver as cuda
    import cutlass

    return (
        to_cute(q), to_cute(k), to_cute(v), to_cute(descale), to_cute(out),
        None if lse is None else to_cute(lse),
        cutlass.Float32(softmax_scale), cutlass.Int32(seqlen_kv), cuda.CUstream(stream),
    )


def make_kernel(kernel: str, head_dim: int, **options):
    """The kernel object for a variant name: "mma_sync" (v1, sm_89+) or "sm90" (wgmma, sm_90a)."""
    if kernel == "mma_sync":
        return Fp8AttentionMmaSync(head_dim)
    if kernel == "sm90":
        from .kernel_sm90 import Fp8AttentionSm90

        return Fp8AttentionSm90(head_dim, **options)
    raise ValueError(f"unknown fp8 attention kernel {kernel!r}; one of {KERNELS}")


def compile_fp8_attention(head_dim: int, out_dtype: torch.dtype, with_lse: bool,
                          kernel: str = "mma_sync", **options):
    """Returns the compiled callable; call it with `cute_arguments(...)`. Both kernels take the
    same arguments (prep's packed tensors); options go to the kernel class (sm90: tile_n,
    num_stages)."""
    import cutlass.cute as cute

    import cuda.bindings.driver as cuda
    import cutlass

    fp8 = torch.float8_e4m3fn
    args = (
        fake_tensor(fp8, 3), fake_tensor(fp8, 3), fake_tensor(fp8, 3),  # q, k, v (packed)
        fake_tensor(torch.float32, 2),  # descale [3, B*H]
        fake_tensor(out_dtype, 4),  # out [B, Sq, H, D]
        fake_tensor(torch.float32, 3) if with_lse else None,  # lse [B, H, Sq]
        cutlass.Float32(1.0), cutlass.Int32(1), cuda.CUstream(0),
    )
    return cute.compile(make_kernel(kernel, head_dim, **options), *args)

"""Compiles one FP8 attention kernel variant (`support.KERNELS`: "mma_sync", v1
`Fp8AttentionMmaSync`; "sm90", `Fp8AttentionSm90`) for one plan. The same code path runs on the
GPU (interface) and on CPU machines (tests, with CUTE_DSL_ARCH set), so a CPU compile proves
the GPU one.

Every sequence-length, batch and head dimension is dynamic: one compiled kernel serves all
shapes with the same head_dim, output dtype and LSE choice.

Kernels are compiled for the TVM-FFI calling convention (`--enable-tvm-ffi`, as FlashAttention-4's
CuTe interface does): the compiled function takes torch tensors and Python scalars directly and
reads torch's current stream itself, so a launch converts nothing in Python (no DLPack capsules,
no cute.Tensor wrappers, no stream object).
"""
import torch

from .config import Sm90Config
from .kernel_mma_sync import Fp8AttentionMmaSync
from .support import KERNELS

TORCH_TO_CUTLASS = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32",
                    torch.float8_e4m3fn: "Float8E4M3FN", torch.int8: "Int8", torch.int32: "Int32"}


def fake_tensor(dtype: torch.dtype, rank: int):
    """Compile-time stand-in for `to_cute(t)`: gmem, 16-byte aligned base, every extent and
    every stride but the last (which is 1) dynamic. Needs no GPU."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(getattr(cutlass, TORCH_TO_CUTLASS[dtype]), shape, stride, assumed_align=16)


def make_kernel(kernel: str, head_dim: int, config: Sm90Config | None = None):
    """The kernel object for a variant name: "mma_sync" (v1, sm_89+; it has no configuration) or "sm90"
    (wgmma, sm_90a; config None: `Sm90Config()`)."""
    if kernel == "mma_sync":
        if config is not None:
            raise ValueError("the mma_sync kernel takes no configuration")
        return Fp8AttentionMmaSync(head_dim)
    if kernel == "sm90":
        from .kernel_sm90 import Fp8AttentionSm90

        return Fp8AttentionSm90(head_dim, Sm90Config() if config is None else config)
    raise ValueError(f"unknown fp8 attention kernel {kernel!r}; one of {KERNELS}")


def compile_fp8_attention(head_dim: int, out_dtype: torch.dtype, with_lse: bool,
                          kernel: str = "mma_sync", config: Sm90Config | None = None, with_key_lengths: bool = False):
    """Returns the compiled callable: `compiled(q, k, v, descale, q_scale, k_scale, out, lse, key_lengths,
    softmax_scale, seqlen_kv)` with prep's packed torch tensors (q_scale and k_scale None unless the config has
    qk_int8, lse None when compiled without, key_lengths an int32 [B] tensor when compiled with, else None),
    launched on torch's current stream. Both kernels take the same arguments; config is the sm90 kernel's
    (`config.Sm90Config`; None: its defaults)."""
    import cutlass.cute as cute

    import cutlass

    fp8 = torch.float8_e4m3fn
    qk_int8 = config is not None and config.qk_int8
    qk = torch.int8 if qk_int8 else fp8
    block_scales = (fake_tensor(torch.float32, 2), fake_tensor(torch.float32, 2)) if qk_int8 else (None, None)
    args = (
        fake_tensor(qk, 3), fake_tensor(qk, 3), fake_tensor(fp8, 3),  # q, k, v (packed)
        fake_tensor(torch.float32, 2),  # descale [3, B*H]
        *block_scales,  # q_scale, k_scale [B*H, blocks]
        fake_tensor(out_dtype, 4),  # out [B, Sq, H, D]
        fake_tensor(torch.float32, 3) if with_lse else None,  # lse [B, H, Sq]
        fake_tensor(torch.int32, 1) if with_key_lengths else None,  # key_lengths [B]
        cutlass.Float32(1.0), cutlass.Int32(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),  # torch's current stream at each call
    )
    return cute.compile(make_kernel(kernel, head_dim, config), *args, options="--enable-tvm-ffi")

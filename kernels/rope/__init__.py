"""The fused rotary embedding of MiniMax-H3 (a Triton kernel), installed as `dit_accel.kernels.rope`.

`reference.py`: the contract and its float32 torch reference. `kernel_triton.py`: the kernel, what
it can compute (`unsupported_reason`) and whether Triton is importable (`is_available`); Triton is
imported on the first CUDA call, not by importing this package.
"""
from .kernel_triton import KERNEL_DTYPES, apply_rotary_emb_fused, is_available, unsupported_reason
from .reference import rope_reference

__all__ = ["KERNEL_DTYPES", "apply_rotary_emb_fused", "is_available", "rope_reference", "unsupported_reason"]

"""FP8 (e4m3) flash-attention forward: Triton prep + CuTe DSL mma.sync kernel (sm_89/90/120)."""
from .interface import (
    Fp8AttentionUnsupported,
    fp8_attention,
    fp8_attention_packed,
    prep_fp8_attention,
)
from .prep import PackedQKV, prep_reference

__all__ = [
    "Fp8AttentionUnsupported",
    "PackedQKV",
    "fp8_attention",
    "fp8_attention_packed",
    "prep_fp8_attention",
    "prep_reference",
]

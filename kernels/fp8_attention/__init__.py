"""FP8 (e4m3) flash-attention forward: Triton prep (quantize + pack, `prep`) and two CuTe DSL
kernels on its output: `kernel_sm90` (TMA + FP8 wgmma, warp-specialized, sm_90a) and v1
`kernel_mma_sync` (mma.sync m16n8k32, sm_89 / sm_90 / sm_120). `interface` checks the inputs
(`support.can_implement`), picks the kernel for the device and launches it.

Beside the kernels: `config` (the sm90 kernel's configuration, `Sm90Config`), `tuning` (the one fp8_attention
runs per head dim and key length), `softmax` (quad reductions, the sm90 online-softmax state), `tile_scheduler`
(which tiles a CTA computes), `epilogue`, `named_barrier`, `layout` (the prep/kernel contract), `compile`,
`emulation` (the scheme in float64, for checking)."""
from .interface import (
    Fp8AttentionUnsupported,
    fp8_attention,
    fp8_attention_packed,
    prep_fp8_attention,
)
from .prep import PackedQKV, prep_reference
from .support import can_implement

__all__ = [
    "Fp8AttentionUnsupported",
    "PackedQKV",
    "can_implement",
    "fp8_attention",
    "fp8_attention_packed",
    "prep_fp8_attention",
    "prep_reference",
]

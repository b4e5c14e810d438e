"""Which kind of work a GPU kernel (or, on the CPU, an aten op) is: the classification rules, in one place.

`classify(name, range_label)` looks at the kernel's name first for work that only one kind of kernel
does (quantization), then at the range it ran in (everything launched inside the attention core is
attention time, whatever the backend calls its kernels; generic elementwise kernels inside a norm or
RoPE range are norm or RoPE work, as on the CPU or in unfused norms), then at the name alone.
"""
from __future__ import annotations

import re

CATEGORIES = (
    "attention", "gemm", "norm", "rope", "modulation-elementwise", "gather-index", "quantize", "copy", "other",
)
MATMUL_CATEGORIES = ("attention", "gemm")  # rated in TFLOP/s against the GEMM ceiling; the rest in GB/s

_NAME_RULES: tuple[tuple[str, str], ...] = (
    ("quantize", r"quant|fp8_prep|prep_fp8|amax|to_fp8|cast_fp8|pack_fp8|fp8_pack"),
    ("attention", r"sdpa|fmha|flash_?fwd|flash_?attn|flashattention|attention|softmax|fprop"),
    ("gemm", r"nvjet|gemm|gemv|cublas|cutlass.*matmul|aten::(?:mm|addmm|bmm|matmul|linear|baddbmm)$"),
    ("norm", r"layer_?norm|rms_?norm|group_?norm|batch_?norm"),
    ("rope", r"rotary|rope"),
    ("gather-index", r"index_?select|indexselect|gather|scatter|index_?put|index_?copy|indexfunc|aten::index$"),
    ("copy", r"copy|memcpy|memset|catarray|aten::(?:cat|to|_to_copy|contiguous|clone|fill_|zero_)$"),
    ("modulation-elementwise", r"elementwise|functor|silu|gelu|swiglu|triton_poi|aten::(?:mul|add|sub|div|neg|silu|gelu|"
                               r"sigmoid|tanh|exp|chunk|rsub|pow|mean|rsqrt|where|lerp)_?$"),
)
_COMPILED = tuple((category, re.compile(pattern, re.IGNORECASE)) for category, pattern in _NAME_RULES)

ATTENTION_RANGE = "attention core"
# Ranges that claim every kernel launched inside them, except quantization: {label word: category}.
_RANGE_CLAIMS_ALL = {ATTENTION_RANGE: "attention"}
# Ranges that claim only the generic kernels (elementwise, copies, reductions) launched inside them.
_RANGE_CLAIMS_GENERIC = {"rope": "rope", "norm": "norm"}
_GENERIC = ("modulation-elementwise", "copy", "other")


def classify_name(name: str) -> str:
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return "other"


def classify(name: str, range_label: str | None = None) -> str:
    by_name = classify_name(name)
    if range_label is None or by_name == "quantize":
        return by_name
    for word, category in _RANGE_CLAIMS_ALL.items():
        if word in range_label:
            return category
    if by_name in _GENERIC:
        for word, category in _RANGE_CLAIMS_GENERIC.items():
            if word in range_label:
                return category
    return by_name

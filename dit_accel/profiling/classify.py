"""Which kind of work a GPU kernel (or, on the CPU, an aten op) is: the classification rules, in one place.

`classify(name, range_label)` looks at the kernel's name first for work that only one kind of kernel
does (quantization), then at the range it ran in (everything launched inside the attention core is
attention time, whatever the backend calls its kernels; generic elementwise kernels inside a norm or
RoPE range are norm or RoPE work, as on the CPU or in unfused norms), then at the name alone.

Compiled blocks (torch.compile / inductor) have no module ranges (dynamo drops them), so their
kernels are classified by name alone (range None). Inductor names a generated kernel
``triton_{poi|red|per|tem|for|spl|unk}_fused_{ops}_{n}`` on the GPU and ``cpp_fused_{ops}_{n}`` on the
CPU (torch/_inductor/codegen/triton.py and cpp.py ``define_kernel``), where ``poi``/``red``/``per``/
``tem`` are pointwise / reduction / persistent reduction / template (max-autotune GEMM, flex
attention) kernels and, with ``descriptive_names = "original_aten"`` (the default), ``{ops}`` is the
sorted set of the aten ops (before decomposition) that the kernel fuses, joined by ``_``
(torch/_inductor/utils.py ``get_fused_kernel_name``): ``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3``
is an RMSNorm. `fused_kinds(name)` reads that op list and says every kind of work the kernel covers;
`classify` returns the single most specific one, in this order of precedence::

    tem kernels: attention (flex_attention) else gemm -- a template GEMM with a fused bias or
                 activation epilogue (or quantization prologue) is still a GEMM;
    others:      quantize > attention > gemm > norm > rope > gather-index > modulation-elementwise
                 > copy > other

(quantization first as for eager names, so that the cost of FP8 stays visible even when inductor
fuses it into the norm or the SwiGLU that feeds the FP8 GEMM; a reduction's signature before the
pointwise work fused around it). The signatures, on the op list:

* quantize: ``abs`` with ``amax``/``max`` (a per-row or per-tensor absmax for an FP8 scale), or a
  ``clamp`` with a cast (``_to_copy``) and a scaling (``div``/``reciprocal``): torchao's dynamic
  per-row FP8 quantization compiles to ``..._fused__to_copy_abs_amax_clamp_div_...``.
* attention: ``_softmax``/``_safe_softmax``/``_log_softmax``, ``flex_attention``, an sdpa op, or a
  hand-written softmax (``exp`` + ``amax``/``max`` + ``sum``).
* gemm: ``tem`` kernels; ``red``/``per``/``cpp`` kernels named after a matmul op (``mm``, ``addmm``,
  ``bmm``, ``_scaled_mm``, ...: a small matmul inductor decomposed into a reduction, or a CPU
  max-autotune GEMM template, which cpp.py names like any fused kernel). In a ``poi`` kernel a matmul
  op is only the GEMM's bias add split off to fuse with the activation
  (``triton_poi_fused_addmm_gelu_0``): elementwise.
* norm: an op ending in ``norm`` (``native_layer_norm``, ``native_group_norm``, ``rms_norm``, ...) or
  ``rsqrt`` with ``mean``/``var_mean``/``var``/``sum`` (decomposed RMSNorm / LayerNorm / L2 norm).
* rope: ``cat`` + ``neg`` + ``mul`` (rotate-half RoPE: ``x*cos + cat(-x2, x1)*sin``), ``stack`` +
  ``sub`` + ``mul`` (interleaved RoPE: ``stack(x1*c - x2*s, x1*s + x2*c)``), ``view_as_complex`` /
  ``view_as_real`` / ``polar`` (complex RoPE: inductor does not fuse the complex multiply, so these
  kernels are the RoPE's repacking copies), or ``cos``/``sin`` (RoPE tables computed in the block).
  Limits: the op names carry no tensor names, so any ``cat(-a, b)*c`` or any stacked difference of
  products reads as RoPE, and a sinusoidal timestep embedding compiled into the block (``cos``/``sin``)
  reads as RoPE too.
* gather-index: ``index``/``index_select``/``index_put``/``_unsafe_index``/``gather``/``scatter``/``embedding``.
* modulation-elementwise: any other pointwise op (add, mul, silu, gelu, sigmoid, ...), also those
  left over next to a signature (``add_mul_native_layer_norm`` is a LayerNorm and a modulation).
* copy: only layout ops and casts (``_to_copy``, ``clone``, ``cat``, ``transpose``, ``view``, ...).
  A ``clone``/``cat``/``stack``/``constant_pad_nd`` next to other work adds "copy" to fused_kinds.

Limit of fused_kinds: the op list names each aten op once, so an RMSNorm's own ``add`` (eps) and
``mul`` (weight) hide a residual add or a gate multiply fused into it (``h = r + g*x; rms(h)``
compiles to the same ``_to_copy_add_mean_mul_pow_rsqrt`` as ``rms(x)``); ``native_layer_norm`` is one
aten op, so the modulation around a LayerNorm does show.

Names that still go to "other", each for a reason:

* eager reductions with no kind of their own (``at::native::reduce_kernel<... MeanOps ...>``), and
  inductor kernels whose only work is a reduction or scan matching no signature
  (``triton_red_fused_mean_0``, ``triton_red_fused_sum_1``, ``triton_spl_fused_cumsum_0``): a mean or
  sum alone is no norm, softmax or quantization;
* ``red``/``per``/``spl``/``for``/``unk`` kernels compiled with descriptive names off (``triton_red__0``:
  the name holds no op; ``poi`` ones are still elementwise);
* kernels whose name matches no rule at all (user kernels with other names, vendor kernels not
  listed here), e.g. ``my_mystery_kernel``.

Apart from its kind, `is_fp8(name)` says whether a kernel computes on FP8 operands, so that its time is
rated against the FP8 GEMM ceiling, not the block dtype's: cuBLAS and CUTLASS name their operand types
(``sm90_xmma_gemm_e4m3bf16_e4m3f32_...``, ``cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_...``,
``cutlass::float_e4m3_t`` in a template's arguments, as FlashAttention-3's FP8 kernels carry it),
cuBLASLt's nvjet kernels spell e4m3 operands ``qq`` (``nvjet_sm90_qqtst_...``; bf16 ones are
``nvjet_sm90_tst_...``), torch's FP8 GEMM op is ``_scaled_mm`` (the CPU's ``aten::_scaled_mm``,
inductor's ``triton_tem_fused__scaled_mm_...``), and our attention kernels are ``Fp8AttentionSm90`` and
``Fp8AttentionMmaSync``.
"""
from __future__ import annotations

import re

CATEGORIES = (
    "attention", "gemm", "conv", "norm", "rope", "modulation-elementwise", "gather-index", "quantize", "copy", "other",
)
# Rated in TFLOP/s against the GEMM ceiling (where their FLOPs are known); the rest in GB/s.
MATMUL_CATEGORIES = ("attention", "gemm", "conv")

# cuBLAS / cuBLASLt / CUTLASS 3.x GEMM kernels, by how their names begin: checked before the quantize
# rule, so that an FP8 GEMM (e4m3 operands, perhaps an amax epilogue) is never taken for quantization.
# (Not a bare "gemm" anywhere: fbgemm_gpu's quantize kernels carry "fbgemm" in their namespace.)
_GEMM_PREFIX = re.compile(
    r"^(?:void\s+)?(?:cutlass::(?:device_kernel|Kernel2?)<)?"
    r"(?:sm\d+_xmma_gemm|nvjet|cutlass3?x?_sm\d+_\w*?gemm|cutlass_\d+_\w*?gemm|ampere_\w*?gemm)",
    re.IGNORECASE)

_NAME_RULES: tuple[tuple[str, str], ...] = (
    ("quantize", r"quant|fp8_prep|prep_fp8|amax|to_fp8|cast_fp8|pack_fp8|fp8_pack"),
    # Convolutions (a VAE's): cuDNN's implicit-GEMM "fprop" kernels before attention's "fprop" (cuDNN's
    # SDPA kernels are "..._sdpa_..._fprop_..."), and the CPU's aten conv ops.
    ("conv", r"fprop_implicit|tensorop\w*fprop|implicit_convolve|convolve|winograd|conv_?[123]d|aten::(?:_?convolution|"
             r"cudnn_convolution|mkldnn_convolution|_?slow_conv\w*|_nnpack_spatial_convolution)$"),
    ("attention", r"sdpa|fmha|flash_?fwd|flash_?attn|flashattention|attention|softmax|fprop"),
    ("gemm", r"nvjet|(?<!fb)gemm|gemv|cublas|cutlass.*matmul|aten::(?:mm|addmm|bmm|matmul|linear|baddbmm|_scaled_mm)$"),
    ("norm", r"layer_?norm|rms_?norm|group_?norm|batch_?norm"),
    ("rope", r"rotary|rope"),
    ("gather-index", r"index_?select|indexselect|gather|scatter|index_?put|index_?copy|indexfunc|aten::index$"),
    ("copy", r"copy|memcpy|memset|catarray|aten::(?:cat|to|_to_copy|contiguous|clone|fill_|zero_)$"),
    ("modulation-elementwise", r"elementwise|functor|silu|gelu|swiglu|triton_poi|aten::(?:mul|add|sub|div|neg|silu|"
                               r"gelu|sigmoid|tanh|exp|chunk|rsub|pow|mean|rsqrt|where|lerp|bitwise_(?:and|or|not)|"
                               r"logical_(?:and|or|not)|eq|ne|lt|le|gt|ge)_?$"),
)
_COMPILED = tuple((category, re.compile(pattern, re.IGNORECASE)) for category, pattern in _NAME_RULES)
# Kernels on FP8 operands (see the module docstring); "f8" only as a whole `_`-separated part or a pair.
_FP8_NAME = re.compile(r"e4m3|e5m2|float8|(?:^|_)f8(?:f8|_|$)|nvjet_(?:sm\d+_)?qq|scaled_mm|fp8_?attention",
                       re.IGNORECASE)

# --- inductor-generated kernels -------------------------------------------------------------------
# triton_{kind}_fused_{ops}_{n} (GPU; kind = first 3 letters of the triton_heuristics decorator:
# pointwise, reduction, persistent_reduction, template, foreach, split_scan, or "unk"nown) and
# cpp_fused_{ops}_{n} (CPU). An AOTInductor model name may come first, hence the (?:^|_).
_INDUCTOR = re.compile(r"(?:^|_)(?:triton_(?P<kind>poi|red|per|tem|for|spl|unk)|(?P<cpp>cpp))_(?:fused)?(?P<ops>\w*)$")
# aten op names that hold an underscore (everything else is one `_`-separated token); longest first.
_MULTIWORD_OPS = tuple(sorted((
    "_to_copy", "to_copy", "convert_element_type", "_unsafe_view", "split_with_sizes", "constant_pad_nd",
    "as_strided", "select_scatter", "slice_scatter", "new_zeros", "new_ones", "new_empty", "zeros_like",
    "ones_like", "full_like", "empty_like", "lift_fresh", "_reshape_alias", "expand_as", "view_as",
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "layer_norm", "group_norm",
    "rms_norm", "_fused_rms_norm", "batch_norm", "linalg_vector_norm", "var_mean",
    "index_select", "index_put", "index_add", "index_copy", "index_fill", "_unsafe_index", "_unsafe_index_put",
    "_index_put_impl", "scatter_add", "scatter_reduce", "masked_fill", "masked_scatter", "repeat_interleave",
    "view_as_complex", "view_as_real", "_softmax", "_safe_softmax", "_log_softmax", "log_softmax",
    "flex_attention", "flex_attention_backward", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention", "_scaled_mm", "scaled_mm", "_int_mm", "clamp_min", "clamp_max",
    "copy_", "fill_", "zero_", "native_dropout", "bitwise_and", "bitwise_or", "bitwise_not", "logical_and",
    "logical_not", "logical_or",
), key=len, reverse=True))
# Ops that move or cast data and compute nothing.
_LAYOUT_OPS = frozenset((
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "expand_as", "view_as", "slice",
    "select", "split", "split_with_sizes", "squeeze", "unsqueeze", "unbind", "chunk", "flatten", "unflatten",
    "alias", "as_strided", "_reshape_alias", "contiguous", "_to_copy", "to_copy", "convert_element_type",
    "detach", "lift_fresh", "narrow", "movedim", "diagonal", "unfold", "repeat", "roll", "flip",
    "select_scatter", "slice_scatter", "zeros", "ones", "full", "fill", "empty", "new_zeros", "new_ones",
    "new_empty", "zeros_like", "ones_like", "full_like", "empty_like", "scalar_tensor", "fill_", "zero_",
    "clone", "copy", "copy_", "cat", "stack", "constant_pad_nd", "pad",
))
_EXPLICIT_COPY_OPS = frozenset(("clone", "copy", "copy_", "cat", "stack", "constant_pad_nd", "pad"))
_REDUCTION_OPS = frozenset((
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "argmax", "argmin", "any",
    "all", "logsumexp", "cumsum", "cumprod", "logcumsumexp",
))
_MATMUL_OPS = frozenset(("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "scaled_mm",
                         "_int_mm", "addmv", "mv", "convolution"))
_ATTENTION_OPS = frozenset(("_softmax", "_safe_softmax", "_log_softmax", "log_softmax", "softmax", "flex_attention",
                            "flex_attention_backward", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                            "scaled_dot_product_attention"))
_GATHER_OPS = frozenset(("index", "index_select", "index_put", "index_add", "index_copy", "index_fill", "_unsafe_index",
                         "_unsafe_index_put", "_index_put_impl", "gather", "scatter", "scatter_add", "scatter_reduce",
                         "embedding", "take", "masked_select", "masked_scatter"))
_CASTS = frozenset(("_to_copy", "to_copy", "convert_element_type"))
_PRECEDENCE = ("quantize", "attention", "gemm", "norm", "rope", "gather-index", "modulation-elementwise", "copy",
               "other")


def _split_ops(ops: str) -> list[str]:
    """`_to_copy_add_mean_mul_pow_rsqrt` -> ['_to_copy', 'add', 'mean', 'mul', 'pow', 'rsqrt'] (numbers dropped:
    with descriptive_names="inductor_node" the ops are node names such as `add_1`)."""
    out, i = [], 0
    while i < len(ops):
        for op in _MULTIWORD_OPS:
            end = i + len(op)
            if ops.startswith(op, i) and (end == len(ops) or ops[end] == "_"):
                out.append(op)
                i = end + 1
                break
        else:
            end = ops.find("_", i)
            end = len(ops) if end < 0 else end
            if end > i and not ops[i:end].isdigit():
                out.append(ops[i:end])
            i = end + 1
    return out


def _inductor_kinds(kind: str, ops: list[str]) -> tuple[str, ...]:
    """The kinds of work in one inductor kernel, in CATEGORIES order (see the module docstring)."""
    present, left, kinds = set(ops), set(ops), set()

    def claim(category: str, used) -> None:
        kinds.add(category)
        left.difference_update(used)

    if kind == "tem":
        claim("attention" if present & _ATTENTION_OPS else "gemm", _ATTENTION_OPS | _MATMUL_OPS)
    if present & _ATTENTION_OPS:
        claim("attention", _ATTENTION_OPS | {"exp", "sub", "amax", "max", "sum", "div"})
    elif {"exp", "sum"} <= present and present & {"amax", "max"}:  # a hand-written softmax
        claim("attention", {"exp", "sub", "amax", "max", "sum", "div"})
    if "abs" in present and present & {"amax", "max"}:
        claim("quantize", {"abs", "amax", "max", "clamp", "clamp_min", "clamp_max", "div", "reciprocal", "round"})
    if present & {"clamp", "clamp_min", "clamp_max"} and present & _CASTS and present & {"div", "reciprocal"}:
        claim("quantize", {"clamp", "clamp_min", "clamp_max", "div", "reciprocal", "round"})
    if "quantize" in kinds and "reciprocal" in present:
        left.discard("mul")  # x * (1 / scale)
    if kind != "tem" and present & _MATMUL_OPS:
        if kind in ("red", "per", "cpp"):
            claim("gemm", _MATMUL_OPS | {"sum", "mul"})
        else:  # the bias add split off an addmm, fused with what follows it
            kinds.add("modulation-elementwise")
            left.difference_update(_MATMUL_OPS)
    norms = {op for op in present if op.endswith("norm")}
    if norms:
        claim("norm", norms)
    elif "rsqrt" in present and present & {"mean", "var_mean", "var", "sum"}:
        claim("norm", {"rsqrt", "mean", "var_mean", "var", "sum", "pow", "add", "mul", "sub", "sqrt", "div"})
    if {"cat", "neg", "mul"} <= present:
        claim("rope", {"cat", "neg", "mul", "add"})
    if {"stack", "sub", "mul"} <= present:
        claim("rope", {"stack", "sub", "mul", "add"})
    if present & {"view_as_complex", "view_as_real", "polar", "cos", "sin"}:
        claim("rope", {"view_as_complex", "view_as_real", "polar", "cos", "sin", "mul", "cat", "stack"})
    if present & _GATHER_OPS:
        claim("gather-index", _GATHER_OPS)
    if left & _EXPLICIT_COPY_OPS and (kinds or left - _LAYOUT_OPS - _REDUCTION_OPS):
        kinds.add("copy")
    left -= _LAYOUT_OPS
    if left - _REDUCTION_OPS:
        kinds.add("modulation-elementwise")
    if left & _REDUCTION_OPS:
        kinds.add("other")  # a bare mean/sum/scan: no norm, softmax or quantization signature
    if not kinds:
        if ops:  # layout ops and casts only
            kinds.add("copy")
        elif kind == "poi":  # descriptive names off: still a pointwise kernel
            kinds.add("modulation-elementwise")
        else:
            kinds.add("other")
    return tuple(category for category in CATEGORIES if category in kinds)


def _parse_inductor(name: str) -> tuple[str, list[str]] | None:
    match = _INDUCTOR.search(name.strip())
    if match is None:
        return None
    return (match.group("kind") or "cpp"), _split_ops(match.group("ops"))


def fused_kinds(name: str) -> tuple[str, ...]:
    """Every kind of work one kernel does, in CATEGORIES order: for an inductor kernel, read off the aten ops
    in its name (`triton_poi_fused_add_mul_native_layer_norm_0` -> ("norm", "modulation-elementwise"));
    for any other kernel, the one kind `classify_name` gives it."""
    parsed = _parse_inductor(name)
    if parsed is None:
        return (classify_name(name),)
    return _inductor_kinds(*parsed)


ATTENTION_RANGE = "attention core"
# Ranges that claim every kernel launched inside them, except quantization: {label word: category}.
_RANGE_CLAIMS_ALL = {ATTENTION_RANGE: "attention"}
# Ranges that claim only the generic kernels (elementwise, copies, reductions) launched inside them.
_RANGE_CLAIMS_GENERIC = {"rope": "rope", "norm": "norm"}
_GENERIC = ("modulation-elementwise", "copy", "other")


def classify_name(name: str) -> str:
    if _GEMM_PREFIX.search(name):
        return "gemm"
    parsed = _parse_inductor(name)
    if parsed is not None:
        kinds = _inductor_kinds(*parsed)
        if parsed[0] == "tem":
            return "attention" if "attention" in kinds else "gemm"
        return min(kinds, key=_PRECEDENCE.index)
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return "other"


def is_fp8(name: str) -> bool:
    """Whether the kernel (or aten op) named `name` computes on FP8 operands."""
    return _FP8_NAME.search(name) is not None


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

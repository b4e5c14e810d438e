"""The named ranges of a block or a pipeline stage (`ModuleRange`), as data, and the block's derived from its
module types and names (`derive_ranges`); `profiling.ranges` wraps them for the per-module breakdown and for
Nsight Systems (NVTX)."""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

from torch import nn

ATTENTION_CORE = "attention core"  # `profiling.classify.ATTENTION_RANGE`: every kernel in it is attention
ATTENTION_REST = "attention (other)"  # an attention module's work outside its named parts
# That work by kind (`profiling.classify` categories): the processor's own tensor work, which a family may make
# large (Mochi joins each sample's valid text rows to the video rows, Wan-style processors apply RoPE in a
# nested function, HunyuanVideo 1.5 builds its S x S joint mask every call); what no kind names stays the rest.
ATTENTION_REST_BY_KIND = {
    "copy": "attention: copies and joins", "gather-index": "attention: copies and joins",
    "modulation-elementwise": "attention: elementwise (RoPE, masks)", "rope": "attention: elementwise (RoPE, masks)",
    "norm": "attention: norms",
}


def range_of_kind(label: str, category: str) -> str:
    """The range a kernel of `category` in range `label` is reported under: the attention module's rest split by
    kind, every other range as it is."""
    return ATTENTION_REST_BY_KIND.get(category, label) if label == ATTENTION_REST else label
ROPE_FUNCTIONS = ("apply_rotary_emb", "_apply_rotary_emb")
# Where processors that import diffusers' RoPE helper inside their call (HunyuanVideo's) find it at each call.
SHARED_ROPE = ("diffusers.models.embeddings", "apply_rotary_emb")
QKV = ("to_q", "to_k", "to_v", "to_qkv", "add_q_proj", "add_k_proj", "add_v_proj", "to_query", "to_key", "to_value")
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k", "query_norm", "key_norm")
FFN_NAMES = ("ff", "ffn", "ff_context", "mlp", "proj_mlp", "act_mlp", "feed_forward")
MODULATION_WORDS = ("AdaLayerNorm", "AdaNorm", "AdaLN", "Modulation")


@dataclass(frozen=True)
class ModuleRange:
    """A named range of the block, for the per-module breakdown and for Nsight Systems (NVTX).

    `modules` are attribute paths inside the block whose forward is wrapped; `functions` are (python module,
    attribute) pairs called inside the block (the attention dispatch, RoPE helpers of a diffusers model file),
    wrapped while profiling; an attribute may be dotted ("F.scaled_dot_product_attention": the module's `F`).
    """

    label: str
    modules: tuple[str, ...] = ()
    functions: tuple[tuple[str, str], ...] = ()


def _attention_entry(module_name: str) -> tuple[str, str] | None:
    """How attention processors defined in `module_name` reach the attention kernel: the model file's
    `dispatch_attention_fn`, or torch's SDPA through the file's `F`."""
    module = sys.modules[module_name]
    if callable(getattr(module, "dispatch_attention_fn", None)):
        return module_name, "dispatch_attention_fn"
    # `F`: torch.nn.functional, or the stand-in a routed backend puts there
    if callable(getattr(getattr(module, "F", None), "scaled_dot_product_attention", None)):
        return module_name, "F.scaled_dot_product_attention"
    return None


def _children(block: nn.Module) -> dict[str, nn.Module]:
    """The block's children by path, each child that holds attention modules without being one (nor an FFN)
    replaced by its own children, as deep as that goes: the parts the ranges are made of."""
    found: dict[str, nn.Module] = {}
    for name, child in block.named_children():
        holds_attention = any(getattr(m, "processor", None) is not None for m in child.modules())
        if holds_attention and getattr(child, "processor", None) is None and name not in FFN_NAMES:
            found.update({f"{name}.{path}": part for path, part in _children(child).items()})
        else:
            found[name] = child
    return found


def derive_ranges(block: nn.Module, softmax_modules: frozenset[str] | None = None,
                  cross_modules: frozenset[str] = frozenset()) -> tuple[ModuleRange, ...]:
    """The block's ranges from its module types and names: per diffusers attention module (one with a
    `processor`) its q/k/v (and added context) projections, qk-norms, output projections, the attention core
    (the processors' dispatch function) and the RoPE helpers their file calls; a cross-attention module whole;
    the feed-forward networks; the block's norms, its AdaLN modulation and its own linears, among the block's
    children and inside any child that holds attention modules without being one (Kandinsky 6's fused block keeps
    each modality's attention, feed-forward, norms and modulation in such a container). What no range covers is
    the block body (residuals, gates, the modulation's arithmetic). `softmax_modules`: the attention modules
    that made a softmax attention call in the model's forward (`capture`); another one computes a linear attention
    (SANA's) in its processor, with matmuls: its range is that, not leftovers. `cross_modules`: attention modules
    the capture saw attend to other rows than their queries' (Kandinsky 5's cross-attention has no
    `is_cross_attention`). A block that is itself an attention module (Wan Animate's face adapter, path "") is
    split into those parts like any other, not made one cross-attention range: it has no other parts."""
    children = _children(block)
    qkv, qk_norm, out, cross, attention, linear, ffn, norms, modulation, own = ([] for _ in range(10))
    entries: dict[tuple[str, str], None] = {}
    rope: dict[tuple[str, str], None] = {}
    for path, module in block.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        processor_module = type(processor).__module__
        entry = _attention_entry(processor_module)
        if entry is not None:
            entries[entry] = None
        for name in ROPE_FUNCTIONS:
            if callable(getattr(sys.modules[processor_module], name, None)):
                rope[(processor_module, name)] = None
        if SHARED_ROPE[1] in inspect.getsource(type(processor)):
            rope[SHARED_ROPE] = None
        if path and (getattr(module, "is_cross_attention", False) or path in cross_modules):
            cross.append(path)
            continue
        if softmax_modules is not None and path not in softmax_modules:
            linear.append(path)
        else:
            attention.append(path)
        parts = dict(module.named_children())
        prefix = f"{path}." if path else ""  # the block itself: its parts are the block's children
        qkv += [prefix + name for name in QKV if isinstance(parts.get(name), nn.Module)]
        qk_norm += [prefix + name for name in QK_NORMS if isinstance(parts.get(name), nn.Module)]
        to_out = parts.get("to_out")
        if isinstance(to_out, nn.ModuleList) and len(to_out):
            out.append(prefix + "to_out.0")
        elif isinstance(to_out, nn.Module):
            out.append(prefix + "to_out")
        elif isinstance(parts.get("out_layer"), nn.Linear):  # Kandinsky 5
            out.append(prefix + "out_layer")
        if isinstance(parts.get("to_add_out"), nn.Module):
            out.append(prefix + "to_add_out")
    claimed = {*attention, *cross, *linear, *qkv, *qk_norm, *out}
    for name, child in children.items():
        kind, last = type(child).__name__, name.rsplit(".", 1)[-1]
        if name in claimed:
            continue
        if last in FFN_NAMES or kind.endswith("FeedForward"):
            ffn.append(name)
        elif any(word in kind for word in MODULATION_WORDS):
            modulation.append(name)
        elif "Norm" in kind:
            norms.append(name)
        elif last == "proj_out" and isinstance(child, nn.Linear):  # single-stream blocks: attention + MLP out
            out.append(name)
        elif isinstance(child, nn.Linear):  # the block's own (Wan VACE's control projection into its stream)
            own.append(name)
    ranges = [
        ModuleRange(ATTENTION_REST, modules=tuple(attention)),
        ModuleRange("linear attention (no softmax)", modules=tuple(linear)),
        ModuleRange("qkv projection", modules=tuple(qkv)),
        ModuleRange("qk-norm", modules=tuple(qk_norm)),
        ModuleRange("rope", functions=tuple(rope)),
        ModuleRange(ATTENTION_CORE, functions=tuple(entries)),
        ModuleRange("output projection", modules=tuple(out)),
        ModuleRange("cross-attention", modules=tuple(cross)),
        ModuleRange("ffn", modules=tuple(ffn)),
        ModuleRange("norms", modules=tuple(norms)),
        ModuleRange("AdaLN modulation", modules=tuple(modulation)),
        ModuleRange("block linears", modules=tuple(own)),
    ]
    return tuple(r for r in ranges if r.modules or r.functions)

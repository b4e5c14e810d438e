"""The one attention vocabulary: the names `--attn` takes in profile-block and generate, and
`--backends` in bench-attention.

    NAME[+rope]

NAME is a backend of `backends.BACKENDS` (native, flash, cudnn, efficient, math, fa4, fp8, fp8-v1,
cudnn-fp8) or an alias:
  - `bf16`: generate's historic name for the model's own attention, left as it is; it means
    `native` (diffusers' default: torch SDPA, which picks its kernel) and is reported as typed.
`+rope` also swaps the fused RoPE Triton kernel into MiniMax-H3's attention (`patching.fused_rope`);
it applies to models (profile-block, generate), not to bench-attention, which times attention alone.

Kernel variants behind the fp8 names: `fp8` picks the sm_90 wgmma kernel on sm_90 and the v1
mma.sync kernel elsewhere; `fp8-v1` forces v1 (the kernels' own names are "sm90" and "mma_sync").
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .backends import BACKENDS, get_backend

ALIASES = {"bf16": "native"}
ROPE_OPTION = "rope"


@dataclass(frozen=True)
class AttentionChoice:
    """One parsed attention name. label: as written (reports and file names use it); backend: the
    registry name it resolves to; fused_rope: whether `+rope` was asked for."""

    label: str
    backend: str
    fused_rope: bool = False

    @property
    def is_default(self) -> bool:
        """The model's own attention, nothing swapped in (generate leaves such a model unpatched)."""
        return self.backend == "native" and not self.fused_rope


def parse_attention(text: str, *, allow_rope: bool = True) -> AttentionChoice:
    """'fp8+rope' -> AttentionChoice('fp8+rope', 'fp8', True); a UserError naming the known names."""
    label = text.strip()
    name, plus, option = label.partition("+")
    if plus and option != ROPE_OPTION:
        raise UserError(f"unknown option '+{option}' in attention {label!r}; the one option is +rope (fused RoPE)")
    if plus and not allow_rope:
        raise UserError(f"{label!r}: +rope swaps RoPE into a model; bench-attention times attention alone, "
                        f"so name the backend without it ({name})")
    backend = ALIASES.get(name, name)
    get_backend(backend)  # unknown names: one line listing the known ones
    return AttentionChoice(label, backend, bool(plus))


def parse_attention_list(text: str, *, allow_rope: bool = True) -> list[AttentionChoice]:
    """'cudnn, fp8,fp8+rope' -> three choices, in order; empty entries are skipped."""
    choices = [parse_attention(part, allow_rope=allow_rope) for part in text.split(",") if part.strip()]
    if not choices:
        raise UserError("no attention backend named; write e.g. cudnn,fp8")
    return choices


def vocabulary_help() -> str:
    """One line for --help: the names and the option."""
    aliases = ", ".join(f"{alias} (= {name})" for alias, name in ALIASES.items())
    return f"{', '.join(BACKENDS)}; alias {aliases}; add +rope for the fused RoPE kernel (MiniMax-H3)"

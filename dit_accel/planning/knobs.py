"""The knobs `dit-accel plan` predicts, declared once: each one's name as the tables show it, the recipe part that
turns it (`patching.recipe`'s vocabulary), and the model its prediction follows, in words. `measured` reads which
knobs a run's recipes turned from here, `plan --verify` builds each combination's recipe from here, and the plan's
table and plan.json describe each knob's model from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..attention.backends import TORCH_SDPA_KERNELS
from ..patching.recipe import Recipe, parse_recipe


@dataclass(frozen=True)
class Knob:
    name: str  # as the plan's tables show it
    recipe_part: str  # what turns it on in a recipe: the backend name, or "+option" after the baseline's backend
    turned_on: Callable[[Recipe], bool]
    model: str  # what the prediction does, in a line (plan.json's "models", the table's basis)


OUR_ATTENTION = "fp8"
KNOBS = (  # in the order the tables show them
    Knob("fp8-attention", OUR_ATTENTION, lambda r: r.backend == OUR_ATTENTION,
         "attention calls at our kernel's rate at the nearest crossover point (prep included), a key-padding call "
         "on its kept rows (plus its dropped queries at the measured rate and one read of its mask); calls routed to "
         "the baseline there and head dims other than 64/128 unchanged"),
    Knob("fp8-linear", "+fp8-linear", lambda r: r.fp8_linear,
         "FP8 linears' FLOPs at the FP8 GEMM ceiling x this run's linear GEMM efficiency, other matmuls as measured, "
         "plus their inputs' quantization (25 B/element eager, 5 compiled) at this run's best memory-bound rate"),
    Knob("compile", "+compile", lambda r: r.compile_mode is not None,
         "memory-bound kinds fused: linear inputs and outputs and attention q/k/v once (2 B/element), the tensors "
         "of convolutions and other matmuls, and the attention masks once, at this run's best memory-bound rate"),
)
KNOB_NAMES = tuple(k.name for k in KNOBS)
# The attention a baseline may run: torch's SDPA kernels (diffusers' default and the kernels it can be forced to),
# but `math`, the reference kernel no user runs a model on.
BASELINE_ATTENTION = tuple(name for name in TORCH_SDPA_KERNELS if name != "math")


def knobs_of(label: str) -> frozenset[str] | None:
    """The knobs a recipe label turns, or None for a recipe outside the vocabulary of predictions (another
    attention backend than a baseline's or ours)."""
    recipe = parse_recipe(label)
    if recipe.backend not in (OUR_ATTENTION, *BASELINE_ATTENTION):
        return None
    return frozenset(k.name for k in KNOBS if k.turned_on(recipe))


def recipe_of(knobs: frozenset[str], baseline_attention: str) -> str:
    """The recipe that turns `knobs` on, on `baseline_attention` (ours where a knob's part is the backend)."""
    backend = next((k.recipe_part for k in KNOBS if k.name in knobs and not k.recipe_part.startswith("+")),
                   baseline_attention)
    return backend + "".join(k.recipe_part for k in KNOBS if k.name in knobs and k.recipe_part.startswith("+"))

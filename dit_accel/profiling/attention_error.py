"""Attention-level error inside a block: the q, k, v the block really feeds its attention, and how
far each backend's output on them is from a high-precision reference.

Set beside the block output's error against the first backend, it shows whether the residual
stream damps the attention error (a block error well under the attention error) or amplifies it.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from torch import nn

from ..adapters import BlockAdapter
from ..attention.backends import BackendCannotServe, get_backend
from ..attention.reference import reference_attention, rel_rms_err
from .classify import ATTENTION_RANGE
from .ranges import wrapped_functions


def attention_functions(adapter: BlockAdapter) -> tuple[tuple[str, str], ...]:
    """The (python module, function) pairs through which the block's attention core is called."""
    return tuple(f for spec in adapter.module_ranges if spec.label == ATTENTION_RANGE for f in spec.functions)


@torch.no_grad()
def capture_attention_inputs(block: nn.Module, inputs: dict[str, Any],
                             adapter: BlockAdapter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, S, H, D] of the block's first attention call (its self- or joint attention): through diffusers'
    dispatch ([B, S, H, D]) or torch's SDPA ([B, H, S, D], transposed here). The forward stops at that call."""
    captured: list[tuple[torch.Tensor, ...]] = []

    class Captured(BaseException):  # not an Exception: a processor's own `except Exception` must not swallow it
        pass

    def recording(original: Callable) -> Callable:
        heads_major = getattr(original, "__name__", "") == "scaled_dot_product_attention"

        def record(query, key, value, *args, **kwargs):
            qkv = (query, key, value)
            if heads_major:
                qkv = tuple(x.transpose(1, 2) for x in qkv)
            captured.append(tuple(x.detach().clone() for x in qkv))
            raise Captured
        return record

    with wrapped_functions(attention_functions(adapter), recording), contextlib.suppress(Captured):
        block(**inputs)
    if not captured:
        raise RuntimeError(f"{type(block).__name__} made no attention call through {attention_functions(adapter)}")
    return captured[0]


# The attention check runs over groups of heads, each group's reference, outputs and error temporaries (5
# reference-dtype elements and one of q's a value) at most this many bytes: on a 16 GB card the whole-head check
# of a Wan 720p block (75600 rows, 40 heads) alone took 12 GiB, more than the block's forward.
CHECK_GROUP_BYTES = 2**30


def reference_dtype_of(q: torch.Tensor) -> torch.dtype:
    """The attention check's reference dtype: float64 on the CPU, float32 (no TF32) on a GPU, where float64 at
    block sizes takes minutes."""
    return torch.float32 if q.is_cuda else torch.float64


def heads_per_check_group(batch: int, rows: int, head_dim: int, element_bytes: int, reference_bytes: int) -> int:
    """Heads the attention check takes at once: as many as keep a group's temporaries within CHECK_GROUP_BYTES,
    at least one."""
    per_head = batch * rows * head_dim * (5 * reference_bytes + element_bytes)
    return max(1, CHECK_GROUP_BYTES // per_head)


def attention_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     backend_names: list[str]) -> tuple[dict[str, float | None], str]:
    """Relative RMS error of each backend on (q, k, v) against a reference (`reference_dtype_of`); and which
    reference. Heads are independent, so the check goes over groups of them (`heads_per_check_group`) and adds
    up the squared errors and norms: the same figure as over all heads at once, in a fraction of the memory.
    A backend that cannot take these tensors (its calls fell back inside the block) gets None.
    """
    dtype = reference_dtype_of(q)
    batch, rows, heads, head_dim = q.shape
    group = heads_per_check_group(batch, rows, head_dim, q.element_size(), torch.empty((), dtype=dtype).element_size())
    squared: dict[str, float | None] = dict.fromkeys(backend_names, 0.0)
    norm = 0.0
    for first in range(0, heads, group):
        q_g, k_g, v_g = (x[:, :, first:first + group] for x in (q, k, v))
        reference = reference_attention(q_g, k_g, v_g, dtype=dtype)
        norm += torch.linalg.vector_norm(reference).item() ** 2
        for name in backend_names:
            if squared[name] is None:
                continue
            try:
                output = get_backend(name).run(q_g, k_g, v_g)
            except BackendCannotServe:
                squared[name] = None
                continue
            squared[name] += torch.linalg.vector_norm(output.to(dtype) - reference).item() ** 2
    errors = {name: None if total is None else (total / norm) ** 0.5 if norm else math.nan
              for name, total in squared.items()}
    return errors, str(dtype).replace("torch.", "")


def output_error(output: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """An output (a block's, a stage's) against the reference backend's: relative L2 and cosine similarity."""
    out, ref = output.double().flatten(), reference.double().flatten()
    return {"rel_l2": rel_rms_err(out, ref), "cosine": torch.nn.functional.cosine_similarity(out, ref, dim=0).item()}

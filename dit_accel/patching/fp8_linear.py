"""FP8 linear layers of a video DiT block, through torchao (no FP8 GEMM of our own).

    from dit_accel.patching.fp8_linear import quantize_linears, fp8_linear_unavailable_reason

    reason = fp8_linear_unavailable_reason(device, dtype)     # before loading anything: None or one line
    swap = quantize_linears(block, adapter)                   # the block's large linears go FP8
    print(swap.summary_lines())                               # which went FP8, which stayed and why

What it does: `torchao.quantization.quantize_` with `Float8DynamicActivationFloat8WeightConfig(
granularity=PerRow())` on the linears the adapter's FP8 rule chose (`adapters.linears`: those that run on
the block's sequence rows and are large enough to pay; `fp8_linear_modules`, block-relative names, and
`fp8_bf16_linears`, those that stay in the block dtype, each with its reason). Each weight becomes a
torchao `Float8Tensor`: float8_e4m3fn data [out, in] and one float32 scale per output row (amax / 448).
Each call quantizes its input per row (one float32 scale per row, amax / 448) and runs
`torch._scaled_mm(x_fp8, w_fp8.t(), scale_a [rows, 1], scale_b [1, out], out_dtype=bf16)`, the bias added in
its epilogue. On the H200 (torch 2.11 cu130)
that is one cuBLASLt kernel, `nvjet_sm90_qqtst_128x128_128x6_..._ovscale_TNT` (outer-vector scales; its time
against bf16's: docs/benchmarks.md, "FP8 linears on the H3 block"). torchao's `KernelPreference.TORCH`
is pinned, so the engine does not change with whether the optional `mslk` package happens to be
installed (AUTO would switch to mslk's CUTLASS GEMM and Triton quantize kernel on sm_90).

Invariants a caller relies on:
- Weights and activations are bf16 (torchao's per-row path asserts bf16 weights; the GEMM writes the
  activation dtype). fp16 and fp32 blocks are refused.
- cuBLAS FP8 needs K (in_features) and N (out_features) to be multiples of 16; torchao would silently
  leave such a layer alone, so the policy refuses instead.
- Eagerly, the activation quantize is 8 ATen kernels before every GEMM (abs, amax, clamp, divide, casts),
  which cost more than the GEMM saves; under `torch.compile` inductor fuses them into one Triton reduction.
  Compile the block for speed (the figures: docs/benchmarks.md, "FP8 linears on the H3 block").
  A compiled quantized block must run under `torch.no_grad()` / `torch.inference_mode()`
  (`aten::_scaled_mm` has no derivative, and AOT autograd traces one when a parameter needs grad).
- Error: e4m3's 3 mantissa bits on both operands of each GEMM; the residual carries most of the block's output
  past it (the same section has both errors, and fast_accum's).
- torchao's global inductor settings (`set_inductor_config`, e.g. coordinate-descent tuning) are NOT
  applied: they would change every later compile in the process, FP8 or not.
- `activation_value_lb` is a tiny floor on each row's amax: without it an all-zero input row gets a
  scale of 0 and comes out NaN (0/0) in torchao 0.18; with it the row comes out 0.

Not reversible in place: torchao replaces each weight Parameter by a tensor subclass. The caller
quantizes a block it owns (profile-block builds a fresh block per recipe, or quantizes last).
`keep_original=True` keeps the bf16 Parameters so `Fp8LinearSwap.restore()` puts them back: cheap for
one profiled block (its bf16 weights stay alive: 0.77 GiB for an H3 block), but for a whole model it
keeps both copies and so undoes the memory FP8 saves, hence off by default.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..device import FP8_MIN_CAPABILITY
from ..errors import UserError

GEMM_MULTIPLE = 16  # cuBLAS FP8 GEMMs need K and N to be multiples of 16 (torchao's `_fp8_mm_compat`)
ACTIVATION_AMAX_FLOOR = 1e-12  # a row's amax floor: an all-zero row gets a tiny scale, not 0 (0/0 = NaN)
INSTALL_HINT = "pip install 'dit-accel[fp8]'"
ENGINE = "torchao 0.18 Float8Tensor, per-row scales -> torch._scaled_mm (e4m3 x e4m3 -> bf16)"


def _torchao_missing() -> str | None:
    try:
        import torchao.quantization  # noqa: F401
    except ImportError as exc:
        return f"FP8 linear layers need torchao, which is not importable ({exc}); {INSTALL_HINT}"
    return None


def fp8_linear_unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why FP8 linears cannot run on `device` with blocks in `dtype`, in one line ending with what to do,
    or None when they can. Cheap (imports torchao, loads nothing): the CLI calls it before building a block."""
    device = torch.device(device)
    if device.type != "cuda":  # first: on a CPU, no --dtype would help
        return (f"FP8 linear layers need a CUDA GPU with FP8 tensor cores (compute capability "
                f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+: L4/L40/RTX 4090, H100/H200, B200); {device} has "
                "none; run on such a GPU or leave FP8 linears off")
    if dtype != torch.bfloat16:
        return (f"FP8 linear layers need a bfloat16 block (torchao's per-row float8 path takes bf16 weights "
                f"and activations), not {str(dtype).removeprefix('torch.')}; pass --dtype bf16")
    if not torch.cuda.is_available():
        return f"{device} asked for, but this machine has no CUDA GPU; run on one with FP8 tensor cores"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"{name} (sm_{capability[0]}{capability[1]}) has no FP8 tensor cores (FP8 GEMMs need compute "
                f"capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+); leave FP8 linears off on this GPU")
    return _torchao_missing()


# --- which linears ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearChoice:
    """One nn.Linear of the block: its name, GEMM dims, and why it stays unquantized (None: it goes FP8)."""

    name: str
    in_features: int  # K of the GEMM
    out_features: int  # N of the GEMM
    reason: str | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "in_features": self.in_features, "out_features": self.out_features,
                "reason": self.reason}


@dataclass(frozen=True)
class Fp8LinearPlan:
    """Every nn.Linear of the module, split into those that go FP8 and those that stay (with reasons)."""

    family: str
    chosen: tuple[LinearChoice, ...]
    kept: tuple[LinearChoice, ...]

    @property
    def chosen_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.chosen)


def _policy(policy: Any) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """(family, FP8 patterns, {bf16 pattern: reason}) of an adapter (class or instance)."""
    try:
        return policy.family, tuple(policy.fp8_linear_modules), dict(policy.fp8_bf16_linears)
    except AttributeError as exc:
        raise TypeError(f"{policy!r} is not a block adapter with an FP8 linear policy ({exc})") from exc


def plan_fp8_linears(module: nn.Module, policy: Any, *, prefix: str = "") -> Fp8LinearPlan:
    """Which linears of `module` the family's policy puts in FP8, and why each other one stays.

    `policy` is a `BlockAdapter`: `fp8_linear_modules` and `fp8_bf16_linears` are fnmatch patterns of
    block-relative names (the names its FP8 rule chose and kept). For a whole model pass `prefix`, the
    block's name pattern in it (e.g. `adapter.block_key_template.format(index="*")`); linears outside it stay.
    Works on the meta device (names and shapes only), so it can refuse a policy before any weights load.
    Raises UserError
    when a chosen layer's dims cannot go through an FP8 GEMM, or when the policy's names match no linear of
    `module` (a rule that chose none, as for a stack on the text alone, plans none).
    """
    family, fp8_patterns, bf16_patterns = _policy(policy)
    chosen, kept, bad = [], [], []
    for name, linear in module.named_modules():
        if not isinstance(linear, nn.Linear):
            continue
        k, n = linear.in_features, linear.out_features

        def keep(reason: str) -> None:
            kept.append(LinearChoice(name, k, n, reason))

        if prefix and not fnmatch.fnmatchcase(name, prefix + "*"):
            keep(f"outside the blocks ({prefix}*): the {family} FP8 policy covers block linears only")
            continue
        # Block-relative name: drop as many dotted parts as the prefix has ("transformer_blocks.*." -> 2).
        relative = name.split(".", prefix.rstrip(".").count(".") + 1)[-1] if prefix else name
        bf16_reason = next((r for p, r in bf16_patterns.items() if fnmatch.fnmatchcase(relative, p)), None)
        if bf16_reason is not None:
            keep(bf16_reason)
        elif not any(fnmatch.fnmatchcase(relative, p) for p in fp8_patterns):
            keep(f"not a linear of the {family} block that the FP8 rule chose")
        elif k % GEMM_MULTIPLE or n % GEMM_MULTIPLE:
            bad.append(f"{name} [{k} -> {n}]")
        elif linear.weight.device.type != "meta" and bool((linear.weight.detach().abs().amax(dim=1) == 0).any()):
            keep("has an all-zero output row: its per-row weight scale would be 0 and the column NaN")
        else:
            chosen.append(LinearChoice(name, k, n))
    if bad:
        raise UserError(f"cannot put {', '.join(bad)} in FP8: cuBLAS FP8 GEMMs need in and out features that are "
                        f"multiples of {GEMM_MULTIPLE}; leave FP8 linears off for this config")
    if not chosen and fp8_patterns:
        raise UserError(f"the {family} FP8 policy matches no nn.Linear in this {type(module).__name__}; "
                        "check that the module is one of its blocks (or pass prefix= for a whole model)")
    return Fp8LinearPlan(family, tuple(chosen), tuple(kept))


# --- the swap -----------------------------------------------------------------------------------------
@dataclass
class Fp8LinearSwap:
    """What `quantize_linears` did: the linears now in FP8, those left alone and why, and their weight bytes.

    `weight_bytes_before` / `weight_bytes_after` cover the quantized linears only (bf16 weights vs e4m3
    data plus float32 row scales). `restore()` works when the swap kept the original weights.
    """

    family: str
    quantized: tuple[LinearChoice, ...]
    kept: tuple[LinearChoice, ...]
    weight_bytes_before: int
    weight_bytes_after: int
    fast_accum: bool
    engine: str = ENGINE
    _module: nn.Module | None = field(default=None, repr=False)
    _originals: dict[str, nn.Parameter] | None = field(default=None, repr=False)

    @property
    def quantized_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.quantized)

    @property
    def kept_reasons(self) -> dict[str, str]:
        return {c.name: c.reason or "" for c in self.kept}

    @property
    def reversible(self) -> bool:
        return self._originals is not None

    def restore(self) -> None:
        """Put the original bf16 weights back (only with `keep_original=True`); a second call does nothing."""
        if self._originals is None:
            raise RuntimeError("this FP8 swap did not keep the original weights (keep_original=False): "
                               "torchao replaced them in place; build the block again")
        for name, weight in self._originals.items():
            linear = self._module.get_submodule(name)
            linear.weight = weight
            linear.__dict__.pop("extra_repr", None)  # torchao binds a per-instance extra_repr
        self._originals = {}

    def as_dict(self) -> dict:
        return {"family": self.family, "engine": self.engine, "fast_accum": self.fast_accum,
                "quantized": [c.as_dict() for c in self.quantized], "kept": [c.as_dict() for c in self.kept],
                "weight_bytes_before": self.weight_bytes_before, "weight_bytes_after": self.weight_bytes_after}

    def summary_lines(self) -> list[str]:
        gib = 2**30
        lines = [f"FP8 linears ({self.engine}, fast_accum={self.fast_accum}): {len(self.quantized)} quantized, "
                 f"weights {self.weight_bytes_before / gib:.3f} GiB -> {self.weight_bytes_after / gib:.3f} GiB"]
        lines += [f"  fp8   {c.name} [{c.in_features} -> {c.out_features}]" for c in self.quantized]
        lines += [f"  kept  {c.name} [{c.in_features} -> {c.out_features}]: {c.reason}" for c in self.kept]
        return lines


def _fp8_config(fast_accum: bool):
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
    from torchao.quantization.quantize_.common import KernelPreference

    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), mm_config=Float8MMConfig(use_fast_accum=fast_accum),
        kernel_preference=KernelPreference.TORCH, activation_value_lb=ACTIVATION_AMAX_FLOOR,
        set_inductor_config=False)


def quantize_linears(module: nn.Module, policy: Any, *, prefix: str = "", fast_accum: bool = True,
                     keep_original: bool = False) -> Fp8LinearSwap:
    """Quantize the large linears of `module` (a block, or a model with `prefix`) to FP8 in place.

    `policy`: the family's `BlockAdapter` (class or instance). `fast_accum`: cuBLAS FP8 fast accumulation
    (torchao's default; on sm_90 it skips the periodic promotion of partial sums to fp32). Refuses with a
    UserError when torchao is missing, the device has no FP8 GEMMs, a chosen weight is not bf16 or a chosen
    layer's dims are not multiples of 16. Returns what was quantized and what was left alone, with reasons.
    """
    plan = plan_fp8_linears(module, policy, prefix=prefix)
    weights = {c.name: module.get_submodule(c.name).weight for c in plan.chosen}
    if not weights:  # the rule chose none (a stack on the text alone): nothing to swap, where FP8 GEMMs run
        reason = fp8_linear_unavailable_reason(next(module.parameters()).device, torch.bfloat16)
        if reason:
            raise UserError(reason)
        return Fp8LinearSwap(plan.family, (), plan.kept, 0, 0, fast_accum, _module=module,
                             _originals={} if keep_original else None)
    first = next(iter(weights.values()))
    reason = fp8_linear_unavailable_reason(first.device, first.dtype)
    if reason:
        raise UserError(reason)
    for name, weight in weights.items():
        if weight.dtype != torch.bfloat16 or weight.device != first.device:
            raise UserError(f"{name} holds a {str(weight.dtype).removeprefix('torch.')} weight on {weight.device}; "
                            "FP8 linear layers need every chosen weight in bfloat16 on one GPU: pass --dtype bf16")
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    from ..loading.block import tensor_bytes

    before = sum(w.numel() * w.element_size() for w in weights.values())
    chosen = set(plan.chosen_names)
    with torch.no_grad():
        quantize_(module, _fp8_config(fast_accum), filter_fn=lambda _m, fqn: fqn in chosen)
    after, missed = 0, []
    for name in plan.chosen_names:
        weight = module.get_submodule(name).weight
        if not isinstance(weight, Float8Tensor):
            missed.append(name)
            continue
        after += tensor_bytes(weight)
    if missed:  # torchao leaves a layer alone silently when it cannot take it
        raise UserError(f"torchao did not quantize {', '.join(missed)}; check the torchao version "
                        f"(dit-accel pins 0.18.0: {INSTALL_HINT})")
    return Fp8LinearSwap(plan.family, plan.chosen, plan.kept, before, after, fast_accum, _module=module,
                         _originals=weights if keep_original else None)

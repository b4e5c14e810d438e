"""What a profile-block session will need in memory, worked out from the config and the workload
before anything large is allocated (`estimate_session`), and the check against the room there is
(`check_fits`: the GPU's free memory and `--memory-budget`, or the host's available memory on the
CPU), which refuses in one line that says how much and what to lower.

Model (bytes; B batch, S rows, D hidden, I = heads x head dim, e the dtype's bytes, r the
attention reference's bytes: 8 on the CPU, 4 on a GPU):

- weights: the block's parameters in the dtypes a load gives them (exact, from a meta-device block),
  plus the transformer without its blocks (counted the same way): every run builds it with one block per
  stack to capture the block's inputs from the model's own forward, and `--outside measure` times it; both
  are freed before the block is built, so counting both is an upper bound;
- inputs: hidden states B*S*D*e, RoPE cos/sin S*2*head_dim*4, indices and positions ~64 B a row;
- forward: the transient peak of one forward, B*S*D*e*FORWARD_ELEMENTS[device] (+ the S x S
  scores twice over, for a `math` recipe), and the weights once more for FP8-linear or compiled
  recipes (an upper bound: FP8 linears keep the bf16 weights beside their e4m3 copies, half their
  bytes; a compiled block's buffers are inductor's);
- profiling: the reference and current outputs kept (2*B*S*D*e), then the attention check: the
  block's own q/k/v (3*B*S*I*e), and per group of heads (`attention_error.heads_per_check_group`, I_g =
  its heads x head dim) k, v and the output in the reference dtype (3*B*S*I_g*r), two chunks of scores
  (each at most REFERENCE_CHUNK_SCORES, `attention.reference`), the backend's output and the error's
  temporaries in the reference dtype (B*S*I_g*(e + 2r));
- validate: the chain's other blocks ((N-1) x weights on the CPU; on a GPU the chain holds what
  fits and cycles, so only one more block when streaming: in FP8 where the first recipe has FP8 linears,
  `streamed_block_bytes`); `--validate model` holds every block
  resident ((N-1) x weights, no cycling) or streams them (one more block), and beside them the
  transformer without its blocks (counted as `outside`, here held together with the block and the
  chain; streamed too, since only the block stacks stream and the rest stays on the GPU). Its
  forward's activations are taken as the block's: not yet calibrated on a GPU.

total = (weights + inputs + kept outputs + max(forward, attention check) + validate) * (1 +
MARGIN) + FIXED_BYTES.

FORWARD_ELEMENTS (per device), MARGIN and FIXED_BYTES come from the calibration docs/profile-block.md ("Memory")
records: CPU peaks of scaled-down sessions (`measured_peak_bytes`) and the H3 block's GPU peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..adapters.stage_specs import StageSpec
from ..attention.reference import REFERENCE_CHUNK_SCORES
from ..errors import UserError
from ..loading.block import loaded_param_bytes
from ..headroom import FIXED_BYTES, MARGIN, GiB, memory_room
from .attention_error import heads_per_check_group
from .outside import outside_weight_bytes

if TYPE_CHECKING:
    from .session import ProfileSettings

# Transient peak of one forward, in elements of the block's dtype per row and per hidden unit.
FORWARD_ELEMENTS = {"cpu": 22.0, "cuda": 14.0}


@dataclass(frozen=True)
class MemoryEstimate:
    """A session's memory, by what holds it (bytes, before the margin), and the total with it."""

    weights_bytes: int
    inputs_bytes: int
    forward_bytes: int  # one forward's transient peak (and what an FP8-linear or compiled recipe adds)
    profiling_bytes: int  # kept outputs, then the attention check: what profiling adds to a plain run
    validate_bytes: int  # the --validate pass's other blocks
    device_kind: str
    outside_bytes: int = 0  # --outside measure: the transformer without its blocks (its weights)

    @property
    def total_bytes(self) -> int:
        held = self.weights_bytes + self.outside_bytes + self.inputs_bytes + self.validate_bytes
        return int((held + max(self.forward_bytes, self.profiling_bytes)) * (1 + MARGIN) + FIXED_BYTES)

    def breakdown(self) -> str:
        """What holds the memory, in GiB before the margin; the forward and the attention check come
        one after the other, so the total takes the larger of the two."""
        parts = [f"weights {self.weights_bytes / GiB:.2f} GiB",
                 f"inputs and activations {(self.inputs_bytes + self.forward_bytes) / GiB:.2f} GiB",
                 f"then profiling's kept outputs and attention check {self.profiling_bytes / GiB:.2f} GiB"]
        if self.outside_bytes:
            parts.insert(1, f"the transformer without its blocks {self.outside_bytes / GiB:.2f} GiB")
        if self.validate_bytes:
            parts.append(f"--validate's other blocks {self.validate_bytes / GiB:.2f} GiB")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"weights_bytes": self.weights_bytes, "inputs_bytes": self.inputs_bytes,
                "forward_bytes": self.forward_bytes, "profiling_bytes": self.profiling_bytes,
                "validate_bytes": self.validate_bytes, "outside_bytes": self.outside_bytes, "margin": MARGIN,
                "fixed_bytes": FIXED_BYTES, "total_bytes": self.total_bytes, "device_kind": self.device_kind,
                "summary": self.breakdown()}


def block_weight_bytes(settings: "ProfileSettings") -> int:
    """The block's parameters in the dtypes a load gives them, counted on a meta-device block."""
    s = settings
    prefix = s.adapter.block_prefix(s.block_index) if s.block_index < s.adapter.num_blocks else ""
    return loaded_param_bytes(s.adapter.build_block(), s.adapter, s.dtype, prefix)


def streamed_block_bytes(settings: "ProfileSettings", weights: int) -> int:
    """One streamed block of the --validate pass on the device: its `weights`, or where the first recipe has FP8
    linears (built into the streamed blocks) with the chosen linears' e4m3 codes and per-row fp32 scales in
    place of their weights (the family's FP8 plan on a meta-device block)."""
    from ..patching.fp8_linear import plan_fp8_linears

    if not settings.recipes[0].fp8_linear:
        return weights
    e = torch.empty((), dtype=settings.dtype).element_size()
    chosen = plan_fp8_linears(settings.adapter.build_block(), settings.adapter).chosen
    return weights - sum(c.in_features * c.out_features * (e - 1) - 4 * c.out_features for c in chosen)


def estimate_session(settings: "ProfileSettings", weights_bytes: int | None = None,
                     outside_bytes: int | None = None) -> MemoryEstimate:
    s = settings
    kind = "cuda" if s.device.type == "cuda" else "cpu"
    e = torch.empty((), dtype=s.dtype).element_size()
    r = 4 if kind == "cuda" else 8
    batch, rows, hidden = s.workload.batch, s.workload.seq_len, s.adapter.hidden_size
    heads, head_dim = s.adapter.attention_heads
    inner = heads * head_dim
    weights = block_weight_bytes(s) if weights_bytes is None else weights_bytes
    tokens = batch * rows

    inputs = tokens * hidden * e + rows * (2 * head_dim * 4 + 64)
    forward = tokens * hidden * e * FORWARD_ELEMENTS[kind]
    if any(recipe.backend == "math" for recipe in s.recipes):
        calls = s.adapter.attention_calls(s.workload)  # None: a forward that cannot run on meta (FramePack)
        scores = (max(call.batch * call.heads * call.q_len * call.kv_len for call in calls)  # one call at a time
                  if calls else batch * heads * rows * rows)
        forward += 2 * scores * e
    if any(recipe.fp8_linear or recipe.compile_mode for recipe in s.recipes):
        forward += weights
    # The check's group of heads, and the reference's scores per chunk: whole rows, at most
    # REFERENCE_CHUNK_SCORES unless one row is more.
    group_heads = min(heads, heads_per_check_group(batch, rows, head_dim, e, r))
    group_inner = group_heads * head_dim
    chunk_scores = min(group_heads * rows * rows, max(REFERENCE_CHUNK_SCORES, group_heads * rows))
    kept_outputs = 2 * tokens * hidden * e
    attention_check = (3 * tokens * inner * e + 3 * tokens * group_inner * r + 2 * chunk_scores * r
                       + tokens * group_inner * (e + 2 * r))
    validate = 0
    if s.validate_blocks > 1:
        if s.offload == "stream":
            validate = streamed_block_bytes(s, weights)
        elif kind == "cpu" or s.validate_model:  # all N held: no cycling
            validate = (s.validate_blocks - 1) * weights
    if outside_bytes is None:
        outside_bytes = outside_weight_bytes(s.adapter, s.dtype)  # built for the capture of the block's inputs
    return MemoryEstimate(int(weights), int(inputs), int(forward), int(kept_outputs + attention_check), int(validate),
                          kind, int(outside_bytes))


def _rows_that_fit(settings: "ProfileSettings", weights: int, room: int, outside: int | None = None) -> int:
    """The largest --seq-len (same batch) whose estimate fits in `room` bytes; 0 if none does. `outside`: the
    bytes outside the blocks (None: the estimate's own)."""
    import dataclasses

    def fits(rows: int) -> bool:
        workload = dataclasses.replace(settings.workload, seq_len=rows)
        return estimate_session(dataclasses.replace(settings, workload=workload), weights, outside).total_bytes <= room

    low, high = 0, settings.workload.seq_len
    while low < high:  # the estimate grows with rows: bisect
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _check_stages(settings: "ProfileSettings", block_bytes: int, room: int, where: str,
                  budget_bytes: int | None) -> None:
    """A UserError naming the first --stages stage that cannot fit: a stage runs after the block's
    recipes, beside the block's weights (which stay for the --validate chain), one stage at a time."""
    from .stage_profile import stage_memory

    for spec in settings.stages:
        if not isinstance(spec, StageSpec):  # a StageSkip
            continue
        weights, activations = stage_memory(spec, settings.dtype)
        need = int((block_bytes + weights + activations) * (1 + MARGIN) + FIXED_BYTES)
        if need <= room:
            continue
        larger = "raise --memory-budget" if budget_bytes is not None and room == budget_bytes else "use a larger device"
        raise UserError(f"the {spec.title} stage ({spec.model_name}; {spec.workload}) needs about {need / GiB:.1f} GiB "
                        f"(its weights {weights / GiB:.2f} GiB, one run's activations {activations / GiB:.2f} GiB "
                        f"[{spec.activation_source}], the block's weights {block_bytes / GiB:.2f} GiB, "
                        f"+{MARGIN:.0%}): it does not fit in {where}; drop {spec.key} from --stages, or {larger}")


def check_fits(settings: "ProfileSettings", budget_bytes: int | None = None,
               budget_text: str | None = None) -> MemoryEstimate:
    """The session's estimate; a UserError (one line: how much, where it does not fit, what to
    lower) when it exceeds the budget, the GPU's free memory, or the host's available memory."""
    s = settings
    estimate = estimate_session(s)
    found = memory_room(s.device, budget_bytes, budget_text)
    if found is None:
        return estimate
    room, where = found
    _check_stages(s, estimate.weights_bytes, room, where, budget_bytes)
    if estimate.total_bytes <= room:
        return estimate
    w = s.workload
    what = (f"the {s.adapter.display_name} block at S={w.seq_len} (batch {w.batch}) needs about "
            f"{estimate.total_bytes / GiB:.1f} GiB ({estimate.breakdown()}, +{MARGIN:.0%}): it does not fit in {where}")
    fixed = (estimate.weights_bytes + estimate.outside_bytes + estimate.validate_bytes) * (1 + MARGIN) + FIXED_BYTES
    if fixed > room:
        lower = "raise --memory-budget" if budget_bytes is not None and room == budget_bytes else "use a larger device"
        if s.validate_model and s.offload == "resident":
            instead = ("add --offload stream (the blocks from pinned host memory, one block ahead)"
                       if s.device.type == "cuda" else "drop --validate model")
            lower = f"{instead}, or {lower}"
            held = f"the whole transformer ({s.validate_blocks} blocks and the parts outside them) resident"
        elif s.validate_blocks > 1:
            lower = f"lower --validate, or {lower}"
            held = "its weights and the chain"
        else:
            held = "its weights"
        raise UserError(f"{what}; {held} alone take{'s' if s.validate_model else ''} {fixed / GiB:.2f} GiB: {lower}")
    rows = _rows_that_fit(s, estimate.weights_bytes, room, estimate.outside_bytes)
    hint = f"lower --seq-len (about {rows} fits)" if rows else "lower --seq-len"
    if w.batch > 1:
        hint += " or --batch"
    if budget_bytes is not None and room == budget_bytes:
        hint += ", or raise --memory-budget"
    raise UserError(f"{what}; {hint}")


def measured_peak_bytes(fn: Callable[[], object]) -> int | None:
    """The process's resident-memory high-water mark while `fn()` ran, above its resident memory
    before: Linux only (VmHWM, reset through /proc/self/clear_refs); None elsewhere. Used to
    calibrate the CPU estimate."""
    status = Path("/proc/self/status")

    def read(field: str) -> int:
        for line in status.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise OSError(field)

    try:
        before = read("VmRSS:")
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    fn()
    return read("VmHWM:") - before

"""`--validate`: time one pass built from real blocks (synthetic weights) to check the extrapolation.
`--validate N` chains N blocks on the block's inputs; `--validate model` runs the whole transformer:
its parts outside the blocks (`synthetic_outside`) with the blocks put in as its block stack, on the
pass the block is one block of. With `--offload stream` the blocks live in host memory and stream
onto the GPU (the parts outside them stay on it). `--validate model --cache`: the whole transformer through every
step and pass of the video under a step cache (`time_cached_video`)."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..adapters import BlockAdapter, Workload
from ..loading.block import param_bytes, synthetic_block, synthetic_outside, tensor_bytes
from ..loading.offload import StreamedRun, host_to_device_gbps, pin_to_host, stream_blocks
from ..patching.apply import apply_recipe, compile_failures_as_user_errors, dynamo_counts
from ..patching.fp8_linear import quantize_linears
from ..patching.recipe import Recipe
from ..patching.step_cache import apply_step_cache
from ..timing import time_region, wall_seconds
from .extrapolate import CachedVideo, Validation
from .progress import NO_PROGRESS, SessionProgress

if TYPE_CHECKING:
    from ..patching.step_cache import AppliedCache, CacheSpec

# Activation headroom kept free when deciding how many distinct blocks fit: the single-block peak
# minus its weights, times this factor.
_HEADROOM = 1.5


def distinct_blocks_that_fit(n: int, block_bytes: int, activation_bytes: int, device: torch.device) -> int:
    """How many of the N blocks can be held at once (all N on a GPU with room; fewer on a small one)."""
    if device.type != "cuda":
        return n
    free_bytes, _ = torch.cuda.mem_get_info(device)
    total_bytes = torch.cuda.get_device_properties(device).total_memory
    budget_cap = torch.cuda.get_per_process_memory_fraction(device) * total_bytes
    room = min(free_bytes, budget_cap - torch.cuda.memory_allocated(device)) - _HEADROOM * activation_bytes
    return max(1, min(n, int(room // block_bytes)))


class BlockChain(nn.Module):
    """Blocks run one after another, each one's output feeding the next (a transformer's block stack) through
    the blocks' `argument` (`hidden_states` in most diffusers blocks; Kandinsky 5's take `x`, `visual_embed`). A
    block that returns several streams (LTX-2's video and audio, HunyuanVideo's video and text, a VACE block's
    skip and control) feeds its first on and the next block gets the others as the first one did: the same
    shapes, so the same work."""

    def __init__(self, blocks: list[nn.Module], argument: str = "hidden_states"):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.argument = argument

    def forward(self, hidden_states: torch.Tensor, n: int | None = None, **rest: Any) -> torch.Tensor:
        """Runs `n` blocks (default: all), cycling through the held ones when n is larger."""
        for i in range(len(self.blocks) if n is None else n):
            out = self.blocks[i % len(self.blocks)](**{self.argument: hidden_states}, **rest)
            hidden_states = out[0] if isinstance(out, tuple) else out
        return hidden_states


@dataclass
class ValidationStack:
    """What a --validate pass runs. model: the module called (a `BlockChain`, or the whole
    transformer); blocks: its block stack (an nn.ModuleList), where the recipe goes (the parts outside the
    blocks keep diffusers' default attention, eager, as the outside measurement ran them); distinct: the
    blocks held; streamed_bytes: what one pass copies from host memory (0: resident)."""

    model: nn.Module
    blocks: nn.Module
    distinct: int
    streamed_bytes: int


def build_stack(adapter: BlockAdapter, first_block: nn.Module, n: int, *, device: torch.device, dtype: torch.dtype,
                activation_bytes: int, offload: str = "resident", whole_model: bool = False, fp8_linear: bool = False,
                seed: int = 0, progress: SessionProgress = NO_PROGRESS) -> ValidationStack:
    """The blocks of a --validate pass, in a `BlockChain` of `n` blocks of the adapter's stack or
    (`whole_model`) in the transformer, every stack full.

    resident: `first_block` (the profiled one, first in its stack) and fresh synthetic blocks (speed does not
    depend on the values, as long as they are not zeros) held on the device; for a chain, when fewer than `n`
    fit, they are cycled through (the whole model holds all its blocks: the memory check refuses it when they
    do not fit). stream: fresh synthetic blocks, each built on the device and moved to pinned host memory,
    streamed back one block at a time, the next prefetched while one runs (`offload.stream_blocks`, the same
    for the chain and the whole model; the parts outside the blocks stay on the device). `fp8_linear`: each
    block's linears go to FP8 as it is built (`quantize_linears`, on the device, so a streamed block keeps and
    copies one byte a weight), and the first block is a fresh one too (the profiled block keeps its bf16 weights).
    """
    stacks = adapter.stacks if whole_model else [(adapter.stack, n)]
    if offload == "stream":
        distinct = n
    elif whole_model:
        distinct = sum(count for _, count in stacks)
    else:
        distinct = distinct_blocks_that_fit(n, param_bytes(first_block), activation_bytes, device)
    lists: dict[str, nn.ModuleList] = {}
    with progress.stage(f"validation: building {distinct} blocks" + (" in host memory" if offload == "stream" else ""),
                        distinct) as built:
        for name, count in stacks:
            stack_adapter = adapter.for_stack(name)
            blocks = []
            for i in range(count if whole_model or offload == "stream" else distinct):
                if name == adapter.stack and i == 0 and offload != "stream" and not fp8_linear:
                    block = first_block  # the profiled block is the first of its stack
                else:  # one block on the device at a time while streaming
                    block = synthetic_block(stack_adapter, i % stack_adapter.num_blocks, device, dtype,
                                            seed=seed + i).block
                    if fp8_linear:
                        quantize_linears(block, stack_adapter)
                    if offload == "stream":
                        pin_to_host(block, pin=device.type == "cuda")
                blocks.append(block)
                built()
            lists[name] = nn.ModuleList(blocks)
    if whole_model:
        with progress.stage("validation: the transformer's parts outside the blocks (synthetic weights)"):
            model = synthetic_outside(adapter, device, dtype, seed=seed)
            for name, blocks in lists.items():
                setattr(model, name, blocks)  # under its checkpoint name, which the forward runs in order
        # The model's own stack, or every stack's blocks in order where there are several.
        stack = next(iter(lists.values())) if len(lists) == 1 else nn.ModuleList(
            [block for blocks in lists.values() for block in blocks])
    else:
        model = BlockChain(list(lists[adapter.stack]), adapter.sequence_argument)
        stack = model.blocks
    streamed_bytes = stream_blocks(model, device) if offload == "stream" else 0
    return ValidationStack(model, stack, distinct, streamed_bytes)


def session_bytes_used(stack: ValidationStack, first_block: nn.Module, inputs: dict[str, Any],
                       device: torch.device) -> int:
    """Bytes of what the profiling session held before the --validate pass that the pass uses: the profiled
    block, where it is the stack's first (resident and bf16), and the block's inputs a chain runs on. The rest the
    session holds through the pass (the profiled block beside a streamed or FP8 stack, the block's inputs beside
    the whole model's own, its other buffers) is no part of a pass a user runs: on the H200 it was 1.5 GiB of the
    H3 and Wan streamed passes' peaks."""
    block = (param_bytes(first_block) + sum(tensor_bytes(b) for b in first_block.buffers())
             if any(b is first_block for b in stack.blocks) else 0)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.device.type == device.type}
    return block + sum(storages.values())


def validate_chain(adapter: BlockAdapter, first_block: torch.nn.Module, inputs: dict[str, Any], n: int, *,
                   recipe: Recipe, device: torch.device, dtype: torch.dtype, block_ms: float,
                   activation_bytes: int, offload: str = "resident", whole_model: Workload | None = None,
                   outside_ms: float = 0.0, outside_source: str | None = None, warmup: int = 1, runs: int = 3,
                   cache: CacheSpec | None = None, steps: int = 1, passes_per_step: int = 1,
                   seed: int = 0, progress: SessionProgress = NO_PROGRESS) -> Validation:
    """Time one pass of `n` blocks, all under `recipe` (`build_stack` holds them, its FP8 linears in them; compiled,
    block by block, as the profiled block was).

    Without `whole_model`: the blocks chained on the block's `inputs`, against n x block_ms. With it
    (the block profile's workload): the whole transformer's forward on that workload's pass
    (`adapter.make_transformer_inputs`), against n x block_ms + outside_ms (`outside_source` says
    where that came from); with `cache` too, the whole video of `steps` x `passes_per_step` such passes under that
    step cache (`time_cached_video`), a pass averaged over it. Streamed, the report also compares with the resident
    extrapolation and says how much copying was hidden. On a GPU the pass's own peak memory over the timed passes is
    kept.
    """
    cuda = device.type == "cuda"
    held_before = 0
    if cuda:  # what the session holds now, its garbage collected first, lest the pass's peak be net of it
        gc.collect()
        held_before = torch.cuda.memory_allocated(device)
    stack = build_stack(adapter, first_block, n, device=device, dtype=dtype, activation_bytes=activation_bytes,
                        offload=offload, whole_model=whole_model is not None, fp8_linear=recipe.fp8_linear, seed=seed,
                        progress=progress)
    if whole_model is None:
        name = adapter.sequence_argument
        hidden = inputs[name]
        rest = {k: v for k, v in inputs.items() if k != name}
        arguments, pass_seq_len, pass_layout = {"hidden_states": hidden, "n": n, **rest}, None, None
        what = f"{n} blocks"
    else:
        generator = torch.Generator(device=device).manual_seed(seed)
        transformer_inputs = adapter.make_transformer_inputs(whole_model, device, dtype, generator)
        arguments = transformer_inputs.kwargs
        pass_seq_len, pass_layout = transformer_inputs.seq_len, transformer_inputs.layout
        what = f"the whole transformer ({n} blocks)"

    def run_pass():
        with torch.no_grad():
            return stack.model(**arguments)

    video = None
    with contextlib.ExitStack() as patched:
        if cache is not None:  # on before the recipe compiles the blocks: the compiled code holds the cache's hooks
            applied = apply_step_cache(stack.model, cache, what=adapter.display_name, steps=steps,
                                       passes_per_step=passes_per_step)
            patched.callback(applied.undo)
        patched.enter_context(apply_recipe(stack.blocks, dataclasses.replace(recipe, fp8_linear=False)))
        patched.enter_context(compile_failures_as_user_errors(f"{recipe.label} on the --validate pass",
                                                              "put an eager recipe first"))
        if cache is not None:
            video = time_cached_video(run_pass, applied, steps, passes_per_step, device=device, progress=progress)
            measured_ms = video.pass_ms
        else:
            # The first streamed pass teaches diffusers the block order it prefetches in: warm up once more.
            chain_warmup = warmup + (offload == "stream")
            with progress.stage(f"validation: {what}, warm-up and timed passes", chain_warmup + runs) as done:
                def counted():
                    run_pass()
                    done()
                for _ in range(chain_warmup):
                    counted()
                if cuda:  # the peak of the timed passes, not of a first call's compile
                    _reset_peak(device)
                measured_ms = time_region(counted, device=device, warmup=0, runs=runs).median_ms
    peak = None
    if cuda:  # the pass's own: not what the session holds that the pass does not use (`session_bytes_used`)
        peak = (torch.cuda.max_memory_allocated(device) - held_before
                + session_bytes_used(stack, first_block, inputs if whole_model is None else {}, device))
    extrapolated_ms = n * block_ms + outside_ms
    streamed = None
    if offload == "stream":
        resident = f"{n} x the profiled block" + (" + outside the blocks" if whole_model is not None else "")
        streamed = StreamedRun(stack.streamed_bytes, host_to_device_gbps(device), measured_ms, extrapolated_ms,
                               resident)
    return Validation(n, stack.distinct, measured_ms, block_ms, outside_ms, outside_source, pass_seq_len,
                      pass_layout, streamed, peak, video)


def _reset_peak(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def time_cached_video(run_pass: Callable[[], Any], cache: AppliedCache, steps: int, passes_per_step: int, *,
                      device: torch.device, progress: SessionProgress = NO_PROGRESS) -> CachedVideo:
    """The whole video, `steps` x `passes_per_step` calls of `run_pass` under the step cache `cache` (a pipeline's
    denoising loop with the inputs held fixed: a fixed-schedule cache skips by the step count, not the values),
    timed once. First its warm-up: steps until a computed step has followed a skipped one (the cache's every path
    run, and compiled), then the hooks' state reset, so the timed video starts at step 0 as a user's does. On a GPU
    the peak memory is reset before the timed video (its own, not the warm-up's compile)."""
    from diffusers.hooks import HookRegistry

    def step() -> None:
        for _ in range(passes_per_step):
            run_pass()
        cache.step_done()

    def cycled(per_step: list[dict[str, int]]) -> bool:
        skipped = [s["computed"] < s["full"] for s in per_step]
        return True in skipped and False in skipped[skipped.index(True):]

    with progress.stage(f"validation: the video under {cache.spec.label}, warm-up (its first cycle)"):
        while len(cache.steps) < steps and not cycled(cache.steps):
            step()
    warmup_steps = len(cache.steps)
    HookRegistry.check_if_exists_or_initialize(cache.model).reset_stateful_hooks(recurse=True)
    if device.type == "cuda":
        _reset_peak(device)
    graphs_before = dynamo_counts()[1]
    with progress.stage(f"validation: the whole video under {cache.spec.label}, {steps} steps x {passes_per_step} "
                        f"pass(es), timed", steps) as done:
        def video() -> None:
            for _ in range(steps):
                step()
                done()
        seconds = wall_seconds(video, device=device)
    timed = cache.steps[warmup_steps:]
    return CachedVideo(cache.spec.label, steps, passes_per_step, warmup_steps, seconds, cache.hooked,
                       tuple(s["computed"] for s in timed), dynamo_counts()[1] - graphs_before)

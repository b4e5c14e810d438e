"""`generate --ulysses N`: diffusers' context parallelism (Ulysses) over N GPUs of one machine.

The processes come from torchrun (`torchrun --nproc-per-node N -m dit_accel generate ...
--ulysses N`); each one runs the whole pipeline with the same seed. diffusers shards the
transformer's sequence (its `_cp_plan`) and, in every attention, swaps sequence for heads with
all-to-alls, so each rank attends over the whole sequence with 1/N of the heads; with `--attn fp8`
that local attention is our kernel (see `attention.routing`). Rank 0 writes the outputs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import UserError

TRANSFORMERS = ("transformer", "transformer_2")
# What diffusers' Ulysses sharder asserts when a sequence does not split evenly over the GPUs.
UNEVEN_SEQUENCE = "must be divisible by mesh size"


@dataclass(frozen=True)
class UlyssesGroup:
    degree: int
    rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (f"Ulysses x{self.degree}: diffusers context parallelism over {self.degree} GPUs "
                f"({torch.cuda.get_device_name(self.device)}), one torchrun process each")


def start_ulysses(degree: int) -> UlyssesGroup:
    """Joins the torchrun process group (NCCL) and binds this process to its GPU."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != degree:
        raise UserError(f"--ulysses {degree} needs {degree} processes, one per GPU: run "
                        f"`torchrun --nproc-per-node {degree} -m dit_accel generate ... --ulysses {degree}` "
                        f"(this is {world} process{'es' if world != 1 else ''})")
    if not torch.cuda.is_available() or torch.cuda.device_count() < degree:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise UserError(f"--ulysses {degree} needs {degree} CUDA GPUs on this machine; found {have}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    return UlyssesGroup(degree, dist.get_rank(), device)


def apply_ulysses(pipe, degree: int) -> None:
    """Turns on diffusers' Ulysses context parallelism in the pipeline's transformer(s)."""
    from diffusers import ContextParallelConfig

    for name in TRANSFORMERS:
        model = getattr(pipe, name, None)
        if model is None:
            continue
        if getattr(model, "_cp_plan", None) is None:
            raise UserError(f"{type(model).__name__} has no context-parallel plan in this diffusers version; "
                            f"--ulysses needs one (Wan, MiniMax-H3 and others have it)")
        heads = model.config.get("num_attention_heads")
        if heads is not None and heads % degree:
            raise UserError(f"--ulysses {degree} splits the {heads} attention heads of {type(model).__name__} "
                            f"evenly over the GPUs; choose a degree that divides {heads}")
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))


def stop_ulysses(synchronize: bool) -> None:
    """Leaves the process group; waits for the other ranks only after a run that finished (after an
    error the ranks may have stopped at different points, and a barrier would hang)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()

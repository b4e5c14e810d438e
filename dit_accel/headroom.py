"""The room a run has: the GPU's free memory (and a user's budget), or the host's available memory, and the
margin every estimate checked against it adds. Light on imports, so a command can refuse a size in one line
before loading anything heavy."""
from __future__ import annotations

import os
from pathlib import Path

import torch

MARGIN = 0.20  # added to every estimate
FIXED_BYTES = 256 * 2**20  # the interpreter's and the profiler's own buffers
GiB = 2**30


def host_available_bytes() -> int | None:
    """The host's available memory (MemAvailable: free plus what the kernel can reclaim), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_room(device: torch.device, budget_bytes: int | None = None,
                budget_text: str | None = None) -> tuple[int, str] | None:
    """(bytes, in words) of the tightest room a run on `device` must fit: the GPU's free memory and the
    budget, or the host's available memory; None when it cannot be read."""
    rooms: list[tuple[int, str]] = []
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        rooms.append((free, f"this GPU's {free / GiB:.1f} GiB of free memory"))
        if budget_bytes is not None:
            rooms.append((budget_bytes, f"the {budget_text} budget"))
    else:
        available = host_available_bytes()
        if available is not None:
            rooms.append((available, f"this host's {available / GiB:.1f} GiB of available memory"))
    return min(rooms, key=lambda pair: pair[0]) if rooms else None

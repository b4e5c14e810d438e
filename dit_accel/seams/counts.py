"""Call counters that keep counting inside torch.compile'd graphs.

    counts = CallCounts.on_device_of(model)
    counts.count(None)              # one call served
    counts.count("attention mask")  # one call declined, by reason
    counts.served, counts.declined  # 1, Counter({"attention mask": 1})

Each reason's count is a 0-d int64 tensor bumped in place, so the increment is part of a compiled graph
and runs on every call (a Python int reached through a module would be guarded by its value, and each
increment would recompile the model). The served count and the reasons a caller names up front (`expect`)
exist from the start: a counter first created inside a compiled graph is a dict entry added, which the next
call's guards see, and the model recompiles once (a reason first met there, e.g. an exception's message,
still costs that one recompile).

The counters live on the device the model computes on. On a GPU the increment is one more GPU op of the
graph: a CUDA graph replays it, so replayed calls count too. A CPU counter in a GPU model's compiled graph
would be a CPU kernel of its own: inductor then builds its C++ toolchain check and a C++ kernel on the first
compile of each process (35-50 s on the H200's host, docs/notes/compile-recompiles.md) and leaves the graph
out of CUDA graphs. Reading a GPU count waits for the GPU.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from .placement import module_device


class CallCounts:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._counts: dict[str | None, torch.Tensor] = {}  # None: served
        self.expect(None)

    @classmethod
    def on_device_of(cls, module: nn.Module) -> "CallCounts":
        """Counters on the device `module` computes on (`module_device`)."""
        return cls(module_device(module))

    def expect(self, *reasons: str | None) -> None:
        """Create the counters of these reasons now, before any compiled graph looks them up."""
        for reason in reasons:
            self._counts.setdefault(reason, torch.zeros((), dtype=torch.int64, device=self.device))

    def count(self, reason: str | None) -> None:
        """One call: served (None) or declined for `reason`."""
        count = self._counts.get(reason)
        if count is None:  # a reason nobody expected: created here (inside a compiled graph, one recompile)
            self.expect(reason)
            count = self._counts[reason]
        count.add_(1)

    @property
    def served(self) -> int:
        return int(self._counts[None])

    @property
    def declined(self) -> Counter[str]:
        return Counter({reason: int(n) for reason, n in self._counts.items() if reason is not None and int(n)})


class CountedCalls:
    """`served_calls` and `fallback_calls` of a swap handle, read from its `counts` (a CallCounts)."""

    counts: CallCounts

    @property
    def served_calls(self) -> int:
        return self.counts.served

    @property
    def fallback_calls(self) -> Counter[str]:
        return self.counts.declined

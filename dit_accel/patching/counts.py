"""Call counters that keep counting inside torch.compile'd graphs.

    counts = CallCounts()
    counts.count(None)              # one call served
    counts.count("attention mask")  # one call declined, by reason
    counts.served, counts.declined  # 1, Counter({"attention mask": 1})

Each reason's count is a 0-d int64 CPU tensor bumped in place, so the increment is part of a
compiled graph and runs on every call (a Python int reached through a module would be guarded by
its value, and each increment would recompile the model). The served count and the reasons a caller
names up front (`expect`) exist from the start: a counter first created inside a compiled graph is a
dict entry added, which the next call's guards see, and the model recompiles once (a reason first met
there, e.g. an exception's message, still costs that one recompile). The limits: calls replayed from a
CUDA graph are counted once, at capture, and a CPU op in a compiled CUDA graph makes inductor split or
skip it.
"""
from __future__ import annotations

from collections import Counter

import torch


class CallCounts:
    def __init__(self) -> None:
        self._counts: dict[str | None, torch.Tensor] = {}  # None: served
        self.expect(None)

    def expect(self, *reasons: str | None) -> None:
        """Create the counters of these reasons now, before any compiled graph looks them up."""
        for reason in reasons:
            self._counts.setdefault(reason, torch.zeros((), dtype=torch.int64))

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

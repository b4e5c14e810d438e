"""What a profile-block session reports while it works: named stages (loading, warm-up, timed runs,
profiler pass, attention check, validation chain), each with a count when it has one. The library
calls `stage`; the command line draws it (`commands.profile_block`), `--quiet` and library callers
get this do-nothing base."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator


class SessionProgress:
    """Receives the session's stages; draws nothing."""

    @contextlib.contextmanager
    def stage(self, label: str, total: int | None = None) -> Iterator[Callable[[], None]]:
        """A stage of `total` units (None: no count); the callable yielded marks one unit done."""
        yield lambda: None


NO_PROGRESS = SessionProgress()

"""The host path's memos of per-call work (compiled launches, passed checks), bounded."""


class BoundedMemo(dict):
    """A dict that empties itself before a new key would take it past `limit` entries. Its keys are inputs'
    metadata, so a caller cycling through more of them than `limit` starts over (each miss redoes the work it
    saves) instead of growing the memo without end. Only `remember` keeps the bound: add entries through it."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def remember(self, key, value=None) -> None:
        if key not in self and len(self) >= self.limit:
            self.clear()
        self[key] = value

"""Where dit-accel keeps what it measures once per machine: the device ceilings and the attention crossover."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$XDG_CACHE_HOME/dit-accel, else ~/.cache/dit-accel (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dit-accel"

"""The tiny pipelines `make-tiny-pipeline` builds, and the run defaults it leaves beside them.

A tiny pipeline folder is an ordinary diffusers folder plus `dit_accel.json`, which holds the
frames / height / width / steps that make `generate` finish in seconds on a CPU; `generate` reads
it when present and the command line overrides it. Diffusers ignores the extra file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..run_dir import staged_run_dir

DEFAULTS_FILE = "dit_accel.json"


def _wan(directory: Path, seed: int) -> dict:
    from .tiny_wan import DEFAULTS, save_tiny_wan

    return {**save_tiny_wan(directory, seed), "defaults": DEFAULTS}


def _h3(directory: Path, seed: int) -> dict:
    # Not built yet: MiniMax-H3 is a modular pipeline whose tiny set needs a Qwen3-VL conditioner of more than
    # 50 layers, a Qwen3VLProcessor built in code and tiny video/audio VAEs; see README (generate) for the status.
    raise UserError("the tiny MiniMax-H3 pipeline is not built yet; use `make-tiny-pipeline wan DIR` for now")


TINY_BUILDERS: dict[str, Callable[[Path, int], dict]] = {"wan": _wan, "h3": _h3}


def make_tiny_pipeline(family: str, directory: Path, seed: int = 0) -> dict:
    """Build the tiny `family` pipeline into `directory` (created; must be empty or absent)."""
    if family not in TINY_BUILDERS:
        raise UserError(f"no tiny pipeline for {family!r}; choose one of: {', '.join(TINY_BUILDERS)}")
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UserError(f"{directory} exists and is not an empty folder; pass a new folder")
    from .loading import quiet_library_progress

    quiet_library_progress()
    with staged_run_dir(directory) as staging:  # a failed build leaves nothing behind
        info = TINY_BUILDERS[family](staging, seed)
        (staging / DEFAULTS_FILE).write_text(json.dumps({"family": family, "seed": seed, **info["defaults"]},
                                                        indent=2) + "\n")
    return info


def read_run_defaults(directory: Path) -> dict:
    """The defaults a tiny pipeline folder suggests ({} for any other folder)."""
    try:
        data = json.loads((Path(directory) / DEFAULTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: data[k] for k in ("frames", "height", "width", "steps", "guidance") if k in data}

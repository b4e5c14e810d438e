"""Output folders that appear whole or not at all.

A command writes its files into a hidden staging folder beside the final one and renames it into
place only when everything was written, so an error (bad input, out of memory, Ctrl-C) never leaves
a half-written run under `outputs/`.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import UserError

DEFAULT_OUTPUT_ROOT = Path("outputs")


def default_run_name(command: str, tag: str) -> str:
    """`profile-block_minimax-h3_20261130-051200`: command, what ran, and when (local time)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{command}_{tag}_{stamp}"


def check_run_dir(final_dir: Path) -> None:
    """UserError unless `final_dir` is absent or an empty folder (a run never overwrites)."""
    final_dir = Path(final_dir)
    if final_dir.exists() and (not final_dir.is_dir() or any(final_dir.iterdir())):
        kind = "a file" if not final_dir.is_dir() else "a folder that is not empty"
        raise UserError(f"{final_dir} is {kind}; pass --out a new folder (runs never overwrite)")


@contextlib.contextmanager
def staged_run_dir(final_dir: Path) -> Iterator[Path]:
    """Yield a staging folder; on success it becomes `final_dir`, on any exception it is removed.

    `final_dir` must not exist yet, or be an empty folder: a run never deletes what it did not write
    (an `--out` pointing at `.` or at `outputs/` must not wipe them).
    """
    final_dir = Path(final_dir)
    check_run_dir(final_dir)
    try:
        final_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", suffix=".partial", dir=final_dir.parent))
    except OSError as exc:
        raise UserError(f"cannot create the output folder {final_dir.parent} ({exc.strerror}); pass --out DIR") from exc
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if final_dir.exists():
        final_dir.rmdir()  # empty, checked above
    staging.rename(final_dir)

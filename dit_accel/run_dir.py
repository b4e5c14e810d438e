"""Output folders that appear whole or not at all.

A command writes its files into a hidden staging folder beside the final one and renames it into
place only when everything was written, so an error (bad input, out of memory, Ctrl-C, SIGTERM: the
CLI turns both signals into exceptions) never leaves a half-written run under `outputs/`.

A process killed outright (SIGKILL, the kernel's out-of-memory killer) cannot clean up, so the
staging folder's name carries the host and the process id, `.<name>.<host>-<pid>.<random>.partial`,
and the next run on that host into the same parent folder removes every such folder whose process
is gone. One whose process still runs (another run, writing now), and another host's, are left alone.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import UserError

DEFAULT_OUTPUT_ROOT = Path("outputs")
# `.<name>.<host>-<pid>.<8 characters of tempfile.mkdtemp>.partial`: a pid means something only on its host
# (an `outputs/` on a shared file system is seen by runs on other machines).
_STAGING_NAME = re.compile(r"\..+\.(?P<host>[A-Za-z0-9-]+)-(?P<pid>[0-9]+)\.[a-z0-9_]{8}\.partial")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


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


def _process_is_gone(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # no signal sent: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by someone else
        return False
    return False


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging folders in `parent` left by runs that were killed outright (their process
    is gone); returns what was removed. Folders of other names, and those of live runs, stay."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _STAGING_NAME.fullmatch(entry.name)
        if (match and match["host"] == _host() and entry.is_dir() and not entry.is_symlink()
                and _process_is_gone(int(match["pid"]))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


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
        remove_stale_staging(final_dir.parent)
        staging = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.{_host()}-{os.getpid()}.", suffix=".partial",
                                        dir=final_dir.parent))
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

"""Output folders that appear whole or not at all, and that two runs never fight over.

A command writes its files into a hidden staging folder beside the final one and renames it into
place only when everything was written, so an error (bad input, out of memory, Ctrl-C, SIGTERM: the
CLI turns both signals into exceptions) never leaves a half-written run under `outputs/`, nor the
folders it created to hold it.

A process killed outright (SIGKILL, the kernel's out-of-memory killer) cannot clean up, so the
staging folder's name carries the host and the process id, `.<name>.<host>-<pid>.<random>.partial`,
and the next run on that host into the same parent folder removes every such folder whose process
is gone. One whose process still runs (another run, writing now), and another host's, are left alone.

Two runs, one folder: a run claims its folder's name with a lock (`.<name>.lock` beside it, released by
the kernel when the process ends) before it stages anything. A run refuses a folder another live run
holds (one line naming its process), and a default-named run (`numbered`) takes the next free
`<name>-2`, `<name>-3`, ... instead. If the folder appears anyway while a run writes (a run on another
host, a user's copy), the finished run goes to the next free numbered sibling and says so: no result is
ever left in a hidden folder.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from .errors import UserError

DEFAULT_OUTPUT_ROOT = Path("outputs")
# `.<name>.<host>-<pid>.<8 characters of tempfile.mkdtemp>.partial`: a pid means something only on its host
# (an `outputs/` on a shared file system is seen by runs on other machines).
_STAGING_NAME = re.compile(r"\..+\.(?P<host>[A-Za-z0-9-]+)-(?P<pid>[0-9]+)\.[a-z0-9_]{8}\.partial")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _umask() -> int:
    """This process's umask (read without changing it where Linux tells it, else set and put back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _open_to_umask(folder: Path) -> None:
    """Give `folder` and everything in it the modes the user's umask gives new folders and files (a staging folder
    is made 0700 by mkdtemp, and libraries write some files 0600 through temporary files): 0755 / 0644 under 022."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for root, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def default_run_name(command: str, tag: str) -> str:
    """`profile-block_minimax-h3_20261130-051200`: command, what ran, and when (local time)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{command}_{tag}_{stamp}"


OUT_OPTION = "--out"  # how a command's user names the folder; make-tiny-pipeline names its DIRECTORY instead


def check_run_dir(final_dir: Path, option: str = OUT_OPTION) -> None:
    """UserError unless `final_dir` is absent or an empty folder (a run never overwrites). `option`: how the user
    names another folder (the command's option, or its argument), for the message."""
    final_dir = Path(final_dir)
    if _is_taken(final_dir):
        kind = "a file" if not final_dir.is_dir() else "a folder that is not empty"
        raise UserError(f"{final_dir} is {kind}; {_another(option)} (runs never overwrite)")


def _another(option: str) -> str:
    """'pass --out a new folder', or for an argument 'give another DIRECTORY'."""
    return f"pass {option} a new folder" if option.startswith("--") else f"give another {option}, a new folder"


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


def _unheld(lock: Path) -> bool:
    """Whether no live process holds the claim `lock` (a killed run's lock file)."""
    try:
        with open(lock) as file:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except OSError:
        return False


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging folders in `parent` left by runs that were killed outright (their process
    is gone); returns what was removed. Folders of other names, and those of live runs, stay."""
    removed = []
    for entry in _entries(Path(parent)):
        if entry.name.startswith(".") and entry.name.endswith(".lock") and entry.is_file() and _unheld(entry):
            entry.unlink(missing_ok=True)
            removed.append(entry)
            continue
        match = _STAGING_NAME.fullmatch(entry.name)
        if (match and match["host"] == _host() and entry.is_dir() and not entry.is_symlink()
                and _process_is_gone(int(match["pid"]))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


class _Claim:
    """An exclusive claim on a final folder's name: a lock (`flock`) on `.<name>.lock` beside it, which the
    kernel releases when its process ends however it ends, holding the claimant's process id."""

    def __init__(self, final_dir: Path, option: str = OUT_OPTION):
        """Raises BlockingIOError when a live process holds the claim."""
        self.path = final_dir.with_name(f".{final_dir.name}.lock")
        try:
            self._file = open(self.path, "a+")  # noqa: SIM115 (held until release)
        except OSError as exc:
            raise UserError(f"cannot write files in {final_dir.parent} (making {self.path.name} there failed: "
                            f"{exc.strerror}); {_another(option)} where you can write") from exc
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise
        self._file.seek(0)
        self._file.truncate()
        self._file.write(str(os.getpid()))
        self._file.flush()

    def release(self) -> None:
        """Unlink the lock file, then let go of the lock (a second call does nothing)."""
        if not self._file.closed:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self._file.close()


def _claim(final_dir: Path, option: str) -> "_Claim | str":
    """The claim on `final_dir`'s name, or the process id of the live run that holds it."""
    try:
        return _Claim(final_dir, option)
    except BlockingIOError:
        try:
            return final_dir.with_name(f".{final_dir.name}.lock").read_text().strip() or "?"
        except OSError:
            return "?"


def _entries(parent: Path) -> list[Path]:
    try:
        return list(parent.iterdir())
    except OSError:
        return []


def _is_taken(final_dir: Path) -> bool:
    return final_dir.exists() and (not final_dir.is_dir() or any(final_dir.iterdir()))


def _numbered(final_dir: Path, number: int) -> Path:
    return final_dir if number == 1 else final_dir.with_name(f"{final_dir.name}-{number}")


class StagedRun:
    """A run's output folder, staged: `with StagedRun(final) as staging:` yields the staging folder; on
    success it becomes `run.final`, on any exception it is removed with the folders made to hold it.

    `final` must not exist yet, or be an empty folder: a run never deletes what it did not write (an `--out`
    pointing at `.` or at `outputs/` must not wipe them). `numbered` (a default name, not the user's): a taken
    or claimed name moves on to `<name>-2`, `<name>-3`, ... instead of being refused. `option`: how the user names
    the folder (`--out`, or an argument's name), for the messages. The folder and its files end with the modes the
    user's umask gives (0755 and 0644 under 022), whatever the staging and the libraries made them.
    """

    def __init__(self, final: Path, *, numbered: bool = False, option: str = OUT_OPTION):
        self.final = Path(final)
        self.numbered = numbered
        self.option = option
        self.staging: Path | None = None
        self._claim: _Claim | None = None
        self._made_parents: list[Path] = []
        self.moved_note: str | None = None  # set when the folder appeared while the run wrote

    def __enter__(self) -> Path:
        if not self.numbered:
            check_run_dir(self.final, self.option)
        parent = self.final.parent
        self._made_parents = [p for p in (parent, *parent.parents) if not p.exists()]
        try:
            parent.mkdir(parents=True, exist_ok=True)
            remove_stale_staging(parent)
        except OSError as exc:
            self._remove_made_parents()
            raise UserError(f"cannot create the folder {parent} ({exc.strerror}); {_another(self.option)} where you "
                            f"can write") from exc
        for number in range(1, 1000):
            candidate = _numbered(self.final, number)
            claim = _claim(candidate, self.option)
            if isinstance(claim, _Claim) and not _is_taken(candidate):
                self.final, self._claim = candidate, claim
                self.staging = Path(tempfile.mkdtemp(prefix=f".{candidate.name}.{_host()}-{os.getpid()}.",
                                                     suffix=".partial", dir=parent))
                return self.staging
            if isinstance(claim, _Claim):
                claim.release()  # written meanwhile: a numbered run moves on, a named one is refused
                if not self.numbered:
                    self._remove_made_parents()
                    check_run_dir(candidate, self.option)
            elif not self.numbered:
                self._remove_made_parents()
                raise UserError(f"another run (process {claim}) is writing {candidate}; {_another(self.option)}")
        raise UserError(f"no free folder beside {self.final}; {_another(self.option)}")

    def __exit__(self, kind, exc, traceback) -> bool:
        try:
            return self._finish(kind)
        finally:
            self._claim.release()

    def _finish(self, kind) -> bool:
        if kind is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._claim.release()
            self._remove_made_parents()
            return False
        _open_to_umask(self.staging)
        wanted = self.final
        for number in range(1, 1000):
            candidate = _numbered(wanted, number)
            try:
                self.staging.rename(candidate)  # onto nothing, or onto an empty folder
            except OSError:
                continue  # it appeared, not empty, while this run wrote: the next free sibling
            self.final = candidate
            if candidate != wanted:
                self.moved_note = f"{wanted} appeared while this run wrote; its results are in {candidate}"
            return False
        raise UserError(f"no free folder beside {wanted}; this run's results are in {self.staging}")

    def _remove_made_parents(self) -> None:
        """The folders this run made to hold its output, deepest first, where they are still empty."""
        for folder in self._made_parents:
            try:
                folder.rmdir()
            except OSError:
                break


# --- reading a finished run ---------------------------------------------------------------------------

REPORT_NAME = "report.json"
RUN_KEYS = ("backend", "block_ms", "categories", "modules", "extrapolation")  # what a profile-block run has


def read_run(folder: Path) -> dict[str, Any]:
    """The report.json of a profile-block run folder; a UserError naming what is wrong otherwise."""
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give a profile-block run folder (outputs/profile-block_...)")
    path = folder / REPORT_NAME
    if not path.is_file():
        raise UserError(f"{folder} has no {REPORT_NAME}: it is not a profile-block run folder")
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {str(exc).splitlines()[0]}; it may be truncated, rerun "
                        f"profile-block") from None
    runs = report.get("runs") if isinstance(report, dict) else None
    if not isinstance(runs, list) or not runs or not isinstance(report.get("header"), dict) or \
            not all(isinstance(run, dict) and all(key in run for key in RUN_KEYS) for run in runs):
        raise UserError(f"{path} is not a profile-block report (no runs with block_ms, categories and modules); "
                        f"give a profile-block run folder")
    return report

"""Writing results: JSON and CSV files, the terminal consoles every command prints to, and the
provenance block every report.json carries (`provenance`)."""
from __future__ import annotations

import csv
import datetime
import json
import math
import platform
import shlex
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping

from rich.console import Console

# Wide enough for the tables when output goes to a file or a pipe (rich would assume 80 columns).
console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
# Progress and warnings when stdout carries data (`--json`): the same look, on stderr.
err_console = Console(highlight=False, stderr=True, width=None if sys.stderr.isatty() else 150)


def print_note(note: str | None, out: Console = console) -> None:
    """A yellow `note: ...` line for the user, when there is a note."""
    if note:
        out.print(f"[yellow]note: {note}[/yellow]")

# Distributions whose versions a report names (importlib.metadata names; None where not installed).
PROVENANCE_PACKAGES = {"dit-accel": "dit-accel", "torch": "torch", "diffusers": "diffusers",
                       "cutlass-dsl": "nvidia-cutlass-dsl", "torchao": "torchao"}
_NVIDIA_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
                      "power.limit", "temperature.gpu")


def command_line() -> str:
    """The command as the user typed it, for reports: `dit-accel profile-block --seq-len 4096`."""
    return shlex.join(["dit-accel", *sys.argv[1:]])


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> dict[str, Any] | None:
    """{"commit", "dirty"} when dit_accel runs from a git checkout (an editable install), else None."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def _nvidia_smi(index: int) -> dict[str, str] | None:
    """The GPU's name, driver, current and max clocks (MHz), power limit (W), temperature (C), as
    nvidia-smi reads them; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        query = ["nvidia-smi", f"--query-gpu={','.join(_NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits",
                 "-i", str(index)]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in out.strip().splitlines()[0].split(",")] if out.strip() else []
    return dict(zip(_NVIDIA_SMI_FIELDS, values)) if len(values) == len(_NVIDIA_SMI_FIELDS) else None


def provenance(*, seed: int | None = None, device: Any = None) -> dict[str, Any]:
    """Where a report's numbers come from: versions, git commit, GPU (name, driver, clocks), host,
    seed, time and command line. One call per report: `report["provenance"] = provenance(seed=...,
    device=...)`; `device` is a torch.device (its GPU is described) or None."""
    versions = {name: _version(dist) for name, dist in PROVENANCE_PACKAGES.items()}
    versions["python"] = platform.python_version()
    gpu = None
    torch = sys.modules.get("torch")  # a command that ran on a device has torch loaded; never import it here
    if torch is not None:
        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
        if device is not None and getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
            index = device.index if device.index is not None else torch.cuda.current_device()
            gpu = {"index": index, "name": torch.cuda.get_device_name(index), **(_nvidia_smi(index) or {})}
    return {
        "versions": versions,
        "git": _git_commit(),
        "gpu": gpu,
        "host": {"name": socket.gethostname(), "platform": platform.platform(), "cpu": platform.processor() or None},
        "seed": seed,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a missing value reads as null
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def to_json(data: Mapping[str, Any]) -> str:
    """`data` as report.json writes it (NaN and inf as null, paths as strings)."""
    return json.dumps(_jsonable(data), indent=2)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(to_json(data) + "\n")


def write_csv(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One row per mapping; the columns are the union of keys, in first-seen order."""
    rows = list(rows)
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

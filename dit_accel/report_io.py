"""Writing results: JSON and CSV files, and the one terminal console every command prints to."""
from __future__ import annotations

import csv
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from rich.console import Console

# Wide enough for the tables when output goes to a file or a pipe (rich would assume 80 columns).
console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)


def command_line() -> str:
    """The command as the user typed it, for reports: `dit-accel profile-block --seq-len 4096`."""
    return shlex.join(["dit-accel", *sys.argv[1:]])


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


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(_jsonable(data), indent=2) + "\n")


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

"""The code passes the project's lint (ruff, configured in pyproject.toml: pycodestyle and pyflakes, lines of
at most 120 characters), so the test command is also the lint step."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: run scripts/setup.sh (the test extra pins it)"
    result = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

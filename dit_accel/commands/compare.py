"""`dit-accel compare RUN_A RUN_B`: two saved profile-block runs side by side, so a change shows what
it bought: per kind of work, per module, block ms, per-video time, speed-up and error.

It reads only the two report.json files (`runs[i]`: backend, block_ms, categories, modules,
extrapolation, attention_rel_err, output_vs_reference), so it imports neither torch nor diffusers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ..errors import UserError
from ..report_io import console
from ..run_dir import read_run

# Workload and set-up facts that make two runs' times incomparable when they differ.
SAME_SETUP = (("model", lambda r: r["header"].get("model")),
              ("workload", lambda r: r.get("workload", {}).get("seq_len")),
              ("batch", lambda r: r.get("workload", {}).get("batch")), ("dtype", lambda r: r.get("dtype")),
              ("device", lambda r: r["header"].get("device")), ("run kind", lambda r: r.get("run_kind")))


def pick_run(report: dict[str, Any], backend: str | None, folder: Path) -> dict[str, Any]:
    if backend is None:
        return report["runs"][0]
    for run in report["runs"]:
        if run["backend"] == backend:
            return run
    names = ", ".join(run["backend"] for run in report["runs"])
    raise UserError(f"{folder} has no run with attention {backend!r}; it has {names}")


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _speedup(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "—"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.3g}%"


def _side_by_side(title: str, first_column: str, a: dict[str, dict], b: dict[str, dict],
                  names: tuple[str, str]) -> Table:
    """Rows: the union of both runs' labels (A's order first); columns: ms, B - A, A / B."""
    table = Table(title=title, caption="speed-up = A ms / B ms (above 1: B is faster)")
    table.add_column(first_column)
    for column in (f"A ms ({names[0]})", f"B ms ({names[1]})", "B - A ms", "speed-up"):
        table.add_column(column, justify="right")
    for label in dict.fromkeys([*a, *b]):
        ms_a, ms_b = a.get(label, {}).get("ms"), b.get(label, {}).get("ms")
        delta = f"{ms_b - ms_a:+.2f}" if ms_a is not None and ms_b is not None else "—"
        table.add_row(label, _ms(ms_a), _ms(ms_b), delta, _speedup(ms_a, ms_b))
    return table


@click.command("compare")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--backend-a", default=None, help="Which of RUN_A's attention runs (default: its first).")
@click.option("--backend-b", default=None, help="Which of RUN_B's attention runs (default: its first).")
def compare(run_a, run_b, backend_a, backend_b):
    """Compare two saved profile-block runs (RUN_A, RUN_B: their folders) side by side.

    Per kind of work and per module, block ms, per-video time, speed-up (A over B) and error.
    """
    reports = read_run(run_a), read_run(run_b)
    runs = pick_run(reports[0], backend_a, run_a), pick_run(reports[1], backend_b, run_b)
    names = runs[0]["backend"], runs[1]["backend"]

    console.print(f"[bold]dit-accel compare[/bold]  A = {run_a} ({names[0]})  B = {run_b} ({names[1]})")
    for label, fact in SAME_SETUP:
        values = [fact(report) for report in reports]
        if values[0] != values[1]:
            console.print(f"[yellow]warning: the runs differ in {label}: A {values[0]}, B {values[1]}; "
                          f"their times are not like for like[/yellow]")
    for report, side in zip(reports, "AB"):
        if report.get("scaled_down") or report.get("run_kind") == "cpu-scaled-down":
            console.print(f"[yellow]note: {side} is a scaled-down CPU run: its figures say nothing about a "
                          f"GPU[/yellow]")
        for warning in report.get("warnings") or []:
            console.print(f"[yellow]warning ({side}): {warning}[/yellow]")

    console.print(_side_by_side("By kind of work (ms per block)", "kind of work", runs[0]["categories"],
                                runs[1]["categories"], names))
    console.print(_side_by_side("By module (ms per block)", "module", runs[0]["modules"], runs[1]["modules"], names))

    summary = Table(title="Block and whole model")
    summary.add_column("")
    for column in ("A", "B", "speed-up"):
        summary.add_column(column, justify="right")
    e_a, e_b = runs[0]["extrapolation"], runs[1]["extrapolation"]
    summary.add_row("attention", names[0], names[1], "")
    summary.add_row("block ms (median)", _ms(runs[0]["block_ms"]), _ms(runs[1]["block_ms"]),
                    _speedup(runs[0]["block_ms"], runs[1]["block_ms"]))
    video_a, video_b = e_a.get("video_s"), e_b.get("video_s")
    summary.add_row("per video (extrapolated)", "—" if video_a is None else f"{video_a / 60:.1f} min",
                    "—" if video_b is None else f"{video_b / 60:.1f} min", _speedup(video_a, video_b))
    summary.add_row("attention error (q/k/v vs reference)", _pct(runs[0].get("attention_rel_err")),
                    _pct(runs[1].get("attention_rel_err")), "")
    summary.add_row("block output vs its run's first", _pct((runs[0].get("output_vs_reference") or {}).get("rel_l2")),
                    _pct((runs[1].get("output_vs_reference") or {}).get("rel_l2")), "")
    commits = [((report.get("provenance") or {}).get("git") or {}).get("commit") for report in reports]
    summary.add_row("git commit", *[(c or "—")[:12] for c in commits], "")
    console.print(summary)

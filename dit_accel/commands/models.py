"""`dit-accel models`: the model families dit-accel serves, as data derived from diffusers."""
from __future__ import annotations

import functools

import click

from ..report_io import console, to_json


@functools.cache
def family_rows() -> tuple[dict, ...]:
    """Each family's summary (it builds the family's transformer on meta: ~0.5 s each, so once a process)."""
    from ..adapters import FAMILIES, adapter_for_preset

    return tuple(adapter_for_preset(name).summary() for name in FAMILIES)


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def models(as_json: bool) -> None:
    """The model families profile-block serves: presets, the pipeline's default video and the rows it makes,
    block stacks, attention heads, and whether our FP8 attention kernel serves them.

    Everything but the preset configs is derived from diffusers: the stacks and the attention calls from the
    model's own forward (on the meta device: no weights, no memory), the video and text rows from the pipeline
    class's defaults. A local diffusers transformer of any of these families is recognised by the `_class_name`
    of its config.json (profile-block --checkpoint DIR).
    """
    rows = family_rows()
    if as_json:
        click.echo(to_json(list(rows)))
        return
    # One short block per family rather than a wide table: readable at 80 columns, and no name (a preset a user
    # must type) is ever cut or folded; rich wraps the lines at spaces only.
    console.print("[bold]Model families[/bold]: dit-accel profile-block --model NAME [--preset PRESET]\n"
                  "[dim]rows: of the default video's pass; FP8 attention: whether our kernel serves it; --json for "
                  "all of it as data[/dim]\n")
    for row in rows:
        console.print(f"[bold]{row['family']}[/bold] ({row['model']})   presets: {', '.join(row['presets'])}")
        console.print(f"    default video: {row['video'] or 'packed rows'}; rows: "
                      + " + ".join(f"{n} {k}" for k, n in row["rows"].items()))
        console.print(f"    heads {row['heads']} x {'/'.join(map(str, row['head_dims']))}; block stacks: "
                      + ", ".join(f"{name} x {count}" for name, count in row["stacks"].items()))
        console.print(f"    FP8 attention: {row['fp8_attention']}")

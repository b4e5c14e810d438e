"""`dit-accel models`: the model families dit-accel serves, as data derived from diffusers."""
from __future__ import annotations

import click
from rich.table import Table

from ..report_io import console, to_json


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
    from ..adapters import FAMILIES, adapter_for_preset

    rows = [adapter_for_preset(name).summary() for name in FAMILIES]
    if as_json:
        click.echo(to_json(rows))
        return
    table = Table(title="Model families (dit-accel profile-block --model NAME [--preset PRESET])",
                  caption="rows: of the default video's pass (video, text, audio); FP8 attention: our kernel")
    for column in ("model", "presets", "default video", "rows", "block stacks", "heads x dim", "FP8 attention"):
        table.add_column(column)
    for row in rows:
        table.add_row(f"{row['family']}\n{row['model']}", ", ".join(row["presets"]), row["video"] or "packed rows",
                      " + ".join(f"{n} {k}" for k, n in row["rows"].items()),
                      "\n".join(f"{name} x {count}" for name, count in row["stacks"].items()),
                      f"{row['heads']} x {'/'.join(map(str, row['head_dims']))}", row["fp8_attention"])
    console.print(table)

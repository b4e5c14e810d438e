"""Every measured figure the README and the design docs (docs/*.md) state is recorded in docs/benchmarks.md, the
figure of record (its date, command and commit beside it), or in the dated experiment note (docs/notes/) the doc
links: they cite, they never restate a number the record does not hold.

A figure is a number with a decimal point, or any number followed by a unit (ms, TFLOP/s, x, %, min, GiB, GB/s,
s), outside the README's shell examples. It matches the record where the record holds it as written or to more
places that round to it (524.39 ms recorded, 524.4 ms in the README's table).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Numbers of the README that are not measurements, and what they are.
NOT_FIGURES = {"3.10": "the Python version setup.sh needs", "0.12": "a cache threshold in a recipe example"}
_UNIT = r"(?=\s?(?:ms|TFLOP/s|x|%|min|GiB|GB/s|s)\b)"


def figures(text: str) -> set[str]:
    """The measured figures of a Markdown text, as written."""
    text = re.sub(r"```bash.*?```", "", text, flags=re.S)  # commands, not results
    decimals = re.findall(r"(?<![\w.\-/])\d+\.\d+(?![\w.])", text)
    with_units = re.findall(r"(?<![\w.\-/+=:])\d+(?:\.\d+)?" + _UNIT, text)
    return set(decimals) | set(with_units)


def _places(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def recorded(figure: str, record: set[str]) -> bool:
    """`figure` is in `record` as written, or as a number of more places that rounds to it."""
    if figure in record:
        return True
    places = _places(figure)
    return any(_places(r) > places and round(float(r), places) == float(figure) for r in record)


def _record(cited_by: str = "") -> set[str]:
    """The numbers of docs/benchmarks.md, and of the dated notes (docs/notes/) the text `cited_by` links: an
    experiment's note is the record of what it measured."""
    notes = sorted(set(re.findall(r"notes/([\w-]+\.md)", cited_by)))
    text = "".join((ROOT / "docs" / path).read_text() for path in ["benchmarks.md", *(f"notes/{n}" for n in notes)])
    return set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text))


def test_every_figure_of_the_readme_is_in_the_record():
    readme = figures((ROOT / "README.md").read_text())
    assert len(readme) > 50  # the extraction finds the README's figures (the results tables among them)
    record = _record()
    missing = sorted((f for f in readme - set(NOT_FIGURES) if not recorded(f, record)), key=float)
    assert not missing, f"README figures with no record in docs/benchmarks.md: {missing}"


# Numbers of the design docs that are not measurements, and what they are.
NOT_MEASURED = {"generate.md": {"0.03": "the tiny Wan's text encoder, M parameters",
                                "5.17": "the tiny H3 pipeline's soundtrack, seconds"},
                "profile-block.md": {"64.5": "the H3 block stack's GB (50 blocks of 1.29 GB)"}}


DESIGN_DOCS = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")


@pytest.mark.parametrize("doc", DESIGN_DOCS)
def test_every_figure_of_a_design_doc_is_in_the_record(doc):
    text = (ROOT / "docs" / doc).read_text()
    stated = figures(text) - set(NOT_MEASURED.get(doc, ()))
    record = _record(text)
    missing = sorted((f for f in stated if not recorded(f, record)), key=float)
    assert not missing, f"docs/{doc} figures with no record in docs/benchmarks.md or the notes it cites: {missing}"


def test_a_figure_matches_its_record_only_as_written_or_rounded():
    record = {"524.39", "1.71", "843"}
    assert recorded("524.4", record) and recorded("524.39", record) and recorded("843", record)
    assert not recorded("524.3", record) and not recorded("1.72", record) and not recorded("844", record)
    assert not recorded("524.390", record)  # more places than the record: not the record's figure
    assert figures("ours 52.94 ms, 1.31x; `--runs 5`\n```bash\nrun --seq-len 30272.5\n```\n3 GiB") == {
        "52.94", "1.31", "3"}

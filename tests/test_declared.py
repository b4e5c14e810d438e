"""The names the CLI reads from the registries' source (`dit_accel.declared`) are the registries' own, and a
registry written in a form the reader does not know is said in one line, not misread."""
from __future__ import annotations

import ast

import pytest

from dit_accel import declared


def test_each_reading_is_the_imported_registry():
    from dit_accel.adapters import DEFAULT_FAMILY, FAMILIES
    from dit_accel.adapters.stage_specs import STAGE_KEYS
    from dit_accel.attention.backends import BACKENDS

    assert declared.family_names() == tuple(FAMILIES) and declared.family_names()[0] == DEFAULT_FAMILY
    assert declared.backend_names() == tuple(BACKENDS)
    assert declared.stage_keys() == STAGE_KEYS


def test_a_registry_in_another_form_is_refused_by_name(monkeypatch):
    sources = {"adapters/__init__.py": "from .families import GENERIC\nFAMILIES = dict(GENERIC)\n",
               "attention/backends.py": "BACKENDS = {'native': 1}\n"}
    monkeypatch.setattr(declared, "_module", lambda relative: ast.parse(sources[relative]))
    with pytest.raises(LookupError, match=r"adapters/__init__.py: FAMILIES is not written as"):
        declared.family_names.__wrapped__()
    with pytest.raises(LookupError, match=r"attention/backends.py: BACKENDS is not written as"):
        declared.backend_names.__wrapped__()
    with pytest.raises(LookupError, match=r"assigns no STAGE_KEYS"):
        monkeypatch.setitem(sources, "adapters/stage_specs.py", "KEYS = ()\n")
        declared.stage_keys.__wrapped__()


def test_a_family_added_to_the_generic_tuple_is_read_without_touching_the_cli(monkeypatch):
    """Adding a served family is one `Family(...)` entry of families.py's tuple (and its preset): the CLI's choices
    follow from the source."""
    real = declared._module
    families = ast.parse("GENERIC_FAMILIES = (Family(name='a', pipeline='P'), Family(display_name='B', name='b'))")
    monkeypatch.setattr(declared, "_module", lambda r: families if r == "adapters/families.py" else real(r))
    assert declared.family_names.__wrapped__() == ("minimax-h3", "wan", "a", "b")

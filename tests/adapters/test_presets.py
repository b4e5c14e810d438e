"""The embedded presets are what their notes say: each one whose note states what it builds to builds to that
many parameters under diffusers' class, on the meta device (a config edited by hand, or a class that changed
under it, shows here)."""
from __future__ import annotations

import json
import re

import pytest

from testing import slow_beyond

from dit_accel.adapters import FAMILIES
from dit_accel.adapters.family import PRESETS
from dit_accel.adapters.stage_specs import build_on_meta

BUILDS_TO = re.compile(r"Builds on the meta device under diffusers [0-9.]+ to ([0-9,]+) parameters")
STATED = {path.stem: int(match.group(1).replace(",", "")) for path in sorted(PRESETS.glob("*.json"))
          if (match := BUILDS_TO.search(json.loads(path.read_text())["note"]))}


def test_every_embedded_preset_belongs_to_a_family_and_most_state_their_size():
    used = {name for family in FAMILIES.values() for name in family.presets}
    assert {path.stem for path in PRESETS.glob("*.json")} <= used
    assert len(STATED) >= 20


@pytest.mark.parametrize("name", slow_beyond(sorted(STATED), keep=3))
def test_a_preset_builds_to_the_parameters_its_note_states(name):
    family = next(f for f in FAMILIES.values() if name in f.presets)
    model = build_on_meta(family.transformer_class, family.presets[name].config)
    assert sum(p.numel() for p in model.parameters()) == STATED[name]

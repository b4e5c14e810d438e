"""Device helpers: sizes as users write them, ceilings measured once and cached."""
import json
import os
from pathlib import Path

import pytest
import torch

from dit_accel.device import device_ceilings, parse_bytes
from dit_accel.errors import UserError


@pytest.mark.parametrize("text, expected", [("16GiB", 16 * 2**30), ("800MB", 800 * 10**6), ("1.5 GiB", int(1.5 * 2**30)),
                                             ("512", 512)])
def test_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "16 parsecs", "-3GiB", ""])
def test_bad_sizes_say_how_to_write_one(text):
    with pytest.raises(UserError, match="write it like 16GiB"):
        parse_bytes(text)


def test_ceilings_are_measured_once_then_read_from_the_cache():
    first, _ = device_ceilings(torch.device("cpu"), torch.float32)  # maybe measured by an earlier test
    assert first.gemm_tflops > 0 and first.copy_gbps > 0 and first.dtype == "float32"
    again, cached = device_ceilings(torch.device("cpu"), torch.float32)
    assert cached and again == first
    path = Path(os.environ["XDG_CACHE_HOME"]) / "dit-accel" / "ceilings.json"
    cache = json.loads(path.read_text())
    key = next(k for k in cache if "float32" in k)
    cache[key] = {"gemm_tflops": 1.0}  # written by an older version: unreadable, so measured again
    path.write_text(json.dumps(cache))
    remeasured, cached = device_ceilings(torch.device("cpu"), torch.float32)
    assert not cached and remeasured.gemm_tflops > 0 and remeasured.dtype == "float32"

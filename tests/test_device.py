"""Device helpers: sizes as users write them, ceilings measured once and cached."""
import json
import os
from pathlib import Path

import pytest
import torch

from dit_accel import device
from dit_accel.device import device_ceilings, measure_ceilings, parse_bytes
from dit_accel.errors import UserError


@pytest.mark.parametrize("text, expected", [("16GiB", 16 * 2**30), ("800MB", 800 * 10**6),
                                            ("1.5 GiB", int(1.5 * 2**30)), ("512", 512)])
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


def test_the_cpu_has_no_fp8_ceiling_and_says_why():
    ceilings, _ = device_ceilings(torch.device("cpu"), torch.float32)
    assert ceilings.fp8_gemm_tflops is None
    assert ceilings.fp8_gemm_unavailable == "no CUDA GPU: FP8 GEMMs need a CUDA GPU of compute capability 8.9+"
    assert ceilings.gemm_ceiling("fp8") == ("FP8 GEMM", None)
    assert ceilings.gemm_ceiling("float32") == ("float32 GEMM", ceilings.gemm_tflops)
    assert ceilings.host_link_gbps is None  # no host link to a GPU


@pytest.mark.gpu
def test_a_gpu_measures_its_host_link():
    """The pinned copy onto the GPU, at most what a PCIe 5.0 x16 link carries (64 GB/s a direction) plus NVLink-C2C's
    450 on a Grace host; at least 1 GB/s."""
    ceilings = measure_ceilings(torch.device("cuda"), torch.bfloat16)
    assert 1 < ceilings.host_link_gbps < 500


@pytest.mark.parametrize("capability, reason", [((8, 0), "NVIDIA A100 is sm_80: FP8 GEMMs need a CUDA GPU of "
                                                         "compute capability 8.9+"),
                                                ((8, 9), None), ((9, 0), None), ((12, 0), None)])
def test_fp8_ceilings_are_measured_on_sm89_and_later(monkeypatch, capability, reason):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert device.fp8_gemm_unavailable_reason(torch.device("cuda", 0)) == reason


def test_the_fp8_gemm_is_torchaos_per_row_layout():
    """Runs on the CPU (torch._scaled_mm has a CPU kernel): e4m3 operands, the weight passed transposed."""
    a, weight = (torch.randn(64, 64).to(torch.float8_e4m3fn) for _ in range(2))
    out = device._fp8_gemm(a, weight)()
    assert out.dtype == torch.bfloat16 and out.shape == (64, 64)
    torch.testing.assert_close(out.float(), a.float() @ weight.float().t(), rtol=2e-2, atol=0.5)


def test_where_there_are_fp8_tensor_cores_the_fp8_gemm_is_measured(monkeypatch):
    """The GPU's path, on the CPU: a device with FP8 tensor cores, small GEMMs."""
    monkeypatch.setattr(device, "fp8_gemm_unavailable_reason", lambda d: None)
    monkeypatch.setitem(device.CEILING_SIZES, "cpu", (128, 2**16))
    ceilings = device.measure_ceilings(torch.device("cpu"), torch.float32)
    assert ceilings.fp8_gemm_tflops > 0 and ceilings.fp8_gemm_unavailable is None
    assert ceilings.gemm_ceiling("fp8") == ("FP8 GEMM", ceilings.fp8_gemm_tflops)

    def refused(a, weight):
        raise RuntimeError("Invalid scaling configuration\nmore")

    monkeypatch.setattr(device, "_fp8_gemm", refused)
    ceilings = device.measure_ceilings(torch.device("cpu"), torch.float32)
    assert ceilings.fp8_gemm_tflops is None
    assert ceilings.fp8_gemm_unavailable == ("torch._scaled_mm with per-row scales failed here: Invalid scaling "
                                             "configuration")


def test_the_cpu_ceiling_gemm_shrinks_for_a_dtype_the_cpu_emulates():
    """fp16 on a 2-core CPU: 2.5 s per 1024^3 GEMM, so 2048^3 x 13 runs would take minutes; the size stops where
    the next one would pass CPU_GEMM_SECONDS. A fast dtype keeps the largest size."""
    emulated = lambda n, dtype: 2.5 * (n / 1024) ** 3  # noqa: E731
    assert device._cpu_gemm_size(torch.float16, 2048, emulated) == 512
    assert device._cpu_gemm_size(torch.float32, 2048, lambda n, dtype: 1e-4) == 2048
    assert device._cpu_gemm_size(torch.float32, 128, lambda n, dtype: 1e-4) == 128

"""The device a run uses: what it is, its measured ceilings (cached), and an optional memory budget."""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .cache import cache_root
from .errors import UserError
from .timing import time_region

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184; '800MB' -> 800000000; '1.5 GiB' works too."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise UserError(f"cannot read the size {text!r}; write it like 16GiB, 800MiB or 12GB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


DEVICE_FORMS = "cuda, cuda:N or cpu"  # what --device takes
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


def pick_device(requested: str | None) -> torch.device:
    """The CUDA device when there is one (or the one asked for), else the CPU.

    Only `cuda`, `cuda:N` and `cpu` are accepted: dit-accel times work on CUDA GPUs and runs its
    scaled-down checks on the CPU; other torch device types (meta holds no data, mps, xpu...) are
    refused with one line, before anything is loaded."""
    if requested is not None and not _DEVICE_PATTERN.fullmatch(requested):
        kind = requested.split(":")[0]
        why = ("meta tensors hold no data, so nothing can run or be timed" if kind == "meta"
               else f"dit-accel runs on CUDA GPUs and on the CPU, not on {kind!r}")
        raise UserError(f"--device {requested}: {why}; pass {DEVICE_FORMS} (or leave --device out)")
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {requested} asked for, but this machine has no CUDA GPU; leave --device out")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {requested} asked for, but this machine has {count} CUDA GPU(s), "
                            f"cuda:0 to cuda:{count - 1}; pass one of them")
        if device.index is None:  # memory queries and caps need an explicit index
            device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    kind: str  # "cuda" or "cpu"
    capability: str | None  # "9.0"
    total_memory_gib: float | None
    torch_version: str

    @classmethod
    def of(cls, device: torch.device) -> "DeviceInfo":
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return cls(props.name, "cuda", f"{props.major}.{props.minor}", props.total_memory / 2**30,
                       torch.__version__)
        return cls(f"CPU ({os.cpu_count()} threads)", "cpu", None, None, torch.__version__)

    @property
    def label(self) -> str:
        """'NVIDIA H200 (sm_90)', or the CPU's name."""
        return f"{self.name} (sm_{self.capability.replace('.', '')})" if self.capability else self.name

    def as_dict(self) -> dict:
        return asdict(self)


def apply_memory_budget(device: torch.device, budget_bytes: int) -> None:
    """Cap this process's CUDA allocations, so a 16 GB card can be reproduced on a bigger one.

    Allocations past the cap raise torch.OutOfMemoryError, which the commands turn into one line.
    """
    if device.type != "cuda":
        raise UserError("--memory-budget applies to CUDA devices only; leave it out on the CPU")
    total = torch.cuda.get_device_properties(device).total_memory
    if budget_bytes > total:
        raise UserError(f"--memory-budget {budget_bytes / 2**30:.1f} GiB exceeds this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(budget_bytes / total, device)


# --- ceilings -----------------------------------------------------------------------------------

FP8 = "fp8"  # the precision of work on e4m3 operands; other work is in the ceilings' `dtype`
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell (sm_100, sm_120)


@dataclass(frozen=True)
class Ceilings:
    """What this device reaches on large, simple work, measured here (not datasheet values).

    gemm_tflops: matrix product in `dtype` (the dtype the block runs in), TFLOP/s.  copy_gbps:
    device-to-device copy, counting bytes read plus bytes written, GB/s.  fp8_gemm_tflops: the
    same GEMM on e4m3 operands with per-row scales, as torchao's FP8 linears run it (`_fp8_gemm`),
    TFLOP/s; None where it was not measured, and `fp8_gemm_unavailable` says why (no CUDA GPU, no
    FP8 tensor cores, or `torch._scaled_mm` refused). host_link_gbps: a copy from pinned host memory onto the
    GPU, bytes copied, GB/s (what streaming blocks from the host moves at; None on the CPU).
    """

    dtype: str
    gemm_tflops: float
    copy_gbps: float
    gemm_shape: tuple[int, int, int]
    copy_bytes: int
    fp8_gemm_tflops: float | None = None
    fp8_gemm_unavailable: str | None = None
    host_link_gbps: float | None = None

    def gemm_ceiling(self, precision: str) -> tuple[str, float | None]:
        """(name, TFLOP/s) of the ceiling matmul work in `precision` is rated against: `FP8` work against
        the FP8 GEMM (None where there is none), work in `dtype` against the GEMM in that dtype."""
        if precision == FP8:
            return "FP8 GEMM", self.fp8_gemm_tflops
        return f"{self.dtype} GEMM", self.gemm_tflops

    def as_dict(self) -> dict:
        return asdict(self)


def _cache_path() -> Path:
    return cache_root() / "ceilings.json"


# Bumped whenever the measurement changes, so values measured the old way are not reused.
_CEILINGS_METHOD = 4  # 2: fastest of the runs, 2048^3 GEMM on the CPU; 3: the FP8 GEMM on sm_89+; 4: the host link

# Per device type: (the GEMMs' n of n x n x n, elements copied). On a GPU: 2^29 elements (1 GiB in bf16)
# copied, far past any L2; on a CPU: a few seconds' worth.
CEILING_SIZES = {"cuda": (8192, 2**30), "cpu": (2048, 2**26)}
HOST_LINK_BYTES = 2**28  # pinned host memory copied onto the GPU per timed run: a block's worth, ~5 ms over PCIe 5


def _cache_key(info: DeviceInfo, dtype: torch.dtype) -> str:
    """Per GPU model, torch version, dtype and method, and per host: the host link is the machine's, not the GPU's."""
    return (f"{info.name}|{info.capability}|torch {info.torch_version}|{dtype}|method {_CEILINGS_METHOD}"
            f"|host {socket.gethostname()}")


def fp8_gemm_unavailable_reason(device: torch.device) -> str | None:
    """Why `device` has no FP8 GEMM ceiling to measure, in words, or None when it has FP8 tensor cores."""
    need = f"FP8 GEMMs need a CUDA GPU of compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+"
    if device.type != "cuda":
        return f"no CUDA GPU: {need}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: {need}"
    return None


def _fp8_gemm(a: torch.Tensor, weight: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The e4m3 GEMM `a @ weight.t()` as torchao's per-row FP8 linears run it: `torch._scaled_mm` of the
    row-major activation `a` [M, K] and the weight [N, K] passed transposed (column-major [K, N]), one
    float32 scale per activation row [M, 1] and per output column [1, N], bf16 out, fast accumulation."""
    scale_a = torch.ones(a.shape[0], 1, device=a.device)
    scale_b = torch.ones(1, weight.shape[0], device=a.device)
    return lambda: torch._scaled_mm(a, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def _fastest_tflops(gemm: Callable[[], torch.Tensor], n: int, device: torch.device) -> float:
    """TFLOP/s of an n x n x n GEMM at its fastest run: other work on the machine can only slow a run down."""
    timing = time_region(gemm, device=device, warmup=3, runs=10)
    return 2 * n**3 / (timing.min_ms * 1e-3) / 1e12


CPU_GEMM_SECONDS = 0.5  # about the longest one GEMM of the CPU's ceiling may take (13 are timed)


def _gemm_seconds(n: int, dtype: torch.dtype) -> float:
    """One n x n x n GEMM on the CPU, warm (the first call of a size carries one-time costs)."""
    a = torch.randn(n, n, dtype=dtype)
    a @ a
    started = time.perf_counter()
    a @ a
    return time.perf_counter() - started


def _cpu_gemm_size(dtype: torch.dtype, largest: int, seconds_of: Callable[[int, torch.dtype], float] = _gemm_seconds
                   ) -> int:
    """The CPU's GEMM size for `dtype`: doubled from 256 while the next size's GEMM (~8x this one's time) would
    stay under CPU_GEMM_SECONDS, up to `largest`, so a dtype the CPU emulates (fp16: 2.5 s per 1024^3 GEMM on a
    2-core host) measures in seconds instead of minutes; the report states the size."""
    n = min(256, largest)
    while n < largest and seconds_of(n, dtype) * 8 <= CPU_GEMM_SECONDS:
        n *= 2
    return n


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Time one large GEMM in `dtype`, the same GEMM in FP8 where the device has FP8 tensor cores, and
    one large copy on `device` (a few seconds). Each is the fastest of its runs."""
    n, copy_elems = CEILING_SIZES[device.type]
    if device.type == "cpu":
        n = _cpu_gemm_size(dtype, n)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemm_tflops = _fastest_tflops(lambda: a @ b, n, device)
    fp8_tflops, fp8_unavailable = None, fp8_gemm_unavailable_reason(device)
    if fp8_unavailable is None:
        try:
            a8, weight8 = (torch.randn(n, n, device=device).to(torch.float8_e4m3fn) for _ in range(2))
            fp8_tflops = _fastest_tflops(_fp8_gemm(a8, weight8), n, device)
        except RuntimeError as exc:  # a torch build without per-row scaled FP8 GEMMs for this GPU
            fp8_unavailable = f"torch._scaled_mm with per-row scales failed here: {str(exc).splitlines()[0]}"
    src = torch.randn(copy_elems // 2, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy = time_region(lambda: dst.copy_(src), device=device, warmup=3, runs=10)
    copy_bytes = 2 * src.numel() * src.element_size()
    return Ceilings(
        dtype=str(dtype).replace("torch.", ""),
        gemm_tflops=gemm_tflops,
        copy_gbps=copy_bytes / (copy.min_ms * 1e-3) / 1e9,
        gemm_shape=(n, n, n),
        copy_bytes=copy_bytes,
        fp8_gemm_tflops=fp8_tflops,
        fp8_gemm_unavailable=fp8_unavailable,
        host_link_gbps=_host_link_gbps(device) if device.type == "cuda" else None,
    )


def _host_link_gbps(device: torch.device) -> float:
    """GB/s of the fastest of a few copies of HOST_LINK_BYTES from pinned host memory onto `device`."""
    host = torch.empty(HOST_LINK_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(HOST_LINK_BYTES, dtype=torch.uint8, device=device)
    copy = time_region(lambda: on_device.copy_(host, non_blocking=True), device=device, warmup=2, runs=5)
    return HOST_LINK_BYTES / (copy.min_ms * 1e-3) / 1e9


def device_ceilings(device: torch.device, dtype: torch.dtype, *, refresh: bool = False) -> tuple[Ceilings, bool]:
    """Ceilings of `device` in `dtype`, measured once per device model and torch version, then cached.

    Returns (ceilings, came_from_cache).
    """
    info = DeviceInfo.of(device)
    path, key = _cache_path(), _cache_key(info, dtype)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not refresh and key in cache:
        try:
            entry = {**cache[key], "gemm_shape": tuple(cache[key]["gemm_shape"])}
            return Ceilings(**entry), True
        except (KeyError, TypeError):
            pass  # an entry this version cannot read: measure again
    ceilings = measure_ceilings(device, dtype)
    cache[key] = ceilings.as_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
    return ceilings, False

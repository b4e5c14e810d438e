"""Where our routed kernels lose: crossover data measured on a device, and the router's lookup of it.

A routed backend (our `fp8`) is not the fastest at every shape: with a short key side (text
cross-attention, Skv 512-777) or a tiny sequence (S = 128) its fixed cost (prep launches, the launch
path) or its short main loop loses to cuDNN's bf16 kernel. `bench-attention --crossover` times the
routed backends against the fallbacks (backends diffusers runs itself: `native`, `cudnn`, `flash`,
...) over `GRIDS[device type]`, a full product Sq x Skv x D at one batch and head count, and writes
the medians to one JSON file per (GPU name, torch version, cuDNN version): `data_file_name`. The files
this package ships live in `crossover_data/`; the router looks its device's file up when a custom
backend is set on a model (`crossover_for`), and a call whose nearest measured point was won by a
fallback goes to that fallback, counted as "routed: <name> measured faster".

The rule (`Crossover.pick`), for a call q [B, Sq, H, D], k [B, Skv, H, D]:
  - no data for the device, the call's dtype, head dim or backend: no opinion (None), the router
    serves the call as it would without data;
  - else the nearest measured point, per axis in log space: rows = B*H*Sq against the measured
    B0*H0*Sq values (work and CTA count scale with B*H*Sq, so a call with twice the heads looks like
    twice the query rows), and Skv against the measured Skv values. Along an axis x is nearer to b
    than to a (a < b neighbours) when x*x >= a*b: integer comparisons only, so torch.compile traces
    the lookup into a constant (shapes are static ints) and eager calls cache it per distinct shape;
  - the backend with the smallest median there, among the routed backend itself and the measured
    fallbacks (a backend that could not run at that point does not count). Beyond the grid the
    edge point answers.

`DIT_ACCEL_CROSSOVER=off` turns routing by crossover off (every servable call served, as before);
`DIT_ACCEL_CROSSOVER=PATH` reads that file instead of the package's (e.g. one just measured).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..cache import cache_root
from ..errors import UserError, first_line
from .backends import BACKENDS, AttentionBackend
from .bench import END_TO_END, AttentionShape, BenchRow, bench_shape

SCHEMA = "dit-accel attention crossover 1"
DATA_PACKAGE_DIR = "crossover_data"  # next to this module: dit_accel/attention/crossover_data/<file name>
ENV_VAR = "DIT_ACCEL_CROSSOVER"  # "off", or the path of a crossover file to use instead of the package's
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
ROUTED_REASON = "routed: {} measured faster"  # the fallback reason of a call the crossover sends away


@dataclass(frozen=True)
class CrossoverGrid:
    """The points a crossover measurement times: every (Sq, Skv, D) of the product, at one B and H."""

    batch: int
    heads: int
    seq_q: tuple[int, ...]
    seq_kv: tuple[int, ...]
    head_dims: tuple[int, ...]

    def shapes(self) -> list[AttentionShape]:
        return [AttentionShape(self.batch, self.heads, sq, skv, d)
                for d in self.head_dims for sq in self.seq_q for skv in self.seq_kv]


# On a GPU: the sequence lengths where the kernel's fixed cost and short key sides show (128/129: one
# tile and one tile plus a row; 512/777: Wan's and H3's text cross-attention) up to the H3 shape, where it
# wins; Skv also takes every Sq, so self-attention is on the grid. 108 shapes, under 3 minutes on an
# H200 with the default backends. The CPU grid is scaled down for the tests, which run the command with a
# stand-in routed backend (the real ones need a GPU, so on a CPU the command refuses); no CPU data is used.
GRIDS = {
    "cuda": CrossoverGrid(1, 56, (128, 129, 1024, 4096, 8192, 30272),
                          (128, 129, 512, 777, 1024, 2048, 4096, 8192, 30272), (64, 128)),
    "cpu": CrossoverGrid(1, 2, (16, 17, 64), (16, 17, 40, 64), (32, 64)),
}
DEFAULT_BACKENDS = ("fp8", "native", "cudnn", "flash")  # ours against diffusers' default and its bf16 peers
MEASURE_WARMUP, MEASURE_RUNS = 3, 10  # measure_here's, bench-attention's defaults
ROUTED_DEVICE_TYPES = ("cuda",)  # where calls are routed by shape: our kernels run on CUDA GPUs only
KERNEL_PACKAGES = ("dit_accel.kernels.fp8_attention",)  # whose sources key a crossover measured here


# --- which data ---------------------------------------------------------------------------------

def device_key(device: torch.device) -> dict[str, Any]:
    """What a crossover is valid for: the GPU's name ("cpu" on the CPU), torch's version and cuDNN's
    (None without it)."""
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}


def describe_key(key: dict[str, Any]) -> str:
    return f"{key['gpu']} (torch {key['torch']}, cuDNN {key['cudnn']})"


def data_file_name(key: dict[str, Any]) -> str:
    """'nvidia-h200_torch-2.13.0-cu130_cudnn-91002.json'."""
    def slug(text: Any) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", str(text).lower()).strip("-")

    return f"{slug(key['gpu'])}_torch-{slug(key['torch'])}_cudnn-{slug(key['cudnn'])}.json"


@functools.lru_cache(maxsize=1)
def kernel_fingerprint() -> str:
    """12 hex digits of a hash over our attention kernels' and their prep's sources: a crossover measured here
    holds for the kernel that was measured, so the cache's key names it (a changed kernel measures again)."""
    digest = hashlib.sha1()
    for package in KERNEL_PACKAGES:
        folder = resources.files(package)
        for entry in sorted((e for e in folder.iterdir() if e.name.endswith(".py")), key=lambda e: e.name):
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes())
    return digest.hexdigest()[:12]


def cache_file(key: dict[str, Any]) -> Path:
    """Where a crossover measured on this machine is kept: beside the device ceilings, one file per device key and
    kernel fingerprint."""
    return cache_root() / "crossover" / data_file_name(key).replace(".json", f"_kernel-{kernel_fingerprint()}.json")


def crossover_for(device: torch.device) -> tuple["Crossover | ConservativeRule | None", str]:
    """What the router routes by on `device`, and one line saying which and from when: DIT_ACCEL_CROSSOVER's file
    (or nothing with =off), the package's data for this GPU, the data measured on this machine (`measure_here`),
    else the conservative rule. On the CPU nothing routes (our kernels do not run there).

    Raises UserError for a file that is not crossover data (the package's or DIT_ACCEL_CROSSOVER's)."""
    override = os.environ.get(ENV_VAR, "")
    if override.lower() == "off":
        return None, f"crossover routing off ({ENV_VAR}=off): every servable call served"
    if override:
        return _load(Path(override).resolve()), f"crossover data {override} ({ENV_VAR})"
    if device.type not in ROUTED_DEVICE_TYPES:
        return None, f"no crossover data for the {device.type.upper()}: every servable call served"
    key = device_key(device)
    packaged = resources.files(__package__) / DATA_PACKAGE_DIR / data_file_name(key)
    if packaged.is_file():
        data = _load(packaged)
        return data, f"crossover data {DATA_PACKAGE_DIR}/{packaged.name}{data.measured_on}"
    cached, _ = _read_cache(key)
    if cached is not None:
        return cached, f"crossover data measured on this machine{cached.measured_on} ({cached.source})"
    return CONSERVATIVE_RULE, (f"no crossover data for {describe_key(key)}: {CONSERVATIVE_RULE.description} "
                               f"(measure it once: any profile-block or generate run, or "
                               f"`dit-accel bench-attention --crossover`)")


def _read_cache(key: dict[str, Any]) -> tuple["Crossover | None", str | None]:
    """The crossover cached for `key`, or (None, why it cannot be used: None where there is no file)."""
    path = cache_file(key)
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
        table = Crossover.from_data(data, str(path))
    except (OSError, ValueError, UserError) as exc:
        return None, f"the cached crossover {path} cannot be read ({first_line(exc)})"
    if table.key != key or data.get("kernel", {}).get("fingerprint") != kernel_fingerprint():
        return None, (f"the cached crossover {path} was measured for {describe_key(table.key)}, kernel "
                      f"{data.get('kernel', {}).get('fingerprint')}, not this device and kernel {kernel_fingerprint()}")
    return table, None


@dataclass(frozen=True)
class MeasuredHere:
    """What routes our kernel's calls on a device after `measure_here`: the data (None: the conservative rule, or
    no routing), the line saying which and from when, seconds spent measuring now (None: nothing measured), and
    the problem of a cache file it replaced (None: there was none)."""

    table: "Crossover | None"
    note: str
    seconds: float | None = None
    replaced: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.note, "measured_now_s": self.seconds, "replaced_cache": self.replaced,
                "measured_at": self.table.measured_at if self.table else None,
                "file": RUN_FILE if self._data_file() else None}

    def copy_into(self, run_dir: Path) -> None:
        """The data routed by, as `RUN_FILE` in a run folder (nothing where there is none: the rule, no routing)."""
        path = self._data_file()
        if path is not None:
            shutil.copyfile(path, run_dir / RUN_FILE)

    def _data_file(self) -> Path | None:
        return Path(self.table.source) if self.table is not None and Path(self.table.source).is_file() else None


RUN_FILE = "crossover.json"  # in a profile-block run folder: the data its device routed by (plan reads it)
MEASURE_STAGE = ("attention crossover: our kernel against diffusers' backends, {} shapes (measured once per GPU, "
                 "torch, cuDNN and kernel, then cached)")


def measure_here(device: torch.device, *, skip: bool = False, progress=None) -> MeasuredHere:
    """Make sure the router has measured data on `device`: where neither DIT_ACCEL_CROSSOVER, the package nor this
    machine's cache has any (and `skip` is not set), time our kernel against diffusers' backends over the GPU grid
    (about 30 s on an H200, once per device, torch, cuDNN and kernel) and cache it, so the router and `plan` read
    it from then on. A corrupt or foreign cache file is replaced (its problem returned, to be said). Nothing is
    measured on the CPU or where our kernel cannot run. `progress`: a profiling.progress.SessionProgress, whose
    stage shows the measurement."""
    routing, note = crossover_for(device)
    backends = [BACKENDS[name] for name in DEFAULT_BACKENDS if BACKENDS[name].unavailable_reason(device) is None]
    if routing is not CONSERVATIVE_RULE or skip or not any(b.routed for b in backends):
        return MeasuredHere(routing if isinstance(routing, Crossover) else None, note)
    key = device_key(device)
    _, problem = _read_cache(key)
    grid = GRIDS[device.type]
    shapes = grid.shapes()
    stage = (progress.stage(MEASURE_STAGE.format(len(shapes)), total=len(shapes)) if progress is not None
             else contextlib.nullcontext(lambda: None))
    started = time.perf_counter()
    with stage as advance:
        _, data = measure_crossover(grid, backends, dtype=torch.bfloat16, device=device,
                                    warmup=MEASURE_WARMUP, runs=MEASURE_RUNS, seed=0,
                                    on_shape=lambda index, count, shape: advance() if index else None)
        advance()
    seconds = round(time.perf_counter() - started, 1)
    data.update(elapsed_s=seconds, command="measured on first use (dit_accel.attention.crossover.measure_here)",
                kernel={"fingerprint": kernel_fingerprint()},
                measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    Crossover.from_data(data, "the measurement")  # what the router will read, checked as it will be
    path = cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    routing, note = crossover_for(device)
    return MeasuredHere(routing, f"{note}, measured now in {seconds} s", seconds, problem)


def packaged_for_gpu(gpu_name: str) -> "Crossover | None":
    """The package's crossover data measured on a GPU of this name (any torch and cuDNN; the first file by name),
    None without one."""
    folder = resources.files(__package__) / DATA_PACKAGE_DIR
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json") and json.loads(entry.read_text()).get("device", {}).get("gpu") == gpu_name:
            return _load(entry)
    return None


def for_run(run_dir: Path, gpu_name: str) -> tuple["Crossover | None", str]:
    """The crossover data a profile-block run's device routed by: the run folder's own copy (`RUN_FILE`), else the
    package's for its GPU; (None, why) without either. What `dit-accel plan` reads our kernel's rates from, and the
    line saying which."""
    own = run_dir / RUN_FILE
    if own.is_file():
        table = _load(own.resolve())
        return table, f"crossover data of the run ({RUN_FILE}, {table.key['gpu']}{table.measured_on})"
    packaged = packaged_for_gpu(gpu_name)
    if packaged is not None:
        return packaged, f"crossover data {DATA_PACKAGE_DIR}/{Path(packaged.source).name}{packaged.measured_on}"
    return None, f"no crossover data for {gpu_name}"


@functools.lru_cache(maxsize=8)
def _load(path: Any) -> "Crossover":
    """Read once per process (per path)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the crossover data {path}: {exc}; fix the file or measure it again "
                        f"with `dit-accel bench-attention --crossover`") from None
    return Crossover.from_data(data, str(path))


# --- the data and its lookup ---------------------------------------------------------------------

def _nearest(axis: tuple[int, ...], x: int) -> int:
    """Index of the value of the ascending `axis` nearest to x in log space (integer compares only)."""
    index = 0
    for i in range(1, len(axis)):
        if x * x >= axis[i - 1] * axis[i]:
            index = i
    return index


@dataclass(frozen=True, eq=False)
class Crossover:
    """One crossover file, read and checked (`from_data`), ready for the router's lookups.

    ms: (head_dim, seq_q, seq_kv) -> backend name -> median ms (None: it could not run there).
    winners: (routed backend, head_dim) -> [seq_q index][seq_kv index] -> the fastest backend's name.
    """

    source: str
    key: dict[str, Any]
    dtype: torch.dtype
    batch: int
    heads: int
    seq_q: tuple[int, ...]
    seq_kv: tuple[int, ...]
    head_dims: tuple[int, ...]
    routed: tuple[str, ...]
    fallbacks: tuple[str, ...]
    ms: dict[tuple[int, int, int], dict[str, float | None]]
    winners: dict[tuple[str, int], tuple[tuple[str, ...], ...]]
    measured_at: str | None = None  # ISO time of the measurement, where the file says
    _rows: tuple[int, ...] = field(init=False)
    _picks: dict[tuple, str | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rows", tuple(self.batch * self.heads * sq for sq in self.seq_q))

    @classmethod
    def from_data(cls, data: Any, source: str) -> "Crossover":
        """Check `data` (a parsed crossover file) against the schema; UserError, one line, if it fails."""
        _check_schema(data, source)
        grid = data["grid"]
        ms = {(p["head_dim"], p["seq_q"], p["seq_kv"]): dict(p["ms"]) for p in data["points"]}
        routed = tuple(b for b in data["backends"] if BACKENDS[b].routed)
        fallbacks = tuple(b for b in data["backends"] if BACKENDS[b].diffusers_backend is not None)
        winners = {}
        for name in routed:
            for d in grid["head_dims"]:
                winners[name, d] = tuple(
                    tuple(_fastest(ms[d, sq, skv], (name, *fallbacks)) for skv in grid["seq_kv"])
                    for sq in grid["seq_q"])
        dtype = next(t for t, n in DTYPE_NAMES.items() if n == data["dtype"])
        measured_at = data.get("measured_at") or (data.get("provenance") or {}).get("timestamp")
        return cls(source, dict(data["device"]), dtype, grid["batch"], grid["heads"], tuple(grid["seq_q"]),
                   tuple(grid["seq_kv"]), tuple(grid["head_dims"]), routed, fallbacks, ms, winners,
                   measured_at if isinstance(measured_at, str) else None)

    @property
    def measured_on(self) -> str:
        """' (measured 2026-12-01)', or '' where the file does not say when."""
        return f" (measured {self.measured_at[:10]})" if self.measured_at else ""

    @staticmethod
    def reason(choice: str) -> str:
        """The fallback reason a call this data sends to `choice` is counted under."""
        return ROUTED_REASON.format(choice)

    def nearest_point(self, batch: int, heads: int, seq_q: int, seq_kv: int) -> tuple[int, int]:
        """(Sq, Skv) of the measured point nearest to the call, per the module's rule."""
        return (self.seq_q[_nearest(self._rows, batch * heads * seq_q)], self.seq_kv[_nearest(self.seq_kv, seq_kv)])

    def _decide(self, backend: str, batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int,
                dtype: torch.dtype) -> str | None:
        table = self.winners.get((backend, head_dim))
        if table is None or dtype != self.dtype:
            return None
        return table[_nearest(self._rows, batch * heads * seq_q)][_nearest(self.seq_kv, seq_kv)]

    def pick(self, backend: str, batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int,
             dtype: torch.dtype) -> str | None:
        """The backend measured fastest for this call (`backend` itself or a fallback's name), or None
        where the data has nothing to say. Eager calls compute it once per distinct shape; under
        torch.compile it is traced on static ints and becomes a constant of the graph."""
        if torch.compiler.is_compiling():
            return self._decide(backend, batch, heads, seq_q, seq_kv, head_dim, dtype)
        key = (backend, batch, heads, seq_q, seq_kv, head_dim, dtype)
        try:
            return self._picks[key]
        except KeyError:
            choice = self._picks[key] = self._decide(*key)
            return choice

    def explain(self, backend: str, shape: AttentionShape, dtype: torch.dtype) -> dict[str, Any] | None:
        """For reports: what the router picks for a call of `shape`, from which measured point, and the
        measured times there; `ratio` is the fastest fallback's ms over `backend`'s (above 1: `backend`
        is faster). None where the data has nothing to say."""
        args = (shape.batch, shape.heads, shape.seq_q, shape.seq_kv)
        picks = self.pick(backend, *args, shape.head_dim, dtype)
        if picks is None:
            return None
        seq_q, seq_kv = self.nearest_point(*args)
        ms = self.ms[shape.head_dim, seq_q, seq_kv]
        fallback = _fastest(ms, self.fallbacks)
        ratio = ms[fallback] / ms[backend] if ms[fallback] is not None and ms[backend] is not None else None
        return {"shape": shape.label, "backend": backend, "picks": picks,
                "nearest_point": AttentionShape(self.batch, self.heads, seq_q, seq_kv, shape.head_dim).label,
                "backend_ms": ms[backend], "fastest_fallback": fallback, "fallback_ms": ms[fallback], "ratio": ratio}


@dataclass(frozen=True)
class ConservativeRule:
    """How the router routes our kernel on a GPU without crossover data (none shipped, none measured here, or the
    measurement skipped): it serves a call only where the kernel's fixed cost is small against its work, and sends
    the rest to diffusers' default backend, never "serve everything".

    What it stands on (the crossover data of the H200 and the H100, `crossover_data/`): our kernel's call costs a
    fixed ~0.1-0.25 ms (its prep's launches and the host path: 0.116 ms at S 128 against cuDNN's 0.040 on the
    H200), and its main loop pays off over long key sides and many query rows only. On both GPUs it lost at every
    measured point with fewer than 4096 keys or fewer than 56 x 4096 query rows (B x H x Sq; at best 0.98x), and
    won at every point with at least 8192 keys and 56 x 8192 query rows (1.07-1.63x). Between those (0.93-1.31x)
    the rule declines: a wrong "decline" costs up to a quarter of such a call, a wrong "serve" 2-5x on a short one.
    Calls outside the rule's backends (fa4, fa3) are served as asked, as before.
    """

    backends: tuple[str, ...] = ("fp8", "fp8-v1")
    min_seq_kv: int = 8192
    min_query_rows: int = 56 * 8192
    fallbacks: tuple[str, ...] = ("native",)
    source: str = "the conservative rule"

    @property
    def description(self) -> str:
        return (f"routed by the conservative rule ({'/'.join(self.backends)} serve calls of at least "
                f"{self.min_seq_kv} keys and {self.min_query_rows} query rows, B x H x Sq; the rest go to diffusers' "
                f"default)")

    @staticmethod
    def reason(choice: str) -> str:
        return f"routed: {choice} by the conservative rule (short keys or few query rows; no crossover data)"

    def pick(self, backend: str, batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int,
             dtype: torch.dtype) -> str | None:
        """`backend` where the rule serves the call, the fallback where it declines, None for other backends.
        Integer compares on the call's static sizes: traced into a constant under torch.compile."""
        if backend not in self.backends:
            return None
        if seq_kv < self.min_seq_kv or batch * heads * seq_q < self.min_query_rows:
            return self.fallbacks[0]
        return backend

    def explain(self, backend: str, shape: AttentionShape, dtype: torch.dtype) -> dict[str, Any] | None:
        """As `Crossover.explain`, with no measured point or times."""
        picks = self.pick(backend, shape.batch, shape.heads, shape.seq_q, shape.seq_kv, shape.head_dim, dtype)
        if picks is None:
            return None
        return {"shape": shape.label, "backend": backend, "picks": picks, "nearest_point": "none (the rule)",
                "backend_ms": None, "fastest_fallback": self.fallbacks[0], "fallback_ms": None, "ratio": None}


CONSERVATIVE_RULE = ConservativeRule()


def _fastest(ms: dict[str, float | None], names: tuple[str, ...]) -> str:
    """The name with the smallest measured time; the first name (the routed backend) if none ran."""
    timed = [(ms[n], i, n) for i, n in enumerate(names) if ms.get(n) is not None]
    return min(timed)[2] if timed else names[0]


def _check_schema(data: Any, source: str) -> None:
    """Raise UserError with the first problem found, in one line."""
    def fail(problem: str) -> None:
        raise UserError(f"crossover data {source} is not valid: {problem}; measure it again with "
                        f"`dit-accel bench-attention --crossover`")

    def positive_ints(value: Any, what: str, ascending: bool = False) -> None:
        if not isinstance(value, list) or not value or not all(type(x) is int and x > 0 for x in value):
            fail(f"{what} must be a non-empty list of positive integers")
        if ascending and value != sorted(set(value)):
            fail(f"{what} must be strictly ascending")

    if not isinstance(data, dict):
        fail("it is not a JSON object")
    if data.get("schema") != SCHEMA:
        fail(f"schema is {data.get('schema')!r}, not {SCHEMA!r}")
    for name, kind in (("device", dict), ("dtype", str), ("grid", dict), ("backends", list), ("points", list),
                       ("command", str)):
        if not isinstance(data.get(name), kind):
            fail(f"{name!r} is missing or not a {kind.__name__}")
    if set(data["device"]) != {"gpu", "torch", "cudnn"}:
        fail(f"device must name gpu, torch and cudnn, not {sorted(data['device'])}")
    if data["dtype"] not in DTYPE_NAMES.values():
        fail(f"dtype {data['dtype']!r} is not one of {', '.join(DTYPE_NAMES.values())}")
    grid = data["grid"]
    for name in ("batch", "heads"):
        if type(grid.get(name)) is not int or grid[name] < 1:
            fail(f"grid {name} must be a positive integer")
    for name in ("seq_q", "seq_kv", "head_dims"):
        positive_ints(grid.get(name), f"grid {name}", ascending=True)
    names = data["backends"]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or len(set(names)) != len(names):
        fail(f"backends {names} name unknown or repeated backends (known: {', '.join(BACKENDS)})")
    if not any(BACKENDS[n].routed for n in names) or not any(BACKENDS[n].diffusers_backend for n in names):
        fail(f"backends {names} need a routed backend (fp8, fa4) and a diffusers one (native, cudnn, ...)")
    expected = {(d, sq, skv) for d in grid["head_dims"] for sq in grid["seq_q"] for skv in grid["seq_kv"]}
    seen = set()
    for point in data["points"]:
        if not isinstance(point, dict) or not isinstance(point.get("ms"), dict):
            fail(f"point {point!r} is not an object with head_dim, seq_q, seq_kv and ms")
        where = (point.get("head_dim"), point.get("seq_q"), point.get("seq_kv"))
        if where not in expected or where in seen:
            fail(f"point (head_dim, seq_q, seq_kv) = {where} is off the grid or repeated")
        seen.add(where)
        times = point["ms"]
        if set(times) != set(names) or not all(
                t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0)
                for t in times.values()):
            fail(f"point {where}: ms must give each of {names} a positive number or null")
    if seen != expected:
        fail(f"{len(expected - seen)} grid point(s) have no measurement, e.g. {min(expected - seen)}")


# --- measuring -----------------------------------------------------------------------------------

def measure_crossover(grid: CrossoverGrid, backends: list[AttentionBackend], *, dtype: torch.dtype,
                      device: torch.device, warmup: int, runs: int, seed: int,
                      on_shape=None) -> tuple[list[BenchRow], dict[str, Any]]:
    """Time every backend end to end at every grid point (bench-attention's engine, timing only);
    returns the rows and the crossover file's data (without `command`/`provenance`, which the caller adds).
    `on_shape(index, count, shape)` is told before each shape."""
    rows: list[BenchRow] = []
    points = []
    shapes = grid.shapes()
    for index, shape in enumerate(shapes):
        if on_shape is not None:
            on_shape(index, len(shapes), shape)
        shape_rows = bench_shape(shape, backends, dtype=dtype, device=device, warmup=warmup, runs=runs, seed=seed,
                                 timing_only=True)
        rows += shape_rows
        by_name = {r.backend: r for r in shape_rows if r.timed == END_TO_END}
        points.append({"head_dim": shape.head_dim, "seq_q": shape.seq_q, "seq_kv": shape.seq_kv,
                       "ms": {b.name: by_name[b.name].median_ms for b in backends},
                       **({"not_run": not_run} if (not_run := {n: r.status for n, r in by_name.items()
                                                                if r.status != "ok"}) else {})})
    data = {"schema": SCHEMA, "device": device_key(device),
            "dtype": DTYPE_NAMES[dtype], "runs": runs, "warmup": warmup,
            "grid": {"batch": grid.batch, "heads": grid.heads, "seq_q": list(grid.seq_q),
                     "seq_kv": list(grid.seq_kv), "head_dims": list(grid.head_dims)},
            "backends": [b.name for b in backends], "points": points}
    return rows, data

"""Shared fixtures: a tiny MiniMax-H3 checkpoint laid out exactly like the real one, and CPU-only set-up."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import sys

# `python -m pytest` (and `python -c` in the tests' subprocesses) put the working directory on sys.path: in the
# repository's root its kernels/ folder would shadow Hugging Face's `kernels` package, which transformers imports
# (`dit_accel/__main__.py` says more). Nothing here imports from the working directory: drop it, and keep it off
# the subprocesses' paths (PYTHONSAFEPATH, Python 3.11+).
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run only in Triton's interpreter (the FP8 prep's tests), and `triton.jit`
    # reads this when it decorates: set before anything imports Triton (torch._dynamo, diffusers and the
    # kernels all do), so every kernel and Triton's own library functions are interpreted alike.
    os.environ["TRITON_INTERPRET"] = "1"

from safetensors.torch import save_file  # noqa: E402
from testing import DATA, cpu_fp8, fake_backend, routed_sdpa  # noqa: E402, F401 (fixtures every module shares)

# MiniMax-H3's public checkpoint index (66.28 GB in 14 shards), copied from the public release.
REAL_H3_INDEX = DATA / "h3_transformer_index.json"

# Same structure and key names as the real H3 transformer, shapes shrunk.
TINY_H3_CONFIG = dict(
    num_attention_heads=2, attention_head_dim=32, hidden_size=48, num_layers=50, num_refiner_layers=2,
    ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=16, freq_dim=16, time_embed_hidden_dim=32,
    time_embed_dim=24, rope_freq_dim=4,
)


def pytest_collection_modifyitems(config, items):
    """Every test marked `gpu` is skipped, with its reason, where there is no CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Test modules skipped whole on a machine without a CUDA GPU. Only GPU modules (named `*_gpu.py`) may be: any
# other module skipped there means the set-up is incomplete (a package `scripts/setup.sh` installs is missing),
# and the run fails, so a CPU machine never passes while running fewer tests than it should.
_SKIPPED_CPU_MODULES: list[str] = []


def pytest_collectreport(report):
    if report.skipped and not torch.cuda.is_available() and report.nodeid.endswith(".py") \
            and not report.nodeid.endswith("_gpu.py"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED_CPU_MODULES.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED_CPU_MODULES:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    for module in _SKIPPED_CPU_MODULES:
        terminalreporter.write_line(f"error: {module}: this module must run on a machine without a GPU; "
                                    "run scripts/setup.sh", red=True)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test, drop what it compiled (dynamo's caches keep the compiled modules, and with them
    their weights) and its cached blocks, so a later test's memory budget counts only its own tensors."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def _test_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _isolated_cache(_test_cache_dir, monkeypatch):
    """Device ceilings are measured once per test session and cached there, never in the user's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(_test_cache_dir))


@pytest.fixture(scope="session")
def real_h3_weight_map() -> dict[str, str]:
    return json.loads(REAL_H3_INDEX.read_text())["weight_map"]


@pytest.fixture(scope="session")
def tiny_h3_config() -> dict:
    return dict(TINY_H3_CONFIG)


@pytest.fixture(scope="session")
def tiny_h3_checkpoint(tmp_path_factory, real_h3_weight_map) -> Path:
    """A random tiny H3 transformer saved in 14 shards with the real index's key -> shard split.

    Stored dtypes follow the real checkpoint: float32 for `_keep_in_fp32_modules`, bfloat16 otherwise.
    """
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    folder = tmp_path_factory.mktemp("tiny_h3") / "transformer"
    weight_map = real_h3_weight_map
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**TINY_H3_CONFIG)
    keep = MiniMaxH3Transformer3DModel._keep_in_fp32_modules
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in model.state_dict().items():
        dtype = torch.float32 if any(m in key.split(".") for m in keep) else torch.bfloat16
        shards.setdefault(weight_map[key], {})[key] = tensor.to(dtype).contiguous()
    folder.mkdir(parents=True)
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name))
    total = sum(t.numel() * t.element_size() for s in shards.values() for t in s.values())
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    model.save_config(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> Path:
    """A tiny random WanPipeline folder (`make-tiny-pipeline wan`), built once; tests that damage one
    copy it first."""
    from dit_accel.pipelines.tiny import make_tiny_pipeline

    folder = tmp_path_factory.mktemp("pipelines") / "wan"
    make_tiny_pipeline("wan", folder, 0)
    return folder


@pytest.fixture(scope="session")
def tiny_h3(tmp_path_factory) -> Path:
    """A tiny random MiniMax-H3 modular pipeline folder (`make-tiny-pipeline h3`), built once."""
    from dit_accel.pipelines.tiny import make_tiny_pipeline

    folder = tmp_path_factory.mktemp("pipelines") / "h3"
    make_tiny_pipeline("h3", folder, 0)
    return folder


@pytest.fixture
def tiny_h3_copy(tiny_h3_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    copy = tmp_path / "transformer"
    shutil.copytree(tiny_h3_checkpoint, copy)
    return copy

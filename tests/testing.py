"""What several test modules share: the test data folder, a routed test-double attention backend, a tiny
MiniMax-H3 transformer, the FP8 prep tests' launch helpers, and the pipeline tests' CLI runner and video
reader. Imported as `testing` (pytest puts tests/ on sys.path: pyproject's `pythonpath`)."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

DATA = Path(__file__).parent / "data"  # public configs and index copied from the real models, and fixtures
FAST_FAMILIES = ("minimax-h3", "wan")  # the fast tier's families: the packed one and the generic path's reference


def slow_beyond(cases, keep: int) -> list:
    """`cases` (parametrize's argument values, tuples or single values) as pytest parameters, those from index `keep`
    on marked `slow`: the fast tier runs the first few, the full suite all."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=() if i < keep else pytest.mark.slow)
            for i, case in enumerate(cases)]


def every_family() -> list:
    """Every served family as a pytest parameter, those past FAST_FAMILIES marked `slow` (the full suite runs them
    all; the fast tier, `pytest -m "not slow"`, the two)."""
    from dit_accel.adapters import FAMILIES

    return [pytest.param(name, marks=() if name in FAST_FAMILIES else pytest.mark.slow) for name in FAMILIES]


# ---------------------------------------------------------------- attention test doubles
def torch_sdpa(q, k, v, scale=None):
    """A routed backend's kernel ([B, S, H, D] in and out) answered by torch SDPA."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          scale=scale).transpose(1, 2)


class RecordingSdpa:
    """A fake custom backend's kernel: records each call's shapes and answers with torch SDPA."""

    def __init__(self):
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, q, k, v, scale=None):
        self.calls.append((tuple(q.shape), tuple(k.shape)))
        return torch_sdpa(q, k, v, scale)


@pytest.fixture
def fake_backend(monkeypatch):
    """Registers a routed backend named `fake` for this test only."""
    from dit_accel.attention import backends
    from dit_accel.attention.backends import AttentionBackend

    kernel = RecordingSdpa()
    backend = AttentionBackend("fake", "test double", kernel, lambda device: None, routed=True,
                               serves_reason=lambda q, k, v: None)
    monkeypatch.setitem(backends.BACKENDS, "fake", backend)
    return kernel


@pytest.fixture
def routed_sdpa(monkeypatch):
    """A routed backend named `fake` whose kernel is torch's SDPA and keeps nothing, for compiled models (the
    `fake_backend` fixture's recorded calls make dynamo guard on their count, which recompiles on every call)."""
    from dit_accel.attention import backends
    from dit_accel.attention.backends import AttentionBackend

    monkeypatch.setitem(backends.BACKENDS, "fake", AttentionBackend("fake", "test double", torch_sdpa,
                                                                    lambda device: None, routed=True,
                                                                    serves_reason=lambda q, k, v: None))


# ---------------------------------------------------------------- tiny models
def tiny_h3_transformer(num_layers: int, num_refiner_layers: int = 2, head_dim: int = 32, rope_freq_dim: int = 4):
    """A MiniMax-H3 transformer with 2 heads of `head_dim` (6 x rope_freq_dim rotary channels: 24 by
    default) and one packed request of 3 text, 8 video and 2 audio rows, as (model, forward kwargs)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=head_dim, hidden_size=48, num_layers=num_layers,
        num_refiner_layers=num_refiner_layers, ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=16,
        freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=24, rope_freq_dim=rope_freq_dim).eval()
    video, audio, text = 8, 2, 3
    s = video + audio + text
    inputs = dict(
        hidden_states=torch.randn(1, video, 16), audio_hidden_states=torch.randn(1, audio, 4),
        encoder_hidden_states=torch.randn(1, text, 16), timestep=torch.tensor([0.5]),
        timestep_indices=torch.zeros(s, dtype=torch.long),
        token_tags=torch.tensor([1] * text + [0] * video + [2] * audio),
        position_ids=torch.stack([torch.arange(s), torch.arange(s) % 2, torch.arange(s) % 4], dim=1),
        text_indices=torch.arange(text), video_indices=torch.arange(text, text + video),
        audio_indices=torch.arange(text + video, s), return_dict=False)
    return model, inputs


def small_block(family: str, dtype: torch.dtype, device: str = "cpu"):
    """(adapter, block 0) of the family's scaled-down config, synthetic weights."""
    from dit_accel.adapters import adapter_for_preset
    from dit_accel.loading.block import synthetic_block

    adapter = adapter_for_preset(family)
    adapter = adapter.scaled_down()
    return adapter, synthetic_block(adapter, 0, torch.device(device), dtype).block


def wan_block_and_inputs(seq_len: int = 20, text_len: int = 7, dim: int = 64, heads: int = 2):
    """A Wan block (`dim` wide, `heads` heads, FFN 128) and its positional inputs: video rows, text rows,
    the timestep projection and no RoPE."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    block = WanTransformerBlock(dim, 128, heads).eval()
    return block, (torch.randn(1, seq_len, dim), torch.randn(1, text_len, dim), torch.randn(1, 6, dim), None)


# ---------------------------------------------------------------- FP8 linears on the CPU
def _cpu_rowwise_scaled_mm() -> bool:
    """torch 2.13's CPU `_scaled_mm` takes row-wise scales; 2.11's takes per-tensor scales only."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t().contiguous().t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.fixture
def cpu_fp8(monkeypatch):
    """torchao's real FP8 quantize path on the CPU: both hardware gates (ours and torchao's) lifted. torchao
    0.18 refuses float8 on the CPU, but the kernel it calls runs there (torch 2.13's CPU `_scaled_mm`)."""
    if not _cpu_rowwise_scaled_mm():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only (2.13 takes rows)")
    import torchao.quantization.quant_api as quant_api

    from dit_accel.patching import fp8_linear

    monkeypatch.setattr(fp8_linear, "fp8_linear_unavailable_reason", lambda device, dtype: None)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularities: None)


# ---------------------------------------------------------------- FP8 prep launches
# `kernels` below is `prep_triton_kernels` as the test imported it (compiled on a GPU machine, interpreted on
# the CPU).
def force_path(monkeypatch, kernels, one_launch: bool) -> None:
    """Every plain call takes the one-launch path (one_launch) or the two-launch path, whatever its length
    (a call with the prologue takes two launches either way)."""
    monkeypatch.setattr(kernels, "SINGLE_LAUNCH_MAX_S", 1 << 30 if one_launch else 0)


def count_launches(monkeypatch, kernels, *, run: bool = True) -> list[str]:
    """The names of the prep kernels launched from here on, in order, however each goes out (Triton's JIT
    or the compiled kernel it returned before: `_launch`); run=False launches nothing."""
    launched = []
    launch = kernels._launch

    def counted(kernel, grid, args, constexprs, spec):
        launched.append(kernel.__name__)
        if run:
            launch(kernel, grid, args, constexprs, spec)

    monkeypatch.setattr(kernels, "_launch", counted)
    return launched


def in_layout(q, k, v, layout: str):
    """The same q, k, v [B, S, H, D] values through the strides prep must read: "contiguous" as they are;
    views of one fused [B, S, 3, H, D] projection ("qkv", Sq == Skv); or transposed [B, H, S, D] storage
    ("heads-major")."""
    if layout == "qkv":
        return torch.stack((q, k, v), dim=2).unbind(2)
    if layout == "heads-major":
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q, k, v


def add_special_heads(q, k, v):
    """An all-zero head, a head with inf and one with NaN (a NaN descale each), on distinct heads where
    there are two or more (b, h)."""
    b, _, h, _ = q.shape
    last = (b - 1, h - 1)
    q[0, q.shape[1] // 2, 0, 3] = float("inf")
    k[last[0], k.shape[1] - 1, last[1], 1] = float("nan")
    v[0, :, 0] = 0
    if b * h > 1:
        q[last[0], :, last[1]] = 0
        v[last[0], 0, last[1], 2] = float("-inf")


# ---------------------------------------------------------------- the command line and its videos
def invoke_cli(*args: str):
    """`dit-accel ARGS` in this process, exceptions raised rather than caught."""
    from click.testing import CliRunner

    from dit_accel.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def fp8_served_by_fake(monkeypatch) -> None:
    """`generate`'s `fp8` served by the routed test backend `fake` (the `fake_backend` fixture) through the real
    patching seam: the FP8 kernel needs a GPU."""
    from dit_accel.commands import generate as generate_command
    from dit_accel.patching import apply

    real_patch = apply.patch_attention
    monkeypatch.setattr(generate_command, "check_attention", lambda attention, device: None)
    monkeypatch.setattr(apply, "patch_attention", lambda pipe, backend="fp8", **kw: real_patch(pipe, "fake", **kw))


def compare_with_fake_fp8(folder: Path, out: Path, monkeypatch) -> tuple[dict, dict]:
    """`generate --compare bf16` (no warm-up) on a tiny pipeline, `fp8` served by `fake`: checks the run and
    that only the fp8 run was patched, with no call falling back; (report.json, the fp8 run's patch summary)."""
    import json

    fp8_served_by_fake(monkeypatch)
    result = invoke_cli("generate", "--pipeline", str(folder), "--out", str(out), "--compare", "bf16", "--no-warmup")
    assert result.exit_code == 0, result.output
    assert "PSNR" in result.output and "speed-up" in result.output
    report = json.loads((out / "report.json").read_text())
    bf16_run, fp8_run = report["runs"]
    assert [bf16_run["attention"], fp8_run["attention"]] == ["bf16", "fp8"]
    assert bf16_run["attention_patch"] == {}
    patch = fp8_run["attention_patch"]
    assert patch["backend"] == "fake" and patch["fallback_calls"] == {}
    return report, patch


def compare_with_the_fp8_kernel(folder: Path, out: Path, monkeypatch) -> tuple[dict, dict]:
    """`generate --compare bf16` on the GPU with the real FP8 kernel (needs sm_89+: skips below), routing by the
    measured crossover off (it would send tiny calls to diffusers' default; tests/attention/test_crossover.py
    covers it): checks the run; (report.json, the fp8 run)."""
    import json

    monkeypatch.setenv("DIT_ACCEL_CROSSOVER", "off")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 kernel needs sm_89 or newer")
    result = invoke_cli("generate", "--pipeline", str(folder), "--out", str(out), "--compare", "bf16",
                        "--device", "cuda", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["run_kind"] == "gpu"
    return report, next(run for run in report["runs"] if run["attention"] == "fp8")


def read_video_frames(path: Path) -> list:
    """Every frame of a video file, as arrays."""
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(path))
    try:
        return [frame for frame in reader]
    finally:
        reader.close()

"""Routing by measured crossover, on the CPU: the lookup's rule on a fixture file
(tests/data/crossover_test_fixture.json: invented numbers, not a measurement), the file checks, no
data leaving the router as it was, the router choosing per shape with counts (eager and inside a
fullgraph-compiled model), and bench-attention's routing table and --crossover measurement."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch._dynamo.testing import CompileCounterWithBackend

from testing import DATA, RecordingSdpa, tiny_h3_transformer, wan_block_and_inputs

from dit_accel.attention import backends, crossover
from dit_accel.attention.backends import AttentionBackend
from dit_accel.attention.bench import AttentionShape
from dit_accel.attention.crossover import Crossover, _nearest, crossover_for
from dit_accel.attention.routing import use_attention_backend
from dit_accel.cli import main
from dit_accel.commands import bench_attention
from dit_accel.errors import UserError

FIXTURE = DATA / "crossover_test_fixture.json"
PACKAGED = Path(crossover.__file__).parent / crossover.DATA_PACKAGE_DIR
BF16 = torch.bfloat16
ROUTED_TO_MATH = "routed: math measured faster"


@pytest.fixture
def table() -> Crossover:
    return Crossover.from_data(json.loads(FIXTURE.read_text()), FIXTURE.name)


@pytest.fixture
def fixture_data(monkeypatch):
    """The router reads the fixture (DIT_ACCEL_CROSSOVER=PATH), whatever the device."""
    monkeypatch.setenv(crossover.ENV_VAR, str(FIXTURE))


@pytest.fixture
def fake_fp8(monkeypatch):
    """`fp8` replaced by a routed double that runs on the CPU and records its calls."""
    kernel = RecordingSdpa()
    monkeypatch.setitem(backends.BACKENDS, "fp8", AttentionBackend("fp8", "test double", kernel, lambda d: None,
                                                                   routed=True))
    return kernel


# --- the lookup -----------------------------------------------------------------------------------

def test_nearest_is_taken_in_log_space_with_integer_compares():
    axis = (128, 512, 2048)
    assert [_nearest(axis, x) for x in (1, 128, 255, 256, 511, 1023, 1024, 10**6)] == [0, 0, 0, 1, 1, 1, 2, 2]


def test_the_lookup_picks_the_fastest_at_the_nearest_measured_point(table):
    def pick(b, h, sq, skv, d=32, dtype=BF16, backend="fp8"):
        return table.pick(backend, b, h, sq, skv, d, dtype)

    # the grid's own points (B1 H2): math wins at (4, 4) and, with fp8 unmeasured there, at (16, 4)
    assert [pick(1, 2, sq, skv) for sq, skv in ((4, 4), (4, 16), (16, 4), (16, 16))] == ["math", "fp8", "math", "fp8"]
    assert pick(1, 2, 4, 4, d=64) == "native"
    # Skv 7 is nearer 4 than 16 in log space (49 < 64), 8 is not (64 >= 64); beyond the grid the edge answers
    assert (pick(1, 2, 16, 7), pick(1, 2, 16, 8), pick(1, 2, 10**6, 1)) == ("math", "fp8", "math")
    # rows = B*H*Sq against 2*Sq (8, 32): at D64, Skv 4, native wins 4 queries and math 16
    assert pick(1, 2, 4, 4, d=64) == "native" and pick(1, 2, 16, 4, d=64) == "math"
    assert pick(1, 8, 4, 4, d=64) == "math" and pick(4, 2, 4, 4, d=64) == "math"  # 4 rows of 8 heads: 16 of 2
    assert pick(1, 2, 7, 4, d=64) == "native" and pick(1, 2, 8, 4, d=64) == "math"  # 14*14 < 8*32 <= 16*16
    # nothing to say: another dtype, head dim or backend
    assert pick(1, 2, 4, 4, dtype=torch.float16) is None
    assert pick(1, 2, 4, 4, d=128) is None
    assert pick(1, 2, 4, 4, backend="fa4") is None
    assert table.nearest_point(1, 8, 4, 7) == (16, 4)


def test_each_distinct_shape_is_decided_once(table, monkeypatch):
    decided = []
    original = Crossover._decide
    monkeypatch.setattr(Crossover, "_decide", lambda self, *key: decided.append(key) or original(self, *key))
    for _ in range(3):
        table.pick("fp8", 1, 2, 4, 4, 32, BF16)
        table.pick("fp8", 1, 2, 16, 16, 32, BF16)
    assert len(decided) == 2


def test_explain_gives_the_measured_ratio(table):
    entry = table.explain("fp8", AttentionShape(1, 2, 4, 4, 32), BF16)
    assert entry["picks"] == "math" and entry["nearest_point"] == "1x2x4x32"
    assert entry["fastest_fallback"] == "math" and entry["ratio"] == pytest.approx(0.03 / 0.50)
    unmeasured = table.explain("fp8", AttentionShape(1, 2, 16, 4, 32), BF16)
    assert unmeasured["picks"] == "math" and unmeasured["backend_ms"] is None and unmeasured["ratio"] is None
    assert table.explain("fp8", AttentionShape(1, 2, 4, 4, 32), torch.float16) is None


# --- the file -------------------------------------------------------------------------------------

def _broken(data: dict, change: str) -> dict:
    data = json.loads(json.dumps(data))
    if change == "schema":
        data["schema"] = "something else"
    elif change == "unknown backend":
        data["backends"] = ["fp8", "native", "warp-drive"]
    elif change == "no fallback":
        data["backends"] = ["fp8"]
    elif change == "missing point":
        data["points"].pop()
    elif change == "off the grid":
        data["points"][0]["seq_q"] = 5
    elif change == "bad time":
        data["points"][0]["ms"]["fp8"] = -1
    elif change == "missing time":
        del data["points"][0]["ms"]["native"]
    elif change == "unsorted axis":
        data["grid"]["seq_kv"] = [16, 4]
    elif change == "no grid":
        del data["grid"]
    elif change == "no key":
        del data["device"]["torch"]
    return data


@pytest.mark.parametrize("change, words", [
    ("schema", "schema is 'something else'"), ("unknown backend", "unknown or repeated backends"),
    ("no fallback", "need a routed backend"), ("missing point", "have no measurement"),
    ("off the grid", "off the grid"), ("bad time", "positive number or null"), ("missing time", "positive number"),
    ("unsorted axis", "strictly ascending"), ("no grid", "'grid' is missing"),
    ("no key", "device must name gpu, torch and cudnn"),
])
def test_a_bad_crossover_file_is_one_line_naming_it(tmp_path, monkeypatch, change, words):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_broken(json.loads(FIXTURE.read_text()), change)))
    monkeypatch.setenv(crossover.ENV_VAR, str(bad))
    with pytest.raises(UserError) as caught:
        crossover_for(torch.device("cpu"))
    message = str(caught.value)
    assert str(bad) in message and words in message and "\n" not in message, message


def test_a_file_that_is_not_json_is_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv(crossover.ENV_VAR, str(bad))
    with pytest.raises(UserError, match="cannot read the crossover data .*bad.json"):
        crossover_for(torch.device("cpu"))


def test_every_packaged_crossover_file_is_valid_and_named_by_its_key():
    for path in sorted(PACKAGED.glob("*.json")):
        data = json.loads(path.read_text())
        Crossover.from_data(data, path.name)
        assert path.name == crossover.data_file_name(data["device"])


def test_a_gpu_without_data_is_routed_by_the_conservative_rule_and_the_cpu_by_nothing(monkeypatch):
    monkeypatch.delenv(crossover.ENV_VAR, raising=False)
    assert crossover_for(torch.device("cpu")) == (None, "no crossover data for the CPU: every servable call served")
    monkeypatch.setattr(crossover, "device_key", lambda device: {"gpu": "NVIDIA H999", "torch": "9.9", "cudnn": 1})
    table, note = crossover_for(torch.device("cuda"))
    assert table is crossover.CONSERVATIVE_RULE
    assert note.startswith("no crossover data for NVIDIA H999 (torch 9.9, cuDNN 1): routed by the conservative rule")
    monkeypatch.setenv(crossover.ENV_VAR, "off")
    assert crossover_for(torch.device("cuda"))[0] is None


def test_the_file_name_is_the_key():
    key = {"gpu": "NVIDIA H200", "torch": "2.13.0+cu130", "cudnn": 91002}
    assert crossover.data_file_name(key) == "nvidia-h200_torch-2.13.0-cu130_cudnn-91002.json"


def test_the_help_text_names_the_library_grid_and_backends():
    grid = crossover.GRIDS["cuda"]
    assert bench_attention.HELP_CROSSOVER_GRID == " x ".join(
        ",".join(map(str, axis)) for axis in (grid.seq_q, grid.seq_kv, grid.head_dims))
    assert bench_attention.HELP_CROSSOVER_BACKENDS == crossover.DEFAULT_BACKENDS
    assert (grid.batch, grid.heads) == (1, 56)


# --- the router -----------------------------------------------------------------------------------

@torch.no_grad()
def test_the_router_sends_the_short_key_side_to_the_measured_faster_fallback(fixture_data, fake_fp8):
    """Wan's block: self-attention 20 x 20 (nearest (16, 16): fp8 wins) is served, cross-attention to 7
    text tokens (nearest (16, 4): math wins) goes to diffusers' math backend, counted."""
    block, inputs = _bf16_wan_block()
    before = block(*inputs)
    with use_attention_backend(block, "fp8") as routed:
        during = block(*inputs)
        during_again = block(*inputs)
    assert routed.crossover is not None and routed.crossover_note.endswith(f"({crossover.ENV_VAR})")
    assert routed.served_calls == 2 and routed.fallback_calls == {ROUTED_TO_MATH: 2}
    assert [k_shape[1] for _, k_shape in fake_fp8.calls] == [20, 20]
    torch.testing.assert_close(during, before, rtol=2e-2, atol=1e-2)  # bf16: math against SDPA's default
    assert torch.equal(during, during_again)


@torch.no_grad()
def test_a_patch_summary_counts_routed_calls_and_names_its_data(fixture_data, fake_fp8):
    from dit_accel.patching import patch_attention

    block, inputs = _bf16_wan_block()
    with patch_attention(block, "fp8") as patch:
        block(*inputs)
    summary = patch.summary()
    assert summary["served_calls"] == 1 and summary["fallback_calls"] == {ROUTED_TO_MATH: 1}
    assert summary["crossover"] == [f"crossover data {FIXTURE} ({crossover.ENV_VAR})"]


def _bf16_wan_block():
    block, inputs = wan_block_and_inputs()
    return block.to(BF16), tuple(x.to(BF16) if x is not None else None for x in inputs)


@torch.no_grad()
def test_without_data_every_servable_call_is_served(monkeypatch, fake_fp8):
    monkeypatch.delenv(crossover.ENV_VAR, raising=False)
    block, inputs = wan_block_and_inputs()
    with use_attention_backend(block, "fp8") as routed:
        block(*inputs)
    assert routed.crossover is None and "no crossover data for the CPU" in routed.crossover_note
    assert routed.served_calls == 2 and routed.fallback_total == 0


@torch.no_grad()
def test_data_in_another_dtype_routes_nothing(fixture_data, fake_fp8):
    block, inputs = wan_block_and_inputs()  # fp32; the fixture is bf16
    with use_attention_backend(block, "fp8") as routed:
        block(*inputs)
    assert routed.served_calls == 2 and routed.fallback_total == 0


@pytest.mark.slow
def test_a_compiled_model_routes_per_shape_in_one_graph(fixture_data, monkeypatch):
    """fullgraph=True over the router with crossover data: no graph break, one compile, the refiner's
    3-token calls (nearest (4, 4): math) routed and the 13-row main calls (nearest (16, 16)) served by
    the FP8 custom op (its CPU emulation), every call counted."""
    from dit_accel.kernels.fp8_attention.op import FP8_ATTENTION

    monkeypatch.setitem(backends.BACKENDS, "fp8", AttentionBackend(
        "fp8", "the custom op", lambda q, k, v, scale=None: FP8_ATTENTION(q, k, v, scale, "auto"), lambda d: None,
        routed=True))
    torch._dynamo.reset()
    layers, refiner_layers, calls = 2, 2, 3
    model, inputs = tiny_h3_transformer(layers, refiner_layers)
    model = model.to(BF16)
    inputs = {name: x.to(BF16) if torch.is_tensor(x) and x.is_floating_point() else x for name, x in inputs.items()}
    with torch.no_grad(), use_attention_backend(model, "fp8") as routed:
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        outputs = [compiled(**inputs)[0] for _ in range(calls)]  # compiled first: no counter exists before
        eager = model(**inputs)[0]
        explanation = torch._dynamo.explain(model)(**inputs)
    assert counter.frame_count == 1  # neither the served nor the routed calls' counters recompile
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    forwards = calls + 1 + 1  # compiled, eager, explain's
    assert routed.served_calls == layers * forwards
    assert routed.fallback_calls == {ROUTED_TO_MATH: refiner_layers * forwards}
    for out in outputs:
        torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)  # bf16, inductor's own order


# --- bench-attention ------------------------------------------------------------------------------

def test_bench_attention_shows_what_the_router_picks(tmp_path, fixture_data, fake_fp8):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", "--backends", "fp8,native",
                                       "--shapes", "1x2x4x4x32,1x2x16x16x32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    routing = json.loads((out / "report.json").read_text())["crossover"]
    assert routing["source"].startswith("crossover data")
    assert [(e["shape"], e["picks"], e["nearest_point"]) for e in routing["routing"]] == [
        ("1x2x4x32", "math", "1x2x4x32"), ("1x2x16x32", "fp8", "1x2x16x32")]
    assert "Routing by crossover" in result.output and "router picks" in result.output


def test_bench_attention_says_when_there_is_no_crossover_data(tmp_path, monkeypatch, fake_fp8):
    monkeypatch.delenv(crossover.ENV_VAR, raising=False)
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", "--backends", "fp8,native",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "routing: no crossover data for the CPU" in result.output


def test_crossover_measurement_writes_a_file_the_router_reads(tmp_path, monkeypatch, fake_fp8):
    """--crossover on the CPU (its scaled-down grid, a routed double for fp8): the file passes the
    checks, names its key, and routes as its own numbers say."""
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["bench-attention", "--crossover", "--device", "cpu", "--backends",
                                       "fp8,native,math", "--warmup", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    grid = crossover.GRIDS["cpu"]
    files = sorted(out.glob("cpu_torch-*.json"))
    assert len(files) == 1 and {"report.json", "results.csv"} <= {p.name for p in out.iterdir()}
    data = json.loads(files[0].read_text())
    assert files[0].name == crossover.data_file_name(data["device"])
    assert len(data["points"]) == len(grid.shapes()) and data["command"].startswith("dit-accel ")
    assert data["provenance"]["seed"] == 0 and data["elapsed_s"] >= 0
    monkeypatch.setenv(crossover.ENV_VAR, str(files[0]))
    table, _ = crossover_for(torch.device("cpu"))
    for point in data["points"]:
        ms = point["ms"]
        expected = min(("fp8", "native", "math"), key=lambda n: (ms[n], ("fp8", "native", "math").index(n)))
        assert table.pick("fp8", grid.batch, grid.heads, point["seq_q"], point["seq_kv"], point["head_dim"],
                          BF16) == expected
    assert f"Crossover, D{grid.head_dims[0]}" in result.output and files[0].name in result.output


@pytest.mark.parametrize("args, words", [
    (["--crossover", "--shapes", "1x2x64x32"], "--crossover measures its own grid"),
    (["--crossover", "--inputs", "flat"], "--crossover times N(0,1) inputs"),
    (["--crossover"], "--crossover needs a routed backend"),
])
def test_crossover_refusals_are_one_line(tmp_path, args, words):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["bench-attention", "--device", "cpu", *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and words in result.output and result.output.count("\n") == 1
    assert not out.exists()


@pytest.mark.gpu
def test_a_crossover_measured_on_this_gpu_routes_the_model_as_measured(tmp_path, monkeypatch):
    """On a GPU with the FP8 kernel: a two-by-two grid timed with the real backends, written, read back
    by the router, and a Wan block's calls counted where its numbers say."""
    from dit_accel.attention.crossover import CrossoverGrid, measure_crossover

    device = torch.device("cuda")
    chosen = [backends.get_backend(name) for name in ("fp8", "native", "cudnn")]
    if any(b.unavailable_reason(device) for b in chosen):
        pytest.skip("needs fp8, native and cudnn on this GPU")
    grid = CrossoverGrid(1, 2, (20, 4096), (7, 4096), (64,))  # the kernel's head dims are 64 and 128
    _, data = measure_crossover(grid, chosen, dtype=BF16, device=device, warmup=2, runs=10, seed=0)
    data["command"] = "test"
    path = tmp_path / crossover.data_file_name(data["device"])
    path.write_text(json.dumps(data))
    monkeypatch.setenv(crossover.ENV_VAR, str(path))
    table, _ = crossover_for(device)
    expected = {skv: table.pick("fp8", 1, 2, 20, skv, 64, BF16) for skv in (20, 7)}
    block, inputs = wan_block_and_inputs(dim=128)  # 2 heads of 64
    block = block.to(device, BF16)
    inputs = tuple(x.to(device, BF16) if x is not None else None for x in inputs)
    with torch.no_grad(), use_attention_backend(block, "fp8") as routed:
        block(*inputs)
    served = sum(choice == "fp8" for choice in expected.values())
    assert routed.served_calls == served and routed.fallback_total == 2 - served

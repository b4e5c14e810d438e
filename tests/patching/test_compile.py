"""torch.compile of a patched model on the CPU path: the router is traced into one graph, the FP8
custom op is a node of it (its CPU implementation, the float64 emulation, serves the calls), every
call is counted, and later calls reuse the graph."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from testing import tiny_h3_transformer

from dit_accel.attention import backends
from dit_accel.attention.backends import AttentionBackend
from dit_accel.attention.routing import use_attention_backend
from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention
from dit_accel.kernels.fp8_attention.op import FP8_ATTENTION

H3_LAYERS, H3_REFINER_LAYERS = 2, 2
CALLS = 4  # compiled calls after the first


@pytest.fixture
def op_backend(monkeypatch):
    """A routed backend whose kernel is the FP8 custom op (on the CPU: its emulation), on bf16 copies
    of the fp32 tiny model's q, k, v (the op takes bf16/fp16, as the kernel)."""

    def run(q, k, v, scale=None):
        return FP8_ATTENTION(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale, "auto").to(q.dtype)

    backend = AttentionBackend("fp8-op", "the custom op", run, lambda device: None, routed=True)
    monkeypatch.setitem(backends.BACKENDS, "fp8-op", backend)


def test_a_compiled_patched_model_is_one_graph_served_by_the_op(op_backend):
    torch._dynamo.reset()
    model, inputs = tiny_h3_transformer(H3_LAYERS, H3_REFINER_LAYERS)
    calls_per_forward = H3_LAYERS + H3_REFINER_LAYERS
    with torch.no_grad(), use_attention_backend(model, "fp8-op") as routed:
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        outputs = [compiled(**inputs)[0] for _ in range(1 + CALLS)]  # compiled first: no counter exists before
        eager = model(**inputs)[0]
        explanation = torch._dynamo.explain(model)(**inputs)
    assert counter.frame_count == 1  # one compile serves every later call: the counters do not recompile
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert routed.served_calls == calls_per_forward * (2 + CALLS + 1) and routed.fallback_total == 0
    for out in outputs:
        torch.testing.assert_close(out, eager)  # inductor reorders fp32 math outside attention


def test_a_processor_calling_torch_sdpa_is_served_inside_one_compiled_graph(op_backend):
    """CogVideoX's processor calls torch's SDPA itself: the choice its class sets around its call and its file's `F`
    stand-in trace into one graph too, every call counted."""
    from testing import small_block

    torch._dynamo.reset()
    adapter, block = small_block("cogvideox", torch.float32)
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), torch.device("cpu"), torch.float32,
                                 torch.Generator().manual_seed(0))
    with torch.no_grad(), use_attention_backend(block, "fp8-op") as routed:
        eager = block(**inputs)[0]
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(block, backend=counter, fullgraph=True)
        outputs = [compiled(**inputs)[0] for _ in range(1 + CALLS)]
    assert counter.frame_count == 1
    assert routed.served_calls == 1 + 1 + CALLS and routed.fallback_total == 0
    for out in outputs:
        torch.testing.assert_close(out, eager)


def test_the_op_matches_the_emulation_inside_a_model(op_backend):
    """The graph really runs the emulation: the patched model differs from its bf16 attention by the
    e4m3 error, and attention alone equals the emulation bit for bit."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 40, 2, 32, generator=generator).to(torch.bfloat16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: FP8_ATTENTION(q, k, v, None, "auto"), backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), emulate_fp8_attention(q, k, v, out_dtype=q.dtype), rtol=0, atol=0)


def test_fallbacks_inside_a_compiled_model_are_counted_per_call(monkeypatch):
    """A backend that refuses (here: every call) falls back to diffusers' default inside the graph."""
    from dit_accel.attention.backends import BackendCannotServe

    def refuse(q, k, v, scale=None):
        raise BackendCannotServe("head dim 32 not served")

    monkeypatch.setitem(backends.BACKENDS, "refuses", AttentionBackend("refuses", "refuses", refuse, lambda d: None,
                                                                       routed=True))
    torch._dynamo.reset()
    model, inputs = tiny_h3_transformer(H3_LAYERS, H3_REFINER_LAYERS)
    with torch.no_grad(), use_attention_backend(model, "refuses") as routed:
        eager = model(**inputs)[0]
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        for _ in range(1 + CALLS):
            out = compiled(**inputs)[0]
    assert counter.frame_count == 1
    assert routed.served_calls == 0
    assert routed.fallback_calls == {"head dim 32 not served": (H3_LAYERS + H3_REFINER_LAYERS) * (2 + CALLS)}
    torch.testing.assert_close(out, eager)


def test_profile_block_compares_an_eager_and_a_compiled_recipe(tmp_path):
    """profile-block --compare-attn native,native+compile on the CPU: one graph, no break, the compile
    time reported apart, the module table saying the compiled kernels are not attributed, and the
    compiled block's output equal to eager's within fp32 reordering, and what the CPU profiler cannot see of
    it said."""
    import csv
    import json

    from click.testing import CliRunner

    from dit_accel.cli import main
    from dit_accel.profiling.profiler import COMPILED_RANGE_NOTE
    from dit_accel.profiling.results import COMPILED_CPU_NOTE

    torch._dynamo.reset()
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "64", "--runs", "1",
                                       "--warmup", "1", "--compare-attn", "native,native+compile", "--out", str(out)])
    assert result.exit_code == 0, result.output
    eager, compiled = json.loads((out / "report.json").read_text())["runs"]
    assert eager["compile"] is None and eager["backend"] == "native"
    assert compiled["backend"] == "native+compile"
    assert compiled["compile"]["mode"] == "default" and compiled["compile"]["graph_breaks"] == 0
    assert compiled["compile"]["graphs"] >= 1 and compiled["compile"]["first_call_s"] > 0
    assert set(compiled["modules"]) <= {COMPILED_RANGE_NOTE, "outside aten ops"} and COMPILED_RANGE_NOTE in \
        compiled["modules"]
    # ops.csv says the same of the compiled recipe's kernels (not "the block body")
    with (out / "ops.csv").open() as f:
        ranges = {row["range"] for row in csv.DictReader(f) if row["backend"] == "native+compile"}
    assert ranges == {COMPILED_RANGE_NOTE}
    assert compiled["output_vs_reference"]["rel_l2"] < 1e-4
    assert "torch.compile mode default: first call" in result.output
    # What the CPU profiler cannot see of a compiled graph is said, not left to mislead.
    assert COMPILED_CPU_NOTE in " ".join(result.output.split())


@pytest.mark.slow
def test_two_compiled_recipes_report_no_false_recompiles(tmp_path):
    """dynamo's graph counter is process-wide: the second compiled recipe's count starts from its own compile."""
    import json

    from click.testing import CliRunner

    from dit_accel.cli import main

    torch._dynamo.reset()
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "64", "--runs", "1",
                                       "--warmup", "1", "--compare-attn", "native+compile,math+compile",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [r["compile"]["graphs_after_first_call"] for r in runs] == [0, 0]
    assert "recompiled" not in result.output


@pytest.mark.parametrize("args, words", [
    (["--compare-attn", "fp8+prologue,native", "--validate", "2"], "adds the fused prologue, which it does not apply"),
    (["--model", "wan", "--attn", "native+rope"], "+rope serves MiniMax-H3's attention processor"),
])
def test_recipes_a_run_cannot_honour_are_refused_before_it_starts(tmp_path, args, words):
    from click.testing import CliRunner

    from dit_accel.cli import main

    out = tmp_path / "outputs" / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "64", "--runs", "1", *args,
                                       "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and words in result.output and result.output.count("\n") == 1
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_the_fp8_backend_emits_the_op_when_traced_and_refuses_grad_first_either_way(monkeypatch):
    """`get_backend("fp8").run` traced by torch.compile (fullgraph) is the custom op: with `can_implement` let
    through for CPU tensors, the compiled call runs the op's CPU emulation, bit for bit. Eager, the backend calls
    the function, which refuses CPU tensors (BackendCannotServe); inputs that require grad are refused before
    that (Fp8AttentionNoGrad), as the op refuses them."""
    from dit_accel.attention.backends import BackendCannotServe, get_backend
    from dit_accel.kernels.fp8_attention import op
    from dit_accel.kernels.fp8_attention.op import Fp8AttentionNoGrad

    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 24, 2, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    run = get_backend("fp8").run
    with pytest.raises(BackendCannotServe, match="CUDA device"):
        run(q, k, v)
    with pytest.raises(Fp8AttentionNoGrad):
        run(q.requires_grad_(), k, v)
    q.requires_grad_(False)
    torch._dynamo.reset()
    monkeypatch.setattr(op, "can_implement", lambda q, k, v, kernel="auto": None)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(run, backend=counter, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), emulate_fp8_attention(q, k, v, out_dtype=q.dtype), rtol=0, atol=0)
    assert counter.frame_count == 1 and counter.op_count >= 1


def test_the_counters_live_on_the_device_the_model_computes_on(op_backend):
    """A GPU model's counters are GPU tensors: a CPU counter would be a CPU kernel in its compiled graph (a C++
    toolchain check and build on each process's first compile, and no CUDA graphs); the meta device stands in."""
    from dit_accel.seams.counts import CallCounts

    assert CallCounts.on_device_of(torch.nn.Linear(2, 2, device="meta")).device == torch.device("meta")
    assert CallCounts.on_device_of(torch.nn.ReLU()).device == torch.device("cpu")  # no parameters: the CPU
    model, _ = tiny_h3_transformer(H3_LAYERS, H3_REFINER_LAYERS)
    with use_attention_backend(model.to("meta"), "fp8-op") as routed:
        assert routed.counts.device == torch.device("meta")
        assert {count.device for count in routed.counts._counts.values()} == {torch.device("meta")}


@pytest.mark.gpu
def test_gpu_a_compiled_patched_block_has_no_cpu_kernel_and_counts_cuda_graph_replays(monkeypatch):
    """On the GPU the router's counters are GPU tensors: the compiled graph holds no C++ (CPU) kernel, and a CUDA
    graph of the compiled call counts every replay (a scaled-down Wan block: self- and cross-attention served)."""
    from testing import small_block
    from torch._inductor.utils import run_and_get_code

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 kernel needs sm_89 or newer")
    monkeypatch.setenv("DIT_ACCEL_CROSSOVER", "off")  # the counters are under test, not the routing
    torch._dynamo.reset()
    device, dtype = torch.device("cuda"), torch.bfloat16
    adapter, block = small_block("wan", dtype, "cuda")
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), device, dtype,
                                 torch.Generator(device=device).manual_seed(0))
    with torch.no_grad(), use_attention_backend(block, "fp8") as routed:
        assert routed.counts.device.type == "cuda"
        compiled = torch.compile(block, fullgraph=True)
        _, code = run_and_get_code(lambda: compiled(**inputs))
        calls_per_forward = routed.served_calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(**inputs)  # warm-up on a side stream, as CUDA graph capture wants
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled(**inputs)  # captured, not run: counts nothing
        before_replays = routed.served_calls
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        after_replays = routed.served_calls
    assert not any("cpp_fused" in source or "extern \"C\"" in source for source in code)
    assert calls_per_forward == 2 and routed.fallback_total == 0  # self- and cross-attention
    assert before_replays == 2 * calls_per_forward
    assert after_replays == before_replays + 3 * calls_per_forward


def test_a_block_torch_compile_cannot_compile_is_one_line_naming_the_recipe(tmp_path, monkeypatch):
    """torch.compile failing inside a recipe (here inductor raising, as dynamo failed on Mochi's torchao FP8 linears
    under torch 2.11) ends the run with one error line naming the recipe, exit 2, and no run folder."""
    import torch._inductor.compile_fx as compile_fx
    from click.testing import CliRunner

    from dit_accel.cli import main

    def fails(*args, **kwargs):
        raise RuntimeError("Polyfill handler for this method is missing\nsecond line")

    monkeypatch.setattr(compile_fx, "compile_fx", fails)
    torch._dynamo.reset()
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["profile-block", "--device", "cpu", "--seq-len", "64", "--runs", "1",
                                       "--warmup", "1", "--compare-attn", "native,native+compile", "--out", str(out)])
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "native+compile on this block: torch" in error[0] and "could not compile it" in error[0]
    assert "run the recipe without +compile" in error[0]
    assert "Polyfill handler" in error[0] and "second line" not in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_a_block_stack_compiles_block_by_block_sharing_its_graphs_and_is_uncompiled_after():
    """apply_recipe on an nn.ModuleList of blocks (what --validate patches) compiles each block, as diffusers' regional
    compilation does: the second and third block of one class reuse the first one's graphs; on exit every block is
    eager again."""
    from torch._dynamo.utils import counters

    from dit_accel.adapters import adapter_for_preset
    from dit_accel.loading.block import synthetic_block
    from dit_accel.patching.apply import apply_recipe
    from dit_accel.patching.recipe import parse_recipe

    adapter = adapter_for_preset("wan").scaled_down()
    workload = adapter.workload_from_seq_len(64, 1)
    blocks = torch.nn.ModuleList(synthetic_block(adapter, i, torch.device("cpu"), torch.float32, seed=i).block
                                 for i in range(3))
    inputs = adapter.make_inputs(workload, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad(), apply_recipe(blocks, parse_recipe("native+compile")):
        assert all(block._compiled_call_impl is not None for block in blocks)
        graphs = []
        for block in blocks:
            inputs["hidden_states"] = block(**inputs)
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] >= 1 and graphs[1] == graphs[2] == graphs[0]
    assert all(block._compiled_call_impl is None for block in blocks)


def test_mochis_block_compiles_as_one_graph_past_its_per_sample_text_rows(monkeypatch):
    """Mochi's processor finds each sample's text rows with torch.nonzero in a loop: the recipe's compile traces it
    into the block's one graph (a graph break there ran the processor eager and left its linears to frames of
    their own, where torch 2.11 cannot trace torchao's FP8 weights)."""
    from testing import small_block

    from dit_accel.patching.apply import apply_recipe
    from dit_accel.patching.recipe import parse_recipe

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    adapter, block = small_block("mochi", torch.float32)
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), torch.device("cpu"), torch.float32,
                                 torch.Generator().manual_seed(0))
    counter = CompileCounterWithBackend("eager")
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: compile_(fn, backend=counter))
    with torch.no_grad():
        eager = block(**inputs)
        with apply_recipe(block, parse_recipe("native+compile"), adapter=adapter):
            outputs = [block(**inputs) for _ in range(2)]
    torch._dynamo.reset()
    assert counter.frame_count == 1 and not torch._dynamo.utils.counters["graph_break"]
    for out in outputs:
        torch.testing.assert_close(out, eager)

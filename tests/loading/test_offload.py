"""`--offload stream`: the streaming engine on the CPU (diffusers' group offloading hooks, no side
stream), the hidden-transfer arithmetic, and the profile-block wiring; the H3-sized run is a GPU test."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
from click.testing import CliRunner

from testing import slow_beyond

from dit_accel.adapters import BlockAdapter, adapter_for_preset
from dit_accel.loading.block import synthetic_block
from dit_accel.cli import main
from dit_accel.loading.offload import StreamedRun, pack_into_one_buffer, pin_to_host, stream_blocks
from dit_accel.profiling.validate import BlockChain


def tiny_h3_chain(n=3):
    adapter = adapter_for_preset("minimax-h3")
    adapter = adapter.scaled_down()
    device = torch.device("cpu")
    blocks = [synthetic_block(adapter, i, device, torch.float32, seed=i).block for i in range(n)]
    workload = adapter.workload_from_seq_len(1024, 1)
    inputs = adapter.make_inputs(workload, device, torch.float32, torch.Generator().manual_seed(0))
    return BlockChain(blocks), inputs


def test_streamed_chain_gives_the_resident_output():
    chain, inputs = tiny_h3_chain()
    with torch.no_grad():
        resident = chain(**inputs)
    nbytes = sum(p.numel() * p.element_size() for p in chain.parameters())
    assert stream_blocks(chain, torch.device("cpu")) == nbytes
    hooked = [m for m in chain.blocks if getattr(m, "_diffusers_hook", None) is not None]
    assert len(hooked) == len(chain.blocks)  # one offload group per block
    with torch.no_grad():
        assert torch.equal(chain(**inputs), resident)
        # n past the held blocks cycles through them: block i % 3 for i in 0..4
        by_hand = inputs["hidden_states"]
        rest = {k: v for k, v in inputs.items() if k != "hidden_states"}
        for i in range(5):
            by_hand = chain.blocks[i % 3](hidden_states=by_hand, **rest)
        assert torch.equal(chain(**inputs, n=5), by_hand)


def test_pin_to_host_counts_parameters_and_buffers_and_leaves_host_tensors_in_place():
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    tensors = [*block.parameters(), *block.buffers()]
    pointers = [t.data_ptr() for t in tensors]
    assert pin_to_host(block, pin=False) == sum(t.numel() * t.element_size() for t in tensors)
    assert [t.data_ptr() for t in tensors] == pointers  # already on the host: nothing packed or copied
    assert "_dit_accel_host_buffers" not in vars(block)


@pytest.mark.parametrize("streamed_ms, hidden", [(100.0, 1.0), (110.0, 0.5), (120.0, 0.0), (150.0, 0.0), (90.0, 1.0)])
def test_hidden_fraction(streamed_ms, hidden):
    run = StreamedRun(streamed_bytes=int(20e9), h2d_gbps=1000.0, streamed_ms=streamed_ms, resident_ms=100.0,
                      resident_source="test")
    assert run.transfer_ms == pytest.approx(20.0)
    assert run.hidden_fraction == pytest.approx(hidden)
    assert run.as_dict()["hidden_fraction"] == pytest.approx(hidden)
    assert "% of the transfer hidden" in run.summary()


def test_offload_stream_needs_the_validate_chain(tmp_path):
    result = CliRunner().invoke(main, ["profile-block", "--seq-len", "64", "--offload", "stream",
                                       "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "add --validate N" in result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_offload_stream_needs_a_gpu(tmp_path):
    result = CliRunner().invoke(main, ["profile-block", "--seq-len", "64", "--validate", "2", "--offload", "stream",
                                       "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "needs a CUDA device" in result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.gpu
def test_streamed_h3_chain_under_a_small_budget(tmp_path):
    """Eight full-size H3 blocks (10.3 GB) streamed under a 10 GiB cap: resident, with the rest of the session
    (about 15 GiB), they could not be."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = tmp_path / "stream"
    try:
        result = CliRunner().invoke(main, ["profile-block", "--seq-len", "4096", "--runs", "2", "--warmup", "1",
                                           "--validate", "8", "--offload", "stream", "--memory-budget", "10GiB",
                                           "--out", str(out)], catch_exceptions=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    streamed = report["validation"]["streamed"]
    assert report["offload"] == "stream" and report["validation"]["distinct_blocks"] == 8
    assert streamed["streamed_bytes"] > 8 * 1.2e9
    assert 0.0 <= streamed["hidden_fraction"] <= 1.0 and streamed["h2d_gbps"] > 5
    assert "offload stream: streamed" in result.output


def test_a_streamed_module_computes_on_the_device_its_blocks_stream_to():
    """Streamed blocks' parameters live on the host between calls, so patches ask `module_device`, which answers
    the device stream_blocks brings them to, for the model, its stack and each block (a CUDA device stands in
    for the CPU stream here, which cannot be told from the parameters' device otherwise)."""
    from dit_accel.seams.placement import module_device, onload_device

    chain, _ = tiny_h3_chain()
    assert onload_device(chain) is None
    stream_blocks(chain, torch.device("cpu"))
    for module in (chain, chain.blocks, chain.blocks[1]):
        assert onload_device(module) == torch.device("cpu")
        vars(module)["_dit_accel_onload_device"] = torch.device("cuda", 0)
        assert module_device(module) == torch.device("cuda", 0)
    assert module_device(torch.nn.Linear(2, 2)) == torch.device("cpu")


def test_a_torchao_fp8_weight_pins_its_codes_and_leaves_its_scales_to_diffusers():
    """Of an FP8 weight pin_to_host packs the codes only: with every inner tensor pinned torchao would call the weight
    pinned, and diffusers would keep the parameter itself as its host copy (see `_pinned_parts`)."""
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    from dit_accel.loading.block import tensor_bytes
    from dit_accel.loading.offload import _pinned_parts

    weight = Float8Tensor.from_hp(torch.randn(64, 32, dtype=torch.bfloat16), granularity=PerRow())
    assert _pinned_parts(weight) == [weight.qdata] and tensor_bytes(weight) == 64 * 32 + 64 * 4
    plain = torch.ones(3)
    assert _pinned_parts(plain) == [plain]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["minimax-h3", "wan", "cogvideox"])
def test_the_full_recipe_streamed_gives_its_resident_output_and_copies_fp8_weights(family):
    """A whole (small) transformer under our FP8 attention, FP8 linears and compile: streamed from pinned host
    memory (torchao's FP8 weights packed and pinned by pin_to_host, moved by diffusers' group offloading) it gives,
    pass after pass, what the same blocks give resident, and a pass copies the FP8 bytes (about half the bf16
    ones)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from dit_accel.loading.block import param_bytes, tensor_bytes
    from dit_accel.patching.apply import apply_recipe
    from dit_accel.patching.recipe import parse_recipe
    from dit_accel.profiling.validate import build_stack

    cuda, dtype = torch.device("cuda"), torch.bfloat16
    adapter = _small(family, 3)
    inputs = adapter.make_transformer_inputs(adapter.workload_from_seq_len(1024, 1), cuda, dtype,
                                             torch.Generator(device=cuda).manual_seed(0))
    first = synthetic_block(adapter, 0, cuda, dtype).block
    bf16_bytes = 3 * param_bytes(first)

    def run(offload):
        stack = build_stack(adapter, first, 3, device=cuda, dtype=dtype, activation_bytes=0, offload=offload,
                            whole_model=True, fp8_linear=True)
        with torch.no_grad(), apply_recipe(stack.blocks, parse_recipe("fp8+compile")) as applied:
            outputs = [stack.model(**inputs.kwargs) for _ in range(3)]  # from the second on: prefetched blocks
            summary = applied.attention.summary()  # served by the kernel or routed by shape: counted either way
        return stack, outputs[-1], summary["served_calls"] + sum(summary["fallback_calls"].values())

    resident_stack, resident, resident_served = run("resident")
    streamed_stack, streamed, streamed_served = run("stream")
    # Between calls every block's tensors are on the host (of an FP8 weight its inner tensors: diffusers puts those
    # back and leaves the wrapper's device as it was on the GPU).
    held = [*streamed_stack.blocks.parameters(), *streamed_stack.blocks.buffers()]
    assert streamed_stack.blocks[0] is not first
    fp8_weights = [t for t in held if is_traceable_wrapper_subclass(t)]
    assert fp8_weights and all(getattr(t, name).device.type == "cpu" for t in fp8_weights
                               for name in t.__tensor_flatten__()[0])
    assert all(t.device.type == "cpu" for t in held if not is_traceable_wrapper_subclass(t))
    # The FP8 codes and their scales, the rest in bf16: 0.58-0.70x the bf16 bytes for these small blocks.
    assert streamed_stack.streamed_bytes == sum(tensor_bytes(t) for t in held) < 0.75 * bf16_bytes
    assert streamed_served == resident_served > 0
    for r, s in zip(resident, streamed):
        torch.testing.assert_close(s, r, rtol=1e-3, atol=1e-3)


def test_pack_into_one_buffer_keeps_values_and_aligns():
    block = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3, bias=False).to(torch.bfloat16))
    tensors = list(block.parameters())
    before = [t.detach().clone() for t in tensors]
    host = pack_into_one_buffer(tensors)
    assert host.dtype == torch.uint8 and host.numel() == 3 * 256  # 140 B, 28 B, 42 B: each in a 256-byte slot
    base = host.data_ptr()
    assert [t.data_ptr() - base for t in tensors] == [0, 256, 512]
    assert all(torch.equal(t, b) and t.dtype == b.dtype for t, b in zip(tensors, before))
    with torch.no_grad():
        out = block[1](block[0](torch.ones(1, 5)).to(torch.bfloat16))
    assert out.shape == (1, 3)


# --- prefetching, checked on the CPU through a fake side stream ---------------------------------------------------

class _LoggedStream:
    """A side (or default) stream that only logs when the host waits for it."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(("wait", self.name))


@pytest.fixture
def fake_side_stream(monkeypatch):
    """diffusers' streamed group offloading (`use_stream=True`: the lazy prefetch hook, the side stream) on
    the CPU, whose backend has no streams: `stream_blocks`' call to `apply_group_offloading` is served by
    diffusers' own `_apply_group_offloading` with a logged fake stream (and no `record_stream`, which needs
    a real one). Returns the log: ("copy", group, tensor) for each tensor a group copies to the device,
    ("wait", "side") when the host waits for the side stream."""
    import diffusers.hooks
    import diffusers.hooks.group_offloading as go

    log = []
    side, default = _LoggedStream(log, "side"), _LoggedStream(log, "default")

    class Backend:
        def __init__(self, device=None):
            pass

        Stream = staticmethod(lambda: side)
        stream = staticmethod(lambda s: contextlib.nullcontext())
        current_stream = staticmethod(lambda: default)

    def apply(module, *, onload_device, offload_type, num_blocks_per_group, block_modules=None,
              exclude_kwargs=None, **_):
        config = go.GroupOffloadingConfig(
            # cpu:0 compares unequal to a CPU tensor's device, as "cpu" does to a GPU tensor's: diffusers'
            # "was it prefetched?" check (its params still on the offload device) then reads as on a GPU.
            onload_device=onload_device, offload_device=torch.device("cpu", 0),
            offload_type=go.GroupOffloadingType(offload_type), num_blocks_per_group=num_blocks_per_group,
            non_blocking=True, record_stream=False, low_cpu_mem_usage=False, stream=side,
            block_modules=block_modules if block_modules is not None else getattr(
                module, "_group_offload_block_modules", None),
            exclude_kwargs=exclude_kwargs if exclude_kwargs is not None else getattr(module, "_skip_keys", None))
        go._apply_group_offloading(module, config)

    transfer = go.ModuleGroup._transfer_tensor_to_device

    def logged_transfer(group, tensor, source, default_stream):
        log.append(("copy", group, tensor))
        return transfer(group, tensor, source, default_stream)

    monkeypatch.setattr(go, "TorchDeviceBackend", Backend)
    monkeypatch.setattr(diffusers.hooks, "apply_group_offloading", apply)
    monkeypatch.setattr(go.ModuleGroup, "_transfer_tensor_to_device", logged_transfer)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)  # diffusers pins its copies
    return log


def _small(family, num_layers):
    adapter = adapter_for_preset(family)
    return BlockAdapter(adapter.spec, {**adapter.scaled_down_config(), "num_layers": num_layers}, preset=adapter.preset)


@pytest.mark.parametrize("family, whole_model", [("minimax-h3", False), ("minimax-h3", True), ("wan", True)],
                         ids=["h3-chain", "h3-model", "wan-model"])
def test_each_streamed_block_is_prefetched_while_the_one_before_runs(fake_side_stream, family, whole_model):
    """After the first pass (which teaches diffusers the order), every streamed block's copy is issued
    before the previous block's computation (one block ahead), the host waits for it before queuing the
    block's own (so no block reads weights still in flight), and nothing outside the block stacks is
    copied per pass: the `--validate N` chain and `--validate model`'s transformer alike."""
    from dit_accel.profiling.validate import build_stack

    log, cpu, n = fake_side_stream, torch.device("cpu"), 4
    adapter = _small(family, n)
    workload = adapter.workload_from_seq_len(64, 1)
    generator = torch.Generator().manual_seed(0)
    if whole_model:
        arguments = adapter.make_transformer_inputs(workload, cpu, torch.float32, generator).kwargs
    else:
        arguments = {**adapter.make_inputs(workload, cpu, torch.float32, generator), "n": n}

    def stack(offload):
        first = synthetic_block(adapter, 0, cpu, torch.float32, seed=0).block
        return build_stack(adapter, first, n, device=cpu, dtype=torch.float32, activation_bytes=0, offload=offload,
                           whole_model=whole_model)

    with torch.no_grad():
        resident_stack = stack("resident")
        resident = resident_stack.model(**arguments)
        streamed = stack("stream")
        assert list(streamed.model.state_dict()) == list(resident_stack.model.state_dict())  # nothing added or lost
        blocks = list(streamed.blocks if whole_model else streamed.model.blocks)  # the chain is its own stack
        in_blocks = {id(t) for b in blocks for t in [*b.parameters(), *b.buffers()]}
        outside = [t for t in [*streamed.model.parameters(), *streamed.model.buffers()] if id(t) not in in_blocks]
        assert bool(outside) == whole_model
        for block in blocks:
            for linear in (m for m in block.modules() if isinstance(m, torch.nn.Linear)):
                linear.register_forward_pre_hook(lambda m, args, block=block: log.append(("compute", block)))
        streamed.model(**arguments)  # the first pass: diffusers learns the blocks' order
        for _ in range(2):
            log.clear()
            output = streamed.model(**arguments)
            for o, r in zip(output if whole_model else [output], resident if whole_model else [resident]):
                assert torch.equal(o, r)

            def starts(block):
                return next(i for i, e in enumerate(log) if e[0] == "compute" and e[1] is block)

            for i, block in enumerate(blocks):
                copies = [j for j, e in enumerate(log) if e[0] == "copy" and block in e[1].modules]
                assert copies, f"block {i} was not copied to the device in this pass"
                assert max(copies) < starts(block), f"block {i} ran before its copy was issued"
                if i:
                    assert max(copies) < starts(blocks[i - 1]), (
                        f"block {i} was copied after block {i - 1} started: not prefetched one block ahead")
                assert ("wait", "side") in log[max(copies) + 1:starts(block)], (
                    f"block {i} was queued without waiting for its copy on the side stream")
            copied = {id(e[2]) for e in log if e[0] == "copy"}
            assert not [t for t in outside if id(t) in copied], "the parts outside the blocks were copied again"


# Compiled graphs by family whatever the number of blocks: CogVideoX's first block takes its hidden states as a
# strided view (of the patch embedding's joined text and video rows), the later ones contiguous tensors.
_GRAPHS = {"minimax-h3": 1, "wan": 1, "cogvideox": 2}


@pytest.mark.parametrize("family", slow_beyond(list(_GRAPHS), keep=1))
@pytest.mark.parametrize("target", ["blocks", "model"], ids=["validate-stack", "generate-model"])
@pytest.mark.parametrize("attention", ["native", "fake"])
def test_streamed_blocks_compiled_share_one_graph(fake_side_stream, routed_sdpa, family, target, attention):
    """torch.compile on a transformer whose blocks stream (`apply_recipe` on --validate's stack, or on the whole
    model as generate patches it), with diffusers' attention or a routed backend: every block runs the graph its
    class compiled once, no recompile per block, and the output is the eager one; undone, the blocks are eager
    again. Compiling the hooked blocks' whole calls, or the model around them, traced diffusers' offload hooks and
    recompiled per block until dynamo's limit of 8, leaving every later block eager; so did the routing's
    always-called hooks on the attention modules of processors that call torch's SDPA themselves (CogVideoX's: a
    guard on each hook's id, which differs from block to block; on the H200 its full recipe streamed took 1.8x its
    compiled time), which the routing no longer uses."""
    from torch._dynamo.utils import counters

    from dit_accel.loading.offload import own_forwards
    from dit_accel.patching.apply import apply_recipe
    from dit_accel.patching.recipe import parse_recipe
    from dit_accel.profiling.validate import build_stack

    cpu, n = torch.device("cpu"), 12
    adapter = _small(family, n)
    arguments = adapter.make_transformer_inputs(adapter.workload_from_seq_len(64, 1), cpu, torch.float32,
                                                torch.Generator().manual_seed(0)).kwargs
    first = synthetic_block(adapter, 0, cpu, torch.float32, seed=0).block
    stack = build_stack(adapter, first, n, device=cpu, dtype=torch.float32, activation_bytes=0, offload="stream",
                        whole_model=True)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        expected = stack.model(**arguments)
        with apply_recipe(stack.blocks if target == "blocks" else stack.model, parse_recipe(f"{attention}+compile")):
            assert all(forward.compiled for forward in own_forwards(stack.model))
            for _ in range(3):
                outputs = stack.model(**arguments)
            assert stack.model._compiled_call_impl is None  # the parts outside the blocks stay eager
        assert not any(forward.compiled for forward in own_forwards(stack.model))
    assert counters["stats"]["unique_graphs"] == _GRAPHS[family] and counters["frames"]["ok"] >= 1, (
        dict(counters["stats"]))
    assert not [reason for reason in counters["unimplemented"] if "recompile" in reason.lower()]
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_streamed_fp8_weights_under_compile_move_on_every_pass(fake_side_stream, cpu_fp8):
    """FP8 linears and compile on streamed Wan blocks, pass after pass: diffusers moves each torchao weight with
    `torch.utils.swap_tensors`, which refuses a tensor that something holds a weak reference to. With the hooked
    blocks' whole calls compiled from the first pass on (which installs diffusers' prefetch hooks, so the second
    recompiles through them), dynamo held weak references to every weight after the second pass and the third
    failed ("Cannot swap t1 because it has weakref associated with it", as Wan's full recipe streamed did on the
    H200). Compiled inside the hooks, the weights move on every pass and the output is the eager streamed one."""
    import weakref

    from torchao.utils import TorchAOBaseTensor

    from dit_accel.patching.apply import apply_recipe
    from dit_accel.patching.recipe import parse_recipe
    from dit_accel.profiling.validate import build_stack

    cpu, dtype = torch.device("cpu"), torch.bfloat16
    adapter = _small("wan", 3)
    arguments = adapter.make_transformer_inputs(adapter.workload_from_seq_len(64, 1), cpu, dtype,
                                                torch.Generator().manual_seed(0)).kwargs
    first = synthetic_block(adapter, 0, cpu, dtype, seed=0).block
    stack = build_stack(adapter, first, 3, device=cpu, dtype=dtype, activation_bytes=0, offload="stream",
                        whole_model=True, fp8_linear=True)
    fp8_weights = [p for p in stack.blocks.parameters() if isinstance(p, TorchAOBaseTensor)]
    assert fp8_weights
    torch._dynamo.reset()
    with torch.no_grad():
        with apply_recipe(stack.blocks, parse_recipe("native+compile")):
            for _ in range(3):  # the first compiled pass is also the one that teaches diffusers the blocks' order
                outputs = stack.model(**arguments)
                assert not [w for w in fp8_weights if weakref.getweakrefcount(w)]
        expected = stack.model(**arguments)  # eager again
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_generate_counts_only_the_streamed_block_stacks():
    """generate's streamed bytes per pass: the transformer's block stacks, not its parts that stay on the GPU
    nor the other components."""
    from types import SimpleNamespace

    from dit_accel.pipelines.pipeline_folder import streamed_bytes

    transformer = torch.nn.Module()
    transformer.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])  # 3 x 20 floats
    transformer.blocks[0].register_buffer("table", torch.zeros(5))  # buffers stream too
    transformer.proj_out = torch.nn.Linear(4, 100)  # stays on the GPU
    pipe = SimpleNamespace(components={"transformer": transformer, "vae": torch.nn.Linear(8, 8), "scheduler": object()})
    assert streamed_bytes(pipe) == (3 * 20 + 5) * 4


def test_a_model_without_a_block_stack_is_refused_in_one_line():
    from dit_accel.errors import UserError
    from dit_accel.loading.offload import stream_blocks

    with pytest.raises(UserError, match="Linear has none; leave out --offload stream"):
        stream_blocks(torch.nn.Linear(4, 4), torch.device("cpu"))

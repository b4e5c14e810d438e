"""The profiler's attribution on the CPU: ranges, categories and exact op bytes of a real H3 block."""
import pytest
import torch

from dit_accel.adapters import adapter_for_preset
from dit_accel.loading.block import synthetic_block
from dit_accel.profiling.op_bytes import count_op_bytes
from dit_accel.profiling.profiler import profile_block
from dit_accel.profiling.ranges import active_range, instrument


@pytest.fixture(scope="module")
def small_h3():
    adapter = adapter_for_preset("minimax-h3")
    adapter = adapter.scaled_down()
    block = synthetic_block(adapter, 0, torch.device("cpu"), torch.float32).block
    workload = adapter.workload_from_seq_len(128, 1)
    inputs = adapter.make_inputs(workload, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0))
    return adapter, block, workload, inputs


def test_op_bytes_are_exact(small_h3):
    adapter, block, workload, inputs = small_h3
    with instrument(block, adapter.module_ranges, use_nvtx=False), torch.no_grad():
        op_bytes = count_op_bytes(lambda: block(**inputs), adapter.body_label)
    s, hidden = workload.seq_len, adapter.config["hidden_size"]
    # The six AdaLN index_selects: a [3, hidden] table (one timestep x 3 modalities) and S indices in,
    # an [S, hidden] float32 table out.
    per_call = 3 * hidden * 4 + s * 8 + s * hidden * 4
    assert op_bytes[(adapter.body_label, "aten::index_select")] == 6 * per_call
    # The FFN's first linear: x [S, hidden] and W [2*ffn, hidden] in, [S, 2*ffn] out (+ bias none).
    ffn = adapter.config["ffn_dim"]
    mm = op_bytes[("ffn", "aten::mm")]
    first = (s * hidden + hidden * 2 * ffn + s * 2 * ffn) * 4
    second = (s * ffn + ffn * hidden + s * hidden) * 4
    assert mm == first + second


def test_ranges_are_closed_after_the_run(small_h3):
    adapter, block, _, inputs = small_h3
    with instrument(block, adapter.module_ranges, use_nvtx=False), torch.no_grad():
        block(**inputs)
        assert active_range() is None
    assert not block._forward_hooks and not block.attn.to_q._forward_pre_hooks


def test_profile_attributes_every_op_to_a_range_and_category(small_h3):
    adapter, block, _, inputs = small_h3
    profile = profile_block(block, inputs, adapter, device=torch.device("cpu"), warmup=1, runs=2, profiled_runs=1)
    ranges = profile.by_range()
    assert {"qkv projection", "qk-norm", "rope", "attention core", "output projection", "ffn", "norms",
            "AdaLN modulation", adapter.body_label} <= set(ranges)
    categories = profile.by_category()
    assert categories["gemm"]["time_us"] > 0 and categories["attention"]["time_us"] > 0
    for record in profile.kernels:
        if record.range == "attention core":
            assert record.category == "attention"
        if record.range == "ffn" and record.name == "aten::mm":
            assert record.category == "gemm" and record.bytes_est > 0
    assert profile.peak_memory_bytes is None  # no CUDA allocator on the CPU


def test_attention_error_on_the_blocks_own_inputs(small_h3, monkeypatch):
    from dit_accel.attention import backends
    from dit_accel.attention.backends import AttentionBackend
    from dit_accel.profiling.attention_error import attention_errors, capture_attention_inputs

    adapter, block, workload, inputs = small_h3
    finished = []
    hook = block.register_forward_hook(lambda *_: finished.append(True))
    q, k, v = capture_attention_inputs(block, inputs, adapter)
    hook.remove()
    assert not finished  # the forward stopped at the attention call
    heads, head_dim = adapter.config["num_attention_heads"], adapter.config["attention_head_dim"]
    assert q.shape == k.shape == v.shape == (1, workload.seq_len, heads, head_dim)
    monkeypatch.setitem(backends.BACKENDS, "zeros", AttentionBackend(
        "zeros", "test double", lambda q, k, v, scale=None: torch.zeros_like(q), lambda d: None, routed=True))
    errors, reference = attention_errors(q, k, v, ["math", "zeros"])
    assert reference == "float64"
    assert errors["math"] < 1e-6
    assert errors["zeros"] == pytest.approx(1.0)


def test_attention_errors_over_groups_of_heads_equal_all_heads_at_once(monkeypatch):
    """The check adds up squared errors and norms over groups of heads (to bound its memory): one head at a
    time gives the figure all heads at once give, for a backend with a per-head error of its own."""
    from dit_accel.attention import backends
    from dit_accel.attention.backends import AttentionBackend
    from dit_accel.attention.reference import reference_attention, rel_rms_err
    from dit_accel.profiling import attention_error

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 96, 5, 16, generator=generator) for _ in range(3))
    noise = torch.randn(1, 96, 5, 16, generator=generator, dtype=torch.float64) * torch.arange(1, 6).view(1, 1, 5, 1)

    def noisy(q_g, k_g, v_g, scale=None):  # each head off by its own amount, whichever group it is in
        first = next(h for h in range(5) if torch.equal(q_g[:, :, 0], q[:, :, h]))
        return reference_attention(q_g, k_g, v_g) + 0.01 * noise[:, :, first:first + q_g.shape[2]]

    assert attention_error.heads_per_check_group(1, 75600, 128, 2, 4) == 5  # Wan 720p on a GPU: 8 groups of 40
    monkeypatch.setitem(backends.BACKENDS, "noisy", AttentionBackend("noisy", "test double", noisy, lambda d: None))
    whole = rel_rms_err(noisy(q, k, v), reference_attention(q, k, v))
    grouped = []
    for group_bytes in (2**30, 1):  # all five heads at once; one at a time
        monkeypatch.setattr(attention_error, "CHECK_GROUP_BYTES", group_bytes)
        grouped.append(attention_error.attention_errors(q, k, v, ["noisy", "math"])[0])
    assert grouped[0]["noisy"] == pytest.approx(whole, rel=1e-9)
    assert grouped[1]["noisy"] == pytest.approx(whole, rel=1e-9) and grouped[1]["math"] < 1e-6


def test_gpu_work_is_attributed_through_the_runtime_call_that_launched_it():
    """Kernels launched inside aten ops belong to the op's range; Triton and CuTe DSL kernels,
    launched outside any op, to the record_function range around their launch."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from dit_accel.profiling.profiler import _collect

    def cpu(name, parent, id=0):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, id=id,
                               self_cpu_time_total=1.0)

    def gpu(name, id, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, id=id, is_user_annotation=False,
                               time_range=SimpleNamespace(start=100.0, end=100.0 + us))

    attention = cpu("dit-accel/attention core", None)
    zero = cpu("aten::zero_", attention)
    ffn = cpu("dit-accel/ffn", None)
    mm = cpu("aten::mm", ffn)
    add = cpu("aten::add", None)
    gather = cpu("aten::index_select", None)
    inner = cpu("aten::index", gather)  # an op the dispatch-mode pass does not see
    events = [
        attention, zero, ffn, mm, add, gather, inner,
        cpu("cudaLaunchKernel", inner, id=16), gpu("vectorized_gather_kernel", 16, 4.0),
        cpu("cuLaunchKernel", attention, id=11), gpu("_fp8_prep_amax_kernel", 11, 5.0),
        cpu("cuLaunchKernelEx", attention, id=12), gpu("Fp8AttentionSm90_kernel", 12, 300.0),
        cpu("cudaMemsetAsync", zero, id=13), gpu("Memset (Device)", 13, 1.0),
        cpu("cudaLaunchKernel", mm, id=14), gpu("nvjet_sm90_tst", 14, 200.0),
        cpu("cudaLaunchKernel", add, id=15), gpu("vectorized_elementwise_kernel<AddFunctor>", 15, 10.0),
        SimpleNamespace(name="dit-accel/ffn", device_type=DeviceType.CUDA, id=0, is_user_annotation=True,
                        time_range=SimpleNamespace(start=0.0, end=500.0)),  # GPU span of a range: not work
    ]
    prof = SimpleNamespace(events=lambda: events)
    op_bytes = {("ffn", "aten::mm"): 1e6, ("body", "aten::index_select"): 3e5}
    records = {(r.name, r.range): r for r in _collect(prof, 1, "cuda", "body", op_bytes)}
    assert records[("Fp8AttentionSm90_kernel", "attention core")].category == "attention"
    assert records[("_fp8_prep_amax_kernel", "attention core")].category == "quantize"
    assert records[("Memset (Device)", "attention core")].category == "attention"
    assert records[("nvjet_sm90_tst", "ffn")].category == "gemm"
    assert records[("nvjet_sm90_tst", "ffn")].bytes_est == 1e6
    assert records[("vectorized_elementwise_kernel<AddFunctor>", "body")].category == "modulation-elementwise"
    assert records[("vectorized_gather_kernel", "body")].bytes_est == 3e5  # counted at the op the pass saw
    assert sum(r.time_us for r in records.values()) == 520.0  # each piece of work counted once


def test_gemm_kernels_are_told_apart_by_the_op_that_launched_them():
    """One GEMM kernel name, three launchers in one range: under an nn.Linear (aten::linear) it is the linears' work
    (what FP8 linears change), under a 1x1 convolution it is conv work, under a bare matmul it is a GEMM no linear
    launched; the profile's sums tell the linears' time and the bytes of the rest."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from dit_accel.profiling.profiler import BlockProfile, _collect

    def cpu(name, parent, id=0):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, id=id,
                               self_cpu_time_total=1.0)

    def gpu(name, id, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, id=id, is_user_annotation=False,
                               time_range=SimpleNamespace(start=0.0, end=us))

    ffn = cpu("dit-accel/ffn", None)
    linear = cpu("aten::linear", ffn)
    addmm = cpu("aten::addmm", linear)
    conv = cpu("aten::convolution", ffn)
    cudnn = cpu("aten::cudnn_convolution", cpu("aten::_convolution", conv))
    bmm = cpu("aten::bmm", cpu("aten::matmul", ffn))
    events = [ffn, linear, addmm, conv, cudnn, bmm,
              cpu("cudaLaunchKernel", addmm, id=1), gpu("nvjet_sm90_tst", 1, 100.0),
              cpu("cudaLaunchKernel", cudnn, id=2), gpu("nvjet_sm90_tst", 2, 30.0),
              cpu("cudaLaunchKernel", bmm, id=3), gpu("nvjet_sm90_tst", 3, 7.0)]
    op_bytes = {("ffn", "aten::addmm"): 5e6, ("ffn", "aten::convolution"): 3e6, ("ffn", "aten::bmm"): 2e6}
    records = _collect(SimpleNamespace(events=lambda: events), 1, "cuda", "body", op_bytes)
    assert sorted((r.category, r.launched_by or "", r.time_us, r.bytes_est) for r in records) == [
        ("conv", "conv", 30.0, 3e6), ("gemm", "", 7.0, 2e6), ("gemm", "linear", 100.0, 5e6)]
    sums = BlockProfile(None, records, None, 0, 1, "cuda").by_category()
    assert sums["gemm"]["linear_time_us"] == 100.0 and sums["gemm"]["not_linear_bytes_est"] == 2e6
    assert sums["conv"]["linear_time_us"] == 0.0 and sums["conv"]["not_linear_bytes_est"] == 3e6


def test_validate_runs_every_chained_block_on_the_chosen_backend(small_h3, fake_backend):
    from dit_accel.patching.recipe import parse_recipe
    from dit_accel.profiling.validate import validate_chain

    adapter, block, _, inputs = small_h3
    validation = validate_chain(adapter, block, inputs, 4, recipe=parse_recipe("fake"), device=torch.device("cpu"),
                                dtype=torch.float32, block_ms=1.0, activation_bytes=0, warmup=1, runs=2)
    assert validation.chained_blocks == validation.distinct_blocks == 4
    assert len(fake_backend.calls) == 4 * (1 + 2)  # every block of every run, warm-up included
    assert not any("_attention_backend" in vars(m.processor) for m in block.modules() if hasattr(m, "processor"))


def test_a_rate_above_the_copy_ceiling_says_cache_not_a_percentage():
    from dit_accel.profiling.render import _fmt_rate

    assert _fmt_rate({"bytes_est": 1e9, "gbps_est": 352.0, "pct_of_ceiling": 998.0}) == \
        "~352 GB/s (above the copy ceiling: cache-resident)"
    assert _fmt_rate({"bytes_est": 1e9, "gbps_est": 2920.0, "pct_of_ceiling": 68.4}) == "~2.92e+03 GB/s (68%)"
    assert _fmt_rate({"tflops": 850.0, "pct_of_ceiling": 107.0}) == "850 TFLOP/s (107%)"  # past 100%: as measured

"""The routing seam on tiny diffusers blocks (CPU): every attention call reaches a routed backend, masked
calls other than key padding (`test_key_padding`) fall back and are counted, native names set diffusers'
own backend, and leaving the context gives back the original module bit for bit; the same for processors
that call torch's SDPA themselves (CogVideoX, Mochi, Allegro), through their file's `F`."""
from __future__ import annotations

import inspect

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.transformers import transformer_minimax_h3, transformer_wan
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed, MiniMaxH3TransformerBlock

from testing import RecordingSdpa, small_block, wan_block_and_inputs

from dit_accel.attention import backends, routing
from dit_accel.attention.backends import AttentionBackend, BackendCannotServe
from dit_accel.attention.routing import restore_attention_backend, set_attention_backend_by_name, use_attention_backend
from dit_accel.errors import UserError

H3_HIDDEN, H3_HEADS, H3_HEAD_DIM, H3_FFN, H3_TIME_DIM, H3_ROPE_FREQ_DIM = 64, 2, 32, 128, 32, 4


def h3_block_and_inputs(seq_len: int = 24, num_timesteps: int = 2):
    torch.manual_seed(0)
    block = MiniMaxH3TransformerBlock(H3_HIDDEN, H3_HEADS, H3_HEAD_DIM, H3_FFN, H3_TIME_DIM, 1e-6, 1e-6).eval()
    hidden = torch.randn(1, seq_len, H3_HIDDEN)
    temb = torch.randn(num_timesteps, H3_TIME_DIM, dtype=torch.float32)
    adaln_indices = torch.randint(0, 3 * num_timesteps, (seq_len,), dtype=torch.long)
    rows = torch.arange(seq_len)
    position_ids = torch.stack([rows // 8, rows // 4 % 2, rows % 4], dim=1)
    rotary_emb = MiniMaxH3RotaryPosEmbed(rope_freq_dim=H3_ROPE_FREQ_DIM)(position_ids)
    return block, (hidden, temb, adaln_indices, rotary_emb)


def processors(block):
    return [m.processor for m in block.modules() if hasattr(m, "processor")]


@torch.no_grad()
def test_h3_block_every_attention_call_is_routed_and_exit_is_bit_identical(fake_backend):
    block, inputs = h3_block_and_inputs()
    original_dispatch = transformer_minimax_h3.dispatch_attention_fn
    before = block(*inputs)

    with use_attention_backend(block, "fake") as routed:
        assert transformer_minimax_h3.dispatch_attention_fn is not original_dispatch
        during = block(*inputs)

    assert routed.served_calls == 1 and routed.fallback_total == 0
    assert fake_backend.calls == [((1, 24, H3_HEADS, H3_HEAD_DIM), (1, 24, H3_HEADS, H3_HEAD_DIM))]
    torch.testing.assert_close(during, before)
    assert transformer_minimax_h3.dispatch_attention_fn is original_dispatch
    assert all("_attention_backend" not in vars(p) for p in processors(block))
    assert torch.equal(block(*inputs), before)


@torch.no_grad()
def test_wan_block_routes_self_and_cross_attention(fake_backend):
    block, inputs = wan_block_and_inputs()
    original_dispatch = transformer_wan.dispatch_attention_fn
    before = block(*inputs)

    with use_attention_backend(block, "fake") as routed:
        during = block(*inputs)

    assert routed.served_calls == 2 and routed.fallback_total == 0
    assert [k_shape[1] for _, k_shape in fake_backend.calls] == [20, 7]  # self-attention, then the text
    torch.testing.assert_close(during, before)
    assert torch.equal(block(*inputs), before)
    assert transformer_wan.dispatch_attention_fn is original_dispatch


@torch.no_grad()
def test_masked_call_falls_back_to_diffusers_and_is_counted(fake_backend):
    block, (hidden, _, _, rotary_emb) = h3_block_and_inputs()
    seq_len = hidden.shape[1]
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    normed = block.norm1(hidden)
    expected = block.attn(normed, rotary_emb, mask)

    with use_attention_backend(block, "fake") as routed:
        got = block.attn(normed, rotary_emb, mask)

    assert routed.served_calls == 0 and routed.fallback_calls == {"attn_mask given ([24, 24], not key padding)": 1}
    assert fake_backend.calls == []
    assert torch.equal(got, expected)


@torch.no_grad()
def test_backend_that_cannot_serve_falls_back_with_its_reason(monkeypatch):
    def refuses(q, k, v, scale=None):
        raise BackendCannotServe("head dim 32 not served")

    picky = AttentionBackend("picky", "test double", refuses, lambda d: None, routed=True)
    monkeypatch.setitem(backends.BACKENDS, "picky", picky)
    block, inputs = h3_block_and_inputs()
    before = block(*inputs)
    with use_attention_backend(block, "picky") as routed:
        during = block(*inputs)
    assert routed.fallback_calls == {"head dim 32 not served": 1} and routed.served_calls == 0
    assert torch.equal(during, before)


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("family", ["wan", "allegro"])
def test_a_call_the_metadata_check_refuses_falls_back_inside_one_compiled_graph(family, monkeypatch):
    """A backend whose metadata check refuses a call (our fp8 kernel at Allegro's head dim 96) is declined before it
    runs, with the check's reason, so torch.compile traces the fallback in the block's one graph: Wan's calls reach
    the backend through diffusers' dispatch, Allegro's through torch's SDPA in its file, its cross-attention under a
    key-padding bias. Learnt from the `BackendCannotServe` the run raises, the handler was a graph break, and on
    torch 2.11 the trace it discarded left weak references on the block's weights, which then refused to stream
    (diffusers moves torchao's weights with `torch.utils.swap_tensors`): Allegro's full recipe streamed, on the
    H200."""
    runs = []

    def refuses(q, k, v, scale=None):
        runs.append(q.shape)
        raise BackendCannotServe("head dim 96 not served")

    monkeypatch.setitem(backends.BACKENDS, "picky", AttentionBackend(
        "picky", "test double", refuses, lambda d: None, routed=True,
        serves_reason=lambda q, k, v: "head dim 96 not served"))
    adapter, block = small_block(family, torch.float32)
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), torch.device("cpu"), torch.float32,
                                 torch.Generator().manual_seed(0))
    expected = block(**inputs)
    torch._dynamo.reset()
    with use_attention_backend(block, "picky") as routed:
        eager = block(**inputs)
        assert runs == []  # declined before the run: no exception to handle
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(**inputs)
    torch._dynamo.reset()
    calls = 2 * 2  # self- and cross-attention, eager and compiled
    assert routed.fallback_calls == {"head dim 96 not served": calls} and routed.served_calls == 0
    for got in (eager, compiled):
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got,
                                   expected[0] if isinstance(expected, tuple) else expected, rtol=1e-5, atol=1e-5)


def test_autograd_calls_fall_back(fake_backend):
    block, inputs = h3_block_and_inputs()
    with use_attention_backend(block, "fake") as routed:
        block(*inputs)
    assert routed.fallback_calls == {"autograd needed": 1}


@torch.no_grad()
def test_nested_uses_share_one_router_until_the_last_leaves(fake_backend):
    block_a, inputs_a = h3_block_and_inputs()
    block_b, _ = h3_block_and_inputs()
    original_dispatch = transformer_minimax_h3.dispatch_attention_fn
    with use_attention_backend(block_a, "fake") as routed_a:
        router = transformer_minimax_h3.dispatch_attention_fn
        with use_attention_backend(block_b, "fake"):
            assert transformer_minimax_h3.dispatch_attention_fn is router
        assert transformer_minimax_h3.dispatch_attention_fn is router  # block_a still routed
        block_a(*inputs_a)
    assert routed_a.served_calls == 1
    assert transformer_minimax_h3.dispatch_attention_fn is original_dispatch
    assert routing._installed_routers == {}


@torch.no_grad()
def test_native_name_sets_diffusers_backend_and_restores_previous_value():
    block, inputs = h3_block_and_inputs()
    (processor,) = processors(block)
    processor._attention_backend = AttentionBackendName.NATIVE  # a value set before us
    before = block(*inputs)

    swap = set_attention_backend_by_name(block, "math")
    assert processor._attention_backend == AttentionBackendName._NATIVE_MATH
    assert swap.routed is None
    torch.testing.assert_close(block(*inputs), before)
    restore_attention_backend(swap)
    restore_attention_backend(swap)  # twice is harmless

    assert processor._attention_backend == AttentionBackendName.NATIVE
    assert torch.equal(block(*inputs), before)


def test_context_restores_after_an_exception(fake_backend):
    block, _ = h3_block_and_inputs()
    original_dispatch = transformer_minimax_h3.dispatch_attention_fn
    with pytest.raises(RuntimeError, match="boom"):
        with use_attention_backend(block, "fake"):
            raise RuntimeError("boom")
    assert transformer_minimax_h3.dispatch_attention_fn is original_dispatch
    assert "_attention_backend" not in vars(processors(block)[0])


@pytest.mark.parametrize("name, message", [
    ("cudnn-fp8", "needs a CUDA GPU"),  # on a CPU module the device check answers first
    ("fa4", "needs a CUDA GPU"),
    ("nonsense", "pick one of"),
])
def test_unusable_names_are_user_errors(name, message):
    block, _ = h3_block_and_inputs()
    with pytest.raises(UserError, match=message):
        set_attention_backend_by_name(block, name)


def test_benchmark_only_backend_is_refused(monkeypatch):
    bench_only = AttentionBackend("bench-only", "", RecordingSdpa(), lambda d: None)
    monkeypatch.setitem(backends.BACKENDS, "bench-only", bench_only)
    block, _ = h3_block_and_inputs()
    with pytest.raises(UserError, match="benchmark only"):
        set_attention_backend_by_name(block, "bench-only")


def test_module_without_attention_is_a_user_error():
    with pytest.raises(UserError, match="no diffusers attention processors"):
        set_attention_backend_by_name(torch.nn.Linear(4, 4), "native")


def _context_parallel(ring: int, ulysses: int):
    from diffusers import ContextParallelConfig, ParallelConfig

    return ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses))


def _set_parallel_config(block, config):
    for processor in processors(block):
        processor._parallel_config = config


@torch.no_grad()
def test_ulysses_calls_go_through_diffusers_templated_attention_with_our_kernel(fake_backend, monkeypatch):
    """Under Ulysses, diffusers' own context-parallel engine does the all-to-alls; the local
    attention it runs on each rank is the routed backend (stood in for here: one process)."""
    import diffusers.models.attention_dispatch as dispatch

    engine_calls = []

    def templated(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *,
                  forward_op, backward_op, _parallel_config):
        engine_calls.append(_parallel_config)
        return forward_op(None, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                          _parallel_config=_parallel_config)

    # The stand-in must keep the real engine's signature, or this test would pass against a changed diffusers.
    def shape(fn):
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]

    assert shape(templated) == shape(dispatch._templated_context_parallel_attention)
    monkeypatch.setattr(dispatch, "_templated_context_parallel_attention", templated)
    block, inputs = h3_block_and_inputs()
    reference = block(*inputs)
    config = _context_parallel(ring=1, ulysses=2)
    _set_parallel_config(block, config)
    with use_attention_backend(block, "fake") as routed:
        out = block(*inputs)
    assert engine_calls == [config] and routed.served_calls == 1 and routed.fallback_total == 0
    assert len(fake_backend.calls) == 1
    torch.testing.assert_close(out, reference)


@torch.no_grad()
def test_ring_attention_falls_back_to_diffusers_with_its_config_and_is_counted(fake_backend):
    routed = routing.RoutedBackend(backends.get_backend("fake"))
    seen = []

    def diffusers_dispatch(**arguments):
        seen.append((arguments["backend"], arguments["parallel_config"]))
        return torch.zeros_like(arguments["query"])

    q = torch.randn(1, 4, 2, 8)
    ring = _context_parallel(ring=2, ulysses=1)
    out = routed.dispatch({"query": q, "key": q, "value": q, "attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                           "scale": None, "parallel_config": ring}, diffusers_dispatch)
    assert torch.equal(out, torch.zeros_like(q)) and fake_backend.calls == []
    assert seen == [(None, ring)]  # diffusers' default backend runs the ring, with the caller's config
    assert routed.served_calls == 0 and list(routed.fallback_calls.values()) == [1]
    assert next(iter(routed.fallback_calls)).startswith("ring")


@torch.no_grad()
def test_a_key_mask_in_diffusers_two_dimensional_form_is_served_on_the_kept_keys(fake_backend):
    """Kandinsky 6 hands diffusers' dispatch its prompt's mask as [B, S_kv] (bool), which diffusers' native backend
    reads as one row of kept keys per element: the router reads it so, and serves the call on the kept keys."""
    from dit_accel.adapters import adapter_for_preset
    from dit_accel.loading.block import synthetic_block

    adapter = adapter_for_preset("kandinsky-6").scaled_down().for_stack("video_text_transformer_blocks")
    block = synthetic_block(adapter, 0, torch.device("cpu"), torch.float32).block
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), torch.device("cpu"), torch.float32,
                                 torch.Generator().manual_seed(0))
    assert inputs["attn_mask"] is None  # a prompt of all 1024 rows: the pipeline passes no mask
    inputs["attn_mask"] = torch.arange(1024)[None] < 700  # a 700-token prompt, padded to 1024 as the pipeline does
    before = _first(block(**inputs))
    with use_attention_backend(block, "fake") as routed:
        during = _first(block(**inputs))
    assert routed.served_calls == 1 and routed.fallback_total == 0
    assert [k_shape[1] for _, k_shape in fake_backend.calls] == [700]  # the kept keys alone
    torch.testing.assert_close(during, before, rtol=1e-4, atol=1e-5)


# --- processors that call diffusers' dispatch naming no backend ---------------------------------------------

@torch.no_grad()
def test_processors_naming_no_backend_are_routed_by_their_choice_and_exit_is_bit_identical(fake_backend):
    """Cosmos' processors have no `_attention_backend` and call diffusers' dispatch without one: each chosen
    processor's call makes its choice the running one, which its file's router hands the call (a RoutedBackend,
    or, for a native name, the diffusers backend itself); a block not chosen calls diffusers' own dispatch."""
    from diffusers.models.transformers import transformer_cosmos

    adapter, block = small_block("cosmos", torch.float32)
    kept = small_block("cosmos", torch.float32)[1]
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), torch.device("cpu"), torch.float32,
                                 torch.Generator().manual_seed(0))
    assert not any(hasattr(p, "_attention_backend") for p in processors(block))  # what this path is for
    original = transformer_cosmos.dispatch_attention_fn
    before = _first(block(**inputs))

    both = torch.nn.ModuleList([block, kept])
    swap = set_attention_backend_by_name(both, "fake", exclude=(kept,))
    try:
        assert transformer_cosmos.dispatch_attention_fn is not original
        during = _first(block(**inputs))
        _first(kept(**inputs))
    finally:
        restore_attention_backend(swap)
    assert swap.routed.served_calls == 2 and swap.routed.fallback_total == 0  # self- and cross-attention
    assert len(fake_backend.calls) == 2
    torch.testing.assert_close(during, before)
    assert transformer_cosmos.dispatch_attention_fn is original and routing._installed_routers == {}
    assert routing._RUNNING.choice is None and all(routing._CHOICE not in vars(p) for p in processors(block))
    assert torch.equal(_first(block(**inputs)), before)

    seen = []
    real = transformer_cosmos.dispatch_attention_fn

    def recording(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    transformer_cosmos.dispatch_attention_fn = recording
    try:
        with use_attention_backend(block, "native"):
            block(**inputs)
    finally:
        transformer_cosmos.dispatch_attention_fn = real
    assert seen == [AttentionBackendName.NATIVE] * 2


# --- processors that call torch's SDPA themselves ------------------------------------------------------

def _sdpa_block(family: str):
    """(block 0 of the family's scaled-down config, its inputs, its processor's model file)."""
    import sys

    adapter, block = small_block(family, torch.float32)
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), torch.device("cpu"), torch.float32,
                                 torch.Generator().manual_seed(0))
    (processor, *_) = processors(block)
    assert not hasattr(processor, "_attention_backend")  # what this path is for
    return block, inputs, sys.modules[type(processor).__call__.__module__]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
@pytest.mark.parametrize("family, served", [
    ("cogvideox", 1),  # one joint text + video attention
    ("mochi", 1),  # one joint attention per sample, over its valid text rows
    ("allegro", 2),  # self-attention, and the cross-attention to the text under its key-padding bias
])
def test_processors_calling_torch_sdpa_are_routed_and_exit_is_bit_identical(fake_backend, family, served):
    block, inputs, file = _sdpa_block(family)
    functional = file.F
    before = _first(block(**inputs))

    with use_attention_backend(block, "fake") as routed:
        assert file.F is not functional
        during = _first(block(**inputs))

    assert routed.served_calls == served and routed.fallback_total == 0
    assert len(fake_backend.calls) == served
    assert all(q_shape[2:] == k_shape[2:] and q_shape[1] > q_shape[2]  # [B, S, H, D]: rows before heads
               for q_shape, k_shape in fake_backend.calls)
    torch.testing.assert_close(during, before)
    assert file.F is functional and routing._SDPA_STAND_INS.installed == {}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in block.modules())
    assert torch.equal(_first(block(**inputs)), before)


@torch.no_grad()
def test_excluded_modules_keep_torch_sdpa_untouched(fake_backend):
    """Only the chosen modules' calls are routed: the stand-in is per file, the choice per running module."""
    block_a, inputs, _ = _sdpa_block("cogvideox")
    block_b, _, _ = _sdpa_block("cogvideox")
    both = torch.nn.ModuleList([block_a, block_b])
    swap = set_attention_backend_by_name(both, "fake", exclude=(block_a,))
    try:
        block_a(**inputs)
        assert fake_backend.calls == []
        block_b(**inputs)
    finally:
        restore_attention_backend(swap)
    assert swap.routed.served_calls == 1 and len(fake_backend.calls) == 1


@torch.no_grad()
def test_a_chosen_call_that_raises_leaves_no_choice_behind(fake_backend, monkeypatch):
    """A chosen processor's call that raises puts the running choice back as it goes: a kept block's attention,
    called next inside the same swap, runs torch's own call (with forward hooks saying the choice, the hook that
    cleared it did not run on a raise, or ran on every one and recompiled compiled blocks)."""
    block_a, inputs, _ = _sdpa_block("cogvideox")
    block_b, _, _ = _sdpa_block("cogvideox")
    swap = set_attention_backend_by_name(torch.nn.ModuleList([block_a, block_b]), "fake", exclude=(block_a,))
    try:
        with monkeypatch.context() as patched:
            patched.setattr(type(fake_backend), "__call__", lambda self, q, k, v, scale=None: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                block_b(**inputs)
        assert routing._RUNNING.choice is None
        block_a(**inputs)
        assert fake_backend.calls == [] and swap.routed.served_calls == 0
        block_b(**inputs)
        assert len(fake_backend.calls) == 1 and swap.routed.served_calls == 1
    finally:
        restore_attention_backend(swap)


@pytest.mark.slow
@pytest.mark.parametrize("kept_first", [True, False])
def test_compiled_kept_and_chosen_blocks_of_one_class_each_get_their_own_graph(routed_sdpa, kept_first):
    """Blocks compiled one by one (diffusers' regional compilation) share their class's graph unless a guard tells
    them apart: a kept block and a chosen one must not share one (forward hooks, which dynamo does not guard,
    gave the chosen block the kept one's graph, or the other way round, whichever compiled first); chosen blocks
    share theirs. The processors' classes and attributes are as before once the swap is undone."""
    from torch._dynamo.utils import counters

    blocks = [_sdpa_block("cogvideox")[0] for _ in range(3)]
    _, inputs, _ = _sdpa_block("cogvideox")
    classes = [type(p) for b in blocks for p in processors(b)]
    torch._dynamo.reset()
    counters.clear()
    swap = set_attention_backend_by_name(torch.nn.ModuleList(blocks), "fake", exclude=(blocks[0],))
    try:
        for block in blocks:
            block.compile()
        with torch.no_grad():
            for block in (blocks if kept_first else blocks[::-1]):
                block(**inputs)
        assert swap.routed.served_calls == 2 and swap.routed.fallback_total == 0
        assert counters["stats"]["unique_graphs"] == 2  # the kept block's, the chosen ones'
    finally:
        restore_attention_backend(swap)
        for block in blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
    assert [type(p) for b in blocks for p in processors(b)] == classes
    assert not any(routing._CHOICE in vars(p) for b in blocks for p in processors(b))


@torch.no_grad()
def test_nested_swaps_of_one_processor_put_back_each_choice(fake_backend):
    """A processor chosen by two nested swaps runs the inner one's choice, then the outer one's, then its own
    class again."""
    block, inputs, _ = _sdpa_block("cogvideox")
    (processor,) = processors(block)
    own = type(processor)
    outer = set_attention_backend_by_name(block, "fake")
    inner = set_attention_backend_by_name(block, "math")
    block(**inputs)
    assert outer.routed.served_calls == 0
    restore_attention_backend(inner)
    block(**inputs)
    assert outer.routed.served_calls == 1 and type(processor) is not own
    restore_attention_backend(outer)
    assert type(processor) is own and routing._CHOICE not in vars(processor)


@torch.no_grad()
def test_a_torch_kernel_is_forced_inside_processors_calling_torch_sdpa(monkeypatch):
    """`math` forces torch's math kernel around each call (the flash kernel is off inside only); `native`
    changes nothing: it is what these processors run."""
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return original(*args, **kwargs)

    block, inputs, file = _sdpa_block("cogvideox")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    before = _first(block(**inputs))
    with use_attention_backend(block, "math"):
        during = _first(block(**inputs))
    with use_attention_backend(block, "native"):
        assert file.F is torch.nn.functional
        block(**inputs)
    assert seen == [True, False, True] and torch.backends.cuda.flash_sdp_enabled()
    torch.testing.assert_close(during, before)


@torch.no_grad()
def test_a_declined_call_runs_torch_sdpa_forced_to_the_backend_the_crossover_chose(monkeypatch):
    """A call the router declines goes back to torch's own SDPA in torch's layout, under the kernel of the
    diffusers backend it was routed to."""
    flash_on = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        flash_on.append(torch.backends.cuda.flash_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    functional = routing._make_sdpa_stand_in(torch.nn.functional, [])
    routed = routing.RoutedBackend(backends.get_backend("math"))
    monkeypatch.setattr(routed, "decline_reason", lambda arguments: "routed: math measured faster")
    routed._fallback_values["routed: math measured faster"] = AttentionBackendName._NATIVE_MATH
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))  # [B, H, S, D], as torch takes them
    monkeypatch.setattr(routing._RUNNING, "choice", routed)
    out = functional.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert flash_on == [False] and routed.fallback_calls == {"routed: math measured faster": 1}
    torch.testing.assert_close(out, original(q, k, v, scale=0.3))

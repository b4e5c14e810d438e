"""Key-padding masks (`attention.key_padding`): the op against torch's masked SDPA in float64 for every mask
kind it takes or hands back, the router serving the padded text of each family that masks it (the backend sees
only the kept keys), calls it must not serve falling back by reason, and one graph under torch.compile; boolean
key masks found on the device for a backend that takes key lengths (no host read, no op)."""
from __future__ import annotations

import pytest
import torch

from testing import RecordingSdpa, slow_beyond, small_block

from dit_accel.attention import backends
from dit_accel.attention.backends import AttentionBackend
from dit_accel.attention import key_padding
from dit_accel.attention.key_padding import KEY_PADDED_ATTENTION, attend_kept_keys, device_lengths_reason, shape_reason
from dit_accel.attention.routing import use_attention_backend

B, S, H, D = 2, 24, 3, 8


@pytest.fixture(autouse=True)
def no_remembered_masks():
    """Each test starts with no joint mask's rows remembered (`key_padding._REMEMBERED`), so the backend calls it
    counts are its own masks'."""
    key_padding._REMEMBERED.clear()
    yield
    key_padding._REMEMBERED.clear()


def _qkv(seq_q: int = S):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, seq_q, H, D, dtype=torch.float64, generator=generator)
    return q, *(torch.randn(B, S, H, D, dtype=torch.float64, generator=generator) for _ in range(2))


def _sdpa(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            attn_mask=mask).transpose(1, 2)


def _keys(*kept: list[int]) -> torch.Tensor:
    """A bool [B, 1, 1, S] mask keeping, for each batch element, the given keys."""
    mask = torch.zeros(len(kept), 1, 1, S, dtype=torch.bool)
    for b, keys in enumerate(kept):
        mask[b, 0, 0, keys] = True
    return mask


def _joint(*counts: int) -> torch.Tensor:
    """A bool [B, 1, S, S] joint mask: each element's first `count` rows by its first `count` keys."""
    kept = torch.arange(S)[None, :] < torch.tensor(counts)[:, None]
    return (kept[:, None, :, None] & kept[:, None, None, :])


def _joint_of(*kept: list[int]) -> torch.Tensor:
    """A bool [B, 1, S, S] joint mask: each element's given rows by the same keys."""
    rows = _keys(*kept)[:, 0, 0]
    return (rows[:, None, :, None] & rows[:, None, None, :])


def _with(mask: torch.Tensor, *flips: tuple[int, int, int]) -> torch.Tensor:
    """`mask` with the values at (element, query, key) flipped."""
    mask = mask.clone()
    for b, i, j in flips:
        mask[b, 0, i, j] = ~mask[b, 0, i, j]
    return mask


PREFIX, INNER, RUN = list(range(18)), [0, 1, 2, 5, 6, 7, 20, 23], list(range(4, 20))
BIAS = torch.where(torch.arange(S) < 18, 0.0, -10000.0).to(torch.float64).expand(B, H, 1, S)
CASES = {  # mask, (query rows, key rows) of each call the backend gets
    "one prefix for the batch": (_keys(PREFIX, PREFIX), [((B, S), (B, 18))]),
    "a prefix and gathered keys": (_keys(PREFIX, INNER), [((1, S), (1, 18)), ((1, S), (1, 8))]),
    "an additive bias per head": (BIAS, [((B, S), (B, 18))]),
    "a joint mask": (_joint(18, 24), [((1, 18), (1, 18)), ((1, S), (1, S))]),
    "a joint mask of gathered rows": (_joint_of(INNER, PREFIX), [((1, 8), (1, 8)), ((1, 18), (1, 18))]),
    "a joint mask that drops its first row": (_joint_of(INNER[1:], PREFIX), [((1, 7), (1, 7)), ((1, 18), (1, 18))]),
    # off by one value: a key past the kept ones, a dropped query's key, a hole among the kept (each path); the
    # backend answers as the mask's edges say, and the check, read after, has SDPA answer the element again
    "a joint mask that is not an outer product": (_with(_joint(18, 24), (0, 3, 20), (1, 5, 7)),
                                                  [((1, 18), (1, 18)), ((1, S), (1, S))]),
    "a joint mask with a dropped query's key": (_with(_joint(18, 18), (0, 20, 3)),
                                                [((1, 18), (1, 18)), ((1, 18), (1, 18))]),
    "gathered rows that are not an outer product": (_with(_joint_of(INNER, INNER[1:]), (0, 1, 0), (1, 2, 5)),
                                                    [((1, 7), (1, 8)), ((1, 7), (1, 7))]),
    "a joint mask of one run of rows": (_joint_of(RUN, RUN[2:] + [20, 21]), [((1, 16), (1, 16)), ((1, 16), (1, 16))]),
    "a joint mask of one run of rows with a hole": (_with(_joint_of(RUN, RUN), (0, 10, 10)),
                                                    [((1, 16), (1, 16)), ((1, 16), (1, 16))]),
    "a bias that is not key padding": (torch.full((B, 1, 1, S), -0.5, dtype=torch.float64), []),
    "heads that differ": (torch.cat([_keys(PREFIX, PREFIX), _keys(INNER, INNER), _keys(PREFIX, PREFIX)], dim=1), []),
    "an element with no kept key": (_keys(PREFIX, []), [((1, S), (1, 18))]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_op_equals_masked_sdpa_in_float64(case, fake_backend):
    mask, calls = CASES[case]
    q, k, v = _qkv()
    got = KEY_PADDED_ATTENTION(q, k, v, mask, None, "fake")
    expected = _sdpa(q, k, v, mask)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert [(qs[:2], ks[:2]) for qs, ks in fake_backend.calls] == calls


@pytest.mark.gpu
@pytest.mark.parametrize("case", [case for case in CASES if "joint" in case or "gathered rows" in case])
def test_on_the_gpu_a_joint_mask_is_checked_beside_the_backend(case, fake_backend):
    """On a CUDA device the joint check runs on a side stream: the same answers and calls as on the CPU."""
    mask, calls = CASES[case]
    q, k, v = (t.cuda() for t in _qkv())
    mask = mask.cuda()
    got = KEY_PADDED_ATTENTION(q, k, v, mask, None, "fake")
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), rtol=1e-12, atol=1e-12, equal_nan=True)
    assert [(qs[:2], ks[:2]) for qs, ks in fake_backend.calls] == calls


@pytest.fixture
def joint_reads(monkeypatch):
    """The joint masks the op reads on the host (`_read_joint`), as (kept queries, kept keys) counts."""
    reads, read = [], key_padding._read_joint

    def counted(rows, slot):
        kept = read(rows, slot)
        reads.append((int(kept.queries.sum()), int(kept.keys.sum())))
        return kept

    monkeypatch.setattr(key_padding, "_read_joint", counted)
    return reads


def _sequence(masks, device="cpu"):
    """The op on each mask in turn (each a fresh tensor, as a model builds it in each block), its answers checked
    against torch's masked SDPA in float64."""
    q, k, v = (t.to(device) for t in _qkv())
    for mask in masks:
        mask = mask.clone().to(device)
        got = KEY_PADDED_ATTENTION(q, k, v, mask, None, "fake")
        torch.testing.assert_close(got, _sdpa(q, k, v, mask), rtol=1e-12, atol=1e-12, equal_nan=True)


def _per_element_calls(*counts):
    return [((1, n), (1, n)) for n in counts]


def test_a_joint_mask_like_the_last_is_not_read(fake_backend, joint_reads):
    """A joint mask of a slot (shape, element) seen before is taken to keep the last one's rows: nothing is read on
    the host, one backend call per element, the check confirms it."""
    _sequence([_joint(18, 20)] * 3)
    assert joint_reads == [(18, 18), (20, 20)]
    assert [(q[:2], k[:2]) for q, k in fake_backend.calls] == _per_element_calls(18, 20) * 3


def test_a_new_joint_mask_is_answered_on_its_own_rows(fake_backend, joint_reads):
    """The guess is wrong for an element whose mask changed (another prompt, the other pass of classifier-free
    guidance): the backend's call on the guessed rows is wasted, the mask is read and the element answered again,
    and the next mask of the slot is guessed from the new rows. An element whose mask did not change is not read."""
    _sequence([_joint(18, 20), _joint(18, 22), _joint(18, 22)])
    assert joint_reads == [(18, 18), (20, 20), (22, 22)]
    assert [(q[:2], k[:2]) for q, k in fake_backend.calls] == _per_element_calls(18, 20, 18, 20, 22, 18, 22)


def test_a_new_joint_mask_the_batch_shares_is_read_once(fake_backend, joint_reads):
    """One joint mask for the whole batch ([1, 1, S, S]): read once when its guess fails, for every element."""
    _sequence([_joint(18), _joint(20)])
    assert joint_reads == [(18, 18), (20, 20)]
    assert [(q[:2], k[:2]) for q, k in fake_backend.calls] == _per_element_calls(18, 18, 18, 18, 20, 20)


def test_a_wrong_guess_at_a_mask_that_is_no_outer_product_is_answered_by_sdpa(fake_backend, joint_reads):
    """A guessed slot whose new mask is not an outer product: the guess fails, the mask is read, its check fails,
    SDPA answers it with the mask, and the slot is forgotten (the next mask of it is read, not guessed)."""
    broken = _with(_joint(18, 20), (1, 3, 21))
    _sequence([_joint(18, 20), broken, _joint(18, 20)])
    assert joint_reads == [(18, 18), (20, 20), (20, 20), (20, 20)]
    assert [(q[:2], k[:2]) for q, k in fake_backend.calls] == _per_element_calls(18, 20, 18, 20, 20, 18, 20)


@pytest.mark.gpu
def test_on_the_gpu_a_guessed_joint_mask_is_confirmed_beside_the_backend(fake_backend, joint_reads):
    """On a CUDA device: the same answers, reads and calls as on the CPU, the guess's check on the side stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _sequence([_joint(18, 20), _joint(18, 22), _joint(18, 22)], device="cuda")
    assert joint_reads == [(18, 18), (20, 20), (22, 22)]
    assert [(q[:2], k[:2]) for q, k in fake_backend.calls] == _per_element_calls(18, 20, 18, 20, 22, 18, 22)


def test_one_run_of_kept_rows_is_a_view_and_other_rows_an_index():
    """A prefix, a suffix or any one run of kept rows is sliced (a view: no copy, and on a GPU no host sync, which
    indexing by a CPU index costs); other rows are gathered by an index on the tensors' device."""
    kept = torch.zeros(S, dtype=torch.bool)
    for run in (slice(0, 5), slice(19, S), slice(7, 12), slice(3, 3)):
        kept.zero_()
        kept[run] = True
        assert key_padding._selection(kept, torch.device("cpu")) == (run if run.stop > run.start else slice(0, 0))
    kept[[2, 5, 6]] = True
    assert torch.equal(key_padding._selection(kept, torch.device("cpu")), torch.tensor([2, 5, 6]))


def test_shapes_that_are_not_key_padding_are_named():
    q, k, _ = _qkv()
    assert shape_reason(torch.ones(S, S, dtype=torch.bool), q, k) == "[24, 24], not key padding"
    assert shape_reason(torch.ones(B, 1, 1, S, dtype=torch.long), q, k) == "torch.int64, not key padding"
    assert shape_reason(torch.zeros(B, 1, S, S), q, k) == f"[{B}, 1, {S}, {S}], not key padding"  # bias: one row
    assert shape_reason(torch.ones(B, 1, 1, S - 1, dtype=torch.bool), q, k) is not None
    assert shape_reason(_joint(3, 4), q, k) is None and shape_reason(BIAS, q, k) is None


# --- the families that mask their text padding ---------------------------------------------------

# family -> (its block's mask argument, the value that drops a row there, the trailing rows dropped)
PADDED_TEXT = {
    "hunyuan-video": ("attention_mask", False, 1 / 8),  # [B, 1, 1, video + text], joint attention
    "motif-video": ("attention_mask", False, 1 / 8),
    # [B, text], kept rows first: the block builds the joint [B, 1, S, S] mask; text-to-video already drops its
    # image rows (the last 37%)
    "hunyuan-video-1.5": ("attention_mask", False, 1 / 2),
    "ltx-video": ("encoder_attention_mask", -10000.0, 1 / 8),  # an additive bias on the cross-attention's keys
    "allegro": ("encoder_attention_mask", -10000.0, 1 / 8),
}


def _padded_block(family: str):
    """(block 0 of the family's scaled-down config, its captured inputs, the same with more of the text rows
    dropped by the mask)."""
    adapter, block = small_block(family, torch.float32)
    inputs = adapter.make_inputs(adapter.default_workload(1, scaled_down=True), torch.device("cpu"), torch.float32,
                                 torch.Generator().manual_seed(0))
    name, dropped, share = PADDED_TEXT[family]
    mask = inputs[name].clone()
    mask[..., -int(mask.shape[-1] * share):] = dropped
    return block, inputs, {**inputs, name: mask}


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
@pytest.mark.parametrize("family", slow_beyond(list(PADDED_TEXT), keep=2))
def test_the_padded_text_of_each_family_is_served_on_its_kept_keys(family, fake_backend):
    block, inputs, padded = _padded_block(family)
    before = block(**padded)

    with use_attention_backend(block, "fake") as routed:
        block(**inputs)
        unpadded_calls = list(fake_backend.calls)
        fake_backend.calls.clear()
        during = block(**padded)

    assert routed.served_calls == 2 * len(unpadded_calls) and routed.fallback_total == 0, routed.fallback_calls
    # the last calls: a joint mask unlike the one before also has a call on the rows guessed from that one first
    # (`test_a_new_joint_mask_is_answered_on_its_own_rows`)
    padded_calls = fake_backend.calls[-len(unpadded_calls):]
    fewer = [(full[1][1], kept[1][1]) for full, kept in zip(unpadded_calls, padded_calls) if kept != full]
    assert fewer and all(kept < full for full, kept in fewer)  # the backend saw only the kept keys
    torch.testing.assert_close(_first(during), _first(before), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_backend_without_a_metadata_check_leaves_masked_calls_to_diffusers(monkeypatch):
    kernel = RecordingSdpa()
    monkeypatch.setitem(backends.BACKENDS, "unchecked",
                        AttentionBackend("unchecked", "test double", kernel, lambda device: None, routed=True))
    block, _, padded = _padded_block("hunyuan-video")
    with use_attention_backend(block, "unchecked") as routed:
        block(**padded)
    assert routed.served_calls == 0 and routed.fallback_calls == {"attn_mask given": 1} and kernel.calls == []


@torch.no_grad()
def test_one_graph_under_torch_compile(fake_backend):
    """The op is one opaque node: dynamo traces the router's key-padded path without a graph break, and the
    compiled block answers as the eager one."""
    block, _, padded = _padded_block("hunyuan-video")
    with use_attention_backend(block, "fake") as routed:
        eager = block(**padded)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(**padded)
    torch._dynamo.reset()
    assert routed.served_calls == 2 and routed.fallback_total == 0
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@torch.no_grad()
def test_the_fp8_kernel_serves_key_padding_as_it_serves_the_kept_keys():
    """On the GPU with our kernel: the op's answer, and the answer with the kept keys found on the device, is the
    kernel's own on the kept keys, bit for bit, and the padded keys change nothing (poisoned with huge values);
    under a joint mask the dropped queries get SDPA's answer."""
    backend = backends.get_backend("fp8")
    device = torch.device("cuda")
    if (reason := backend.unavailable_reason(device)) is not None:
        pytest.skip(reason)
    generator = torch.Generator(device).manual_seed(0)
    seq, kept, heads = 4096 + 256, 4096 + 40, 8
    q, k, v = (torch.randn(1, seq, heads, 128, device=device, dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    k[:, kept:], v[:, kept:] = 1e4, 1e4  # what the mask drops must not reach the output
    keys = torch.arange(seq, device=device) < kept
    mask = keys.view(1, 1, 1, seq)
    assert torch.equal(KEY_PADDED_ATTENTION(q, k, v, mask, None, "fp8"),
                       backend.run(q, k[:, :kept], v[:, :kept]))
    # found on the device: the same answer, bit for bit (both lengths take the same kernel plan)
    assert torch.equal(attend_kept_keys(q, k, v, mask, None, backend.run_key_lengths),
                       backend.run(q, k[:, :kept], v[:, :kept]))
    joint_mask = (keys[:, None] & keys[None, :]).view(1, 1, seq, seq)
    joint = KEY_PADDED_ATTENTION(q, k, v, joint_mask, None, "fp8")
    assert torch.equal(joint[:, :kept], backend.run(q[:, :kept], k[:, :kept], v[:, :kept]))
    torch.testing.assert_close(joint[:, kept:], _sdpa(q[:, kept:], k, v, joint_mask[:, :, kept:]))
    assert torch.equal(KEY_PADDED_ATTENTION(q, k, v, joint_mask.clone(), None, "fp8"), joint)  # its rows guessed


# --- boolean key masks, found on the device ---------------------------------------------------------------------

class LengthsSdpa:
    """A backend's `run_key_lengths` by the contract: SDPA over each element's first key_lengths[b] keys; records the
    k and key lengths each call got."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, scale, key_lengths):
        self.calls.append((k, key_lengths))
        kept = torch.arange(k.shape[1])[None, :] < key_lengths[:, None]
        return _sdpa(q, k, v, kept[:, None, None, :])


@pytest.fixture
def lengths_backend(monkeypatch):
    """A routed backend named `fake` that takes key lengths (`LengthsSdpa`); its plain `run` must not be called."""
    def refuse(*args):
        raise AssertionError("a boolean key mask went to the plain run")

    run_key_lengths = LengthsSdpa()
    monkeypatch.setitem(backends.BACKENDS, "fake", AttentionBackend(
        "fake", "test double", refuse, lambda device: None, routed=True, serves_reason=lambda q, k, v: None,
        run_key_lengths=run_key_lengths))
    monkeypatch.setattr(key_padding, "KEY_PADDED_ATTENTION", refuse)  # no host read of the mask either
    return run_key_lengths


BOOL_CASES = ["one prefix for the batch", "a prefix and gathered keys", "an element with no kept key"]


@pytest.mark.parametrize("case", BOOL_CASES + ["one mask for the batch"])
def test_kept_keys_found_on_the_device_are_the_kept_keys(case):
    """Each element's kept keys first in their order, the dropped ones zeroed behind them, their count per element:
    torch's masked SDPA in float64 (an element with none: zeros), with the dropped keys poisoned."""
    mask = _keys(INNER)[:1] if case == "one mask for the batch" else CASES[case][0]
    q, k, v = _qkv()
    k, v = (x.masked_fill(~mask[:, 0, 0, :, None, None], 1e4) for x in (k, v))
    backend = LengthsSdpa()
    got = attend_kept_keys(q, k, v, mask, None, backend)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), rtol=1e-12, atol=1e-12)
    (given_k, lengths), = backend.calls
    counts = mask[:, 0, 0].sum(dim=1).expand(B)
    assert lengths.dtype == torch.int32 and lengths.tolist() == counts.tolist() and lengths.is_contiguous()
    for b, count in enumerate(counts.tolist()):
        kept = mask[b if mask.shape[0] > 1 else 0, 0, 0]
        assert torch.equal(given_k[b, :count], k[b, kept]) and bool((given_k[b, count:] == 0).all())


def test_the_fp8_emulation_on_kept_keys_found_on_the_device_is_itself_on_the_kept_keys():
    """The FP8 op (its CPU emulation) given the kept keys and their counts answers bit for bit as on each element's
    kept keys alone: the poisoned dropped keys reach neither the scores nor the FP8 scales."""
    from dit_accel.kernels.fp8_attention.op import FP8_ATTENTION

    mask = _keys(PREFIX, INNER)
    q, k, v = (x.to(torch.bfloat16) for x in _qkv())
    k, v = (x.masked_fill(~mask[:, 0, 0, :, None, None], 1e4) for x in (k, v))
    got = attend_kept_keys(q, k, v, mask, None, lambda *args: FP8_ATTENTION(*args[:4], "auto", args[4]))
    for b in range(B):
        kept = mask[b, 0, 0]
        assert torch.equal(got[b:b + 1], FP8_ATTENTION(q[b:b + 1], k[b:b + 1, kept], v[b:b + 1, kept], None, "auto"))


def test_only_boolean_masks_of_one_row_on_the_querys_device_are_found_on_the_device():
    q = _qkv()[0]
    assert device_lengths_reason(_keys(PREFIX, PREFIX), q) is None
    assert device_lengths_reason(BIAS, q) is not None and device_lengths_reason(_joint(18, 24), q) is not None
    assert device_lengths_reason(torch.ones(B, H, 1, S, dtype=torch.bool), q) is not None
    assert device_lengths_reason(_keys(PREFIX, PREFIX), q.to("meta")) is not None  # another device: the host op


@torch.no_grad()
@pytest.mark.parametrize("compiled", [False, True])
def test_the_router_serves_hunyuan_videos_text_padding_on_the_device(lengths_backend, compiled):
    """HunyuanVideo's block under the router: every attention call served through key lengths (the host op and the
    plain run refuse), the block's answer as without the router; compiled, one graph (fullgraph)."""
    block, _, padded = _padded_block("hunyuan-video")
    expected = block(**padded)
    with use_attention_backend(block, "fake") as routed:
        run = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
        got = run(**padded)
    torch._dynamo.reset()
    assert routed.served_calls == 1 and routed.fallback_total == 0, routed.fallback_calls
    kept = int(padded["attention_mask"].sum())
    assert [lengths.tolist() for _, lengths in lengths_backend.calls][-1:] == [[kept]]
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_the_op_is_tagged_cudagraph_unsafe():
    """Its host syncs cannot be captured: inductor must leave CUDA graphs off around it (+max-autotune turns them on,
    and nothing else in a patched GPU graph keeps them off now that the router's counters live on the GPU)."""
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no cudagraph_unsafe tag")
    assert torch.Tag.cudagraph_unsafe in KEY_PADDED_ATTENTION.tags


@torch.no_grad()
def test_the_capture_reads_the_rows_a_joint_mask_keeps():
    """What `dit-accel plan` predicts our kernel's work from: a capture on data records each key-padding call's kept
    (queries, keys) and its mask's bytes; HunyuanVideo 1.5's joint mask drops its text padding as queries and keys.
    On meta (shapes only) nothing is read."""
    from dit_accel.adapters import adapter_for_preset

    adapter = adapter_for_preset("hunyuan-video-1.5").scaled_down()
    workload = adapter.default_workload(1, scaled_down=True)
    calls = [c for c in adapter.stack_capture(workload, torch.device("cpu"), torch.float32).attention_calls
             if c.key_padding]
    assert calls
    for call in calls:
        (queries, keys), = call.kept
        assert queries == keys < call.q_len and call.mask_bytes == call.q_len * call.kv_len  # bool [1, 1, S, S]

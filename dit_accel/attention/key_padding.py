"""Attention under a key-padding mask, answered by an unmasked backend on the keys the mask keeps.

HunyuanVideo and Motif-Video join the text rows to the video rows and mask the text padding with one boolean
row per batch element ([B, 1, 1, S]); LTX-Video's cross-attention masks it with an additive bias repeated per
head ([B, H, 1, S]: 0 kept, -10000 dropped); HunyuanVideo 1.5 builds the joint mask in full ([B, 1, S, S]:
kept queries x kept keys). A masked key adds nothing to softmax(q k^T) v, so attending over the kept keys
alone gives the same attention: each batch element's kept keys (a prefix is sliced, anything else gathered)
go to the backend unmasked, one call for the batch when every element keeps the same keys. Queries a joint
mask drops (the text padding's own rows) are answered by torch's SDPA with their mask rows, as diffusers'
default backend answers them (a fully masked row has no answer of its own: SDPA's math and efficient kernels
give zeros, its cuDNN kernel, torch's choice on the H200, attends as if the row were unmasked).

Two ways to find the kept keys:

- On the device (`attend_kept_keys`), for a boolean mask with one row for every query ([B or 1, 1, 1, S]:
  HunyuanVideo's, Motif-Video's) and a backend that takes per-element key lengths (`run_key_lengths`: our FP8
  kernel): each element's kept keys move to the front in their order, the dropped ones behind them zeroed
  (so they add nothing to the FP8 scales either), and the kernel reads each element's count on the device.
  No host sync: torch.compile traces it as ordinary ops (inductor fuses the gather), CUDA graphs can capture
  it, and a streamed or compiled pass keeps the GPU fed (reading the mask on the host at every call left the
  GPU idle between kernels: docs/attention.md has the runs). Any boolean key mask is key padding in value; an
  element that keeps no key gets zero rows, as torch's SDPA gives it.
- On the host (`key_padded_attention`, everything else: bias masks, joint masks, backends without key
  lengths): which rows are kept is read from the mask (a few syncs per call; a joint mask's rows are read once
  for its shape and then guessed, `_REMEMBERED`, the guess confirmed by the mask's check once the backend's work
  is queued), so the work is a custom op, `torch.ops.dit_accel.key_padded_attention`: torch.compile sees one
  opaque node and no graph break; CUDA graphs cannot capture it. A mask that is not key padding in value (a
  bias other than 0 or <= -1e4, rows that differ across heads, a joint mask that is not an outer product, a
  batch element with no kept key) is answered inside the op by torch's SDPA with the mask, as diffusers'
  default backend would answer it; the router counts such a call as served, since only the op sees the values.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

DROPPED_BIAS = -1e4
"""An additive bias at or below this drops its key: exp(-1e4) is 0 in every float format."""


def shape_reason(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> str | None:
    """Why `mask` cannot be key padding for [B, S, H, D] query/key, from its metadata alone, or None: bool or
    floating, [B or 1, H or 1, 1, S_kv] (one row for every query), or bool [B or 1, H or 1, S_q, S_kv] (a
    joint mask of kept queries by kept keys, checked in value by the op)."""
    batch, seq_q, heads, _ = query.shape
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"{mask.dtype}, not key padding"
    rows = (1, seq_q) if mask.dtype == torch.bool else (1,)
    if mask.dim() != 4 or mask.shape[2] not in rows or mask.shape[0] not in (1, batch) \
            or mask.shape[1] not in (1, heads) or mask.shape[3] != key.shape[1]:
        return f"{list(mask.shape)}, not key padding"
    return None


def device_lengths_reason(mask: torch.Tensor, query: torch.Tensor) -> str | None:
    """Why a key-padding mask (`shape_reason` passed) is not one `attend_kept_keys` serves, or None: a boolean
    mask with one row for every query and head ([B or 1, 1, 1, S_kv]) on the query's device. Metadata only."""
    if mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.device != query.device:
        return f"{mask.dtype} {list(mask.shape)} mask on {mask.device}: its kept keys are read on the host"
    return None


def attend_kept_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
                     run_key_lengths) -> torch.Tensor:
    """softmax(q k^T * scale) v over the keys a boolean mask [B or 1, 1, 1, S_kv] keeps (`device_lengths_reason`),
    [B, S, H, D] in and out, without a host sync: each element's kept keys to the front in their order (a stable
    sort of the mask), the rest zeroed, and `run_key_lengths(q, k, v, scale, key_lengths)` told how many each
    element keeps."""
    kept = mask[:, 0, 0, :]  # [B or 1, S_kv]
    order = torch.argsort(kept.logical_not().to(torch.uint8), dim=1, stable=True)  # kept keys first, in order
    lengths = kept.sum(dim=1, dtype=torch.int32)
    front = torch.arange(kept.shape[1], device=kept.device) < lengths[:, None]
    index, front = order[:, :, None, None], front[:, :, None, None]
    k, v = (torch.where(front, torch.take_along_dim(x, index, dim=1), 0) for x in (k, v))
    return run_key_lengths(q, k, v, scale, lengths.expand(q.shape[0]).contiguous())


Selection = slice | torch.Tensor
"""Rows of one axis: a slice (one run of rows: a prefix, a suffix) or an index on the tensors' device."""


def _on_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, copied without a host sync (pinned, non-blocking: a copy from pageable memory waits
    for every kernel queued before it)."""
    if device.type != "cuda":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)


def _selection(kept: torch.Tensor, device: torch.device) -> Selection:
    """A bool vector (on the CPU) as the rows it keeps, for tensors on `device`: a slice where they are one run (a
    view, no copy); else their index on `device` (indexing a CUDA tensor with a CPU index waits for every kernel
    queued before it: HunyuanVideo 1.5's dropped text rows, a suffix indexed so until 2026-12-05, made the host wait
    for our kernel twice a call and left the GPU idle behind it)."""
    flags = kept.numpy()  # numpy's reductions of a short vector: ~10x quicker than torch's CPU ops
    count = int(flags.sum())
    start = int(flags.argmax()) if count else 0
    if flags[start:start + count].all():
        return slice(start, start + count)
    return _on_device(torch.from_numpy(flags.nonzero()[0]), device)


@dataclass
class _Check:
    """A check's flag on its way to the host: on a CUDA device, computed on a side stream and copied into pinned
    memory there, so reading it waits for the check alone, not for the work queued on the current stream."""

    flag: torch.Tensor  # bool scalar on the host
    done: torch.cuda.Event | None = None

    def passed(self) -> bool:
        if self.done is not None:
            self.done.synchronize()
        return bool(self.flag)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _check_beside(device: torch.device, check) -> _Check:
    """`check()` (a bool scalar on `device`) as a `_Check`: beside the current stream's work on a CUDA device (which
    it follows), at once elsewhere."""
    if device.type != "cuda":
        return _Check(check().cpu())
    side = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        flag.copy_(check(), non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    return _Check(flag, done)


Slot = tuple
"""Where a joint mask's confirmed rows are remembered: (device, the element's mask shape, batch element)."""


@dataclass
class _Kept:
    """What one batch element's mask keeps: the queries that attend (None: every one, a row mask) and the keys they
    see, each as rows of the tensors (`_selection`, read once), the queries a joint mask drops, and for a joint mask
    the check that it is their outer product, under way (`confirmed` reads it). `guessed`: the rows of an earlier
    mask of its slot (`_REMEMBERED`), not read from this one, which only the check confirms."""

    queries: torch.Tensor | None  # bool [S_q] on the CPU
    keys: torch.Tensor  # bool [S_kv] on the CPU
    served: Selection  # the queries' rows
    seen: Selection  # the keys' rows
    dropped: Selection | None = None  # the queries a joint mask drops; None: none
    outer: _Check | None = None
    slot: Slot | None = None
    guessed: bool = False

    def confirmed(self) -> bool:
        """Whether the mask is what this says: a joint mask's check, read; its rows then remembered for the next mask
        of its slot, or forgotten where they were a wrong guess."""
        if self.outer is None:
            return True
        passed = self.outer.passed()
        if self.slot is not None and passed:
            _remember(self)
        elif self.slot is not None and self.guessed:
            _REMEMBERED.pop(self.slot, None)
        return passed


_REMEMBERED: dict[Slot, _Kept] = {}
"""The rows of the joint masks last confirmed, by slot, most recent last. A model builds the same joint mask in every
block of a pass (HunyuanVideo 1.5: from its text mask), so the op guesses a mask of a known slot keeps what the last
one did and reads nothing before its backend's work is queued: a host read there waited for every kernel before it
and left the GPU idle until the op's first launch, every call. The check, read once that work is queued, confirms
the guess; a wrong one (a new mask: another prompt, the other pass of classifier-free guidance) costs that call the
backend's work on the guessed rows, then the mask is read and the element answered again."""
REMEMBERED_MASKS = 16


def _remember(kept: _Kept) -> None:
    _REMEMBERED.pop(kept.slot, None)
    _REMEMBERED[kept.slot] = replace(kept, outer=None, guessed=True)
    while len(_REMEMBERED) > REMEMBERED_MASKS:
        del _REMEMBERED[next(iter(_REMEMBERED))]


JOINT_CHECK_ROWS = 4096  # rows of a joint mask compared at a time off the fast path (bounds the temporary)


def _joint_check(rows: torch.Tensor, kept: _Kept) -> _Check:
    """The check, under way, that a joint mask [S_q, S_kv] is the outer product of `kept`'s queries and keys:
    row-wise reductions over views of the mask when each is one run of rows (HunyuanVideo 1.5's, its text padding
    last: one read of the mask, timed in docs/attention.md; a reduction of a view to one value ran at half the
    rate, a Triton compare of each byte with the outer product at 0.4x), a compare by blocks of rows otherwise."""
    served, seen = kept.served, kept.seen

    def outer() -> torch.Tensor:
        if isinstance(served, slice) and isinstance(seen, slice):
            outside = (rows[:served.start], rows[served.stop:], rows[served, :seen.start], rows[served, seen.stop:])
            return rows[served, seen].all(dim=1).all() & ~torch.stack([r.any(dim=1).any() for r in outside]).any()
        queries, keys = _on_device(kept.queries, rows.device), _on_device(kept.keys, rows.device)
        differs = torch.zeros((), dtype=torch.bool, device=rows.device)
        for start in range(0, rows.shape[0], JOINT_CHECK_ROWS):
            part = rows[start:start + JOINT_CHECK_ROWS]
            differs |= (part != (queries[start:start + JOINT_CHECK_ROWS, None] & keys[None, :])).any()
        return ~differs

    return _check_beside(rows.device, outer)


def _read_joint(rows: torch.Tensor, slot: Slot | None) -> _Kept:
    """A joint mask [S_q, S_kv] read as the queries and keys it would keep were it their outer product, and the check
    that it is, under way. A mask that keeps its first element holds them as its first column and first row (one
    small read); otherwise rows and columns are reduced."""
    edges = torch.cat([rows[:, 0], rows[0]]).cpu()
    if bool(edges[0]):
        queries, keys = edges[:rows.shape[0]], edges[rows.shape[0]:]
    else:
        queries, keys = rows.any(dim=1).cpu(), rows.any(dim=0).cpu()
    dropped = None if bool(queries.all()) else _selection(~queries, rows.device)
    kept = _Kept(queries, keys, _selection(queries, rows.device), _selection(keys, rows.device), dropped, slot=slot)
    kept.outer = _joint_check(rows, kept)
    return kept


def _kept(rows: torch.Tensor, slot: Slot | None = None, guess: bool = False) -> _Kept | None:
    """What one batch element's mask ([H or 1, S_q or 1, S_kv]) keeps, or None when it is not key padding in value
    (see the module docstring): a joint mask must be kept queries x kept keys (its `outer` check), every head alike.
    slot: where a joint mask's rows are remembered once confirmed; guess: a joint mask of a remembered slot is taken to
    keep what the last one did (`_REMEMBERED`), not read."""
    if rows.dtype != torch.bool:
        kept = rows == 0
        if not bool((kept | (rows <= DROPPED_BIAS)).all()):
            return None
        rows = kept
    if rows.shape[0] > 1 and not bool((rows == rows[:1]).all()):
        return None
    rows = rows[0]
    if rows.shape[0] == 1:
        keys = rows[0].cpu()
        kept = _Kept(None, keys, slice(None), _selection(keys, rows.device))
    elif guess and (remembered := _REMEMBERED.get(slot)) is not None:
        kept = replace(remembered)
        kept.outer = _joint_check(rows, kept)
    else:
        kept = _read_joint(rows, slot)
    return kept if bool(kept.keys.any()) else None


def _element(mask: torch.Tensor, b: int) -> torch.Tensor:
    """Batch element b's mask, [1, H or 1, S_q or 1, S_kv] (a mask of one element serves them all)."""
    return mask[b:b + 1] if mask.shape[0] > 1 else mask


def _kept_each(mask: torch.Tensor, batch: int, guess: bool = False) -> list[_Kept | None]:
    """What the mask keeps for each of `batch` elements (`_kept`, each element's rows in its own slot; a mask of one
    element is read once for them all)."""
    slots = [(mask.device, tuple(mask.shape[1:]), b) for b in range(mask.shape[0])]
    kept = [_kept(mask[b], slots[b], guess) for b in range(mask.shape[0])]
    return kept * batch if mask.shape[0] == 1 else kept


def kept_lengths(mask: torch.Tensor, batch: int, seq_q: int) -> list[tuple[int, int]] | None:
    """(kept queries, kept keys) of each of `batch` elements under a key-padding mask (`shape_reason` passed) for
    `seq_q` queries, or None where its values are not key padding: the rows the backend attends with."""
    kept = _kept_each(mask, batch)
    if not all(one is not None and one.confirmed() for one in kept):
        return None
    return [(seq_q if one.queries is None else int(one.queries.sum()), int(one.keys.sum())) for one in kept]


def _masked_sdpa(q, k, v, mask, scale):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale)
    return out.transpose(1, 2)


def _attend(out, q, k, v, mask, scale, run, b: int, kept: _Kept) -> None:
    """Batch element b's answer into `out`: the backend on its kept queries over its kept keys, SDPA with their
    mask rows on the queries a joint mask drops."""
    e = slice(b, b + 1)
    out[e, kept.served] = run(q[e, kept.served], k[e, kept.seen], v[e, kept.seen], scale)
    if kept.dropped is not None:
        out[e, kept.dropped] = _masked_sdpa(q[e, kept.dropped], k[e], v[e], _element(mask, b)[:, :, kept.dropped],
                                            scale)


def key_padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float | None, backend: str) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, [B, S, H, D] in and out: the backend called `backend` on the kept keys of
    the kept queries, torch's SDPA with the mask on the rest (the queries a joint mask drops, a batch element whose
    mask is not key padding); what the op's CPU and CUDA implementations run. A joint mask's rows are guessed where
    its slot is remembered (`_REMEMBERED`), and its check runs beside the backend's work and is read once that work
    is queued: the host waits for the check alone, and the GPU has the kernel to run meanwhile. An element whose
    guess fails is read and answered again; one whose mask fails the check, by SDPA with its mask."""
    from .backends import get_backend

    run = get_backend(backend).run
    kept = _kept_each(mask, q.shape[0], guess=True)
    if all(one is not None and one.dropped is None and torch.equal(one.keys, kept[0].keys) for one in kept):
        out = run(q, k[:, kept[0].seen], v[:, kept[0].seen], scale)  # the same keys for every element and query
    else:
        out = q.new_empty((*q.shape[:3], v.shape[3]))
        for b, one in enumerate(kept):
            if one is not None:
                _attend(out, q, k, v, mask, scale, run, b, one)
    read: dict[int, _Kept | None] = {}  # by the failed guess: a mask of one element is read once for them all
    for b, one in enumerate(kept):
        if one is not None and one.confirmed():
            continue
        if one is not None and one.guessed:  # an earlier mask's rows: this one's, read
            if id(one) not in read:
                read[id(one)] = _kept(_element(mask, b)[0], one.slot)
            one = read[id(one)]
            if one is not None:
                _attend(out, q, k, v, mask, scale, run, b, one)
                if one.confirmed():
                    continue
        out[b:b + 1] = _masked_sdpa(q[b:b + 1], k[b:b + 1], v[b:b + 1], _element(mask, b), scale)
    return out


def _fake(q, k, v, mask, scale, backend):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


SCHEMA = "key_padded_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float? scale, str backend) -> Tensor"


def _register() -> torch.library.Library:
    """The op, pt2-compliant, one Python implementation for CPU and CUDA and a fake. Tagged cudagraph-unsafe
    (its host syncs), so inductor leaves CUDA graphs off around it (`+max-autotune` turns them on). Kept alive
    by the module: a Library unregisters when freed."""
    library = torch.library.Library("dit_accel", "FRAGMENT")
    unsafe = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()  # torch >= 2.8
    library.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag, *unsafe))
    for device in ("CPU", "CUDA"):
        library.impl("key_padded_attention", key_padded_attention, device)
    torch.library.register_fake("dit_accel::key_padded_attention", _fake, lib=library)
    return library


# A reload finds the op registered by the first import and keeps that import's Library alive.
_LIBRARY = globals().get("_LIBRARY") if hasattr(torch.ops.dit_accel, "key_padded_attention") else _register()

KEY_PADDED_ATTENTION = torch.ops.dit_accel.key_padded_attention.default

"""The one seam where an attention backend is swapped into a diffusers model, reversibly.

How diffusers picks attention: every attention module built on `AttentionModuleMixin` holds a
processor; the processor's `__call__` calls `dispatch_attention_fn(q, k, v, ...,
backend=self._attention_backend)`, a global of the processor's own model file (e.g.
`diffusers.models.transformers.transformer_minimax_h3`), with q/k/v laid out [B, S, H, D].
`_attention_backend` is None (the process-wide default) or a member of diffusers'
`AttentionBackendName` enum; `ModelMixin.set_attention_backend` sets it on each processor.

Native backends (`diffusers_backend` set in the registry): we set each processor's
`_attention_backend` exactly as diffusers does, on any nn.Module (one transformer block counts),
and put the previous values back afterwards. Unlike diffusers we never touch its process-wide
active backend, so leaving the context restores everything.

Custom backends (`routed`: fa4, our fp8): the enum is closed, so the processors get a `RoutedBackend` object
instead, and the `dispatch_attention_fn` global of each processor's model file is replaced by a router. The
router forwards every call unchanged unless its `backend` is a `RoutedBackend` (or names none and the
processor running chose one: see below); then it reads a key mask in diffusers' `[B, S_kv]` form as its native
backend does (`[B, 1, 1, S_kv]`) and runs our kernel when the call is servable (no attn_mask but a key-padding
one, no dropout, not causal, no GQA, no extra attention_kwargs, no ring attention, no autograd, the backend's
metadata check (`serves_reason`: head dim, dtype) passes, and its run does not raise `BackendCannotServe`
after all) and otherwise calls the original dispatch with `backend=None`, i.e.
diffusers' default. A key-padding mask (one row of kept keys per batch element: the text padding of
joint attention) is served by backends with a metadata check (`serves_reason`: fp8, fa4) through
`key_padding`, on the kept keys alone. Under diffusers'
Ulysses context parallelism (`parallel_config` with a Ulysses degree, no ring) the call goes through
diffusers' own templated context-parallel attention (its all-to-alls) with our kernel as the local
attention op, so each rank runs our kernel on its share of the heads over the whole sequence. Each
`RoutedBackend` counts calls served and calls fallen back, by reason, so a run can prove its attention
went where it was meant to.

Routing by measured crossover: where the device has crossover data (`attention.crossover`), a
servable call whose nearest measured point was won by a fallback (e.g. cuDNN bf16 on a short key side)
goes to that diffusers backend instead, counted as the reason "routed: <name> measured faster". On a GPU with no
data (none shipped, none measured on this machine) the conservative rule (`crossover.ConservativeRule`) sends our
kernel's short-key and few-row calls to diffusers' default; on the CPU and with DIT_ACCEL_CROSSOVER=off every
servable call is served.
Not applied under Ulysses context parallelism (diffusers' engine there serves our kernel only).

Processors that call torch's SDPA themselves (CogVideoX, Mochi, Allegro: `F.scaled_dot_product_attention` from
their own file, [B, H, S, D], no `_attention_backend`): their file's `F` is replaced by a stand-in whose
`scaled_dot_product_attention` asks which backend the processor running now chose. Each chosen processor holds
its choice and, for the swap, a subclass of its own class whose call makes that choice the running one and puts
the one before back after it, even when it raises (`_choosing_class`), so calls of processors not chosen (kept
blocks, other models of the same file) run torch's own call untouched, and compiled blocks of one class keep one
graph per choice (dynamo guards on the processor's class and its choice). The choice is a RoutedBackend (q/k/v go
to it as [B, S, H, D] views, through the same servable checks, counts and crossover as above; a call it declines
runs torch's own call, forced to the crossover's kernel where that routed it) or a torch SDPA kernel to force
(`cudnn`, `flash`, ...). `native` changes nothing there: it is what they run.

Processors that call diffusers' `dispatch_attention_fn` but name no backend (Cosmos: no `_attention_backend`) are
chosen the same way: their call makes their choice the running one, and their file's router answers a call that
names no backend by it (a RoutedBackend, as above, or the diffusers backend the swap names).

Why this seam: it needs no edit of diffusers or of the model, covers every attention call a
processor makes (self- and cross-attention alike), keeps diffusers' own checks and fallbacks, and
is undone completely. The router is installed once per model file, reference-counted across
nested or concurrent uses, and the original global is put back when the last user leaves (the
swap itself is `dit_accel.seams.model_globals`, shared with the fused RoPE).
Restoring is last-in first-out: undo swaps in the reverse order they were made.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import UserError
from ..seams.counts import CallCounts, CountedCalls
from ..seams.model_globals import ModelGlobalSwap, Namespace, model_file
from ..seams.placement import module_device
from . import key_padding
from .backends import BACKENDS, TORCH_SDPA_KERNELS, AttentionBackend, BackendCannotServe, get_backend
from .crossover import ConservativeRule, Crossover, crossover_for

DISPATCH_GLOBAL = "dispatch_attention_fn"
FUNCTIONAL_GLOBAL = "F"  # torch.nn.functional, in the files of processors that call torch's SDPA themselves

_UNSET = object()  # a processor that had no instance value (it read its class default)


@dataclass(eq=False)
class RoutedBackend(CountedCalls):
    """What the processors' `_attention_backend` holds while a custom backend is on.

    served_calls: calls our kernel answered. fallback_calls: reason -> calls sent to diffusers'
    default backend instead, or, for a "routed: ..." reason, to the diffusers backend the crossover measured
    faster at their shape (or the conservative rule chose). Every dispatch made by a processor holding
    this object counts in exactly one of the two, also inside a torch.compile'd model
    (`seams.counts.CallCounts`: 0-d tensors on the model's device, bumped in place).
    """

    backend: AttentionBackend
    # Asked before each call: a reason to send this call to the fallback anyway (e.g. a denoising
    # step the user keeps in bf16), or None to serve it. Under torch.compile its answer is guarded:
    # it should change rarely (each distinct answer is one more graph).
    hold_reason: Callable[[], str | None] | None = None
    # What routes servable calls by shape: the device's measured crossover, the conservative rule where it has
    # none, or None (routing off, or the CPU: serve every servable call); the line saying which and from when;
    # and per routed reason the diffusers backend value its calls go to.
    crossover: Crossover | ConservativeRule | None = None
    crossover_note: str = "no crossover data looked up"
    _fallback_values: dict[str, Any] = field(default_factory=dict, repr=False)
    counts: CallCounts = field(default_factory=CallCounts, repr=False)

    def __post_init__(self) -> None:
        if self.crossover is not None:
            from diffusers.models.attention_dispatch import AttentionBackendName

            self._fallback_values = {
                self.crossover.reason(name): AttentionBackendName(get_backend(name).diffusers_backend)
                for name in self.crossover.fallbacks}
            self.counts.expect(*self._fallback_values)  # in place before a compiled graph counts a routed call

    def count_served(self) -> None:
        """One call answered by our backend outside `dispatch` (a fused path that asked `decline_reason`)."""
        self.counts.count(None)

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def fallback_total(self) -> int:
        return sum(self.fallback_calls.values())

    def decline_reason(self, arguments: dict[str, Any]) -> str | None:
        """Why this call does not go to our backend: it is not servable, the backend's metadata check refuses it
        (head dim, dtype: asked here, not learnt from the `BackendCannotServe` its run raises, whose handling
        torch.compile cannot trace: a graph break, and on torch 2.11 the discarded trace's weak references left on
        the block's weights refused their streaming), its step or block is held, or the crossover measured a
        fallback faster at its shape ("routed: <name> measured faster"); None to serve."""
        q, k, v = arguments["query"], arguments["key"], arguments["value"]
        serves_reason = self.backend.serves_reason
        reason = _unservable_reason(arguments, serves_reason is not None) or (
            serves_reason(q, k, v) if serves_reason is not None else None) or (
            self.hold_reason() if self.hold_reason else None)
        if reason is None and self.crossover is not None and arguments.get("parallel_config") is None:
            batch, seq_q, heads, head_dim = q.shape
            choice = self.crossover.pick(self.backend.name, batch, heads, seq_q, k.shape[1], head_dim, q.dtype)
            if choice is not None and choice != self.backend.name:
                reason = self.crossover.reason(choice)
        return reason

    def dispatch(self, arguments: dict[str, Any], original_dispatch: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Answer one `dispatch_attention_fn` call, given its bound arguments (all names present)."""
        reason = self.decline_reason(arguments)
        if reason is None:
            try:
                if arguments.get("parallel_config") is not None:
                    out = _ulysses_attention(self.backend, arguments)
                elif arguments["attn_mask"] is not None:
                    out = _key_padded_attention(self.backend, arguments)
                else:
                    out = self.backend.run(arguments["query"], arguments["key"], arguments["value"], arguments["scale"])
            except BackendCannotServe as exc:
                reason = str(exc)
            else:
                self.counts.count(None)
                return out
        self.counts.count(reason)
        # a routed call goes to the backend measured faster; every other to diffusers' default (None)
        return original_dispatch(**{**arguments, "backend": self._fallback_values.get(reason)})


def _unservable_reason(arguments: dict[str, Any], key_padding_served: bool) -> str | None:
    """Why a call needs more than softmax(q k^T * scale) v, over the keys a key-padding mask keeps where
    `key_padding_served`, or None when it does not."""
    mask = arguments["attn_mask"]
    if mask is not None:
        why = key_padding.shape_reason(mask, arguments["query"], arguments["key"]) if key_padding_served else None
        if why is not None:
            return f"attn_mask given ({why})"
        if not key_padding_served or arguments.get("parallel_config") is not None:
            return "attn_mask given"
    if arguments["dropout_p"]:
        return "dropout_p > 0"
    if arguments["is_causal"]:
        return "is_causal"
    if arguments.get("enable_gqa") or arguments["key"].shape[-2] != arguments["query"].shape[-2]:
        return "grouped-query attention"
    if arguments.get("attention_kwargs"):
        return "attention_kwargs given"
    parallel = arguments.get("parallel_config")
    if parallel is not None:
        cp = getattr(parallel, "context_parallel_config", None)
        if cp is None or cp.ring_degree > 1 or cp.ulysses_degree < 2:
            return "ring or non-Ulysses context parallelism (needs an LSE merge we do not serve)"
    if torch.is_grad_enabled() and any(arguments[name].requires_grad for name in ("query", "key", "value")):
        return "autograd needed"
    return None


def _key_padded_attention(backend: AttentionBackend, arguments: dict[str, Any]) -> torch.Tensor:
    """A call under a key-padding mask, its backend's metadata check passed (`decline_reason`: a refusal inside the
    op would be too late to fall back): the backend on the kept keys, found on the device where the backend takes
    key lengths and the mask is boolean key padding, else by the op that reads them on the host (`key_padding`)."""
    q, k, v, mask = arguments["query"], arguments["key"], arguments["value"], arguments["attn_mask"]
    if backend.run_key_lengths is not None and key_padding.device_lengths_reason(mask, q) is None:
        return key_padding.attend_kept_keys(q, k, v, mask, arguments["scale"], backend.run_key_lengths)
    return key_padding.KEY_PADDED_ATTENTION(q, k, v, mask, arguments["scale"], backend.name)


def _ulysses_attention(backend: AttentionBackend, arguments: dict[str, Any]) -> torch.Tensor:
    """Ulysses attention by diffusers' own engine (all-to-all of heads and sequence, then back),
    with `backend` as the attention each rank runs on its heads over the whole sequence."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    def local_attention(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        return backend.run(query, key, value, scale)

    return _templated_context_parallel_attention(
        arguments["query"], arguments["key"], arguments["value"], None, 0.0, False, arguments["scale"], False, False,
        forward_op=local_attention, backward_op=None, _parallel_config=arguments["parallel_config"])


# --- the router, one per model file -------------------------------------------------------------

def _make_router(original: Callable[..., torch.Tensor], users: list) -> Callable[..., torch.Tensor]:
    """The replacement for a model file's `dispatch_attention_fn` (the users list is not read: each call's
    `backend` argument, or for a call that names none the running processor's choice, says which RoutedBackend,
    if any, answers it)."""
    # Names and defaults read once here, not per call: under torch.compile, inspect.Signature.bind
    # reads a mappingproxy, which dynamo cannot trace once the frame has mutated a dict.
    parameters = inspect.signature(original).parameters
    positional = tuple(n for n, p in parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    defaults = tuple((n, p.default) for n, p in parameters.items() if p.default is not p.empty)
    names = frozenset(parameters)

    @functools.wraps(original)
    def routed_dispatch_attention_fn(*args, **kwargs):
        backend = kwargs.get("backend")  # keyword-only in diffusers
        choice = _RUNNING.choice
        if backend is None and choice is not None and not isinstance(choice, SDPBackend):
            kwargs["backend"] = backend = choice  # a processor that names no backend (Cosmos'): its chosen one
        if not isinstance(backend, RoutedBackend):
            return original(*args, **kwargs)
        if len(args) > len(positional) or not names.issuperset(kwargs):
            return original(*args, **kwargs)  # a call the signature refuses: diffusers raises its own TypeError
        arguments = dict(defaults)
        arguments.update(zip(positional, args))
        arguments.update(kwargs)
        mask, q, k = arguments["attn_mask"], arguments["query"], arguments["key"]
        if mask is not None and mask.dim() == 2 and mask.shape[0] in (1, q.shape[0]) and mask.shape[1] == k.shape[1]:
            # diffusers' key mask [B, S_kv] (Kandinsky 6's), as its native backend reads it: one row per element
            arguments["attn_mask"] = mask[:, None, None, :]
        return backend.dispatch(arguments, original)

    return routed_dispatch_attention_fn


# The router is installed once per model file and shared by every live swap (each swap is one user); the
# original global comes back when the last one leaves.
_ROUTERS = ModelGlobalSwap(DISPATCH_GLOBAL, _make_router)
_installed_routers = _ROUTERS.installed  # model file name -> its live router installation


def _dispatch_module(processor: Any) -> ModuleType:
    """The model file whose `dispatch_attention_fn` global this processor's `__call__` reads."""
    module = model_file(processor, DISPATCH_GLOBAL)
    if module is None:
        raise UserError(
            f"attention processor {type(processor).__name__} does not call diffusers' {DISPATCH_GLOBAL}, "
            "so a custom backend cannot be routed into it; pick a native backend (native, flash, cudnn, ...)")
    return module


# --- processors that call torch's SDPA themselves ------------------------------------------------

@dataclass
class _Running:
    """What the processor running now chose: for its `F.scaled_dot_product_attention` calls, a RoutedBackend or a
    torch SDPA kernel to force; for its `dispatch_attention_fn` calls that name no backend, a RoutedBackend or a
    diffusers backend; None: nothing chosen (torch's or diffusers' own call)."""

    choice: Any = None


_RUNNING = _Running()


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch SDPA's arguments, by name, as `dispatch_attention_fn` takes them ([B, S, H, D] views of q/k/v)."""
    return {"query": query.transpose(1, 2), "key": key.transpose(1, 2), "value": value.transpose(1, 2),
            "attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale,
            "enable_gqa": enable_gqa, "attention_kwargs": None, "parallel_config": None}


def _forced(kernel: SDPBackend | None):
    return sdpa_kernel(kernel) if isinstance(kernel, SDPBackend) else contextlib.nullcontext()


def _make_sdpa_stand_in(functional: Any, users: list) -> Namespace:
    """The replacement for a model file's `F`: torch.nn.functional but for `scaled_dot_product_attention`,
    which serves each call as the running module chose (the users list is not read)."""
    original = functional.scaled_dot_product_attention
    # the crossover hands back diffusers' backend names; here each is the torch SDPA kernel it forces
    kernels = {BACKENDS[name].diffusers_backend: kernel for name, kernel in TORCH_SDPA_KERNELS.items()}

    def declined(*, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, **_):
        with _forced(kernels.get(getattr(backend, "value", None))):
            out = original(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask,
                           dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    @functools.wraps(original)
    def routed_scaled_dot_product_attention(*args, **kwargs):
        choice = _RUNNING.choice
        if isinstance(choice, RoutedBackend):
            return choice.dispatch(_sdpa_arguments(*args, **kwargs), declined).transpose(1, 2)
        with _forced(choice):
            return original(*args, **kwargs)

    return Namespace(functional, {"scaled_dot_product_attention": routed_scaled_dot_product_attention})


_SDPA_STAND_INS = ModelGlobalSwap(FUNCTIONAL_GLOBAL, _make_sdpa_stand_in)


_CHOICE = "_dit_accel_choice"  # a chosen processor's choice, on its instance
_CHOOSING = "_dit_accel_chooses"  # set on the classes `_choosing_class` makes


@functools.cache
def _choosing_class(cls: type) -> type:
    """`cls` (a processor that calls torch's SDPA itself, or diffusers' dispatch naming no backend) with a call
    that makes the processor's own choice (its `_CHOICE`) the running one and puts the one before back after it,
    even when it raises. The class keeps `cls`'s name and module, and its `__call__` the signature of `cls`'s
    (`functools.wraps`): diffusers reads from that which keyword arguments a processor takes, and `model_file`
    finds the file from that module.

    Why not forward hooks on the attention modules: dynamo guards on an always-called hook's id, which differs
    from block to block (blocks compiled one by one recompiled until dynamo's limit of 8, then ran eager); it does
    not guard on plain hooks at all (a kept block and a chosen one compiled from one class shared one graph); and a
    plain clearing hook does not run when the forward raises (the choice stayed set for modules not chosen)."""
    call = cls.__call__

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        previous = _RUNNING.choice
        _RUNNING.choice = getattr(self, _CHOICE)
        try:
            return call(self, *args, **kwargs)
        finally:
            _RUNNING.choice = previous

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, _CHOOSING: True})


def _choose(processor: Any, choice: Any) -> tuple[Any, type, Any]:
    """Makes `choice` the processor's for its calls (`_choosing_class`); returns what `_unchoose` puts back."""
    before = (processor, type(processor), vars(processor).get(_CHOICE, _UNSET))
    if _CHOOSING not in vars(type(processor)):  # a nested swap's processor has its class already
        processor.__class__ = _choosing_class(type(processor))
    setattr(processor, _CHOICE, choice)
    return before


def _unchoose(processor: Any, cls: type, choice: Any) -> None:
    processor.__class__ = cls
    if choice is _UNSET:
        vars(processor).pop(_CHOICE, None)
    else:
        setattr(processor, _CHOICE, choice)


# --- swapping -----------------------------------------------------------------------------------

@dataclass
class AttentionBackendSwap:
    """One swap made by `set_attention_backend_by_name`, with what `restore_attention_backend` needs.

    previous: each processor and the `_attention_backend` it held on its instance (or _UNSET).
    routed: the RoutedBackend the processors hold (custom backends), else None.
    router_modules: the model files whose dispatch global this swap holds a router on.
    sdpa_files: the model files whose `F` this swap holds a stand-in on (processors calling torch's SDPA).
    chosen: each of those processors, and each calling diffusers' dispatch naming no backend, with the class and
    choice it had before (`_choose`).
    """

    previous: list[tuple[Any, Any]]
    routed: RoutedBackend | None
    router_modules: list[ModuleType]
    sdpa_files: list[ModuleType] = field(default_factory=list)
    chosen: list[tuple[Any, type, Any]] = field(default_factory=list)
    restored: bool = False


@functools.cache
def _calls_dispatch(processor_class: type) -> bool:
    """Whether the processor class's call calls diffusers' dispatch (not only shares a file with one that does:
    SANA's linear attention processor calls none); read once per class."""
    return f"{DISPATCH_GLOBAL}(" in inspect.getsource(processor_class.__call__)


Chosen = dict[int, tuple[Any, ModuleType]]
"""Processors chosen through their call (`_choose`), by id, each with its model file."""


def _attention_processors(module: nn.Module, exclude: tuple[nn.Module, ...]) -> tuple[list[Any], Chosen, Chosen]:
    """Under `module`, outside the `exclude` subtrees: each distinct processor that has a selectable
    `_attention_backend`; each distinct processor that has none but whose file calls torch's SDPA through `F`; and
    each that has none but whose file calls diffusers' dispatch (which it names no backend), with their files."""
    skipped = {id(m) for kept in exclude for m in kept.modules()}
    processors: dict[int, Any] = {}
    sdpa_calling: Chosen = {}
    unnamed: Chosen = {}
    for submodule in module.modules():
        processor = getattr(submodule, "processor", None)
        if id(submodule) in skipped or processor is None:
            continue
        if hasattr(processor, "_attention_backend"):
            processors.setdefault(id(processor), processor)
        elif (file := model_file(processor, DISPATCH_GLOBAL)) is not None and _calls_dispatch(type(processor)):
            unnamed.setdefault(id(processor), (processor, file))
        elif callable(getattr(getattr(file := model_file(processor, FUNCTIONAL_GLOBAL), FUNCTIONAL_GLOBAL, None),
                              "scaled_dot_product_attention", None)):
            sdpa_calling.setdefault(id(processor), (processor, file))
    return list(processors.values()), sdpa_calling, unnamed


def set_attention_backend_by_name(module: nn.Module, name: str, *, exclude: tuple[nn.Module, ...] = (),
                                  hold_reason: Callable[[], str | None] | None = None) -> AttentionBackendSwap:
    """Make every attention processor under `module` (but those under `exclude`) use backend `name`;
    undo with `restore_attention_backend`. `hold_reason` gates a custom backend call by call.

    Raises UserError for an unknown name, a backend unavailable on the module's device, a
    benchmark-only backend, or a module without attention processors.
    """
    backend = get_backend(name)
    reason = backend.unavailable_reason(module_device(module))
    if reason is not None:
        raise UserError(f"attention backend {name!r} is unavailable here: {reason}")
    if backend.diffusers_backend is None and not backend.routed:
        raise UserError(f"attention backend {name!r} is benchmark only; use it with bench-attention, not in a model")
    if hold_reason is not None and not backend.routed:
        raise UserError(f"attention backend {name!r} is a diffusers backend: it cannot be switched per step; "
                        "keep steps in bf16 only with a custom backend (fa4, fp8)")
    processors, sdpa_calling, unnamed = _attention_processors(module, exclude)
    if not processors and not sdpa_calling and not unnamed:
        raise UserError(f"{type(module).__name__} has no diffusers attention processors to set a backend on")

    unnamed_files = [file for _, file in unnamed.values()]
    if backend.routed:
        router_modules = [*map(_dispatch_module, processors), *unnamed_files]
        crossover, crossover_note = crossover_for(module_device(module))
        value: Any = RoutedBackend(backend, hold_reason=hold_reason, crossover=crossover, crossover_note=crossover_note,
                                   counts=CallCounts.on_device_of(module))
        sdpa_choice: RoutedBackend | SDPBackend | None = value
    else:
        from diffusers.models.attention_dispatch import AttentionBackendName

        router_modules, value = unnamed_files, AttentionBackendName(backend.diffusers_backend)
        sdpa_choice = TORCH_SDPA_KERNELS.get(backend.name)
    router_modules = list({m.__name__: m for m in router_modules}.values())
    swap = AttentionBackendSwap([], value if backend.routed else None, router_modules)
    _ROUTERS.acquire_all(router_modules, swap)
    if sdpa_calling and sdpa_choice is not None:
        files = {f.__name__: f for _, f in sdpa_calling.values()}
        try:
            swap.sdpa_files = _SDPA_STAND_INS.acquire_all(files.values(), swap)
        except BaseException:
            _ROUTERS.release_all(router_modules, swap)
            raise
        swap.chosen = [_choose(processor, sdpa_choice) for processor, _ in sdpa_calling.values()]
    swap.chosen += [_choose(processor, value) for processor, _ in unnamed.values()]

    swap.previous = [(processor, processor.__dict__.get("_attention_backend", _UNSET)) for processor in processors]
    for processor in processors:
        processor._attention_backend = value
    return swap


def restore_attention_backend(swap: AttentionBackendSwap) -> None:
    """Put back what `swap` changed: processor values, then routers. Restoring twice is a no-op."""
    if swap.restored:
        return
    for processor, value in swap.previous:
        if value is _UNSET:
            processor.__dict__.pop("_attention_backend", None)
        else:
            processor._attention_backend = value
    for chosen in reversed(swap.chosen):
        _unchoose(*chosen)
    _SDPA_STAND_INS.release_all(swap.sdpa_files, swap)
    _ROUTERS.release_all(swap.router_modules, swap)
    swap.restored = True


@contextlib.contextmanager
def use_attention_backend(module: nn.Module, name: str) -> Iterator[RoutedBackend | None]:
    """Run the body with backend `name` in every attention processor under `module`.

    Yields the RoutedBackend (its counters) for custom backends, None for native ones. On exit,
    even by an exception, the module is as it was: outputs are bit-identical to before.
    """
    swap = set_attention_backend_by_name(module, name)
    try:
        yield swap.routed
    finally:
        restore_attention_backend(swap)

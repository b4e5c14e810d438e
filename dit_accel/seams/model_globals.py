"""Swap one named global of a model file (a Python module) reversibly, shared by every user.

Why a global: a diffusers attention processor's `__call__` reads helpers such as
`dispatch_attention_fn` or `_apply_rotary_emb` as globals of its own model file (e.g.
`diffusers.models.transformers.transformer_minimax_h3`) at every call. Replacing that global
reroutes every call of every processor of the file, with no edit of diffusers or of the model;
putting the original object back undoes it exactly.

The invariants, per (swap, model file):

- Installed once: the first user's `acquire` builds the replacement from the original global and
  sets it; later users join the same installation (nothing is wrapped twice).
- Reference-counted: each `acquire(module, user)` is matched by one `release(module, user)`, in
  any order, nested or overlapping. The original comes back when the last user leaves.
- A third party wins: if, at the last release, the global no longer holds our replacement,
  someone patched over us; their object is left in place (restoring ours would undo their patch).
  Two swaps of the same global of one file stack like any such patch: leave them in reverse order.

Users: the replacement gets the live list of the installation's users (in arrival order), so it
can read them on each call, e.g. to count into each live handle. Users are compared by identity.

This module imports nothing from diffusers: it only knows modules, names and callables. Each
feature makes one `ModelGlobalSwap` for the global it replaces (attention routing:
`dispatch_attention_fn`, and `F` where a processor calls torch's SDPA itself, through a `Namespace`;
the fused RoPE: `_apply_rotary_emb`) and finds the files with `model_file`.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable

# Builds the replacement from (original global, the live users list); called once per installation,
# before anything is set, so it may raise to refuse an unsupported original.
MakeReplacement = Callable[[Callable[..., Any], list], Callable[..., Any]]


def model_file(processor: Any, global_name: str) -> ModuleType | None:
    """The model file whose globals this processor's `__call__` reads, when it has a global `global_name`
    (a function, or a module such as `F`; else None: swapping that global could not reach this processor)."""
    module = sys.modules.get(type(processor).__call__.__module__)
    if module is None or getattr(module, global_name, None) is None:
        return None
    return module


class Namespace:
    """A stand-in for a global that is itself a module (a model file's `F`): the `replaced` attributes
    answer from here, every other one from the original, so one function of it is swapped for that
    model file alone."""

    def __init__(self, original: object, replaced: dict[str, Callable[..., Any]]):
        self.__dict__.update(replaced)
        self._original = original

    def __getattr__(self, name: str):
        return getattr(self._original, name)


@dataclass(eq=False)
class Installation:
    """One live swap of a model file's global: what to put back, what we set, and who holds it."""

    original: Callable[..., Any]
    replacement: Callable[..., Any]
    users: list[Any] = field(default_factory=list)


class ModelGlobalSwap:
    """Replaces the global `name` of model files with `make_replacement(original, users)` while
    any user holds the file (see the module docstring for the invariants)."""

    def __init__(self, name: str, make_replacement: MakeReplacement):
        self.name = name
        self.make_replacement = make_replacement
        self.installed: dict[str, Installation] = {}  # model file name -> its live installation
        self._lock = threading.Lock()

    def acquire(self, module: ModuleType, user: Any) -> None:
        """Join (or make) the installation on `module` as `user`."""
        with self._lock:
            installed = self.installed.get(module.__name__)
            if installed is None:
                original = getattr(module, self.name)
                users: list[Any] = []
                installed = Installation(original, self.make_replacement(original, users), users)
                self.installed[module.__name__] = installed
                setattr(module, self.name, installed.replacement)
            installed.users.append(user)

    def release(self, module: ModuleType, user: Any) -> None:
        """Leave the installation on `module`; the last user out puts the original back, unless
        someone patched over our replacement (theirs stays)."""
        with self._lock:
            installed = self.installed[module.__name__]
            index = next(i for i, u in enumerate(installed.users) if u is user)
            del installed.users[index]
            if not installed.users:
                del self.installed[module.__name__]
                if getattr(module, self.name) is installed.replacement:
                    setattr(module, self.name, installed.original)

    def acquire_all(self, modules: Iterable[ModuleType], user: Any) -> list[ModuleType]:
        """`acquire` each module as `user`, all or none: on an error the ones joined are left again.
        Returns the modules, for the matching `release_all`."""
        joined: list[ModuleType] = []
        try:
            for module in modules:
                self.acquire(module, user)
                joined.append(module)
        except BaseException:
            self.release_all(joined, user)
            raise
        return joined

    def release_all(self, modules: list[ModuleType], user: Any) -> None:
        """`release` each module as `user`, last joined first."""
        for module in reversed(modules):
            self.release(module, user)

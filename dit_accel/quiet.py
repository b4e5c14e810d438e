"""Third-party libraries imported without their import-time noise.

Importing diffusers with torchao installed prints about five lines the user can do nothing about
(torchao's "Failed to load _C_mxfp8 / _C_cutlass_90a .so", torch's pytree warnings about torchao's
Enums, diffusers' "Unable to import `torchao` Tensor objects"), and matplotlib may announce that it is
building its font cache. The CLI imports those libraries through `quiet_import`: log records up to
WARNING and Python warnings are dropped *during the import only*, then the previous settings come
back, so what the libraries say while a command runs (and what they say to users of dit-accel's
library API, who import them themselves) is unchanged. Errors still print.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from typing import Iterator


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) held back inside the block and delivered when it ends. A SIGINT that lands inside
    a C++ library's initialisation (torch's pybind11 modules) can abort the process or leave a module
    half-imported with a misleading error; held, it becomes a plain KeyboardInterrupt right after."""
    import signal
    import threading

    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Log records of level WARNING and below, and Python warnings, are dropped inside the block, and
    a Ctrl-C is held until it ends (`_sigint_held`)."""
    previous = logging.root.manager.disable
    logging.disable(max(previous, logging.WARNING))
    try:
        with _sigint_held(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def quiet_import(*modules: str) -> None:
    """Import `modules` (already imported ones cost nothing) inside `quiet_imports`."""
    with quiet_imports():
        for name in modules:
            importlib.import_module(name)


# Warnings libraries raise while a command runs that tell a user of the command line nothing they can act
# on: (category, message pattern, where it comes from). Dropped by `quiet_run`, for that command only.
RUN_NOISE: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"No artists with labels found to put in legend",
     "matplotlib, on a plot with nothing to label (bench-attention when every backend is unavailable)"),
    (UserWarning, r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument",
     "CuTe DSL, compiling flash-attn-4's kernel (its own argument type; seen in bench-attention on the H200)"),
    (UserWarning, r"In CPU autocast, but the target dtype is not supported",
     "torch, when Mochi 1 builds its RoPE under a float32 autocast on the CPU (its scaled-down runs)"),
    (UserWarning, r"Dynamo does not know how to trace the builtin `time\.perf_counter",
     "torch.compile, tracing cache-dit's DBCache timers in a compiled transformer (generate +compile+cache=dbcache)"),
)


@contextlib.contextmanager
def quiet_run() -> Iterator[None]:
    """The warnings of `RUN_NOISE` dropped inside the block (the CLI wraps each command's run in it)."""
    with warnings.catch_warnings():
        for category, message, _source in RUN_NOISE:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield

"""Attention backends (a registry, as data) and the one seam that swaps them into diffusers models."""
from .backends import BACKENDS, AttentionBackend, BackendCannotServe, TwoPhases, get_backend
from .routing import (AttentionBackendSwap, RoutedBackend, restore_attention_backend, set_attention_backend_by_name,
                      use_attention_backend)

__all__ = [
    "BACKENDS", "AttentionBackend", "BackendCannotServe", "TwoPhases", "get_backend",
    "AttentionBackendSwap", "RoutedBackend", "restore_attention_backend", "set_attention_backend_by_name",
    "use_attention_backend",
]

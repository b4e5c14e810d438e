"""Test doubles for attention backends, shared by the routing and patching tests."""
import pytest
import torch.nn.functional as F

from dit_accel.attention import backends
from dit_accel.attention.backends import AttentionBackend


class RecordingSdpa:
    """A fake custom backend's kernel: records each call's shapes and answers with torch SDPA."""

    def __init__(self):
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, q, k, v, scale=None):
        self.calls.append((tuple(q.shape), tuple(k.shape)))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return out.transpose(1, 2)


@pytest.fixture
def fake_backend(monkeypatch):
    """Registers a routed backend named `fake` for this test only."""
    kernel = RecordingSdpa()
    backend = AttentionBackend("fake", "test double", kernel, lambda device: None, routed=True)
    monkeypatch.setitem(backends.BACKENDS, "fake", backend)
    return kernel

"""dit-accel: profile and accelerate video diffusion-transformer inference."""
from .version import __version__

__all__ = ["__version__", "fused_rope", "patch_attention"]


def patch_attention(*args, **kwargs):
    """See `dit_accel.patching.patch_attention` (imported lazily: torch and diffusers load on use)."""
    from .patching import patch_attention as _patch_attention

    return _patch_attention(*args, **kwargs)


def fused_rope(*args, **kwargs):
    """See `dit_accel.patching.fused_rope` (imported lazily: torch and Triton load on use)."""
    from .patching import fused_rope as _fused_rope

    return _fused_rope(*args, **kwargs)

"""Online-softmax pieces both kernels share: reductions over the quad that holds a query row.

In both kernels (mma.sync m16n8k32 and the per-warp slice of an m64nNk32 wgmma) a query row's
accumulator values are spread over the 4 lanes of a quad (lanes 4g..4g+3; lane t holds keys or
features 8j + 2t + {0, 1}). Two butterfly shuffles (xor 1, then xor 2) give all 4 lanes the
quad's result; no other lane takes part.
"""
import cutlass.cute as cute
from cutlass import Float32


def quad_max(x: Float32) -> Float32:
    """max of x over the 4 lanes of this lane's quad, on every lane of it."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


def quad_sum(x: Float32) -> Float32:
    """Sum of x over the 4 lanes of this lane's quad, on every lane of it."""
    x += cute.arch.shuffle_sync_bfly(x, offset=1)
    x += cute.arch.shuffle_sync_bfly(x, offset=2)
    return x

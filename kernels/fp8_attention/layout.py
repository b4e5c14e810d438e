"""The prep/kernel contract: what prep writes and every reader (emulation, both kernels) assumes.

- Q rows are padded to ``Q_ROWS`` (128): one CTA owns 128 query rows (v1; sm90 at D = 128), or
  192 (sm90 at D = 64: its last tile reads TMA's zero fill past the padding and writes no row).
- K rows and V's key columns are padded to ``KEYS`` (32): one m16n8k32 (or m64nNk32) k-block of
  the P.V GEMM, and v1's key strip. Zero padding, masked to -inf in the last block.
- V's keys are permuted inside every 16-key group by `key_order`, so that the fp32 S
  accumulator moves into the e4m3 A registers of the P.V MMA lane-locally.
- P = 2^(logit - running max) <= 1 is stored in e4m3 as p * ``P_SCALE`` (2^``P_SCALE_LOG2``
  = 256 < ``E4M3_MAX`` = 448, so no P code saturates).
- Logits are kept in log2 units (scaled by ``LOG2_E``); LSE goes back to natural log with
  ``LN_2``.
- With INT8 Q/K (the sm90 kernel's ``qk_int8``), Q and K are int8 codes with a scale per group of the
  rows one thread of the kernel holds (`q_scale_group`, `k_scale_group`), in blocks of ``SCALE_BLOCK``
  (64) rows of a head: a query block is one consumer warpgroup's rows, a key block half of a 128-key
  block. V stays e4m3 with its per-head scale.

Torch only (no cutlass): prep and the emulation import it on machines without CuTe DSL.
"""
import math

import torch

Q_ROWS = 128  # Sq padding; query rows per CTA of v1 (4 warps x 32 rows) and of sm90 at D = 128 (2 x 64)
KEYS = 32  # key padding of Skv; v1's strip; one k-block of the P.V MMA
P_SCALE_LOG2 = 8.0  # P is stored as p * 2^8 in e4m3
P_SCALE = 2.0**P_SCALE_LOG2  # 256.0
E4M3_MAX = 448.0  # largest finite e4m3 (float8_e4m3fn) value
INT8_MAX = 127.0  # INT8 Q/K codes are in -127..127 (symmetric; -128 unused)
SCALE_BLOCK = 64  # INT8 Q/K: rows (queries or keys) of a head per block of scale groups
Q_SCALE_GROUPS = 32  # INT8 Q/K: scale groups per 64-query block (`q_scale_group`)
K_SCALE_GROUPS = 4  # INT8 Q/K: scale groups per 64-key block (`k_scale_group`)
ROUND_TO_INT = 1.5 * 2**23  # x + this - this rounds |x| < 2^22 to an integer; the INT8 scores' bias (sm90 softmax)
MAX_STEP = 4.0  # INT8 Q/K: the largest running-max step the sm90 softmax rounds to (`softmax.BiasedGroups`)
FP8 = torch.float8_e4m3fn
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
SUPPORTED_HEAD_DIMS = (64, 128)  # both kernels; read by `support` and the kernel constructors


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def key_order(positions: torch.Tensor) -> torch.Tensor:
    """Key stored at k slot `positions` of V, inside each 16-key group.

    The m16n8k32 accumulator gives lane t (= lane % 4) of a row the keys 8j + 2t + {0, 1} for
    n8 tiles j = 0..3; the A operand wants that lane's 8 bytes at k slots 4t..4t+3 (j = 0, 1)
    and 16 + 4t..16 + 4t+3 (j = 2, 3). Slot p = 16 * (j // 2) + 4t + 2 * (j % 2) + c therefore
    holds key 8j + 2t + c. Within a 16-key group (j // 2 fixed): slot 4t + 2e1 + c -> key
    8e1 + 2t + c. It is a permutation of each group of 16. The per-warp layouts of an FP8
    m64nNk32 wgmma are the same, so the sm90 kernel reads the same V.
    """
    group = positions // 16 * 16
    lane = (positions % 16) // 4
    element = positions % 4
    return group + 8 * (element // 2) + 2 * lane + element % 2


def q_scale_group(rows: torch.Tensor) -> torch.Tensor:
    """INT8 Q/K: the scale group of query rows (indices into q_scale [B*H, blocks * Q_SCALE_GROUPS]).

    A consumer warpgroup's wgmma accumulator gives lane l of warp w (of 4) rows 16w + l // 4 and 16w + l // 4 + 8
    of its 64: those two rows share a scale, read once per tile. Row x of block x // 64 is in group
    32 * (x // 64) + 8 * w + x % 8, w = (x % 64) // 16.
    """
    return rows // SCALE_BLOCK * Q_SCALE_GROUPS + rows % SCALE_BLOCK // 16 * 8 + rows % 8


def k_scale_group(keys: torch.Tensor) -> torch.Tensor:
    """INT8 Q/K: the scale group of keys (indices into k_scale [B*H, blocks * K_SCALE_GROUPS]).

    Lane l of every warp holds, of each n8 tile of S, keys 8j + 2(l % 4) + {0, 1}: within a 64-key block the 16
    keys with (key % 8) // 2 = l % 4, which share a scale (two per 128-key block and thread). Key x is in group
    4 * (x // 64) + (x % 8) // 2.
    """
    return keys // SCALE_BLOCK * K_SCALE_GROUPS + keys % 8 // 2

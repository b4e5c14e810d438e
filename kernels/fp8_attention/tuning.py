"""What `fp8_attention` compiles on sm_90 beyond `Sm90Config`'s defaults, by head dim and key length, as
measured on the H200 (B1 H56, kernel alone, docs/kernels.md). No cutlass here: the host path picks a plan by
it on every call."""
from .config import Sm90Config
from .support import check_head_dim

# Persistent CTAs (one per SM, walking the tiles) up to this many keys, None: at every length. They hide a
# tile's start (its Q and first K/V loads, the launch) under the previous tile's end, and at D = 128 cost
# about 0.04 us per key block in the steady state. D = 64 (with the row sums below): +1.3-4% over one CTA
# per tile at S 4096-30272 (two runs). D = 128: +4% at S 4096, +0.5-2.5% at 8192-16384, -2.7% at 20480 and
# -1.0 to -2.3% at 30272, so up to 12288 keys only.
PERSISTENT_MAX_KEYS = {64: None, 128: 12288}
# The row sums from the tensor core (pv_row_sum): +8-14% at D = 64; at D = 128 3-9% slower.
PV_ROW_SUM_BY_HEAD_DIM = {64: True, 128: False}


def persistent_pays(head_dim: int, seqlen_kv: int) -> bool:
    """Whether fp8_attention runs persistent CTAs at this head dim and key length; raises
    Fp8AttentionUnsupported for a head dim the kernels are not written for."""
    if head_dim not in PERSISTENT_MAX_KEYS:
        check_head_dim(head_dim)
    limit = PERSISTENT_MAX_KEYS[head_dim]
    return limit is None or seqlen_kv <= limit


def sm90_config(head_dim: int, sm_count: int, seqlen_kv: int) -> Sm90Config:
    """The configuration `fp8_attention` runs at this head dim and key length on a device with sm_count SMs;
    raises Fp8AttentionUnsupported for a head dim the kernels are not written for (`persistent_pays`)."""
    return Sm90Config(persistent_ctas=sm_count if persistent_pays(head_dim, seqlen_kv) else 0,
                      pv_row_sum=PV_ROW_SUM_BY_HEAD_DIM[head_dim])

"""Named barrier ids of the sm90 kernel (`bar.sync` / `bar.arrive` ids, 16 per CTA).

0 is the CTA-wide barrier that __syncthreads (`cute.arch.sync_threads`) uses. The two consumer
warpgroups ping-pong their GEMMs: warpgroup w waits on CONSUMER_WG0_MAY_ISSUE + w before issuing
its wgmmas, and once they are issued arrives on the other one's (CONSUMER_WG0_MAY_ISSUE + 1 - w),
both with the 256 threads of the two consumer warpgroups. The DSL takes plain ints (or Int32
for the warpgroup-dependent ids): pass int(NamedBarrier.X), plus the warpgroup index.
"""
import enum


class NamedBarrier(enum.IntEnum):
    SYNC_THREADS = 0  # __syncthreads
    CONSUMER_WG0_MAY_ISSUE = 1  # consumer warpgroup 0 may issue its GEMMs
    CONSUMER_WG1_MAY_ISSUE = 2  # consumer warpgroup 1 may issue its GEMMs

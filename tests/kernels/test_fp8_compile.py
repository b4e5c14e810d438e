"""Compiles every FP8 attention kernel variant on the CPU (no GPU needed).

One subprocess per architecture, because CuTe DSL reads CUTE_DSL_ARCH when it initialises and
the variable must not leak into other tests. Sequence lengths are dynamic in the compiled
kernel, so tail shapes (Sq % 128, Skv % 32 != 0) share these compilations; the key-tail mask
is compiled in every variant.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

COMPILE_ALL = r"""
import json, sys, torch
from dit_accel.kernels.fp8_attention.compile import compile_fp8_attention
done = []
for head_dim, out_dtype, with_lse in [(64, torch.bfloat16, False), (128, torch.bfloat16, False),
                                      (64, torch.float16, True), (128, torch.bfloat16, True)]:
    kernel = compile_fp8_attention(head_dim, out_dtype, with_lse)
    ptx = kernel.__ptx__ or ""
    done.append({"head_dim": head_dim, "lse": with_lse,
                 "mma": ptx.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32")})
print(json.dumps(done))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_compiles(arch, tmp_path):
    # KEEP=ptx makes the compiled object expose its PTX (dumped under tmp_path)
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    variants = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(variants) == 4
    for v in variants:
        # two strip instances (unmasked loop body, masked last strip), each with
        # S = QK^T: (D/32) k-blocks x 2 m-tiles x 4 n8 tiles, O += PV: 2 m-tiles x D/8 n8 tiles
        per_strip = v["head_dim"] // 32 * 2 * 4 + 2 * v["head_dim"] // 8
        assert v["mma"] == 2 * per_strip, v

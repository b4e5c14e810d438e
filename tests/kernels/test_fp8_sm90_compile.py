"""Compiles the Hopper FP8 attention kernel (kernel_sm90) for sm_90a on the CPU.

One subprocess, because CuTe DSL reads CUTE_DSL_ARCH when it initialises. Counts the wgmma
instructions in the PTX: per key block, S = Q K^T is D/32 m64nNk32 wgmmas and P.V is N/32
m64nDk32 wgmmas (RS: P from registers); the first block and the steady-state loop body each
hold one S, and the loop body and the last block each hold one P.V. With fma_exp2_tiles, that
many n8 tiles of each row take the polynomial exp2 (its round-to-integer constant 1.5 * 2^23
appears once per value) and the rest stay on ex2.approx.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

COMPILE = r"""
import glob, json, os, re, torch
from dit_accel.kernels.fp8_attention.compile import compile_fp8_attention
from dit_accel.kernels.fp8_attention.config import Sm90Config
from dit_accel.kernels.fp8_attention.tuning import sm90_config
d64 = sm90_config(64, 132, 30272)  # what fp8_attention runs at D = 64 on a 132-SM H200
dump = os.environ["CUTE_DSL_DUMP_DIR"]
done = []
for head_dim, with_lse, tile_n, two_level, tiles, wgs, ctas, q_stages, row_sum, int8 in [
        (64, False, 128, True, 0, 2, 0, 1, False, False), (128, True, 128, True, 0, 2, 0, 1, False, False),
        (128, False, 192, False, 0, 2, 0, 1, False, False), (128, False, 128, True, 2, 2, 0, 1, False, False),
        (64, True, 128, True, 0, None, 0, 1, False, False), (128, True, 128, True, 0, 2, 132, 1, False, False),
        (64, True, 128, True, 0, None, 132, 1, False, False), (128, True, 128, True, 0, 2, 132, 2, False, False),
        (128, True, 128, True, 0, 2, 0, 1, True, False), (64, True, 128, True, 0, None, 0, 1, True, False),
        (64, True, 128, True, 0, None, d64.persistent_ctas, 1, d64.pv_row_sum, False),
        (128, True, 128, True, 0, 2, 0, 1, False, True), (64, True, 128, True, 0, None, 132, 1, True, True)]:
    for f in glob.glob(os.path.join(dump, "*.ptx")):
        os.remove(f)
    config = Sm90Config(tile_n=tile_n, two_level_pv=two_level, fma_exp2_tiles=tiles, consumer_warpgroups=wgs,
                        persistent_ctas=ctas, q_stages=q_stages, pv_row_sum=row_sum, qk_int8=int8)
    compile_fp8_attention(head_dim, torch.bfloat16, with_lse, kernel="sm90", config=config)
    ptx = open(glob.glob(os.path.join(dump, "*.ptx"))[0]).read()
    threads = int(re.search(r"\.reqntid\s+(\d+)", ptx)[1])
    done.append({"head_dim": head_dim, "tile_n": tile_n, "fma_exp2_tiles": tiles, "default": wgs is None,
                 "persistent": ctas > 0, "grid_dim_reads": ptx.count("%nctaid.x"), "q_stages": q_stages,
                 "row_sum": row_sum, "int8": int8,
                 "sum_wgmma": ptx.count("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3"),
                 "fadd": len(re.findall(r"\badd(?:\.rn)?(?:\.ftz)?\.f32", ptx)),
                 "mbarrier_inits": ptx.count("mbarrier.init"),
                 "warpgroups": wgs or threads // 128 - 1,
                 "consumer_regs": int(re.search(r"setmaxnreg.inc.sync.aligned.u32\s+(\d+)", ptx)[1]),
                 "threads": threads,
                 "named_barriers": len(re.findall(r"bar\.(?:sync|arrive)\s+\S+,\s*256;", ptx)),
                 "poly_exp2": ptx.count("0f4B400000"), "ex2": ptx.count("ex2.approx"),
                 "qk": ptx.count(f"wgmma.mma_async.sync.aligned.m64n{tile_n}k32."
                                 + ("satfinite.s32.s8.s8" if int8 else "f32.e4m3.e4m3")),
                 "pv": ptx.count(f"wgmma.mma_async.sync.aligned.m64n{head_dim}k32.f32.e4m3.e4m3"),
                 "k_scale_loads": ptx.count("ld.global"), "i2f": ptx.count("cvt.rn.f32.s32"),
                 "to_float_iadd": ptx.count(", 1262485504;"), "to_float_fadd": ptx.count("0fCB400000"),
                 "exact_branches": len(re.findall(r"setp\.gt\.f32\s+%p\d+, %r\d+, 0f40800000", ptx)),  # u > 4
                 "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg"),
                 "cvt_e4m3x2": ptx.count("cvt.rn.satfinite.e4m3x2.f32")})
print(json.dumps(done))
"""


@pytest.mark.slow
def test_sm90_compiles(tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    variants = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(variants) == 13
    for v in variants:
        d, n = v["head_dim"], v["tile_n"]
        if d == n and not v["int8"]:  # QK^T and P.V wgmmas have the same shape
            assert v["qk"] == 2 * d // 32 + 2 * n // 32, v
        else:
            assert v["qk"] == 2 * d // 32 and v["pv"] == 2 * n // 32, v
        assert v["tma"] >= 3 and v["setmaxnreg"] == 2, v
        # 2 consumer warpgroups at 240 registers ping-pong through named barriers 1 and 2; 3 (192-row
        # tiles) at 160 registers do not ping-pong.
        assert v["consumer_regs"] == {2: 240, 3: 160}[v["warpgroups"]], v
        assert (v["named_barriers"] > 0) == (v["warpgroups"] == 2), v
        assert v["threads"] == 128 * (1 + v["warpgroups"]), v
        if v["default"]:  # D = 64's default: 3 consumer warpgroups (192-row tiles)
            assert v["head_dim"] == 64 and v["warpgroups"] == 3, v
        # Persistent CTAs step through the tiles by the grid size, in the producer and in the consumers.
        assert v["grid_dim_reads"] == (2 if v["persistent"] else 0), v
        # P: N/32 k-blocks x 8 pairs per thread, in the first block and in the loop body
        assert v["cvt_e4m3x2"] == 2 * (n // 32) * 8, v
        # Per thread and softmax (first block, loop body): 2 rows x n/4 values, 4 per FMA tile,
        # plus the loop's 2 row-rescale factors. (With FMA tiles, LLVM duplicates a few of the
        # first block's ex2 across its key-tail mask branches, so only the poly count is exact.)
        tiles = v["fma_exp2_tiles"]
        # INT8 Q/K's scores become fp32 by the bits of 1.5 * 2^23: per thread and softmax n/2 values, each one
        # IADD of those bits, the constant taken off in the FFMA's bias (a few products of the constant per
        # softmax); the FADD of -1.5 * 2^23 per value sits only in the branch for steps above MAX_STEP
        # (`softmax.BiasedGroups.exact`); no I2F (below).
        assert v["to_float_iadd"] == (n if v["int8"] else 0), v
        if v["int8"]:
            assert v["poly_exp2"] <= 16 < n and v["to_float_fadd"] == n and v["exact_branches"] >= 2, v
        else:
            assert v["poly_exp2"] == 2 * 4 * tiles, v
        if tiles == 0:
            assert v["ex2"] == 2 * (2 * n // 4) + 2, v
        # pv_row_sum: P times the ones tile (m64n8k32) at both P.V sites, else none.
        assert v["sum_wgmma"] == (2 * n // 32 if v["row_sum"] else 0), v
    # The row sums leave the FMA pipe: 2 rows x 31 FADDs at each of the two softmax sites.
    plain, summed = variants[1], variants[8]
    assert (plain["row_sum"], summed["row_sum"]) == (False, True)
    assert plain["fadd"] - summed["fadd"] >= 100, (plain["fadd"], summed["fadd"])
    # A second Q stage is one more full and one more empty barrier than the same kernel with one.
    one_stage, two_stages = variants[5], variants[7]
    assert (one_stage["q_stages"], two_stages["q_stages"]) == (1, 2)
    assert two_stages["mbarrier_inits"] == one_stage["mbarrier_inits"] + 2, (one_stage, two_stages)
    # INT8 Q/K reads its scales from global memory: one Q block's per tile and two K halves' per key block
    # (first block and loop body), beside the e4m3 kernel's per-head descales.
    e4m3, int8 = variants[1], variants[11]
    assert int8["k_scale_loads"] - e4m3["k_scale_loads"] == 1 + 2 * 2, (e4m3, int8)
    # ... and converts its s32 scores without an I2F (the quarter-rate pipe the exp2s queue on).
    assert int8["i2f"] == e4m3["i2f"], (e4m3, int8)


def test_register_split_fits_the_launch_allocation():
    """setmaxnreg moves registers only inside the CTA's launch allocation (threads x the launch register
    count, which ptxas takes as 64K / threads rounded down to 8 here), and an increase that does not fit
    waits forever: four consumer warpgroups at 120 registers hung the GPU this way."""
    from dit_accel.kernels.fp8_attention.config import CONSUMER_REGS
    from dit_accel.kernels.fp8_attention.kernel_sm90 import PRODUCER_REGS, WG_THREADS

    for warpgroups, consumer_regs in CONSUMER_REGS.items():
        threads = WG_THREADS * (1 + warpgroups)
        launch_regs = 65536 // threads // 8 * 8
        assert consumer_regs % 8 == 0 and PRODUCER_REGS % 8 == 0
        assert WG_THREADS * PRODUCER_REGS + WG_THREADS * warpgroups * consumer_regs <= threads * launch_regs, warpgroups


def test_plans_compile_with_each_devices_default_config(monkeypatch):
    """interface._plan compiles the sm90 kernel in `tuning.sm90_config` for its head dim, key length and
    its own device's SM count, once per plan; "cuda" without an index is the current device's plan; at
    D = 128 short and long key sides get a plan each (persistent CTAs up to PERSISTENT_MAX_KEYS), and a
    non-sm90 device one plan for both."""
    import types

    import torch

    from dit_accel.kernels.fp8_attention import compile as compile_module
    from dit_accel.kernels.fp8_attention import interface
    from dit_accel.kernels.fp8_attention.support import Fp8AttentionUnsupported
    from dit_accel.kernels.fp8_attention.tuning import PERSISTENT_MAX_KEYS, sm90_config

    calls = []
    monkeypatch.setattr(compile_module, "compile_fp8_attention", lambda *a, **kw: calls.append((a[0], kw)) or object())
    capability = (9, 0)
    monkeypatch.setattr(interface, "device_capability", lambda device: capability)
    monkeypatch.setattr(interface, "_plans", {})
    sms = {0: 132, 1: 78}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=sms[device.index]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    short, long = PERSISTENT_MAX_KEYS[128], PERSISTENT_MAX_KEYS[128] + 1
    for device in ("cuda:0", "cuda:1", "cuda:0", "cuda"):
        for d in (64, 128):
            for seqlen_kv in (short, 1, long, 30272):
                interface._plan(d, torch.bfloat16, False, torch.device(device), seqlen_kv)
    assert calls == [(d, dict(kernel="sm90", config=sm90_config(d, sms[i], s), with_key_lengths=False))
                     for i in (0, 1) for d, s in ((64, short), (128, short), (128, long))]
    assert [kw["config"].persistent_ctas for _, kw in calls] == [132, 132, 0, 78, 78, 0]
    calls.clear()
    capability = (8, 9)  # v1: nothing depends on the key length
    monkeypatch.setattr(interface, "_plans", {})
    for seqlen_kv in (short, long):
        interface._plan(128, torch.bfloat16, False, torch.device("cuda:0"), seqlen_kv)
    assert calls == [(128, {"kernel": "mma_sync", "with_key_lengths": False})]
    with pytest.raises(Fp8AttentionUnsupported, match="head"):  # not a KeyError from the plan's key
        interface._plan(96, torch.bfloat16, False, torch.device("cuda:0"), 1024)

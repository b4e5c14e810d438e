"""The prep's Triton kernels compile for sm_90 on the CPU, in every mode a launch uses (one launch or two; e4m3 or
INT8 q/k; with or without the prologue). The interpreter tests run them but do not compile them, and a compile
error they cannot see (a module global read without tl.constexpr) once reached the GPU. One subprocess, because
the tests' conftest puts Triton in its interpreter. The compiles stop at PTX: ptxas, 70% of a compile's time on
the CPU, sees nothing the front end has not already checked for this test's purpose."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

COMPILE = r"""
import json, os, triton
from concurrent.futures import ProcessPoolExecutor
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from dit_accel.kernels.fp8_attention import prep_triton_kernels as tk

add_stages = CUDABackend.add_stages
def add_stages_up_to_ptx(self, stages, options, language):
    add_stages(self, stages, options, language)
    stages["cubin"] = lambda ptx, metadata: ptx.encode()  # the PTX in the binary's place: no ptxas
CUDABackend.add_stages = add_stages_up_to_ptx

def compile(job):
    name, types, constexprs = job
    kernel = getattr(tk, name)
    names = kernel.arg_names
    assert len(types) + len(constexprs) == len(names), (name, len(types), len(names))
    signature = dict(zip(names, types)) | dict.fromkeys(constexprs, "constexpr")
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return len(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])

x, e4m3, int8, f32 = "*bf16", "*fp8e4nv", "*i8", "*fp32"
strides = ["i64"] * 9
prologue_args = [x, x, f32, f32, "i32", "i32", "fp32"]
jobs = []
for qk_int8 in (False, True):
    qk = int8 if qk_int8 else e4m3
    jobs.append(("_fp8_prep_single_kernel", [x, x, x, qk, qk, e4m3, f32, f32, f32] + ["i32"] * 6 + strides,
                 dict(D=128, BLOCK=tk.BLOCK_S, QK_INT8=qk_int8)))
    for prologue in (False, True):
        block = tk.SCALE_BLOCK if qk_int8 else tk.PROLOGUE_BLOCK_S if prologue else tk.BLOCK_S
        constexprs = dict(D=128, BLOCK=block, HEADS=tk.PROLOGUE_HEADS if prologue else 1, PROLOGUE=prologue,
                          HALF=48 if prologue else 0, QK_INT8=qk_int8)
        jobs.append(("_fp8_prep_amax_kernel", [x, x, x, f32] + ["i32"] * 5 + strides + prologue_args, constexprs))
        jobs.append(("_fp8_prep_pack_kernel", [x, x, x, f32, qk, qk, e4m3, f32, f32, f32] + ["i32"] * 7
                     + strides + prologue_args, constexprs))
if __name__ == "__main__":  # the compiles are independent: one process a core
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        print(json.dumps(list(pool.map(compile, jobs))))
"""


@pytest.mark.slow
def test_every_prep_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    script = tmp_path / "compile_prep.py"  # a file, not -c: the pool's workers import the script they run
    script.write_text(COMPILE)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    sizes = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(sizes) == 10 and all(size > 0 for size in sizes)

"""sha256 of the PTX of every FP8 attention build that matters, compiled on the CPU (no GPU needed).

    python scripts/ptx_digest.py > before.txt                 # one line per build: digest, label
    python scripts/ptx_digest.py --compare before.txt         # the same, then same/DIFFERENT per label
    python scripts/ptx_digest.py --keep-dir DIR               # also writes each build's PTX to DIR/<label>.ptx

For a restructuring of a kernel that must not change what it compiles to. The builds: what fp8_attention
runs on sm_90 (D = 64 on a 132-SM H200, one configuration at every key length; D = 128 at 4096 keys,
persistent, and at 30272, one CTA per tile), each with and without LSE, bf16 output; every sm90 variant
`tests/kernels/test_fp8_sm90_compile.py` compiles; v1 (mma_sync) as `tests/kernels/test_fp8_compile.py`
compiles it. The PTX is compared whole: it holds no source locations (no .loc / .file lines), and the
kernel's name holds no object address.
"""
import argparse
import hashlib
import os
import sys
import tempfile

SM_COUNT = 132  # an H200's SMs


def builds():
    """(label, head_dim, out dtype name, with_lse, kernel, sm90 configuration or None) of every build."""
    from dit_accel.kernels.fp8_attention.config import Sm90Config
    from dit_accel.kernels.fp8_attention.tuning import sm90_config

    out = []
    for head_dim, seqlen_kv in ((64, 30272), (128, 4096), (128, 30272)):
        config = sm90_config(head_dim, SM_COUNT, seqlen_kv)
        for with_lse in (False, True):
            out.append((f"default D{head_dim} skv{seqlen_kv} lse{int(with_lse)}", head_dim, "bfloat16", with_lse,
                        "sm90", config))
    d64 = sm90_config(64, SM_COUNT, 30272)
    # test_fp8_sm90_compile's variants, in its order: (head_dim, with_lse, tile_n, two_level_pv, fma_exp2_tiles,
    # consumer_warpgroups, persistent_ctas, q_stages, pv_row_sum)
    for i, (head_dim, with_lse, tile_n, two_level, tiles, wgs, ctas, q_stages, row_sum) in enumerate([
            (64, False, 128, True, 0, 2, 0, 1, False), (128, True, 128, True, 0, 2, 0, 1, False),
            (128, False, 192, False, 0, 2, 0, 1, False), (128, False, 128, True, 2, 2, 0, 1, False),
            (64, True, 128, True, 0, None, 0, 1, False), (128, True, 128, True, 0, 2, 132, 1, False),
            (64, True, 128, True, 0, None, 132, 1, False), (128, True, 128, True, 0, 2, 132, 2, False),
            (128, True, 128, True, 0, 2, 0, 1, True), (64, True, 128, True, 0, None, 0, 1, True),
            (64, True, 128, True, 0, None, d64.persistent_ctas, 1, d64.pv_row_sum)]):
        config = Sm90Config(tile_n=tile_n, two_level_pv=two_level, fma_exp2_tiles=tiles, consumer_warpgroups=wgs,
                            persistent_ctas=ctas, q_stages=q_stages, pv_row_sum=row_sum)
        out.append((f"compile-test {i} D{head_dim} lse{int(with_lse)}", head_dim, "bfloat16", with_lse, "sm90",
                    config))
    for head_dim, dtype, with_lse in ((64, "bfloat16", False), (128, "bfloat16", False), (64, "float16", True),
                                      (128, "bfloat16", True)):
        out.append((f"v1 D{head_dim} {dtype} lse{int(with_lse)}", head_dim, dtype, with_lse, "mma_sync", None))
    return out


def ptx_of(head_dim: int, dtype: str, with_lse: bool, kernel: str, config) -> str:
    import torch

    from dit_accel.kernels.fp8_attention.compile import compile_fp8_attention

    compiled = compile_fp8_attention(head_dim, getattr(torch, dtype), with_lse, kernel=kernel, config=config)
    return compiled.__ptx__


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", help="a previous run's output: say per build whether its PTX is the same")
    parser.add_argument("--keep-dir", help="write each build's PTX here")
    args = parser.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="ptx_digest_"))
    before = {}
    if args.compare:
        with open(args.compare) as f:
            before = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f if "  " in line)
    digests = {}
    for label, head_dim, dtype, with_lse, kernel, config in builds():
        ptx = ptx_of(head_dim, dtype, with_lse, kernel, config)
        if ".loc" in ptx or ".file" in ptx:
            sys.exit(f"{label}: the PTX holds source locations; compare with them stripped")
        digests[label] = hashlib.sha256(ptx.encode()).hexdigest()
        print(f"{digests[label]}  {label}", flush=True)
        if args.keep_dir:
            os.makedirs(args.keep_dir, exist_ok=True)
            with open(os.path.join(args.keep_dir, label.replace(" ", "_") + ".ptx"), "w") as f:
                f.write(ptx)
    if args.compare:
        print()
        for label, digest in digests.items():
            print(f"{'same' if before.get(label) == digest else 'DIFFERENT':<10} {label}")
        missing = sorted(set(before) - set(digests))
        if missing:
            print("not built this time:", ", ".join(missing))
        if missing or any(before.get(label) != digest for label, digest in digests.items()):
            sys.exit(1)


if __name__ == "__main__":
    main()

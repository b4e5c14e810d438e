"""CPU study: which Q/K (and V) quantization would take our FP8 attention's error below SageAttention2's.

    python scripts/qk_quantization_study.py --out DIR [--seq-len 4096] [--heads 4] [--block-seq-len 2048] [--rows N]

Every scheme runs through the kernels' own softmax and P.V in float64 (`emulation.softmax_pv`: 128-key blocks
last to first, p rounded to e4m3 against the running max, two-level accumulation; row sums of the rounded p at
D 64, as the sm90 kernel takes them), so only the quantization of Q, K and V differs:
  - e4m3 per head: today's kernel (one scale per (batch, head) for each of Q, K, V);
  - e4m3 / int8 per block: one scale per 64 query rows (a warpgroup's tile) and per 128 keys (a key tile);
    int8 codes are round(x / (amax / 127)), e4m3 ones x * (448 / amax) rounded to nearest even;
  - per warp: 16 query rows a scale;
  - per thread: SageAttention2's sm_90 granularity, the rows one thread of its MMA holds: per 16 query rows,
    the 8 pairs of rows r and r + 8; per 128 keys, the 4 groups of 32 keys whose index mod 8 is 2t or 2t + 1;
  - + K smoothing: K minus its mean over the tokens of its head before quantizing (softmax is unchanged: it adds
    the same q . mean to every logit of a row), as SageAttention2 does;
  - V per channel: one e4m3 scale per head dimension instead of per head.
Inputs: N(0,1) at D 128 and 64, N(0,1) with 50x outliers, and the q/k/v a MiniMax-H3 block (synthetic weights)
feeds its attention, its inputs captured from the model's own forward (the generic path's inputs) and N(0,1)
hidden states (the hand-written adapter's, before 2026-12-02). Error: rel. RMS against float64 attention.
Writes DIR/qk_quantization.json and prints a table.
"""
import argparse
import json
import math
from pathlib import Path

import torch

from dit_accel.attention.reference import random_qkv, reference_attention, rel_rms_err
from dit_accel.kernels.fp8_attention.emulation import softmax_pv
from dit_accel.kernels.fp8_attention.layout import E4M3_MAX, INT8_MAX, LOG2_E

Q_BLOCK, K_BLOCK, WARP_ROWS, KEY_TILE = 64, 128, 16, 128
PER_THREAD_Q, PER_THREAD_K = "per thread (queries)", "per thread (keys)"


def thread_groups(s: int, kind: str) -> torch.Tensor:
    """[S] the scale group of each row under SageAttention2's per-thread granularity (module docstring)."""
    r = torch.arange(s)
    if kind == PER_THREAD_Q:
        return (r // 16) * 8 + r % 8
    return (r // 128) * 4 + (r % 8) // 2


def quantized(x: torch.Tensor, fmt: str, rows_per_scale: int | str | None, per_channel: bool = False) -> torch.Tensor:
    """x [B, H, S, D] float64 rounded as the scheme would store it and dequantized (codes x their scale)."""
    b, h, s, d = x.shape
    if per_channel:
        amax = x.abs().amax(dim=2, keepdim=True)  # [B, H, 1, D]
    elif rows_per_scale is None:
        amax = x.abs().amax(dim=(2, 3), keepdim=True)  # [B, H, 1, 1]
    elif isinstance(rows_per_scale, str):
        groups = thread_groups(s, rows_per_scale)
        row_amax = x.abs().amax(dim=3)  # [B, H, S]
        group_amax = torch.zeros(b, h, int(groups.max()) + 1, dtype=x.dtype).scatter_reduce(
            2, groups.expand(b, h, s), row_amax, reduce="amax")
        amax = group_amax[:, :, groups, None]
    else:
        pad = -s % rows_per_scale
        blocks = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(b, h, -1, rows_per_scale, d)
        amax = blocks.abs().amax(dim=(3, 4), keepdim=True).expand(-1, -1, -1, rows_per_scale, 1)
        amax = amax.reshape(b, h, -1, 1)[:, :, :s]
    amax = torch.where(amax > 0, amax, torch.ones_like(amax)).float()
    if fmt == "int8":
        step = (amax / INT8_MAX).double()
        return torch.round(x / step).clamp(-INT8_MAX, INT8_MAX) * step
    quant = (amax.reciprocal() * E4M3_MAX).double()
    codes = (x * quant).float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()
    return codes / quant


SCHEMES = {  # name -> (Q/K format, query rows a scale, keys a scale, K smoothing, V per channel)
    "e4m3 per head (today)": ("e4m3", None, None, False, False),
    "e4m3 per head + K smoothing": ("e4m3", None, None, True, False),
    "e4m3 per block": ("e4m3", Q_BLOCK, K_BLOCK, False, False),
    "e4m3 per block + K smoothing": ("e4m3", Q_BLOCK, K_BLOCK, True, False),
    "int8 per block": ("int8", Q_BLOCK, K_BLOCK, False, False),
    "int8 per block + K smoothing": ("int8", Q_BLOCK, K_BLOCK, True, False),
    "int8 per warp + K smoothing": ("int8", WARP_ROWS, K_BLOCK, True, False),
    "int8 per thread": ("int8", PER_THREAD_Q, PER_THREAD_K, False, False),
    "int8 per thread + K smoothing (SageAttention2)": ("int8", PER_THREAD_Q, PER_THREAD_K, True, False),
    "int8 per block + K smoothing, V per channel": ("int8", Q_BLOCK, K_BLOCK, True, True),
}


def scheme_error(q, k, v, scheme, rows: torch.Tensor | None = None) -> float:
    """The scheme's attention of q, k, v [B, S, H, D] against float64's, over the query `rows` (all: None); the
    scales are those of the whole q."""
    fmt, q_rows, k_rows, smooth, v_channel = scheme
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    if smooth:
        kd = kd - kd.mean(dim=2, keepdim=True)
    qd, kd = quantized(qd, fmt, q_rows), quantized(kd, fmt, k_rows)
    if rows is not None:
        qd, q = qd[:, :, rows], q[:, rows]
    logits = qd @ kd.transpose(-1, -2) * (q.shape[-1] ** -0.5 * LOG2_E)
    v_scale = vd.abs().amax(dim=2 if v_channel else (2, 3), keepdim=True).clamp_min(1e-30)
    v_codes = quantized(vd, "e4m3", None, per_channel=v_channel) * (E4M3_MAX / v_scale)
    out, _ = softmax_pv(logits, v_codes, v_scale / E4M3_MAX, block_keys=KEY_TILE, reverse=True,
                        rounded_row_sum=q.shape[-1] == 64)
    return rel_rms_err(out.transpose(1, 2), reference_attention(q, k, v))


def h3_block_qkv(seq_len: int, heads: int, captured: bool):
    """The q/k/v of MiniMax-H3's block 0 (synthetic weights) at `seq_len`, its first `heads` heads: with the
    inputs the model's own forward makes (captured) or N(0,1) hidden states (the hand-written adapter's)."""
    from dit_accel.adapters import adapter_for_preset
    from dit_accel.loading.block import synthetic_block
    from dit_accel.profiling.attention_error import capture_attention_inputs

    adapter = adapter_for_preset("minimax-h3")
    device, dtype = torch.device("cpu"), torch.bfloat16
    inputs = adapter.make_inputs(adapter.workload_from_seq_len(seq_len, 1), device, dtype,
                                 torch.Generator().manual_seed(0))
    if not captured:
        generator = torch.Generator().manual_seed(1)
        inputs["hidden_states"] = torch.randn(inputs["hidden_states"].shape, generator=generator).to(dtype)
        inputs["temb"] = torch.randn(inputs["temb"].shape, generator=generator).to(inputs["temb"].dtype)
    block = synthetic_block(adapter, 0, device, dtype, seed=0).block
    return tuple(x[:, :, :heads].contiguous() for x in capture_attention_inputs(block, inputs, adapter))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=4096, help="S of the random inputs")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-seq-len", type=int, default=2048, help="S of the H3 block's q/k/v (0: skip)")
    parser.add_argument("--rows", type=int, default=0,
                        help="query rows each error is taken over, a fixed random sample (0: all; rows are "
                             "independent, so a sample keeps long sequences affordable)")
    args = parser.parse_args()
    cases = {}
    for d in (128, 64):
        cases[f"N(0,1) D{d}"] = random_qkv(1, args.seq_len, args.seq_len, args.heads, d, device="cpu", seed=0)
    cases["N(0,1) + 50x outliers D128"] = random_qkv(1, args.seq_len, args.seq_len, args.heads, 128, outliers=True,
                                                      device="cpu", seed=0)
    if args.block_seq_len:
        cases["H3 block q/k/v, captured inputs"] = h3_block_qkv(args.block_seq_len, args.heads, captured=True)
        cases["H3 block q/k/v, N(0,1) hidden states"] = h3_block_qkv(args.block_seq_len, args.heads, captured=False)

    def sample(seq_len: int) -> torch.Tensor | None:
        if not args.rows or args.rows >= seq_len:
            return None
        return torch.randperm(seq_len, generator=torch.Generator().manual_seed(0))[:args.rows].sort().values

    errors = {case: {name: scheme_error(*qkv, scheme, sample(qkv[0].shape[1])) for name, scheme in SCHEMES.items()}
              for case, qkv in cases.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qk_quantization.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                               "errors": errors}, indent=1))
    width = max(map(len, SCHEMES))
    print(f"{'scheme':{width}}  " + "  ".join(f"{case[:22]:>22}" for case in cases))
    for name in SCHEMES:
        print(f"{name:{width}}  " + "  ".join(f"{errors[case][name]:22.3%}" for case in cases))
    assert all(math.isfinite(e) for row in errors.values() for e in row.values())


if __name__ == "__main__":
    main()

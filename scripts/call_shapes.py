"""Print the attention calls a profile-block run's block makes, as bench-attention's --shapes (BxHxSqxSkvxD, comma-
separated, each distinct shape once; a key-padding call at its kept rows where the capture read them), so the
router's pick for each call can be timed against the backends it chooses between:

    dit-accel bench-attention --backends cudnn,fp8 --shapes "$(python3 scripts/call_shapes.py RUN)"
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def call_shapes(run: Path) -> list[str]:
    report = json.loads((run / "report.json").read_text())
    shapes: list[str] = []
    for work in report["block_work"].values():
        for call in work["attention_calls"]:
            lengths = [tuple(pair) for pair in call.get("kept") or ()] or [(call["q_len"], call["kv_len"])]
            for q_len, kv_len in lengths:
                shape = f"{call['batch'] if not call.get('kept') else 1}x{call['heads']}x{q_len}x{kv_len}x" \
                        f"{call['head_dim']}"
                if shape not in shapes:
                    shapes.append(shape)
    return shapes


if __name__ == "__main__":
    print(",".join(call_shapes(Path(sys.argv[1]))))

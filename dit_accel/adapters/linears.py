"""Which of a block's linears go FP8 (`+fp8-linear`), by one rule for every family.

The rule, stated in every report: a linear goes FP8 when it runs on the block's sequence, when its in and out
features are multiples of 16 (what an FP8 GEMM takes) and when it is at least a sixteenth of the block's
largest linear (in x out: a small GEMM does not pay for the activation's quantize). A linear runs on the
block's sequence when its rows grow with the video: the pass is captured twice, at the default video and at
twice its rows (text, audio and timestep inputs as they were), and the linears whose rows differ between the
two run on the video rows, or on the video joined with the text; those whose rows stay the same run on the
text context alone, the timestep rows or a pooled vector, however many rows that is (HunyuanVideo 1.5's
text side, byT5 glyph and image tokens included, outnumbers the scaled-down video's rows). The rows each
linear saw come from the model's own forward (`capture.StackCapture.linear_rows`), so the choice is the
model's, not a list per family.
"""
from __future__ import annotations

from dataclasses import dataclass

from .capture import StackCapture

RULE = ("a block linear goes FP8 when it runs on the block's sequence rows (its rows grow with the video; not the "
        "text, timestep or pooled rows, which stay the same), its in and out features are multiples of 16 and it "
        "is at least 1/16 of the block's largest linear")
GEMM_MULTIPLE = 16
MIN_SHARE_OF_LARGEST = 1 / 16


@dataclass(frozen=True)
class Fp8Policy:
    """The linears (block-relative names) that go FP8, and each other one with why it stays."""

    fp8: tuple[str, ...]
    kept: dict[str, str]


def fp8_policy(capture: StackCapture, more_video: StackCapture, shapes: dict[str, tuple[int, int]]) -> Fp8Policy:
    """The rule (`RULE`) applied to the linears of a stack's block, on the rows each saw in the captured pass
    (`capture`) and in the same pass with more video rows (`more_video`), and on the full-size block's (in, out)
    features (`shapes`: a capture of the scaled-down config has its smaller ones)."""

    def rows(name: str) -> int:
        return capture.linear_rows.get(name, 0)

    on_sequence = {name for name in shapes
                   if rows(name) and more_video.linear_rows.get(name, 0) > rows(name)}
    block_rows = max((rows(name) for name in on_sequence), default=0)
    largest = max((k * n for k, n in shapes.values()), default=0)
    fp8, kept = [], {}
    for name, (in_features, out_features) in shapes.items():
        n = rows(name)
        if n == 0:
            kept[name] = "does not run in the pass"
        elif not on_sequence:  # a stack on the text alone (Kandinsky 5's text blocks)
            kept[name] = (f"runs on {n} row{'s' if n != 1 else ''} at every video size: this stack's blocks see no "
                          f"video rows (text, timestep or pooled rows), where FP8 saves little and the activation's "
                          f"quantize costs more")
        elif name not in on_sequence:
            kept[name] = (f"runs on {n} row{'s' if n != 1 else ''}, not the block's {block_rows} sequence rows: "
                          f"{n} at every video size (text, timestep or pooled rows), where FP8 saves little and "
                          f"the activation's quantize costs more")
        elif in_features % GEMM_MULTIPLE or out_features % GEMM_MULTIPLE:
            kept[name] = (f"[{in_features} -> {out_features}]: FP8 GEMMs need in and out features that are "
                          f"multiples of {GEMM_MULTIPLE}")
        elif in_features * out_features < MIN_SHARE_OF_LARGEST * largest:
            kept[name] = (f"[{in_features} -> {out_features}]: under 1/16 of the block's largest linear, too small "
                          f"for an FP8 GEMM to pay")
        else:
            fp8.append(name)
    return Fp8Policy(tuple(fp8), kept)

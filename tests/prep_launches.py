"""Helpers of the FP8 prep's tests: force the plain prep's one- or two-launch path, record which kernels
a `prep_triton` call launched, and plant the heads whose scales are special. `kernels` is
`prep_triton_kernels` as the test imported it (compiled on a GPU machine, interpreted on the CPU)."""
import torch


def force_path(monkeypatch, kernels, one_launch: bool) -> None:
    """Every plain call takes the one-launch path (one_launch) or the two-launch path, whatever its length
    (a call with the prologue takes two launches either way)."""
    monkeypatch.setattr(kernels, "SINGLE_LAUNCH_MAX_S", 1 << 30 if one_launch else 0)


def count_launches(monkeypatch, kernels, *, run: bool = True) -> list[str]:
    """The names of the prep kernels launched from here on, in order, however each goes out (Triton's JIT
    or the compiled kernel it returned before: `_launch`); run=False launches nothing."""
    launched = []
    launch = kernels._launch

    def counted(kernel, grid, args, constexprs, spec):
        launched.append(kernel.__name__)
        if run:
            launch(kernel, grid, args, constexprs, spec)

    monkeypatch.setattr(kernels, "_launch", counted)
    return launched


def in_layout(q, k, v, layout: str):
    """The same q, k, v [B, S, H, D] values through the strides prep must read: "contiguous" as they are;
    views of one fused [B, S, 3, H, D] projection ("qkv", Sq == Skv); or transposed [B, H, S, D] storage
    ("heads-major")."""
    if layout == "qkv":
        return torch.stack((q, k, v), dim=2).unbind(2)
    if layout == "heads-major":
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q, k, v


def add_special_heads(q, k, v):
    """An all-zero head, a head with inf and one with NaN (a NaN descale each), on distinct heads where
    there are two or more (b, h)."""
    b, _, h, _ = q.shape
    last = (b - 1, h - 1)
    q[0, q.shape[1] // 2, 0, 3] = float("inf")
    k[last[0], k.shape[1] - 1, last[1], 1] = float("nan")
    v[0, :, 0] = 0
    if b * h > 1:
        q[last[0], :, last[1]] = 0
        v[last[0], 0, last[1], 2] = float("-inf")

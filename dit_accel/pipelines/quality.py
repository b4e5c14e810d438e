"""How close two videos are, frame by frame: PSNR and SSIM on frames in [0, 1].

Used to compare a run with FP8 attention against the same seed with bf16 attention. Both metrics
take frames laid out [F, H, W, C] (what pipelines return with output_type="np"), data range 1.

SSIM is Wang et al. (2004): local means, variances and covariance under an 11-tap Gaussian window
of sigma 1.5, constants C1 = (0.01 L)^2 and C2 = (0.03 L)^2 with L = 1, computed per RGB channel
over the window positions that fit inside the frame ("valid", as pytorch-msssim does; scikit-image
pads by reflection instead, so its numbers differ slightly at the borders), then averaged over
positions and channels. Frames smaller than the window use the largest odd window that fits.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _as_frames(video) -> torch.Tensor:
    """[F, H, W, C] float64 tensor from a numpy array or tensor (a leading batch of 1 is dropped)."""
    frames = torch.as_tensor(np.asarray(video) if not isinstance(video, torch.Tensor) else video).double()
    if frames.ndim == 5 and frames.shape[0] == 1:
        frames = frames[0]
    if frames.ndim == 3:  # one frame
        frames = frames[None]
    if frames.ndim != 4:
        raise ValueError(f"expected frames [F, H, W, C], got shape {tuple(frames.shape)}")
    return frames


def psnr_per_frame(video, reference) -> list[float]:
    """10 log10(1 / MSE) per frame, in dB; `inf` where a frame equals its reference exactly."""
    a, b = _as_frames(video), _as_frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"videos differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    mse = ((a - b) ** 2).flatten(1).mean(dim=1)
    return [math.inf if m == 0 else 10.0 * math.log10(1.0 / m) for m in mse.tolist()]


def gaussian_window(size: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA) -> torch.Tensor:
    """Normalised 1-D Gaussian taps (float64), centred."""
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    taps = torch.exp(-(x**2) / (2 * sigma**2))
    return taps / taps.sum()


def ssim_per_frame(video, reference, *, window: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA) -> list[float]:
    """Mean SSIM per frame (1.0 for identical frames), computed per channel and averaged."""
    a, b = _as_frames(video), _as_frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"videos differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    size = min(window, a.shape[1], a.shape[2])
    size -= 1 - size % 2  # odd
    taps = gaussian_window(size, sigma)
    channels = a.shape[3]
    # [F, C, H, W]; the separable window as two depthwise convolutions.
    x, y = a.permute(0, 3, 1, 2), b.permute(0, 3, 1, 2)
    kh = taps.view(1, 1, size, 1).repeat(channels, 1, 1, 1)
    kw = taps.view(1, 1, 1, size).repeat(channels, 1, 1, 1)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.conv2d(t, kh, groups=channels), kw, groups=channels)

    c1, c2 = SSIM_K1**2, SSIM_K2**2
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return ssim_map.flatten(1).mean(dim=1).tolist()


def compare_videos(video, reference) -> dict:
    """Per-frame PSNR (dB) and SSIM plus their means and minima, for a report.

    A frame equal to its reference has an infinite PSNR, which would swamp a mean: `psnr_db_mean` is
    the mean over the frames that differ, `identical_frames` counts the others, and when every frame
    is identical the mean is inf. The SSIM mean is over all frames (1.0 for an identical one).
    """
    psnr = psnr_per_frame(video, reference)
    ssim = ssim_per_frame(video, reference)
    differing = [p for p in psnr if math.isfinite(p)]
    return {
        "psnr_db_per_frame": psnr, "ssim_per_frame": ssim,
        "psnr_db_mean": sum(differing) / len(differing) if differing else math.inf,
        "identical_frames": len(psnr) - len(differing),
        "psnr_db_min": min(psnr), "ssim_mean": sum(ssim) / len(ssim), "ssim_min": min(ssim),
    }

"""PSNR and SSIM against values computed independently (plain numpy loops over window positions)."""
import math

import numpy as np
import pytest

from dit_accel.pipelines.quality import compare_videos, gaussian_window, psnr_per_frame, ssim_per_frame


def _ssim_reference(a: np.ndarray, b: np.ndarray, size: int = 11, sigma: float = 1.5) -> float:
    """SSIM of two [H, W, C] images by direct weighted statistics at every valid window position."""
    x = np.arange(size) - (size - 1) / 2
    g = np.exp(-(x**2) / (2 * sigma**2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = 0.01**2, 0.03**2
    values = []
    for c in range(a.shape[2]):
        for i in range(a.shape[0] - size + 1):
            for j in range(a.shape[1] - size + 1):
                pa, pb = a[i:i + size, j:j + size, c], b[i:i + size, j:j + size, c]
                ma, mb = (w * pa).sum(), (w * pb).sum()
                va, vb = (w * (pa - ma) ** 2).sum(), (w * (pb - mb) ** 2).sum()
                cov = (w * (pa - ma) * (pb - mb)).sum()
                values.append(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
    return float(np.mean(values))


def test_identical_frames():
    rng = np.random.default_rng(0)
    video = rng.random((3, 20, 24, 3))
    assert psnr_per_frame(video, video) == [math.inf] * 3
    assert ssim_per_frame(video, video) == pytest.approx([1.0] * 3, abs=1e-12)
    summary = compare_videos(video, video)
    assert summary["psnr_db_mean"] == math.inf and summary["identical_frames"] == 3
    assert summary["ssim_min"] == pytest.approx(1.0)


def test_psnr_mean_is_over_the_frames_that_differ():
    rng = np.random.default_rng(4)
    reference = rng.random((4, 16, 16, 3))
    video = reference.copy()
    video[1] += 0.1  # MSE 0.01: 20 dB
    video[3, ::2] += 0.1  # MSE 0.005: about 23.01 dB
    psnr = psnr_per_frame(video, reference)
    assert psnr[0] == psnr[2] == math.inf
    summary = compare_videos(video, reference)
    assert summary["identical_frames"] == 2
    assert summary["psnr_db_mean"] == pytest.approx((psnr[1] + psnr[3]) / 2, rel=1e-12)
    assert summary["psnr_db_mean"] == pytest.approx((20 + 10 * math.log10(200)) / 2, rel=1e-9)
    assert summary["psnr_db_min"] == pytest.approx(20, rel=1e-9)
    assert summary["ssim_mean"] == pytest.approx(sum(summary["ssim_per_frame"]) / 4)
    # No frame identical: the plain mean.
    assert compare_videos(video[[1, 3]], reference[[1, 3]])["identical_frames"] == 0


def test_psnr_of_known_noise():
    rng = np.random.default_rng(1)
    frame = rng.random((1, 16, 16, 3))
    noisy = frame.copy()
    noisy[0, ::2] += 0.1  # half the rows off by 0.1: MSE 0.005
    assert psnr_per_frame(noisy, frame)[0] == pytest.approx(10 * math.log10(1 / 0.005), rel=1e-12)


def test_ssim_matches_direct_computation():
    rng = np.random.default_rng(2)
    # A smooth image (so SSIM is far from 0) and a noisy copy.
    yy, xx = np.mgrid[0:24, 0:28] / 24.0
    clean = np.stack([np.sin(3 * xx + c) * np.cos(2 * yy) * 0.4 + 0.5 for c in range(3)], axis=-1)
    noisy = np.clip(clean + rng.normal(0, 0.05, clean.shape), 0, 1)
    expected = _ssim_reference(noisy, clean)
    assert 0.3 < expected < 0.99
    assert ssim_per_frame(noisy[None], clean[None])[0] == pytest.approx(expected, rel=1e-10)
    # Per frame: the frames keep their own values, in order.
    video, reference = np.stack([clean, noisy]), np.stack([clean, clean])
    got = ssim_per_frame(video, reference)
    assert got[0] == pytest.approx(1.0) and got[1] == pytest.approx(expected, rel=1e-10)


def test_gaussian_window_and_small_frames():
    taps = gaussian_window()
    assert taps.sum().item() == pytest.approx(1.0) and taps.argmax().item() == 5
    rng = np.random.default_rng(3)
    small = rng.random((2, 8, 9, 3))  # smaller than the 11-tap window: uses 7 taps
    assert ssim_per_frame(small, small) == pytest.approx([1.0, 1.0])
    assert ssim_per_frame(small, 1 - small)[0] < 0.5


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        psnr_per_frame(np.zeros((2, 8, 8, 3)), np.zeros((3, 8, 8, 3)))

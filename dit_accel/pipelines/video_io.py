"""Writing what a pipeline returns: frames as an H.264 MP4 (imageio + its bundled ffmpeg), a soundtrack as
a 16-bit PCM WAV (the standard library's `wave`), muxed into the MP4 as AAC when there is one."""
from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from ..errors import UserError


def to_uint8_frames(frames) -> np.ndarray:
    """[F, H, W, 3] uint8 from float frames in [0, 1] (values outside are clipped)."""
    array = np.asarray(frames)
    if array.ndim == 5 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 4 or array.shape[-1] not in (1, 3):
        raise ValueError(f"expected frames [F, H, W, 3], got shape {array.shape}")
    if array.dtype != np.uint8:
        array = (np.clip(array.astype(np.float32), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    return array


def write_wav(path: Path, audio, sample_rate: int) -> dict:
    """16-bit PCM WAV of `audio` [channels, samples], float in [-1, 1] (clipped); returns what was written."""
    array = np.asarray(audio, dtype=np.float32)
    if array.ndim != 2:
        raise ValueError(f"expected audio [channels, samples], got shape {array.shape}")
    pcm = (np.clip(array, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(array.shape[0])
        writer.setsampwidth(2)
        writer.setframerate(int(sample_rate))
        writer.writeframes(pcm.T.tobytes())  # interleaved: one sample of every channel per frame
    return {"file": path.name, "channels": int(array.shape[0]), "samples": int(array.shape[1]),
            "sample_rate": int(sample_rate), "seconds": array.shape[1] / sample_rate, "bytes": path.stat().st_size}


def mp4_writer():
    """imageio's v2 API with its ffmpeg plugin, or a UserError saying what to install. `generate` asks
    before the pipeline runs: imageio alone imports, and only opening a writer finds ffmpeg missing."""
    try:
        import imageio.v2 as imageio
        import imageio_ffmpeg  # noqa: F401 (imageio's FFMPEG plugin needs it)
    except ImportError as exc:
        raise UserError("writing MP4 needs imageio and imageio-ffmpeg: pip install 'dit-accel[generate]'") from exc
    return imageio


def write_mp4(path: Path, frames, fps: float, audio_path: Path | None = None) -> dict:
    """H.264 (yuv420p) MP4 that common players open; returns its frame count, size and bytes.

    Frame sizes must be even (yuv420p halves chroma); pipelines produce multiples of 16 or 32.
    `audio_path` (a WAV) is muxed in as an AAC stream.
    """
    imageio = mp4_writer()
    array = to_uint8_frames(frames)
    if array.shape[1] % 2 or array.shape[2] % 2:
        raise UserError(f"frames of {array.shape[1]}x{array.shape[2]} (height x width) cannot be written as H.264; "
                        f"use even sizes")
    sound = {} if audio_path is None else {"audio_path": str(audio_path), "audio_codec": "aac"}
    with imageio.get_writer(str(path), format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=8,
                            pixelformat="yuv420p", macro_block_size=1, ffmpeg_log_level="error", **sound) as writer:
        for frame in array:
            writer.append_data(frame)
    return {"file": path.name, "frames": int(array.shape[0]), "height": int(array.shape[1]),
            "width": int(array.shape[2]), "fps": fps, "bytes": path.stat().st_size}


"""Loading images (Pillow) and video frames (decord), with errors that say what to fix.

``load_video`` samples frames either as a fixed count spread evenly over the clip
(``num_frames``) or at a rate (``fps``, e.g. 1 frame per second as FLASH's video data);
it returns uint8 RGB frames [F, H, W, 3] plus the timestamps (seconds) of the sampled frames.
``save_video`` writes frames as a Motion-JPEG AVI (Pillow only, no encoder libraries), which
decord reads back: handy for tests, examples and procedurally generated clips.
"""
from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError


def _check_file(path: str | os.PathLike, what: str) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} file not found: {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{what} path is not a file: {path!r}")
    return path


def load_image(path: str | os.PathLike) -> Image.Image:
    """An RGB PIL image; FileNotFoundError / ValueError naming the file when it cannot be read."""
    path = _check_file(path, "image")
    try:
        with Image.open(path) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"cannot read image {path!r} ({err}); expected a file Pillow can open "
                         "(PNG, JPEG, WebP, BMP, ...)") from err


@dataclass
class VideoFrames:
    """frames: uint8 [F, H, W, 3] RGB; timestamps: float seconds [F]; fps: the file's average rate."""

    frames: np.ndarray
    timestamps: np.ndarray
    fps: float

    def __len__(self) -> int:
        return self.frames.shape[0]

    def images(self) -> list[Image.Image]:
        return [Image.fromarray(f) for f in self.frames]


def frame_indices(total: int, file_fps: float, num_frames: int | None = None,
                  fps: float | None = None) -> np.ndarray:
    """Indices of the frames to sample from a clip of ``total`` frames at ``file_fps``.

    num_frames: that many frames at the centres of equal segments (all frames if the clip is
    shorter). fps: one frame every 1/fps seconds starting at 0 (at least one frame).
    """
    if (num_frames is None) == (fps is None):
        raise ValueError("give exactly one of num_frames or fps")
    if total <= 0:
        raise ValueError("the video has no frames")
    if num_frames is not None:
        if num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        if num_frames >= total:
            return np.arange(total)
        return ((np.arange(num_frames) + 0.5) * total / num_frames).astype(np.int64).clip(0, total - 1)
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if not file_fps > 0:
        raise ValueError("the video reports no frame rate; sample with num_frames instead of fps")
    step = file_fps / fps
    return np.unique(np.floor(np.arange(0, total, step)).astype(np.int64).clip(0, total - 1))


def load_video(path: str | os.PathLike, num_frames: int | None = None, fps: float | None = None) -> VideoFrames:
    """Sample frames of a video with decord (num_frames evenly, or at ``fps``; default 8 frames)."""
    path = _check_file(path, "video")
    if num_frames is None and fps is None:
        num_frames = 8
    try:
        import decord  # noqa: PLC0415 (heavy import, only for videos)
    except ImportError as err:  # pragma: no cover - decord is a dependency
        raise ImportError("reading videos needs decord: pip install decord") from err
    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0))
        total, file_fps = len(reader), float(reader.get_avg_fps())
    except Exception as err:  # decord raises its own DECORDError for unreadable files
        raise ValueError(f"cannot read video {path!r} ({str(err).strip().splitlines()[-1]}); expected a "
                         "video file FFmpeg can decode (mp4, avi, mkv, webm, ...)") from err
    index = frame_indices(total, file_fps, num_frames, fps)
    try:
        frames = reader.get_batch(index.tolist()).asnumpy()
    except Exception as err:
        raise ValueError(f"cannot decode frames of video {path!r}: {err}") from err
    timestamps = index / file_fps if file_fps > 0 else index.astype(np.float64)
    return VideoFrames(frames=frames, timestamps=timestamps.astype(np.float64), fps=file_fps)


def _chunk(fourcc: bytes, data: bytes) -> bytes:
    return fourcc + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")


def _list(kind: bytes, body: bytes) -> bytes:
    return b"LIST" + struct.pack("<I", len(body) + 4) + kind + body


def save_video(frames, path: str | os.PathLike, fps: int = 10, quality: int = 90) -> None:
    """Write frames (PIL images or uint8 arrays [F, H, W, 3]) as a Motion-JPEG AVI at ``fps``."""
    images = [f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in frames]
    if not images:
        raise ValueError("save_video needs at least one frame")
    width, height = images[0].size
    if any(im.size != (width, height) for im in images):
        raise ValueError("all frames must have the same size")
    jpegs = []
    for im in images:
        buf = io.BytesIO()
        im.convert("RGB").save(buf, format="JPEG", quality=quality)
        jpegs.append(buf.getvalue())
    n, biggest = len(jpegs), max(map(len, jpegs))
    avih = struct.pack("<14I", int(1e6 / fps), 0, 0, 0x10, n, 0, 1, biggest, width, height, 0, 0, 0, 0)
    strh = b"vidsMJPG" + struct.pack("<IHHIIIIIIII4h", 0, 0, 0, 0, 1, int(fps), 0, n, biggest, 0xFFFFFFFF, 0,
                                     0, 0, width, height)
    strf = struct.pack("<IiiHH4sIiiII", 40, width, height, 1, 24, b"MJPG", width * height * 3, 0, 0, 0, 0)
    header = _list(b"hdrl", _chunk(b"avih", avih) + _list(b"strl", _chunk(b"strh", strh) + _chunk(b"strf", strf)))
    movi, index, offset = [], [], 4
    for data in jpegs:
        chunk = _chunk(b"00dc", data)
        index.append(b"00dc" + struct.pack("<III", 0x10, offset, len(data)))
        offset += len(chunk)
        movi.append(chunk)
    body = b"AVI " + header + _list(b"movi", b"".join(movi)) + _chunk(b"idx1", b"".join(index))
    with open(path, "wb") as fh:
        fh.write(b"RIFF" + struct.pack("<I", len(body)) + body)

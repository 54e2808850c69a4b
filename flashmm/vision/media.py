"""Loading images (Pillow) and video frames (decord or PyAV), with errors that say what to fix.

``load_video`` samples frames either as a fixed count spread evenly over the clip
(``num_frames``) or at a rate (``fps``, e.g. 1 frame per second as FLASH's video data);
it returns uint8 RGB frames [F, H, W, 3] plus the timestamps (seconds) of the sampled frames.
Two decoders give the same frames for the same indices (frame i = the i-th frame in
presentation order; both run FFmpeg's decoders and its default YUV -> RGB conversion): decord
where it is installed (``pip install 'flashmm[decord]'``, Linux x86-64 and Windows wheels only),
PyAV (``av``, a dependency, wheels everywhere) otherwise, or whichever ``backend=`` names.
``save_video`` writes frames as a Motion-JPEG AVI (Pillow only, no encoder libraries), which
both read back: handy for tests, examples and procedurally generated clips.
"""
from __future__ import annotations

import importlib.util
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


VIDEO_BACKENDS = ("decord", "av")


def video_backend(name: str | None = None) -> str:
    """``name`` checked against VIDEO_BACKENDS, or the default: decord where installed, else PyAV."""
    if name is None:
        return "decord" if importlib.util.find_spec("decord") is not None else "av"
    if name not in VIDEO_BACKENDS:
        raise ValueError(f"unknown video backend {name!r}; choose one of {VIDEO_BACKENDS}")
    return name


def load_video(path: str | os.PathLike, num_frames: int | None = None, fps: float | None = None,
               backend: str | None = None) -> VideoFrames:
    """Sample frames of a video (num_frames evenly, or at ``fps``; default 8 frames) with
    ``backend`` ("decord" or "av"; default: decord where installed, else PyAV)."""
    path = _check_file(path, "video")
    if num_frames is None and fps is None:
        num_frames = 8
    read = _read_decord if video_backend(backend) == "decord" else _read_av
    index, frames, file_fps = read(path, lambda total, rate: frame_indices(total, rate, num_frames, fps))
    timestamps = index / file_fps if file_fps > 0 else index.astype(np.float64)
    return VideoFrames(frames=frames, timestamps=timestamps.astype(np.float64), fps=file_fps)


def _unreadable(path: str, err: Exception) -> ValueError:
    reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    return ValueError(f"cannot read video {path!r} ({reason}); expected a video file FFmpeg can decode "
                      "(mp4, avi, mkv, webm, ...)")


def _read_decord(path: str, choose):
    """(index [F], frames uint8 [F, H, W, 3], file fps) with decord; ``choose(total, fps)`` -> index."""
    try:
        import decord  # noqa: PLC0415 (optional, heavy)
    except ImportError as err:
        raise ImportError("the decord video backend needs decord: pip install decord "
                          "(or use backend='av')") from err
    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0))
        total, file_fps = len(reader), float(reader.get_avg_fps())
    except Exception as err:  # decord raises its own DECORDError for unreadable files
        raise _unreadable(path, err) from err
    index = choose(total, file_fps)
    try:
        frames = reader.get_batch(index.tolist()).asnumpy()
    except Exception as err:
        raise ValueError(f"cannot decode frames of video {path!r}: {err}") from err
    return index, frames, file_fps


def _read_av(path: str, choose):
    """(index [F], frames uint8 [F, H, W, 3], file fps) with PyAV, numbering frames as decord does:
    the video stream's packets sorted by presentation time. Seeks to the keyframe before a wanted
    frame when one lies between it and the last decoded frame, otherwise decodes on."""
    import av  # noqa: PLC0415 (heavy import, only for videos)

    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            packets = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.size]
            rate = stream.average_rate or stream.guessed_rate
    except (av.error.FFmpegError, IndexError, OSError, ValueError) as err:
        raise _unreadable(path, IndexError("no video stream") if isinstance(err, IndexError) else err) from err
    if any(pts is None for pts, _ in packets):
        raise ValueError(f"cannot index video {path!r}: its packets carry no timestamps; "
                         "remux it (ffmpeg -i IN -c copy OUT.mp4) or use backend='decord'")
    file_fps = float(rate) if rate else 0.0
    times = sorted(pts for pts, _ in packets)
    keyframes = np.array(sorted(pts for pts, key in packets if key), dtype=np.int64)
    index = choose(len(times), file_fps)
    wanted = sorted({times[i] for i in index.tolist()})
    decoded = {}
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            frames, last = None, None
            for target in wanted:
                if frames is None or ((keyframes > last) & (keyframes <= target)).any():
                    container.seek(int(target), stream=stream, backward=True, any_frame=False)
                    frames = container.decode(stream)
                frame = next((f for f in frames if f.pts is not None and f.pts >= target), None)
                if frame is None or frame.pts != target:
                    raise ValueError(f"no frame at time {target} x {stream.time_base} s")
                decoded[target], last = frame.to_ndarray(format="rgb24"), frame.pts
    except (av.error.FFmpegError, ValueError) as err:
        raise ValueError(f"cannot decode frames of video {path!r}: {err}") from err
    return index, np.stack([decoded[times[i]] for i in index.tolist()]), file_fps


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

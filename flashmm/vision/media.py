"""Finding media files (``expand_paths``) and loading images (Pillow) and video frames (decord or
PyAV), with errors that say what to fix.

``load_video`` samples frames either as a fixed count spread evenly over the clip
(``num_frames``) or at a rate (``fps``, e.g. 1 frame per second as FLASH's video data);
it returns uint8 RGB frames [F, H, W, 3] plus the timestamps (seconds) of the sampled frames.
Two decoders give the same frames for the same indices (frame i = the i-th frame in
presentation order; both run FFmpeg's decoders and its default YUV -> RGB conversion): decord
where it is installed (``pip install 'flashmm[decord]'``, Linux x86-64 and Windows wheels only),
PyAV (``av``, a dependency, wheels everywhere) otherwise, or whichever ``backend=`` names.
Both refuse a clip cut short (a partial download or copy): fewer frames than its header
declares, or data that end well before the duration it declares (``_demux`` reads every packet
and decodes none to tell), since sampling the part left would caption another clip.
``save_video`` writes frames as a Motion-JPEG AVI (Pillow only, no encoder libraries), which
both read back: handy for tests, examples and procedurally generated clips.
"""
from __future__ import annotations

import importlib.util
import io
import os
import struct
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from PIL import Image, UnidentifiedImageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".flv", ".wmv")


def media_kind(path: str | os.PathLike) -> str | None:
    """"image" / "video" from the file suffix, or None when the suffix is not supported."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    return "image" if suffix in IMAGE_SUFFIXES else "video" if suffix in VIDEO_SUFFIXES else None


def expand_paths(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Files as given, directories replaced by their media files (recursive, sorted, hidden
    entries skipped); duplicates (same absolute path) dropped, order kept. A directory that
    cannot be listed (no permission, I/O error) stays in the list where its files would be, so
    captioning it reports why (CaptionPipeline gives it an error) instead of skipping its media."""
    out, seen = [], set()
    for path in map(os.fspath, paths):
        found = [path]
        if os.path.isdir(path):
            found = []
            for root, dirs, files in os.walk(path, onerror=lambda err: found.append(err.filename)):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found.extend(os.path.join(root, f) for f in sorted(files)
                             if not f.startswith(".") and media_kind(f) is not None)
        for item in found:
            key = os.path.abspath(item)
            if key not in seen:
                seen.add(key)
                out.append(item)
    return out


def directory_error(path: str) -> OSError:
    """Why a directory cannot be captioned as an item: it cannot be listed (the reason the
    caller's expand_paths kept it), or it is a directory and not a media file."""
    try:
        with os.scandir(path):
            pass
    except OSError as err:
        message = (f"cannot list directory {path!r} ({err.strerror or err}), so the media under it were not "
                   "captioned; make it readable and run again")
        return OSError(err.errno, message) if err.errno else OSError(message)  # PermissionError for EACCES
    return IsADirectoryError(f"{path!r} is a directory, not a media file; give its files "
                             "(expand_paths lists them)")


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
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as err:
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


def _decord_error(decord) -> type[Exception]:
    """decord's own exception class (``decord._ffi.base.DECORDError``, re-exported by ``decord.base``);
    a stand-in that nothing raises when this decord keeps it elsewhere."""
    for module in (getattr(decord, "base", None), getattr(getattr(decord, "_ffi", None), "base", None)):
        error = getattr(module, "DECORDError", None)
        if isinstance(error, type) and issubclass(error, Exception):
            return error
    return type("DECORDErrorNotFound", (Exception,), {})


def _read_decord(path: str, choose):
    """(index [F], frames uint8 [F, H, W, 3], file fps) with decord; ``choose(total, fps)`` -> index."""
    try:
        import decord  # noqa: PLC0415 (optional, heavy)
    except ImportError as err:
        raise ImportError("the decord video backend needs decord: pip install decord "
                          "(or use backend='av')") from err
    # what decord raises for a file it cannot open or decode: its DECORDError (from FFmpeg), a
    # RuntimeError ("Error reading ..."), an AssertionError ("Invalid frame count"), IndexError
    failures = (_decord_error(decord), RuntimeError, AssertionError, IndexError)
    _demux(path)  # decord reads what is left of a file cut short without a word: refuse it first
    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0))
        total, file_fps = len(reader), float(reader.get_avg_fps())
    except failures as err:
        raise _unreadable(path, err) from err
    index = choose(total, file_fps)
    try:
        frames = reader.get_batch(index.tolist()).asnumpy()
    except failures as err:
        raise ValueError(f"cannot decode frames of video {path!r}: {err}") from err
    return index, frames, file_fps


def _demux(path: str) -> tuple[list, float]:
    """(packets [(pts, is_keyframe)] of the first video stream, in file order; its average frame
    rate, 0.0 if unknown) from reading every packet of the file, decoding none. A clip cut short
    (a partial download or copy) is refused (``_check_complete``): sampling the part left would
    caption another clip."""
    import av  # noqa: PLC0415 (heavy import, only for videos)

    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            packets, stored, packets_end = [], 0, 0.0
            for packet in container.demux():  # every stream: audio may outlast the video of a complete file
                if packet.pts is not None and packet.time_base:
                    packets_end = max(packets_end, float((packet.pts + (packet.duration or 0)) * packet.time_base))
                if packet.stream.index != stream.index:
                    continue
                stored += bool(packet.size or packet.pts is not None)  # not the demuxer's final empty packet
                if packet.size:
                    packets.append((packet.pts, packet.is_keyframe))
            rate = stream.average_rate or stream.guessed_rate
            declared_frames = stream.frames
            start = container.start_time / av.time_base if container.start_time is not None else 0.0
            duration = start + container.duration / av.time_base if container.duration else None
    except (av.error.FFmpegError, IndexError, OSError, ValueError) as err:
        raise _unreadable(path, IndexError("no video stream") if isinstance(err, IndexError) else err) from err
    file_fps = float(rate) if rate else 0.0
    if any(pts is None for pts, _ in packets):
        packets_end = None  # where the data end is unknown
    _check_complete(path, declared_frames, stored, duration, packets_end, 1 / file_fps if file_fps > 0 else 0.0)
    return packets, file_fps


def _check_complete(path: str, declared_frames: int, found_frames: int, duration: float | None,
                    packets_end: float | None, frame_period: float) -> None:
    """Refuse a clip with fewer frames than its header declares, or, where the header gives no
    frame count (Matroska, WebM), whose packets end well before the duration it declares."""
    if declared_frames > 0:
        if found_frames < declared_frames:
            raise _truncated(path, f"its header declares {declared_frames} frames, the file holds {found_frames}")
        return
    slack = max(2 * frame_period, 0.1)  # seconds: container durations round to a frame or so
    if duration is not None and packets_end is not None and packets_end < duration - slack:
        raise _truncated(path, f"its header declares {duration:.2f} s, its data end at {packets_end:.2f} s")


def _truncated(path: str, detail: str) -> ValueError:
    return ValueError(f"video {path!r} is truncated or damaged: {detail}; replace it with a complete copy (to "
                      "caption the part that is left, remux it first: ffmpeg -i IN -c copy OUT.mp4)")


def _read_av(path: str, choose):
    """(index [F], frames uint8 [F, H, W, 3], file fps) with PyAV, numbering frames as decord does:
    the video stream's packets sorted by presentation time. Seeks to the keyframe before a wanted
    frame when one lies between it and the last decoded frame, otherwise decodes on."""
    import av  # noqa: PLC0415 (heavy import, only for videos)

    packets, file_fps = _demux(path)
    if any(pts is None for pts, _ in packets):
        raise ValueError(f"cannot index video {path!r}: its packets carry no timestamps; "
                         "remux it (ffmpeg -i IN -c copy OUT.mp4) or use backend='decord'")
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

"""Video decoding: PyAV (always installed) and decord (where it has wheels) return the same frames,
timestamps and rate for the same sampling, on the shipped example clip and on an H.264 clip with
B-frames and sparse keyframes (PyAV seeks there). Independent references: the JPEG frames
save_video wrote, decoded by Pillow, and a per-frame marker drawn into every encoded frame."""
import importlib.util
import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flashmm.vision import load_video, save_video, video_backend

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_CLIP = ROOT / "assets" / "reference_lmm" / "examples" / "clip.avi"
HAVE_DECORD = importlib.util.find_spec("decord") is not None
needs_decord = pytest.mark.skipif(
    not HAVE_DECORD, reason="decord not installed: it has wheels for Linux x86-64 and Windows only "
                            "(the test extra installs it there)")
SAMPLINGS = [dict(num_frames=8), dict(num_frames=3), dict(fps=1.0), dict(fps=3.0), dict(num_frames=100)]


def avi_jpegs(path: Path) -> list[bytes]:
    """The JPEG payload of every '00dc' chunk of an MJPEG AVI, in file order."""
    data, out, pos = path.read_bytes(), [], 0
    while (pos := data.find(b"00dc", pos)) >= 0:
        size = struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        if data[pos + 8 : pos + 10] == b"\xff\xd8":  # a JPEG start, not an idx1 entry
            out.append(data[pos + 8 : pos + 8 + size])
        pos += 8
    return out


def marker_clip(path: Path, frames: int = 90, fps: int = 30) -> None:
    """H.264 (yuv420p, 2 B-frames, a keyframe every 24 frames); frame i shows marker value 2 * i
    in its top-left 32 x 32 block over a moving random background."""
    import av

    rng = np.random.default_rng(0)
    background = rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        stream.options = {"g": "24", "bf": "2", "crf": "10"}
        for i in range(frames):
            image = np.roll(background, 3 * i, axis=1).copy()
            image[:32, :32] = 2 * i
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="module")
def h264_clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("media") / "m.mp4"
    marker_clip(path)
    return path


def same(a, b) -> bool:
    return (a.frames.shape == b.frames.shape and np.array_equal(a.frames, b.frames)
            and np.array_equal(a.timestamps, b.timestamps) and a.fps == b.fps)


def test_pyav_frames_are_the_files_frames_in_order(tmp_path):
    """Frame i from PyAV is the i-th JPEG save_video wrote (Pillow's decode of it, within the
    YUV -> RGB rounding of two different JPEG decoders), at time i / fps."""
    rng = np.random.default_rng(1)
    frames = [np.full((48, 64, 3), 25 * i, np.uint8) + rng.integers(0, 20, (48, 64, 3), dtype=np.uint8)
              for i in range(10)]
    save_video(frames, tmp_path / "c.avi", fps=5)
    pillow = [np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) for j in avi_jpegs(tmp_path / "c.avi")]
    assert len(pillow) == 10
    got = load_video(tmp_path / "c.avi", num_frames=4, backend="av")
    assert got.fps == 5.0 and got.timestamps.tolist() == [0.2, 0.6, 1.2, 1.6]  # indices 1, 3, 6, 8
    for frame, i in zip(got.frames, [1, 3, 6, 8]):
        diff = np.abs(frame.astype(int) - pillow[i])
        assert diff.mean() < 1 and diff.max() <= 6, (i, diff.mean(), diff.max())  # measured: 0.5, 4


def test_pyav_reads_h264_with_b_frames_by_presentation_order(h264_clip):
    every = load_video(h264_clip, num_frames=90, backend="av")
    assert len(every) == 90 and every.fps == 30.0
    markers = every.frames[:, 4:28, 4:28].reshape(90, -1).mean(axis=1)
    assert np.abs(markers - 2 * np.arange(90)).max() < 3  # frame i carries marker 2 i
    sampled = load_video(h264_clip, num_frames=5, backend="av")  # seeks past keyframes
    index = [9, 27, 45, 63, 81]
    assert np.array_equal(sampled.frames, every.frames[index])
    assert np.allclose(sampled.timestamps, np.array(index) / 30)


@needs_decord
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_decord_and_pyav_return_the_same_frames_of_the_shipped_clip(sampling):
    assert SHIPPED_CLIP.is_file()
    a = load_video(SHIPPED_CLIP, backend="av", **sampling)
    d = load_video(SHIPPED_CLIP, backend="decord", **sampling)
    assert same(a, d), sampling


@needs_decord
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_decord_and_pyav_return_the_same_frames_of_h264(h264_clip, sampling):
    a = load_video(h264_clip, backend="av", **sampling)
    d = load_video(h264_clip, backend="decord", **sampling)
    assert same(a, d), sampling


def test_backend_choice_and_errors(tmp_path):
    assert video_backend() == ("decord" if HAVE_DECORD else "av")
    assert video_backend("av") == "av"
    with pytest.raises(ValueError, match="unknown video backend 'opencv'"):
        video_backend("opencv")
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video" * 10)
    backends = ["av", "decord"] if HAVE_DECORD else ["av"]
    for backend in backends:
        with pytest.raises(ValueError, match="cannot read video .*bad.mp4"):
            load_video(bad, backend=backend)
        with pytest.raises(FileNotFoundError):
            load_video(tmp_path / "missing.mp4", backend=backend)


def encoded_clip(path: Path, frames: int = 16, audio_seconds: float = 0.0, options: dict | None = None) -> Path:
    """Random MPEG-4 frames at 8 fps in any container PyAV writes (by suffix), with
    ``audio_seconds`` of silent AAC beside them."""
    import av

    rng = np.random.default_rng(0)
    with av.open(str(path), "w", options=options or {}) as container:
        video = container.add_stream("mpeg4", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("aac", rate=16000) if audio_seconds else None  # every stream before muxing
        for _ in range(frames):
            image = av.VideoFrame.from_ndarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), format="rgb24")
            for packet in video.encode(image):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        for k in range(int(audio_seconds * 16000 / 1024)):
            chunk = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts = 16000, 1024 * k
            for packet in audio.encode(chunk):
                container.mux(packet)
        if audio is not None:
            for packet in audio.encode():
                container.mux(packet)
    return path


def cut(path: Path, fraction: float) -> Path:
    data = path.read_bytes()
    short = path.with_name("cut_" + path.name)
    short.write_bytes(data[: int(len(data) * fraction)])
    return short


@pytest.mark.parametrize("backend", ["av", "decord"] if HAVE_DECORD else ["av"])
def test_a_clip_cut_short_is_refused(tmp_path, backend):
    """Files cut at half their bytes still open (mp4 with its index first, AVI, Matroska) and
    both decoders would sample what is left (PyAV 4 of 16 frames of the mp4; decord 8 of the
    AVI's 16, 3 of the Matroska's): refused, naming the file and what is missing."""
    mp4 = encoded_clip(tmp_path / "a.mp4", options={"movflags": "faststart"})
    avi = tmp_path / "a.avi"
    save_video([np.full((48, 64, 3), 10 * i, np.uint8) for i in range(16)], avi, fps=8)
    mkv = encoded_clip(tmp_path / "a.mkv")
    for whole, detail in ((mp4, "declares 16 frames"), (avi, "declares 16 frames"), (mkv, "declares 2.00 s")):
        assert len(load_video(whole, num_frames=8, backend=backend)) == 8
        with pytest.raises(ValueError, match=f"video '.*cut_{whole.name}' is truncated .*{detail}"):
            load_video(cut(whole, 0.5), num_frames=8, backend=backend)
    # complete files whose audio outlasts the video (container duration 3 s, video 1 s) are not cut short
    for suffix in ("mkv", "mp4"):
        longer_audio = encoded_clip(tmp_path / f"av.{suffix}", frames=8, audio_seconds=3)
        assert len(load_video(longer_audio, num_frames=4, backend=backend)) == 4


def test_decord_failures_are_narrowed_to_decords_own(tmp_path, monkeypatch):
    """decord's DECORDError (and its RuntimeError for an unreadable file) is a clear ValueError
    naming the file; anything else, a bug, propagates."""
    import sys
    import types

    from flashmm.vision.media import _decord_error

    class DECORDError(Exception):
        pass

    failure = {}

    class VideoReader:
        def __init__(self, path, ctx=None):
            raise failure["error"]

    fake = types.SimpleNamespace(VideoReader=VideoReader, cpu=lambda i: None,
                                 base=types.SimpleNamespace(DECORDError=DECORDError))
    assert _decord_error(fake) is DECORDError
    assert not issubclass(_decord_error(types.SimpleNamespace()), (DECORDError, RuntimeError, ValueError))
    monkeypatch.setitem(sys.modules, "decord", fake)
    clip = tmp_path / "c.avi"
    save_video([np.zeros((16, 16, 3), np.uint8)] * 2, clip, fps=2)
    for error in (DECORDError("av_read_frame failed"), RuntimeError("Error reading c.avi...")):
        failure["error"] = error
        with pytest.raises(ValueError, match=f"cannot read video .*c.avi.*{str(error)[:10]}"):
            load_video(clip, backend="decord")
    failure["error"] = KeyError("a bug")
    with pytest.raises(KeyError, match="a bug"):
        load_video(clip, backend="decord")

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

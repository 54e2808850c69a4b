"""Media loading (Pillow images; videos through decord where installed, else PyAV)."""
from .media import VIDEO_BACKENDS, VideoFrames, load_image, load_video, save_video, video_backend

__all__ = ["VIDEO_BACKENDS", "VideoFrames", "load_image", "load_video", "save_video", "video_backend"]

"""Media loading (pillow images, decord videos)."""
from .media import VideoFrames, load_image, load_video, save_video

__all__ = ["VideoFrames", "load_image", "load_video", "save_video"]

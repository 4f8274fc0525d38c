"""Turning the image/video entries of a dataset row into objects a multimodal processor accepts.

Rows written by preprocessing scripts store images as ``{"bytes": ...}`` or ``{"path": ...}`` dicts (that is
how parquet keeps them), as file paths, or - for rows built in memory - as PIL images already.
"""

from __future__ import annotations

import os
from io import BytesIO
from typing import Any

import numpy as np
import torch


def process_image(image: Any, image_patch_size: int = 14):
    """Return an RGB ``PIL.Image`` for one dataset image entry.

    ``image_patch_size`` is accepted for interface compatibility; resizing to the patch grid is left to the
    processor, which knows its own limits.
    """
    from PIL import Image

    del image_patch_size
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            return Image.open(BytesIO(image["bytes"])).convert("RGB")
        if image.get("image") is not None:
            return process_image(image["image"])
        if image.get("path"):
            return process_image(image["path"])
        raise ValueError(
            f"process_image: an image dict needs a 'bytes', 'image' or 'path' entry, got keys {sorted(image)}"
        )
    if isinstance(image, str | os.PathLike):
        path = os.fspath(image)
        if not os.path.exists(path):
            raise FileNotFoundError(f"process_image: image file {path!r} does not exist")
        return Image.open(path).convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    raise TypeError(
        f"process_image: unsupported image entry of type {type(image).__name__}; "
        "use a PIL image, a file path, or a dict with 'bytes'/'path'"
    )


def process_video(video: Any, image_patch_size: int = 14, fps: float | None = None, **kwargs):
    """Return a video as a ``[T, C, H, W]`` uint8/float tensor.

    In-memory frames (tensor, array, list of frames) are converted directly. Decoding a video *file* needs
    ``qwen_vl_utils``; without it a clear ImportError explains what to install or pass instead.
    """
    del image_patch_size, fps, kwargs
    if isinstance(video, dict) and "video" in video:
        video = video["video"]
    if isinstance(video, torch.Tensor):
        return video
    if isinstance(video, np.ndarray):
        return torch.from_numpy(video)
    if isinstance(video, list | tuple) and video and not isinstance(video[0], str | os.PathLike):
        frames = [np.asarray(process_image(f)) for f in video]  # each [H, W, C]
        return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    try:
        from qwen_vl_utils import fetch_video
    except ImportError as err:
        raise ImportError(
            "process_video: decoding video files or frame paths needs the 'qwen_vl_utils' package; "
            "install it, or store videos as in-memory frames (tensor/array/list of images) in the dataset"
        ) from err
    return fetch_video({"video": video})

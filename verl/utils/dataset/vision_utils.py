"""Turning the image/video entries of a dataset row into objects a multimodal processor accepts.

Rows written by preprocessing scripts store images as ``{"bytes": ...}`` or ``{"path": ...}`` dicts (that is
how parquet keeps them), as file paths, or - for rows built in memory - as PIL images already. Videos are
``{"video": frames_or_path, "fps": ..., "max_frames": ...}`` entries (or the bare frames / path).

``image_patch_size`` (``data.image_patch_size``) sizes every image and frame to the vision tower's patch grid
before the processor sees it, as Qwen's ``qwen_vl_utils`` does for upstream verl: each side becomes a multiple of
``image_patch_size * 2`` (a 2x2 merge of patches is one token) with the pixel count kept between a minimum and a
maximum number of tokens. With the model's own patch size (16 for Qwen3.5) the processor then keeps the size; a
different value gives a different grid and token count.
"""

from __future__ import annotations

import math
import os
from io import BytesIO
from typing import Any

import numpy as np
import torch

# Token bounds of qwen_vl_utils (what upstream's dataset resizes with): per image, and per video frame.
SPATIAL_MERGE_SIZE = 2
IMAGE_MIN_TOKENS, IMAGE_MAX_TOKENS = 4, 16384
VIDEO_MIN_TOKENS, VIDEO_MAX_TOKENS = 128, 768
VIDEO_TOTAL_TOKENS = int(128000 * 0.9)  # a whole video's budget (qwen_vl_utils' default model sequence length)
FRAME_FACTOR = 2  # frames are consumed in pairs (the vision tower's temporal patch)
DEFAULT_FPS = 2.0
MAX_ASPECT_RATIO = 200


def _round_to(value: float, factor: int, how) -> int:
    return int(how(value / factor) * factor)


def fit_to_patch_grid(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` moved to multiples of ``factor`` with ``min_pixels <= h * w <= max_pixels`` and the
    aspect ratio kept as closely as the grid allows."""
    if min(height, width) <= 0:
        raise ValueError(f"an image of {height}x{width} pixels cannot be resized")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"an image of {height}x{width} pixels has an aspect ratio above {MAX_ASPECT_RATIO}")
    h = max(factor, _round_to(height, factor, round))
    w = max(factor, _round_to(width, factor, round))
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, _round_to(height / shrink, factor, math.floor))
        w = max(factor, _round_to(width / shrink, factor, math.floor))
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = _round_to(height * grow, factor, math.ceil)
        w = _round_to(width * grow, factor, math.ceil)
    return h, w


def _check_patch_size(image_patch_size) -> int:
    if isinstance(image_patch_size, bool) or not isinstance(image_patch_size, int) or image_patch_size <= 0:
        raise ValueError(f"data.image_patch_size must be a positive integer, got {image_patch_size!r}")
    return image_patch_size


def _load_image(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            return Image.open(BytesIO(image["bytes"])).convert("RGB")
        if image.get("image") is not None:
            return _load_image(image["image"])
        if image.get("path"):
            return _load_image(image["path"])
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
    if isinstance(image, torch.Tensor):  # a (C, H, W) frame
        return Image.fromarray(image.permute(1, 2, 0).to(torch.uint8).numpy()).convert("RGB")
    raise TypeError(
        f"process_image: unsupported image entry of type {type(image).__name__}; "
        "use a PIL image, a file path, or a dict with 'bytes'/'path'"
    )


def process_image(image: Any, image_patch_size: int | None = None):
    """An RGB ``PIL.Image`` for one dataset image entry.

    With ``image_patch_size`` the image is resized to the patch grid (see the module docstring); a dict entry may
    carry its own ``min_pixels`` / ``max_pixels`` or ``resized_height`` / ``resized_width``. ``None`` keeps the
    stored size and leaves resizing to the processor (the SFT dataset's behaviour).
    """
    from PIL import Image

    out = _load_image(image)
    if image_patch_size is None:
        return out
    factor = _check_patch_size(image_patch_size) * SPATIAL_MERGE_SIZE
    opts = image if isinstance(image, dict) else {}
    if opts.get("resized_height") and opts.get("resized_width"):
        h, w = int(opts["resized_height"]), int(opts["resized_width"])
        h, w = fit_to_patch_grid(h, w, factor, factor * factor, IMAGE_MAX_TOKENS * factor**2)
    else:
        min_pixels = int(opts.get("min_pixels") or IMAGE_MIN_TOKENS * factor**2)
        max_pixels = int(opts.get("max_pixels") or IMAGE_MAX_TOKENS * factor**2)
        if min_pixels > max_pixels:
            raise ValueError(f"process_image: min_pixels {min_pixels} is larger than max_pixels {max_pixels}")
        h, w = fit_to_patch_grid(out.height, out.width, factor, min_pixels, max_pixels)
    return out if (h, w) == (out.height, out.width) else out.resize((w, h), Image.Resampling.BICUBIC)


def _frames_of(video: Any) -> list:
    """In-memory frames as a list of PIL images, or None when the entry names a file to decode."""
    if isinstance(video, torch.Tensor | np.ndarray):
        arr = torch.as_tensor(video)
        if arr.dim() != 4:
            raise ValueError(f"process_video: a video tensor must be 4-D (frames, ...), got shape {tuple(arr.shape)}")
        if arr.shape[-1] in (1, 3, 4) and arr.shape[1] not in (1, 3, 4):  # (T, H, W, C) -> (T, C, H, W)
            arr = arr.permute(0, 3, 1, 2)
        if arr.is_floating_point() and float(arr.max()) <= 1.0:
            arr = arr * 255.0
        return [_load_image(frame.clamp(0, 255).round()) for frame in arr]
    if isinstance(video, list | tuple):
        if not video:
            raise ValueError("process_video: a video has no frames")
        return [_load_image(f) for f in video]  # frame files load like image files
    return None


def _even_pick(total: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly over ``range(total)``."""
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def process_video(
    video: Any,
    image_patch_size: int | None = None,
    nframes: int | None = None,
    fps: float | None = None,
    fps_min_frames: int | None = None,
    fps_max_frames: int | None = None,
    return_video_sample_fps: bool = False,
    return_video_metadata: bool = False,
):
    """A video entry as a ``[T, C, H, W]`` uint8 tensor (T even), optionally with its sampling rate / metadata.

    In-memory frames (a tensor, array, or list of images / frame files) are taken as already sampled at the
    entry's ``fps`` (default 2 per second, which dates the frames for the processor's timestamps); ``nframes``
    or ``max_frames`` keep that many evenly spaced frames, and the count is padded to an even number by repeating
    the last frame. With ``image_patch_size`` every frame is resized to one size on the patch grid within the
    per-frame token bounds (``min_pixels`` / ``max_pixels`` / ``total_pixels`` of the entry override them).
    Decoding a video *file* is ``qwen_vl_utils``' job (it needs av, decord or torchvision); without it a clear
    ImportError says what to install or to store frames instead.
    """
    from PIL import Image

    entry = dict(video) if isinstance(video, dict) else {"video": video}
    if "video" not in entry:
        raise ValueError(f"process_video: a video dict needs a 'video' entry, got keys {sorted(entry)}")
    if nframes is not None and fps is not None:
        raise ValueError("process_video: nframes and fps cannot both be given")
    if "nframes" not in entry and "fps" not in entry:  # the entry's own sampling rules win, as upstream's do
        if nframes is not None:
            entry["nframes"] = nframes
        elif fps is not None:
            entry["fps"] = fps
            if fps_min_frames is not None:
                entry["min_frames"] = fps_min_frames
            if fps_max_frames is not None:
                entry["max_frames"] = fps_max_frames
    frames = _frames_of(entry["video"])
    if frames is None:
        return _decode_video_file(entry, image_patch_size, return_video_sample_fps, return_video_metadata)

    total = len(frames)
    keep = total
    if entry.get("nframes"):
        keep = min(total, int(entry["nframes"]))
    elif entry.get("max_frames"):
        keep = min(total, max(FRAME_FACTOR, _round_to(int(entry["max_frames"]), FRAME_FACTOR, math.floor)))
    indices = _even_pick(total, keep) if keep < total else list(range(total))
    frames = [frames[i] for i in indices]
    while len(frames) % FRAME_FACTOR:
        frames.append(frames[-1])
        indices.append(indices[-1])

    if image_patch_size is not None:
        factor = _check_patch_size(image_patch_size) * SPATIAL_MERGE_SIZE
        min_pixels = int(entry.get("min_pixels") or VIDEO_MIN_TOKENS * factor**2)
        total_pixels = int(entry.get("total_pixels") or VIDEO_TOTAL_TOKENS * factor**2)
        budget = max(min(VIDEO_MAX_TOKENS * factor**2, total_pixels / len(frames) * FRAME_FACTOR), min_pixels * 1.05)
        max_pixels = int(entry.get("max_pixels") or budget)
        h, w = fit_to_patch_grid(frames[0].height, frames[0].width, factor, min_pixels, max_pixels)
        frames = [f if f.size == (w, h) else f.resize((w, h), Image.Resampling.BICUBIC) for f in frames]
    elif len({f.size for f in frames}) > 1:
        raise ValueError(f"process_video: the frames differ in size ({sorted({f.size for f in frames})})")

    tensor = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2).contiguous()
    sample_fps = float(entry.get("fps") or DEFAULT_FPS)
    metadata = {"fps": sample_fps, "frames_indices": indices, "total_num_frames": total, "video_backend": "frames"}
    if return_video_metadata:
        return tensor, metadata
    if return_video_sample_fps:
        return tensor, sample_fps
    return tensor


def _decode_video_file(entry: dict, image_patch_size, return_video_sample_fps: bool, return_video_metadata: bool):
    try:
        from qwen_vl_utils import fetch_video
    except ImportError as err:
        raise ImportError(
            f"process_video: decoding the video file {str(entry['video'])[:200]!r} needs the 'qwen_vl_utils' "
            "package with a video decoder ('av', 'decord' or 'torchvision'); install them, or store the video as "
            "in-memory frames (a tensor/array or a list of images) in the dataset"
        ) from err
    kwargs = {} if image_patch_size is None else {"image_patch_size": image_patch_size}
    return fetch_video(entry, return_video_sample_fps=return_video_sample_fps,
                       return_video_metadata=return_video_metadata, **kwargs)

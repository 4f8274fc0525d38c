"""A video processor for Qwen-VL style processors that works on decoded frames with PIL/numpy only.

transformers' own video processors (Qwen3VLVideoProcessor for Qwen3.5-VL) need torchvision. Where it is missing,
:func:`verl.utils.processor.load_processor` gives the processor this one instead: the RL dataset decodes and
samples frames itself (:func:`verl.utils.dataset.vision_utils.process_video`), so all that is left is what the
model's vision tower expects - frames resized to the patch grid, rescaled and normalised like the model's images,
cut into ``temporal_patch_size`` x ``patch_size`` x ``patch_size`` patches in the merge-window order, plus
``video_grid_thw`` and the frame timestamps (``video_metadata``) the processor writes into the prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl.utils.dataset.vision_utils import DEFAULT_FPS, fit_to_patch_grid


class FramesVideoProcessor:
    """Turns videos (``[T, C, H, W]`` tensors/arrays or lists of PIL frames) into ``pixel_values_videos`` /
    ``video_grid_thw``. Frames use the sizing, rescaling and normalisation of ``image_processor``."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, image_processor):
        ip = image_processor
        self.patch_size = int(ip.patch_size)
        self.merge_size = int(ip.merge_size)
        self.temporal_patch_size = int(ip.temporal_patch_size)
        size = getattr(ip, "size", None) or {}
        self.min_pixels = int(getattr(ip, "min_pixels", None) or size.get("shortest_edge"))
        self.max_pixels = int(getattr(ip, "max_pixels", None) or size.get("longest_edge"))
        self.rescale_factor = float(getattr(ip, "rescale_factor", 1 / 255))
        self.image_mean = np.asarray(ip.image_mean, dtype=np.float32).reshape(-1, 1, 1)
        self.image_std = np.asarray(ip.image_std, dtype=np.float32).reshape(-1, 1, 1)
        self.do_normalize = bool(getattr(ip, "do_normalize", True))
        self.do_rescale = bool(getattr(ip, "do_rescale", True))

    def __repr__(self):
        return (f"FramesVideoProcessor(patch_size={self.patch_size}, merge_size={self.merge_size}, "
                f"temporal_patch_size={self.temporal_patch_size}, pixels={self.min_pixels}..{self.max_pixels})")

    def _frames(self, video: Any) -> np.ndarray:
        """``(T, C, H, W)`` float32 frames resized to the patch grid, T a multiple of the temporal patch."""
        from PIL import Image

        if isinstance(video, list | tuple):
            arr = np.stack([np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f) for f in video])
            arr = arr.transpose(0, 3, 1, 2) if arr.shape[-1] in (1, 3, 4) and arr.shape[1] not in (1, 3, 4) else arr
        else:
            arr = torch.as_tensor(video).numpy() if isinstance(video, torch.Tensor) else np.asarray(video)
        if arr.ndim != 4:
            raise ValueError(f"FramesVideoProcessor: a video must be (frames, channels, height, width), got {arr.shape}")
        factor = self.patch_size * self.merge_size
        h, w = fit_to_patch_grid(arr.shape[2], arr.shape[3], factor, self.min_pixels, self.max_pixels)
        if (h, w) != arr.shape[2:]:
            arr = np.stack([np.asarray(Image.fromarray(f.transpose(1, 2, 0).astype(np.uint8)).resize(
                (w, h), Image.Resampling.BICUBIC)).transpose(2, 0, 1) for f in arr])
        arr = arr.astype(np.float32)
        t = self.temporal_patch_size
        if arr.shape[0] % t:
            arr = np.concatenate([arr, np.repeat(arr[-1:], t - arr.shape[0] % t, axis=0)])
        if self.do_rescale:
            arr = arr * self.rescale_factor
        if self.do_normalize:
            arr = (arr - self.image_mean) / self.image_std
        return arr

    def _patchify(self, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
        t, c, h, w = frames.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gt, gh, gw = t // tp, h // p, w // p
        x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
        # rows: time group, merge window (row, col), position in the window; each patch: channel, time, pixels
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]

    def __call__(self, videos=None, video_metadata=None, return_tensors=None, **kwargs):
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import VideoMetadata

        if videos is None:
            raise ValueError("FramesVideoProcessor: no videos given")
        if isinstance(videos, torch.Tensor | np.ndarray) and np.ndim(videos) == 4:
            videos = [videos]
        if video_metadata is not None and len(video_metadata) != len(videos):
            raise ValueError(f"FramesVideoProcessor: {len(videos)} videos but {len(video_metadata)} metadata entries")
        patches, grids, metas = [], [], []
        for i, video in enumerate(videos):
            frames = self._frames(video)
            flat, grid = self._patchify(frames)
            patches.append(flat)
            grids.append(grid)
            meta = (video_metadata or [None] * len(videos))[i] or {}
            meta = meta if isinstance(meta, dict) else vars(meta)
            fps = float(meta.get("fps") or DEFAULT_FPS)
            indices = list(meta.get("frames_indices") or range(frames.shape[0]))
            metas.append(VideoMetadata(total_num_frames=int(meta.get("total_num_frames") or len(indices)), fps=fps,
                                       frames_indices=indices))
        data = {"pixel_values_videos": np.concatenate(patches), "video_grid_thw": np.asarray(grids, dtype=np.int64)}
        out = BatchFeature(data=data, tensor_type=return_tensors)
        out["video_metadata"] = metas
        return out

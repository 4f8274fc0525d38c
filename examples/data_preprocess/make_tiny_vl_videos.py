"""A tiny video dataset for smoke-testing video RL: ``<local_save_dir>/train.parquet`` / ``test.parquet``.

Each row holds one short synthetic clip - a solid colour with a darker square that moves one step per frame -
stored as pre-decoded PNG frames, and asks for the colour; the answer is the colour's first letter, so the
``letter_echo`` scorer rates responses. Frames are stored decoded because decoding video *files* needs
``qwen_vl_utils`` plus a decoder (av / decord / torchvision); a row may name a file instead where those are
installed. Sized for the tiny Qwen3.5-VL model of ``verl.models.tiny``::

    python examples/data_preprocess/make_tiny_vl_videos.py --local_save_dir ~/data/tiny_vl_videos
    bash examples/grpo_trainer/run_tiny_qwen3_5_vl_video.sh <tiny VL model dir> ~/data/tiny_vl_videos

Each output row (the video entry carries upstream's per-video sampling keys)::

    data_source  "letter_echo"
    prompt       [{"role": "user", "content": "<video>What color is this video?"}]
    videos       [{"video": [{"bytes": <PNG>}, ...], "fps": 1.0, "max_frames": 4}]
    ability      "video"
    reward_model {"style": "rule", "ground_truth": "r" | "g" | "b" | "y"}
    extra_info   {"split", "index", "color", "frames"}
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the image generator next to this file
from make_tiny_vl_images import COLORS, cli, png_bytes, write_parquet  # noqa: E402,F401 (write_parquet: for callers)

QUESTION = "<video>What color is this video?"
FRAME_COUNTS = [4, 6, 3, 8]  # max_frames=4 keeps 4 of 6 or 8; 3 frames are padded to 4


def make_clip(color: str, frames: int, size: tuple[int, int], rng: random.Random) -> list:
    from PIL import Image, ImageDraw

    rgb = COLORS[color]
    w, h = size
    side = max(2, min(w, h) // 4)
    x, y = rng.randrange(0, w - side), rng.randrange(0, h - side)
    clip = []
    for k in range(frames):
        img = Image.new("RGB", size, rgb)
        fx = (x + k) % (w - side)
        ImageDraw.Draw(img).rectangle([fx, y, fx + side - 1, y + side - 1], fill=tuple(c // 2 for c in rgb))
        clip.append(img)
    return clip


def make_rows(n: int, seed: int, split: str, size=(16, 16), fps: float = 1.0, max_frames: int = 4) -> list[dict]:
    rng = random.Random(seed)
    names = sorted(COLORS)
    rows = []
    for i in range(n):
        color = names[i % len(names)] if i < len(names) else rng.choice(names)
        frames = FRAME_COUNTS[i % len(FRAME_COUNTS)]
        clip = make_clip(color, frames, size, rng)
        rows.append({
            "data_source": "letter_echo",
            "prompt": [{"role": "user", "content": QUESTION}],
            "videos": [{"video": [{"bytes": png_bytes(f)} for f in clip], "fps": fps, "max_frames": max_frames}],
            "ability": "video",
            "reward_model": {"style": "rule", "ground_truth": color[0]},
            "extra_info": {"split": split, "index": i, "color": color, "frames": frames},
        })
    return rows


def main(argv=None) -> None:
    cli(make_rows, "~/data/tiny_vl_videos", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()

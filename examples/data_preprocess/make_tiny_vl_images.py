"""A tiny image dataset for smoke-testing vision-language RL: ``<local_save_dir>/train.parquet`` / ``test.parquet``.

Each row shows one small synthetic image (a solid colour with a darker square somewhere on it) and asks for
its colour; the answer is the colour's first letter, so the existing ``letter_echo`` scorer rates responses
(fraction of the first four response characters equal to that letter). Sized for the tiny Qwen3.5-VL model of
``verl.models.tiny`` (16..32 pixels a side, i.e. 4..16 image tokens)::

    python examples/data_preprocess/make_tiny_vl_images.py --local_save_dir ~/data/tiny_vl_images
    python -m verl.trainer.main_ppo --config-name demo trainer.launcher=local \\
        actor_rollout_ref.model.path=<tiny VL model dir> \\
        data.train_files=~/data/tiny_vl_images/train.parquet data.val_files=~/data/tiny_vl_images/test.parquet

Each output row::

    data_source  "letter_echo"
    prompt       [{"role": "user", "content": "<image>What color is this image?"}]
    images       [{"bytes": <PNG>}]
    ability      "vision"
    reward_model {"style": "rule", "ground_truth": "r" | "g" | "b" | "y"}
    extra_info   {"split", "index", "color"}
"""

from __future__ import annotations

import argparse
import io
import os
import random

COLORS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
QUESTION = "<image>What color is this image?"
SIZES = [(16, 16), (24, 16), (16, 24), (32, 32)]


def make_image(color: str, size: tuple[int, int], rng: random.Random):
    from PIL import Image, ImageDraw

    rgb = COLORS[color]
    img = Image.new("RGB", size, rgb)
    w, h = size
    side = max(2, min(w, h) // 4)
    x, y = rng.randrange(0, w - side), rng.randrange(0, h - side)
    ImageDraw.Draw(img).rectangle([x, y, x + side - 1, y + side - 1], fill=tuple(c // 2 for c in rgb))
    return img


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_rows(n: int, seed: int, split: str, sizes=SIZES) -> list[dict]:
    rng = random.Random(seed)
    names = sorted(COLORS)
    rows = []
    for i in range(n):
        color = names[i % len(names)] if i < len(names) else rng.choice(names)
        img = make_image(color, sizes[i % len(sizes)], rng)
        rows.append({
            "data_source": "letter_echo",
            "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": png_bytes(img)}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": color[0]},
            "extra_info": {"split": split, "index": i, "color": color},
        })
    return rows


def write_parquet(rows: list[dict], path: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cli(make_rows, default_dir: str, description: str, argv=None) -> None:
    """The command line both tiny VL generators share (this one and make_tiny_vl_videos.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--local_save_dir", default=default_dir)
    parser.add_argument("--train_size", type=int, default=16)
    parser.add_argument("--test_size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = os.path.expanduser(args.local_save_dir)
    for split, n, seed in (("train", args.train_size, args.seed), ("test", args.test_size, args.seed + 1)):
        path = write_parquet(make_rows(n, seed, split), os.path.join(out, f"{split}.parquet"))
        print(f"wrote {n} rows to {path}")


def main(argv=None) -> None:
    cli(make_rows, "~/data/tiny_vl_images", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()

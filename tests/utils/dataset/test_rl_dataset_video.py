"""``data.image_patch_size`` and video rows of the RL dataset with a tiny Qwen3.5-VL processor (issue 27).

* image_patch_size resizes images (and video frames) to multiples of ``2 * image_patch_size`` pixels before the
  processor sees them, so it changes the vision grid and the number of image tokens; null means the processor's
  own patch size.
* video rows: pre-decoded frames, upstream's per-video ``fps`` / ``max_frames`` / ``nframes`` entries, frame
  timestamps in the prompt, and the frames-only video processor that stands in for transformers' (torchvision).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.config.checks import compose_config
from verl.utils.dataset.rl_dataset import create_rl_dataset
from verl.utils.dataset.vision_utils import fit_to_patch_grid, process_image, process_video


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5, build_tiny_vl_processor
    from verl.utils.tokenizer import load_tokenizer_and_processor

    root = tmp_path_factory.mktemp("vl_video")
    build_tiny_qwen3_5(root / "model", kind="vl", seed=0)
    tok, proc = load_tokenizer_and_processor(OmegaConf.create({"path": str(root / "model")}))
    # the same tower with room for bigger images (up to 64x64 pixels = 8x8 merged tokens)
    roomy = build_tiny_vl_processor(tok, max_pixels=64 * 64)
    return tok, proc, roomy


def _data(*overrides):
    cfg = compose_config("ppo_trainer", ["data.max_prompt_length=256", *overrides], validate=False)
    OmegaConf.resolve(cfg)
    return cfg.data


def _png(size, color=(200, 40, 40)):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _rows_file(tmp_path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _row(text, **media):
    return {"data_source": "letter_echo", "prompt": [{"role": "user", "content": text}],
            "reward_model": {"style": "rule", "ground_truth": "r"}, "extra_info": {"index": 0}, **media}


def test_fit_to_patch_grid_keeps_multiples_and_bounds():
    assert fit_to_patch_grid(40, 24, 8, 64, 4096) == (40, 24)  # already on the grid
    # 28x28 after rounding is under 4 tokens of 28x28: grown, keeping the 5:3 sides as far as the grid allows
    assert fit_to_patch_grid(24, 40, 28, 4 * 28**2, 10**6) == (56, 84)
    h, w = fit_to_patch_grid(1000, 500, 32, 32**2, 100 * 32**2)  # shrunk under the cap, aspect ratio kept
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 100 * 32**2 and h == 2 * w
    with pytest.raises(ValueError, match="aspect ratio"):
        fit_to_patch_grid(1, 500, 8, 64, 4096)


def test_image_patch_size_changes_the_grid_and_token_count(tiny, tmp_path):
    tok, _, roomy = tiny
    path = _rows_file(tmp_path, [_row("<image>what colour?", images=[{"bytes": _png((40, 24))}])])
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    seen = {}
    for size in (4, 14, 8):
        s = create_rl_dataset(path, _data(f"data.image_patch_size={size}"), tok, roomy)[0]
        seen[size] = (s["multi_modal_data"]["image"][0].size, s["multi_modal_inputs"]["image_grid_thw"].tolist(),
                      int((s["input_ids"] == pad).sum()))
    # 4 (the tower's own): 40x24 is on the 8-pixel grid already -> 10x6 patches, 15 tokens
    assert seen[4] == ((40, 24), [[1, 6, 10]], 15)
    # 14 (upstream's default): 28-pixel grid, at least 4 tokens of 28x28 -> 84x56, which the processor then
    # shrinks under its 64x64-pixel cap -> 72x48 -> 12x18 patches, 54 tokens
    assert seen[14] == ((84, 56), [[1, 12, 18]], 54)
    # 8: 16-pixel grid, sides rounded half to even (1.5 -> 2, 2.5 -> 2) -> 32x32 -> 8x8 patches, 16 tokens
    assert seen[8] == ((32, 32), [[1, 8, 8]], 16)
    # null: the processor's own patch size, as upstream falls back to it
    s = create_rl_dataset(path, _data("data.image_patch_size=null"), tok, roomy)[0]
    assert s["multi_modal_data"]["image"][0].size == (40, 24)


def test_image_patch_size_bad_value_is_refused():
    with pytest.raises(ValueError, match="data.image_patch_size must be a positive integer"):
        process_image(np.zeros((8, 8, 3), dtype=np.uint8), image_patch_size=0)


def _clip(n, size=(16, 16)):
    rng = np.random.default_rng(n)
    return [{"bytes": _png(size, tuple(int(c) for c in rng.integers(0, 255, 3)))} for _ in range(n)]


def test_video_row_gets_video_tokens_timestamps_and_grid(tiny, tmp_path):
    tok, proc, _ = tiny
    rows = [_row("<video>what colour?", videos=[{"video": _clip(8), "fps": 2.0, "max_frames": 4}])]
    s = create_rl_dataset(_rows_file(tmp_path, rows), _data("data.image_patch_size=4"), tok, proc)[0]
    mm = s["multi_modal_inputs"]
    # 4 of 8 frames kept (2 pairs); frames sized like the model's images (up to 32x32 = 8x8 patches)
    assert mm["video_grid_thw"].tolist() == [[2, 8, 8]]
    assert mm["pixel_values_videos"].shape == (2 * 8 * 8, 3 * 2 * 4 * 4)
    video_pad = tok.convert_tokens_to_ids("<|video_pad|>")
    assert int((s["input_ids"] == video_pad).sum()) == 2 * 16
    text = tok.decode(s["input_ids"][s["attention_mask"].bool()])
    # kept frames 0, 2, 5, 7 at 2 fps: pairs centred at 0.5 s and 3.0 s
    assert "<0.5" in text and "<3.0" in text
    frames, meta = s["multi_modal_data"]["video"][0]
    assert meta["frames_indices"] == [0, 2, 5, 7] and meta["fps"] == 2.0 and frames.shape[0] == 4
    assert s["position_ids"].shape == (4, 256)  # mRoPE rows for the video grid
    assert "videos" not in s


def test_video_sampling_keys(tiny):
    frames = torch.arange(5 * 3 * 8 * 8, dtype=torch.float32).reshape(5, 3, 8, 8) % 255
    v, meta = process_video({"video": frames.to(torch.uint8), "nframes": 3}, return_video_metadata=True)
    assert v.shape == (4, 3, 8, 8) and meta["frames_indices"] == [0, 2, 4, 4]  # 3 picked, padded to even
    v, fps = process_video(frames.to(torch.uint8), fps=4.0, return_video_sample_fps=True)
    assert v.shape[0] == 6 and fps == 4.0  # all 5 kept (already sampled), padded; fps dates them
    v = process_video({"video": frames.to(torch.uint8)}, image_patch_size=4)
    # every frame on the 8-pixel grid with at least 128 tokens of 8x8: 96x96
    assert v.shape == (6, 3, 96, 96)
    with pytest.raises(ValueError, match="cannot both"):
        process_video(frames, nframes=2, fps=1.0)


def test_video_file_without_decoder_names_the_package(tiny, tmp_path):
    tok, proc, _ = tiny
    rows = [_row("<video>what?", videos=[{"video": "/data/clip.mp4", "fps": 1.0, "max_frames": 32}])]
    path = _rows_file(tmp_path, rows)
    with pytest.raises(ImportError, match="qwen_vl_utils.*'av', 'decord' or 'torchvision'"):
        create_rl_dataset(path, _data("data.filter_overlong_prompts=false"), tok, proc)[0]


def test_frames_video_processor_matches_the_image_processor(tiny):
    """A clip of one frame shown twice is what the image processor makes of that frame (same patch layout)."""
    _, proc, _ = tiny
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 255, (3, 24, 16), dtype=np.uint8)
    vid = proc.video_processor([torch.from_numpy(np.stack([frame, frame]))], return_tensors="pt")
    img = proc.image_processor(images=[frame.transpose(1, 2, 0)], return_tensors="pt")
    assert vid["video_grid_thw"].tolist() == img["image_grid_thw"].tolist() == [[1, 6, 4]]
    torch.testing.assert_close(vid["pixel_values_videos"], img["pixel_values"], atol=1e-5, rtol=1e-5)
    # two different frames: the temporal half of each patch differs
    other = rng.integers(0, 255, (3, 24, 16), dtype=np.uint8)
    two = proc.video_processor([np.stack([frame, other])], return_tensors="pt")["pixel_values_videos"]
    half = two.shape[1] // 2 // 3  # per channel: time 0 then time 1
    assert not torch.allclose(two.view(-1, 3, 2, half)[:, :, 0], two.view(-1, 3, 2, half)[:, :, 1])


def test_agent_loop_prompt_takes_dataset_video_pairs(tiny, tmp_path):
    """The agent loop renders the dataset's (frames, metadata) pairs like the dataset does."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase

    tok, proc, _ = tiny
    rows = [_row("<video>what colour?", videos=[{"video": _clip(4), "fps": 1.0}])]
    s = create_rl_dataset(_rows_file(tmp_path, rows), _data("data.image_patch_size=4"), tok, proc)[0]
    class Loop(AgentLoopBase):
        async def run(self, **kwargs):
            raise NotImplementedError

    loop = Loop.__new__(Loop)
    loop.processor, loop.tokenizer, loop.prompt_length, loop.apply_chat_template_kwargs = proc, tok, 256, {}
    ids, mm = loop.prepare_prompt(s["raw_prompt"], None, s["multi_modal_data"])
    assert ids == s["input_ids"][s["attention_mask"].bool()].tolist()
    torch.testing.assert_close(mm["pixel_values_videos"], s["multi_modal_inputs"]["pixel_values_videos"])
    assert json.dumps(sorted(mm)) == json.dumps(["pixel_values_videos", "video_grid_thw"])

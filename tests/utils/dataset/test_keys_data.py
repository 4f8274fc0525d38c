"""The ``data`` keys of ``ppo_trainer`` shape the RL dataset the trainer builds.

Each test composes ``ppo_trainer`` with the key changed and builds the dataset with ``create_rl_dataset``
from the composed ``data`` section, as ``main_ppo.run_ppo`` does, over a small parquet/jsonl file written
here. The key names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from verl.models.tiny import build_tiny_tokenizer
from verl.trainer.config.checks import compose_config
from verl.utils.dataset import create_rl_dataset


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _data(*overrides):
    cfg = compose_config("ppo_trainer", ["data.max_prompt_length=64", *overrides], validate=False)
    OmegaConf.resolve(cfg)
    return cfg.data


def _row(i, text="hi", key="prompt", **extra):
    return {"data_source": "letter_echo", key: [{"role": "user", "content": text}],
            "reward_model": {"style": "rule", "ground_truth": "a"}, "extra_info": {"index": i}, **extra}


def _parquet(tmp_path, rows, name="d.parquet"):
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_prompt_key_names_the_chat_column(tok, tmp_path):
    path = _parquet(tmp_path, [_row(0, "question one", key="question")])
    ds = create_rl_dataset(path, _data("data.prompt_key=question"), tok, None)
    assert ds[0]["raw_prompt"][0]["content"] == "question one"
    with pytest.raises(Exception, match="prompt"):
        create_rl_dataset(path, _data(), tok, None)[0]  # the default column is missing


def test_return_raw_chat(tok, tmp_path):
    path = _parquet(tmp_path, [_row(0)])
    assert "raw_prompt" in create_rl_dataset(path, _data("data.return_raw_chat=true"), tok, None)[0]
    assert "raw_prompt" not in create_rl_dataset(path, _data("data.return_raw_chat=false"), tok, None)[0]


def test_truncation(tok, tmp_path):
    path = _parquet(tmp_path, [_row(0, " ".join(["word"] * 200))])
    for mode in ("left", "right"):
        sample = create_rl_dataset(path, _data(f"data.truncation={mode}", "data.filter_overlong_prompts=false"),
                                   tok, None)[0]
        assert len(sample["raw_prompt_ids"]) == 64
    left = create_rl_dataset(path, _data("data.truncation=left", "data.filter_overlong_prompts=false"), tok, None)[0]
    right = create_rl_dataset(path, _data("data.truncation=right", "data.filter_overlong_prompts=false"), tok, None)[0]
    assert left["raw_prompt_ids"] != right["raw_prompt_ids"]
    with pytest.raises(ValueError, match="truncation"):
        create_rl_dataset(path, _data("data.truncation=error", "data.filter_overlong_prompts=false"), tok, None)[0]


def test_custom_cls_path_and_name(tok, tmp_path):
    path = _parquet(tmp_path, [_row(i) for i in range(3)])
    mod = tmp_path / "my_ds.py"
    mod.write_text("from verl.utils.dataset.rl_dataset import RLHFDataset\nclass Mine(RLHFDataset):\n    pass\n")
    ds = create_rl_dataset(path, _data(f"data.custom_cls.path={mod}", "data.custom_cls.name=Mine"), tok, None)
    assert type(ds).__name__ == "Mine" and len(ds) == 3
    with pytest.raises(AttributeError, match="Other"):
        create_rl_dataset(path, _data(f"data.custom_cls.path={mod}", "data.custom_cls.name=Other"), tok, None)


class _Processor:
    """A VL processor stand-in: each image becomes 4 pad tokens and canned pixel values."""

    def __init__(self, tok):
        self.tokenizer, self.chat_template = tok, tok.chat_template

    def apply_chat_template(self, messages, **kwargs):
        flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "".join(
            p["text"] if p["type"] == "text" else "<|vision_start|><|image_pad|><|vision_end|>" for p in m["content"])}
            for m in messages]
        return self.tokenizer.apply_chat_template(flat, **kwargs)

    def __call__(self, text, images=None, videos=None, return_tensors=None):
        ids = self.tokenizer.encode(text[0].replace("<|image_pad|>", "<|image_pad|>" * 4), add_special_tokens=False)
        n = len(images or [])
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                "pixel_values": torch.ones(4 * n, 3), "image_grid_thw": torch.tensor([[1, 2, 2]] * n)}


def _image_rows(tmp_path, column="images"):
    from PIL import Image

    img = tmp_path / "img.png"
    Image.new("RGB", (4, 4)).save(img)
    path = tmp_path / "mm.jsonl"
    path.write_text(json.dumps(_row(0, "look <image>", **{column: [str(img)]})) + "\n")
    return str(path)


def test_return_multi_modal_inputs(tok, tmp_path):
    path = _image_rows(tmp_path)
    on = create_rl_dataset(path, _data("data.return_multi_modal_inputs=true"), tok, _Processor(tok))[0]
    off = create_rl_dataset(path, _data("data.return_multi_modal_inputs=false"), tok, _Processor(tok))[0]
    assert "multi_modal_inputs" in on and "multi_modal_inputs" not in off
    assert "multi_modal_data" in off  # the images still go to the rollout


def test_image_and_video_keys_name_the_media_columns(tok, tmp_path):
    path = _image_rows(tmp_path, column="pics")
    sample = create_rl_dataset(path, _data("data.image_key=pics"), tok, _Processor(tok))[0]
    assert sample["multi_modal_data"]["image"][0].size == (56, 56)  # on image_patch_size 14's smallest grid
    # a row whose video column (data.video_key) lists a video but whose text has no <video> is refused, naming
    # the counts; the same row read with another video_key has no videos
    vid = tmp_path / "v.jsonl"
    vid.write_text(json.dumps(_row(0, "no placeholder", clips=["/nonexistent.mp4"])) + "\n")
    with pytest.raises(ValueError, match="0 images and 1 videos"):
        create_rl_dataset(str(vid), _data("data.video_key=clips"), tok, _Processor(tok))[0]
    assert "multi_modal_data" not in create_rl_dataset(str(vid), _data(), tok, _Processor(tok))[0]

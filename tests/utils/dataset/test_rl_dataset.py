import json
import logging
import pickle

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from verl.models.tiny import build_tiny_tokenizer
from verl.utils.dataset import RLHFDataset, collate_fn, create_rl_dataset, create_rl_sampler
from verl.utils.dataset.rl_dataset import _render_chat, truncate_ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _row(i, text="hi", **extra):
    return {
        "data_source": "letter_echo",
        "prompt": [{"role": "user", "content": text}],
        "ability": "demo",
        "reward_model": {"style": "rule", "ground_truth": "a"},
        "extra_info": {"index": i, "split": "train"},
        **extra,
    }


def _parquet(tmp_path, rows, name="d.parquet"):
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _prompt_len(tok, text):
    rendered = _render_chat(tok, [{"role": "user", "content": text}])
    return len(tok.encode(rendered, add_special_tokens=False))


def test_sample_fields_and_left_padding(tok, tmp_path):
    path = _parquet(tmp_path, [_row(7, "hello")])
    ds = RLHFDataset(path, tok, {"max_prompt_length": 40, "return_full_prompt": True, "return_raw_input_ids": True})
    sample = ds[0]
    n = _prompt_len(tok, "hello")
    assert sample["input_ids"].shape == (40,)
    assert sample["attention_mask"].tolist() == [0] * (40 - n) + [1] * n
    assert (sample["input_ids"][: 40 - n] == tok.pad_token_id).all()
    assert sample["position_ids"][-n:].tolist() == list(range(n))
    assert sample["position_ids"][: 40 - n].tolist() == [0] * (40 - n)
    assert sample["raw_prompt_ids"] == sample["input_ids"][-n:].tolist()
    assert sample["raw_input_ids"] == sample["raw_prompt_ids"]
    assert tok.decode(sample["raw_prompt_ids"]) == sample["full_prompts"]
    assert sample["raw_prompt"] == [{"role": "user", "content": "hello"}]
    assert sample["data_source"] == "letter_echo"
    assert sample["reward_model"] == {"style": "rule", "ground_truth": "a"}
    assert sample["index"] == 7 and sample["tools_kwargs"] == {} and sample["interaction_kwargs"] == {}
    assert "prompt" not in sample


def test_collate_stacks_tensors_and_objects(tok, tmp_path):
    path = _parquet(tmp_path, [_row(0, "a"), _row(1, "bbbb")])
    ds = RLHFDataset(path, tok, {"max_prompt_length": 40})
    batch = collate_fn([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 40)
    for key in ("raw_prompt_ids", "reward_model", "data_source", "raw_prompt"):
        assert isinstance(batch[key], np.ndarray) and batch[key].dtype == object and batch[key].shape == (2,)
    # equal-length lists must stay lists, not become a 2-D array
    same = collate_fn([{"x": [1, 2]}, {"x": [3, 4]}])["x"]
    assert same.shape == (2,) and same[1] == [3, 4]


def test_collate_errors():
    with pytest.raises(ValueError, match="empty"):
        collate_fn([])
    with pytest.raises(ValueError, match="'b'"):
        collate_fn([{"a": torch.zeros(1), "b": 1}, {"a": torch.zeros(1)}])


def test_json_jsonl_and_multiple_files(tok, tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(_row(i)) for i in range(2)) + "\n")
    js = tmp_path / "b.json"
    js.write_text(json.dumps([_row(5, "x", extra_col=1)]))
    ds = RLHFDataset([str(jsonl), str(js)], tok, {"max_prompt_length": 64})
    assert len(ds) == 3
    # a column present only in one file is filled with None so batches still collate
    batch = collate_fn([ds[i] for i in range(3)])
    assert list(batch["extra_col"]) == [None, None, 1]


@pytest.mark.parametrize(
    "mode,expected",
    [("left", [3, 4, 5, 6]), ("right", [0, 1, 2, 3]), ("middle", [0, 1, 5, 6])],
)
def test_truncate_ids_modes(mode, expected):
    assert truncate_ids(list(range(7)), 4, mode) == expected
    assert truncate_ids(torch.arange(7), 4, mode).tolist() == expected
    assert truncate_ids([1, 2], 4, mode) == [1, 2]


def test_truncation_modes_in_dataset(tok, tmp_path):
    path = _parquet(tmp_path, [_row(0, "x" * 30)])
    n = _prompt_len(tok, "x" * 30)
    full = RLHFDataset(path, tok, {"max_prompt_length": 100})[0]["raw_prompt_ids"]
    for mode, want in (("left", full[-20:]), ("right", full[:20]), ("middle", full[:10] + full[-10:])):
        ds = RLHFDataset(path, tok, {"max_prompt_length": 20, "truncation": mode, "filter_overlong_prompts": False})
        sample = ds[0]
        assert n > 20
        assert sample["input_ids"].tolist() == want
        assert sample["attention_mask"].sum() == 20
        assert sample["raw_prompt_ids"] == want


def test_truncation_error_names_row_and_lengths(tok, tmp_path):
    path = _parquet(tmp_path, [_row(0, "ok"), _row(1, "y" * 40)])
    ds = RLHFDataset(path, tok, {"max_prompt_length": 30, "filter_overlong_prompts": False})
    ds[0]
    n = _prompt_len(tok, "y" * 40)
    with pytest.raises(ValueError, match=rf"row 1 of .*d\.parquet is {n} tokens.*max_prompt_length=30.*truncation"):
        ds[1]


def test_filter_overlong_prompts_logs_count(tok, tmp_path, caplog):
    path = _parquet(tmp_path, [_row(0, "ok"), _row(1, "y" * 40), _row(2, "z" * 50), _row(3, "ok")])
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(path, tok, {"max_prompt_length": 30, "filter_overlong_prompts": True})
    assert len(ds) == 2 and [ds[i]["index"] for i in range(2)] == [0, 3]
    assert "filtered out 2 of 4" in caplog.text


def test_max_samples(tok, tmp_path):
    path = _parquet(tmp_path, [_row(i) for i in range(6)])
    assert [r["index"] for r in RLHFDataset(path, tok, {}, max_samples=3)] == [0, 1, 2]
    cfg = {"shuffle": True, "seed": 1}
    picked = [r["index"] for r in RLHFDataset(path, tok, cfg, max_samples=3)]
    assert len(picked) == 3 and picked == [r["index"] for r in RLHFDataset(path, tok, cfg, max_samples=3)]


def test_missing_file_named(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLHFDataset(str(tmp_path / "nope.parquet"), tok, {})


def test_unreadable_and_unsupported_files(tok, tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError, match="bad.parquet"):
        RLHFDataset(str(bad), tok, {})
    csv = tmp_path / "x.csv"
    csv.write_text("a,b")
    with pytest.raises(ValueError, match=r"unsupported data file .*x\.csv"):
        RLHFDataset(str(csv), tok, {})


def test_missing_prompt_key_names_row_and_keys(tok, tmp_path):
    rows = [_row(0), {"question": "q", "data_source": "d"}]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(KeyError, match=r"row 1 of .*m\.jsonl.*prompt_key='prompt'.*\['data_source', 'question'\]"):
        RLHFDataset(str(path), tok, {"filter_overlong_prompts": True})


def test_prompt_must_be_messages(tok, tmp_path):
    path = _parquet(tmp_path, [{"prompt": "just a string", "data_source": "d"}])
    with pytest.raises(ValueError, match="list of chat messages"):
        RLHFDataset(path, tok, {})


def test_tokenizer_without_chat_template(tmp_path):
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    path = _parquet(tmp_path, [_row(0)])
    with pytest.raises(ValueError, match="no chat template.*custom_chat_template"):
        RLHFDataset(path, tok, {})
    # a custom template makes it usable
    ds = RLHFDataset(path, tok, {"custom_chat_template": "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"})
    assert ds[0]["raw_prompt_ids"] == tok.encode("<hi>", add_special_tokens=False)


def test_template_failure_names_row(tok, tmp_path):
    template = "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('bad row') }}{% endif %}x"
    path = _parquet(tmp_path, [_row(0), _row(1, "boom")])
    with pytest.raises(ValueError, match=r"chat template to row 1 of .*bad row"):
        RLHFDataset(path, tok, {"custom_chat_template": template})


def test_system_only_chat_renders(tok, tmp_path):
    # the shared helper renders chats without a user message (the raw template would refuse them)
    path = _parquet(tmp_path, [{**_row(0), "prompt": [{"role": "system", "content": "be brief"}]}])
    assert "be brief" in RLHFDataset(path, tok, {"return_full_prompt": True})[0]["full_prompts"]


def test_apply_chat_template_kwargs_forwarded(tok, tmp_path):
    template = "{% if shout %}LOUD{% endif %}{{ messages[0]['content'] }}"
    path = _parquet(tmp_path, [_row(0)])
    cfg = {"custom_chat_template": template, "apply_chat_template_kwargs": {"shout": True}}
    assert tok.decode(RLHFDataset(path, tok, cfg)[0]["raw_prompt_ids"]) == "LOUDhi"


def test_bad_truncation_option(tok, tmp_path):
    with pytest.raises(ValueError, match="truncation='sideways'"):
        RLHFDataset(_parquet(tmp_path, [_row(0)]), tok, {"truncation": "sideways"})


def test_tools_and_interaction_kwargs_from_extra_info(tok, tmp_path):
    row = _row(3)
    row["extra_info"] = {"index": 3, "tools_kwargs": {"calc": {"x": 1}}, "interaction_kwargs": {"name": "g"}}
    sample = RLHFDataset(_parquet(tmp_path, [row]), tok, {})[0]
    assert sample["tools_kwargs"] == {"calc": {"x": 1}} and sample["interaction_kwargs"] == {"name": "g"}


def test_pickle_roundtrip_and_split(tok, tmp_path):
    ds = RLHFDataset(_parquet(tmp_path, [_row(i) for i in range(5)]), tok, OmegaConf.create({"max_prompt_length": 32}))
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone) == 5 and torch.equal(clone[4]["input_ids"], ds[4]["input_ids"])
    parts = ds.split(2)
    assert [len(p) for p in parts] == [2, 2] and parts[1][0]["index"] == 2
    with pytest.raises(ValueError, match="positive integer"):
        ds.split(0)


class _FakeProcessor:
    """Stands in for a VL processor: expands each image into 4 pad tokens and returns canned pixel values."""

    def __init__(self, tok):
        self.tokenizer = tok
        self.chat_template = tok.chat_template
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(messages)
        flat = []
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                content = "".join(
                    p["text"] if p["type"] == "text" else "<|vision_start|><|image_pad|><|vision_end|>" for p in content
                )
            flat.append({"role": m["role"], "content": content})
        return self.tokenizer.apply_chat_template(flat, **kwargs)

    def __call__(self, text, images=None, videos=None, return_tensors=None):
        expanded = text[0].replace("<|image_pad|>", "<|image_pad|>" * 4)
        ids = self.tokenizer.encode(expanded, add_special_tokens=False)
        n = len(images or [])
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "pixel_values": torch.ones(4 * n, 3),
            "image_grid_thw": torch.tensor([[1, 2, 2]] * n),
        }


def test_multimodal_row_through_processor(tok, tmp_path):
    from PIL import Image

    img_path = tmp_path / "img.png"
    Image.new("RGB", (4, 4), color=(255, 0, 0)).save(img_path)
    row = _row(0, "look <image> here")
    row["images"] = [str(img_path)]
    path = tmp_path / "mm.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(_row(1, "text only")) + "\n")
    proc = _FakeProcessor(tok)
    ds = RLHFDataset(str(path), tok, {"max_prompt_length": 64}, processor=proc)
    sample = ds[0]
    assert proc.calls[-1][0]["content"][1] == {"type": "image"}
    # data.image_patch_size defaults to 14 without a processor patch size: the 4x4 image grows to the smallest
    # allowed grid, 4 merged tokens of 28x28 pixels
    assert sample["multi_modal_data"]["image"][0].size == (56, 56)
    assert sample["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 2, 2]]
    pad_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert (sample["input_ids"] == pad_id).sum() == 4  # expanded in input_ids
    assert sample["raw_prompt_ids"].count(pad_id) == 1  # not expanded in raw_prompt_ids
    assert "images" not in sample
    assert sample["raw_prompt"][0]["content"][0] == {"type": "text", "text": "look "}
    assert "multi_modal_data" not in ds[1]


def test_multimodal_placeholder_mismatch(tok, tmp_path):
    from PIL import Image

    img_path = tmp_path / "img.png"
    Image.new("RGB", (2, 2)).save(img_path)
    row = _row(0, "no placeholder")
    row["images"] = [str(img_path)]
    path = tmp_path / "mm.jsonl"
    path.write_text(json.dumps(row))
    with pytest.raises(ValueError, match=r"row 0 of .*0 <image>.*1 images"):
        RLHFDataset(str(path), tok, {}, processor=_FakeProcessor(tok))
    with pytest.raises(ValueError, match="no processor"):
        RLHFDataset(str(path), tok, {})


def test_create_rl_dataset_and_custom_cls(tok, tmp_path):
    path = _parquet(tmp_path, [_row(i) for i in range(4)])
    ds = create_rl_dataset([path], OmegaConf.create({"max_prompt_length": 32}), tok, None, max_samples=2)
    assert isinstance(ds, RLHFDataset) and len(ds) == 2
    mod = tmp_path / "my_ds.py"
    mod.write_text(
        "from verl.utils.dataset.rl_dataset import RLHFDataset\n"
        "class Mine(RLHFDataset):\n    pass\n"
        "class NotADataset:\n    pass\n"
    )
    cfg = OmegaConf.create({"custom_cls": {"path": str(mod), "name": "Mine"}})
    assert type(create_rl_dataset(path, cfg, tok, None)).__name__ == "Mine"
    cfg.custom_cls.name = "NotADataset"
    with pytest.raises(TypeError, match="NotADataset.*torch.utils.data.Dataset"):
        create_rl_dataset(path, cfg, tok, None)
    cfg.custom_cls.name = "Missing"
    with pytest.raises(AttributeError, match="my_ds.py.*'Missing'"):
        create_rl_dataset(path, cfg, tok, None)


def test_create_rl_sampler(tok, tmp_path):
    ds = RLHFDataset(_parquet(tmp_path, [_row(i) for i in range(8)]), tok, {})
    assert list(create_rl_sampler(OmegaConf.create({"shuffle": False}), ds)) == list(range(8))
    a = list(create_rl_sampler(OmegaConf.create({"shuffle": True, "seed": 3}), ds))
    b = list(create_rl_sampler(OmegaConf.create({"shuffle": True, "seed": 3}), ds))
    assert a == b and sorted(a) == list(range(8)) and a != list(range(8))

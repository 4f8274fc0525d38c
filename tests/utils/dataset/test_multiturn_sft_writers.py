"""The SFT data writers in examples/data_preprocess produce files MultiTurnSFTDataset trains on."""

import importlib.util
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.models.tiny import build_tiny_tokenizer
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

REPO = Path(__file__).resolve().parents[3]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "data_preprocess" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trained_text(tok, item):
    return tok.decode([t for t, m in zip(item["input_ids"].tolist(), item["loss_mask"].tolist()) if m])


def test_sharegpt_with_tool_call_round_trips_into_the_dataset(tmp_path):
    conv = {"conversations": [
        {"from": "human", "value": "weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "Sunny."}],
        "tools": json.dumps([{"type": "function", "function": {"name": "weather"}}])}
    other = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in (conv, other)))
    _load("multiturn_sft").main(["--input", str(src), "--format", "sharegpt", "--local_save_dir", str(tmp_path)])
    tok = build_tiny_tokenizer()
    ds = MultiTurnSFTDataset(str(tmp_path / "train.parquet"), tok, OmegaConf.create({"max_length": 512}))
    texts = sorted(_trained_text(tok, ds[i]) for i in range(len(ds)))
    call = "<tool_call><function=weather><parameter=city>Paris</parameter></function></tool_call><|im_end|>"
    assert texts == sorted([call + "Sunny.<|im_end|>", "hello<|im_end|>"])


def test_bad_conversation_stops_the_writer_with_its_number(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"conversations": [{"from": "robot", "value": "x"}]}))
    with pytest.raises(SystemExit, match="conversation 0: turn 0 comes from 'robot'"):
        _load("multiturn_sft").main(["--input", str(src), "--format", "sharegpt", "--local_save_dir", str(tmp_path)])


def test_gsm8k_sft_writer_offline(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for split in ("train", "test"):
        (raw / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    _load("gsm8k_multiturn_sft").main(["--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "out")])
    tok = build_tiny_tokenizer()
    ds = MultiTurnSFTDataset(str(tmp_path / "out" / "train.parquet"), tok, OmegaConf.create({"max_length": 512}))
    assert _trained_text(tok, ds[0]) == "1+1=2\n#### 2<|im_end|>"

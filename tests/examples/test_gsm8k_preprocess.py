import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "gsm8k.py"


@pytest.fixture(scope="module")
def gsm8k():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


TRAIN = [
    {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
    {"question": "A big sum?", "answer": "lots\n#### 1,200"},
]
TEST = [{"question": "1 minus 4?", "answer": "#### -3"}]


def test_writes_upstream_schema(gsm8k, tmp_path):
    raw = tmp_path / "raw"
    _write_jsonl(raw / "main" / "train.jsonl", TRAIN)
    _write_jsonl(raw / "main" / "test.jsonl", TEST)
    out = tmp_path / "out"
    assert gsm8k.main(["--local_dataset_path", str(raw), "--local_save_dir", str(out)]) == 0

    train = pq.read_table(out / "train.parquet").to_pylist()
    test = pq.read_table(out / "test.parquet").to_pylist()
    assert len(train) == 2 and len(test) == 1
    row = train[0]
    assert row["data_source"] == "openai/gsm8k"
    assert row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": TRAIN[0]["question"] + " " + gsm8k.INSTRUCTION}]
    assert "####" in gsm8k.INSTRUCTION
    assert row["reward_model"] == {"style": "rule", "ground_truth": "5"}
    want_extra = {"split": "train", "index": 0, "answer": TRAIN[0]["answer"], "question": TRAIN[0]["question"]}
    assert row["extra_info"] == want_extra
    assert train[1]["reward_model"]["ground_truth"] == "1200"
    assert test[0]["reward_model"]["ground_truth"] == "-3" and test[0]["extra_info"]["split"] == "test"


def test_output_loads_in_rl_dataset_and_scores(gsm8k, tmp_path):
    from verl.models.tiny import build_tiny_tokenizer
    from verl.utils.dataset import RLHFDataset
    from verl.utils.reward_score import default_compute_score

    raw = tmp_path / "raw"
    _write_jsonl(raw / "train.jsonl", TRAIN)
    _write_jsonl(raw / "test.jsonl", TEST)
    gsm8k.main(["--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "out")])
    ds = RLHFDataset(str(tmp_path / "out" / "train.parquet"), build_tiny_tokenizer(), {"max_prompt_length": 256})
    sample = ds[1]
    assert sample["index"] == 1
    gt = sample["reward_model"]["ground_truth"]
    assert default_compute_score(sample["data_source"], "so #### 1,200", gt) == 1.0


def test_missing_split_file(gsm8k, tmp_path):
    raw = tmp_path / "raw"
    _write_jsonl(raw / "train.jsonl", TRAIN)
    with pytest.raises(FileNotFoundError, match="no test file"):
        gsm8k.main(["--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "out")])


def test_bad_rows_are_named(gsm8k, tmp_path):
    raw = tmp_path / "raw"
    _write_jsonl(raw / "train.jsonl", [TRAIN[0], {"question": "q"}])
    _write_jsonl(raw / "test.jsonl", TEST)
    with pytest.raises(KeyError, match=r"train\.jsonl row 1.*'answer'"):
        gsm8k.main(["--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "out")])
    _write_jsonl(raw / "train.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"train\.jsonl row 0.*####"):
        gsm8k.main(["--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "out")])


def test_not_a_directory(gsm8k, tmp_path):
    with pytest.raises(SystemExit):
        gsm8k.main(["--local_dataset_path", str(tmp_path / "missing"), "--local_save_dir", str(tmp_path)])


def test_offline_hub_error_suggests_local_path(gsm8k, monkeypatch):
    import sys
    import types

    fake = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        raise ConnectionError("no network")

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(RuntimeError, match="--local_dataset_path"):
        gsm8k.load_hub_split("train")

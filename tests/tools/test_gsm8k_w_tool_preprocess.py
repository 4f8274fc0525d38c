import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "gsm8k_w_tool.py"


def test_rows_carry_tool_kwargs(tmp_path):
    spec = importlib.util.spec_from_file_location("gsm8k_w_tool", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train.jsonl").write_text(json.dumps({"question": "2 plus 3?", "answer": "#### 5"}) + "\n")
    (raw / "test.jsonl").write_text(json.dumps({"question": "7 times 6?", "answer": "x\n#### 42"}) + "\n")
    assert mod.main(["--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "out")]) == 0
    (row,) = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert row["agent_name"] == "tool_agent"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and "calculator" in row["prompt"][0]["content"]
    assert row["reward_model"]["ground_truth"] == "42"
    assert row["extra_info"]["tools_kwargs"]["calculator"]["create_kwargs"]["ground_truth"] == "42"
    assert row["extra_info"]["need_tools_kwargs"] is True

"""Convert GSM8K into the RL prompt schema: ``<local_save_dir>/train.parquet`` and ``test.parquet``.

Offline (the usual case here) point ``--local_dataset_path`` at a directory holding the GSM8K splits as
parquet/jsonl/json files whose names contain ``train`` / ``test`` (the layout of the HF dataset or the
original ``grade_school_math/data``), each with ``question`` and ``answer`` columns. Without it the script
tries ``datasets.load_dataset("openai/gsm8k", "main")``, which needs the hub.

Each output row::

    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": question + instruction}]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": <number after ####>}
    extra_info   {"split", "index", "answer", "question"}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER_RE = re.compile(r"####\s*(-?[0-9.,]+)")
_SUFFIXES = (".parquet", ".jsonl", ".json")


def extract_solution(answer: str) -> str:
    """The reference number after ``####``, thousands separators removed."""
    match = _ANSWER_RE.search(answer)
    if match is None:
        raise ValueError(f"no '#### <number>' line in answer {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def _read_records(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        content = json.load(f)
    if not isinstance(content, list):
        raise ValueError(f"{path}: expected a JSON list of {{'question', 'answer'}} objects")
    return content


def find_split_files(root: str, split: str) -> list[str]:
    """Data files under ``root`` whose file name mentions ``split`` (e.g. ``train-00000-of-00001.parquet``)."""
    found = []
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            if split in filename.lower() and filename.lower().endswith(_SUFFIXES):
                found.append(os.path.join(dirpath, filename))
    return sorted(found)


def load_local_split(root: str, split: str) -> list[dict]:
    files = find_split_files(root, split)
    if not files:
        raise FileNotFoundError(
            f"no {split} file (*{split}*.parquet/.jsonl/.json) under --local_dataset_path {root!r}"
        )
    records = []
    for path in files:
        for row_idx, record in enumerate(_read_records(path)):
            missing = [k for k in ("question", "answer") if k not in record]
            if missing:
                raise KeyError(f"{path} row {row_idx}: missing column(s) {missing}; it has {sorted(record)}")
            records.append({**record, "_origin": f"{path} row {row_idx}"})
    return records


def load_hub_split(split: str) -> list[dict]:
    try:
        import datasets

        return [dict(r) for r in datasets.load_dataset(DATA_SOURCE, "main")[split]]
    except Exception as err:
        raise RuntimeError(
            f"could not download {DATA_SOURCE} ({type(err).__name__}: {err}); when offline, pass "
            "--local_dataset_path pointing at a directory with the GSM8K train/test parquet or jsonl files"
        ) from err


def make_row(record: dict, split: str, index: int) -> dict:
    question_raw = record["question"]
    answer_raw = record["answer"]
    try:
        solution = extract_solution(answer_raw)
    except ValueError as err:
        where = record.get("_origin", f"{split} example {index}")
        raise ValueError(f"{where}: {err}") from err
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question_raw + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "answer": answer_raw, "question": question_raw},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dir", default=None, help="deprecated alias of --local_save_dir")
    parser.add_argument("--hdfs_dir", default=None, help="not supported in this build (no HDFS client)")
    parser.add_argument("--local_dataset_path", default=None, help="directory with raw GSM8K split files")
    parser.add_argument("--local_save_dir", default="~/data/gsm8k", help="where train/test.parquet are written")
    args = parser.parse_args(argv)

    if args.hdfs_dir:
        parser.error("--hdfs_dir is not supported here; copy the written parquet files yourself")
    save_dir = os.path.expanduser(args.local_dir or args.local_save_dir)
    if args.local_dataset_path is not None and not os.path.isdir(os.path.expanduser(args.local_dataset_path)):
        parser.error(f"--local_dataset_path {args.local_dataset_path!r} is not a directory")

    import pandas as pd

    os.makedirs(save_dir, exist_ok=True)
    for split in ("train", "test"):
        if args.local_dataset_path is not None:
            records = load_local_split(os.path.expanduser(args.local_dataset_path), split)
        else:
            records = load_hub_split(split)
        rows = [make_row(record, split, i) for i, record in enumerate(records)]
        out = os.path.join(save_dir, f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(out, index=False)
        print(f"wrote {len(rows)} {split} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

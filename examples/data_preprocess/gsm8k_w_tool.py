"""GSM8K for multi-turn tool-calling GRPO: like ``gsm8k.py`` but rows invite the model to use the calculator.

Reads the same inputs (``--local_dataset_path`` with train/test parquet/jsonl/json files, or the hub) and
writes ``train.parquet`` / ``test.parquet`` with::

    data_source  "openai/gsm8k"
    agent_name   "tool_agent"
    prompt       [system: how to call the calculator, user: question + instruction]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": <number after ####>}
    extra_info   {"split", "index", "answer", "question", "need_tools_kwargs": True,
                  "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": ...}}}}

The dataset copies ``extra_info.tools_kwargs`` into the ``tools_kwargs`` column the tool agent loop reads.
Pair with ``examples/sglang_multiturn/config/tool_config/calculator_tool_config.yaml``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

TOOL_NAME = "calculator"
SYSTEM_PROMPT = (
    "You are a math expert. Solve the problem step by step. You may call the `calculator` tool to evaluate "
    "arithmetic expressions; after getting results, give the final answer after \"####\"."
)


def _load_base():
    # Reuse the plain GSM8K script (reading, answer extraction) rather than duplicating it.
    path = Path(__file__).resolve().parent / "gsm8k.py"
    spec = importlib.util.spec_from_file_location("_gsm8k_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = _load_base()


def make_row(record: dict, split: str, index: int) -> dict:
    row = base.make_row(record, split, index)
    solution = row["reward_model"]["ground_truth"]
    row["agent_name"] = "tool_agent"
    row["prompt"] = [{"role": "system", "content": SYSTEM_PROMPT}] + row["prompt"]
    row["extra_info"] = {
        **row["extra_info"],
        "need_tools_kwargs": True,
        "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": solution}}},
    }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dataset_path", default=None, help="directory with raw GSM8K split files")
    parser.add_argument("--local_save_dir", default="~/data/gsm8k_w_tool", help="where train/test.parquet go")
    args = parser.parse_args(argv)
    save_dir = os.path.expanduser(args.local_save_dir)
    if args.local_dataset_path is not None and not os.path.isdir(os.path.expanduser(args.local_dataset_path)):
        parser.error(f"--local_dataset_path {args.local_dataset_path!r} is not a directory")

    import pandas as pd

    os.makedirs(save_dir, exist_ok=True)
    for split in ("train", "test"):
        if args.local_dataset_path is not None:
            records = base.load_local_split(os.path.expanduser(args.local_dataset_path), split)
        else:
            records = base.load_hub_split(split)
        rows = [make_row(r, split, i) for i, r in enumerate(records)]
        out = os.path.join(save_dir, f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(out, index=False)
        print(f"wrote {len(rows)} {split} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Convert GSM8K into the SFT conversation schema: ``<local_save_dir>/train.parquet`` and ``test.parquet``.

Reads the same inputs as ``gsm8k.py`` (``--local_dataset_path`` with the GSM8K split files when offline, the
hub otherwise). Each output row::

    messages   [{"role": "user", "content": question + instruction},
                {"role": "assistant", "content": the worked solution ending in "#### <number>"}]
    data_source, extra_info  as in the RL files

Train with ``python -m verl.trainer.sft_trainer data.train_files=<dir>/train.parquet
data.val_files=<dir>/test.parquet data.messages_key=messages model.path=...`` (see examples/sft/gsm8k/).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gsm8k import DATA_SOURCE, INSTRUCTION, extract_solution, load_hub_split, load_local_split  # noqa: E402


def make_row(record: dict, split: str, index: int) -> dict:
    question, answer = record["question"], record["answer"]
    try:
        solution = extract_solution(answer)
    except ValueError as err:
        raise ValueError(f"{record.get('_origin', f'{split} example {index}')}: {err}") from err
    return {
        "data_source": DATA_SOURCE,
        "messages": [{"role": "user", "content": question + " " + INSTRUCTION},
                     {"role": "assistant", "content": answer}],
        "extra_info": {"split": split, "index": index, "ground_truth": solution},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dataset_path", default=None, help="directory with raw GSM8K split files")
    parser.add_argument("--local_save_dir", default="~/data/gsm8k_sft", help="where train/test.parquet are written")
    args = parser.parse_args(argv)
    if args.local_dataset_path is not None and not os.path.isdir(os.path.expanduser(args.local_dataset_path)):
        parser.error(f"--local_dataset_path {args.local_dataset_path!r} is not a directory")
    import pandas as pd

    save_dir = os.path.expanduser(args.local_save_dir)
    os.makedirs(save_dir, exist_ok=True)
    for split in ("train", "test"):
        records = (load_local_split(os.path.expanduser(args.local_dataset_path), split)
                   if args.local_dataset_path is not None else load_hub_split(split))
        rows = [make_row(r, split, i) for i, r in enumerate(records)]
        out = os.path.join(save_dir, f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(out, index=False)
        print(f"wrote {len(rows)} {split} conversations to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

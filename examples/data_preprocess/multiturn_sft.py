"""Write multi-turn chat data (with tool calls, tool results and reasoning) as SFT parquet files.

Input: a ``.jsonl`` / ``.json`` file of conversations in either format

* ``openai``: ``{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}, ...], "tools"?: [...]}``
  with tool calls as ``{"type": "function", "function": {"name", "arguments"}}``;
* ``sharegpt``: ``{"conversations": [{"from": "system|human|gpt|function_call|observation", "value"}], "tools"?}``
  where a ``function_call`` value is the JSON ``{"name", "arguments"}`` of one call made by the assistant.

``--format demo`` writes the embedded "calculator calls" task instead (no input needed).

Output: ``<local_save_dir>/train.parquet`` (and ``test.parquet`` with ``--test_fraction``) with columns
``messages``, ``tools`` (a JSON string: parquet would otherwise merge all rows' schemas into one struct) and
``enable_thinking`` when given. Tool-call arguments are stored as JSON strings for the same reason; the
dataset parses them. Every row is checked here; a bad one stops the script with its line number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "observation": "tool", "tool": "tool"}


class RowError(ValueError):
    pass


def _call(name, arguments) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise RowError(f"tool call {name!r}: arguments are not valid JSON ({err.msg})") from err
    if not isinstance(arguments, dict):
        raise RowError(f"tool call {name!r}: arguments must be a JSON object")
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def from_openai(record: dict) -> list[dict]:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RowError("no 'messages' list")
    out = []
    for k, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise RowError(f"message {k} has role {role!r}")
        msg = {"role": role, "content": m.get("content") or ""}
        if m.get("reasoning_content"):
            msg["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls") or []
        if calls:
            msg["tool_calls"] = [_call((c.get("function") or c)["name"], (c.get("function") or c).get("arguments", {}))
                                 for c in calls]
        out.append(msg)
    return out


def from_sharegpt(record: dict) -> list[dict]:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise RowError("no 'conversations' list")
    out: list[dict] = []
    for k, t in enumerate(turns):
        kind = t.get("from")
        if kind == "function_call":
            try:
                call = json.loads(t["value"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise RowError(f"turn {k}: a function_call value must be JSON with name and arguments") from err
            prev = out[-1] if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls") else None
            if prev is None:
                prev = {"role": "assistant", "content": ""}
                out.append(prev)
            prev["tool_calls"] = [_call(call.get("name"), call.get("arguments", {}))]
        elif kind in ROLES:
            out.append({"role": ROLES[kind], "content": t.get("value") or ""})
        else:
            raise RowError(f"turn {k} comes from {kind!r}; expected one of {sorted(ROLES) + ['function_call']}")
    return out


def convert(record: dict, fmt: str) -> dict:
    messages = from_openai(record) if fmt == "openai" else from_sharegpt(record)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no assistant turn")
    row = {"messages": messages}
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise RowError(f"'tools' is not valid JSON ({err.msg})") from err
    row["tools"] = json.dumps(tools, ensure_ascii=False) if tools else None
    if "enable_thinking" in record:
        row["enable_thinking"] = record["enable_thinking"]
    return row


def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", help="a .jsonl or .json file of conversations")
    parser.add_argument("--format", choices=("openai", "sharegpt", "demo"), default="openai")
    parser.add_argument("--local_save_dir", default="~/data/multiturn_sft")
    parser.add_argument("--test_fraction", type=float, default=0.0, help="share of rows written to test.parquet")
    parser.add_argument("--num_rows", type=int, default=512, help="--format demo: conversations to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.format == "demo":
        from verl.trainer.demo.sft_task import make_rows

        rows = make_rows(args.num_rows, seed=args.seed)
    else:
        if not args.input:
            parser.error("--input is required unless --format demo")
        rows = []
        for i, record in enumerate(read_records(os.path.expanduser(args.input))):
            try:
                rows.append(convert(record, args.format))
            except RowError as err:
                raise SystemExit(f"{args.input}: conversation {i}: {err}") from err
    import pandas as pd

    random.Random(args.seed).shuffle(rows)
    n_test = int(len(rows) * args.test_fraction)
    save_dir = os.path.expanduser(args.local_save_dir)
    os.makedirs(save_dir, exist_ok=True)
    for split, part in (("train", rows[n_test:]), ("test", rows[:n_test])):
        if part:
            out = os.path.join(save_dir, f"{split}.parquet")
            pd.DataFrame(part).to_parquet(out, index=False)
            print(f"wrote {len(part)} {split} conversations to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

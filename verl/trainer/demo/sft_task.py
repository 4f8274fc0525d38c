"""The embedded SFT task: "calculator calls", a synthetic multi-turn conversation with a tool call.

Each conversation: the user asks for the sum or product of two digits; the assistant calls the ``add`` or
``mul`` tool with them; the tool answers; the assistant states the result. Everything the assistant says
follows from earlier turns (which tool from the user's wording, its arguments from the digits, the final
number from the tool result), so a tiny model learns it: ``python -m verl.trainer.sft_trainer`` with no
arguments trains the demo's tiny Qwen3.5 on it and the training loss falls to well under half its start.

Config values ``${verl_sft_demo:model}``, ``${verl_sft_demo:train}`` and ``${verl_sft_demo:val}`` resolve to
the built assets (``${verl_sft_demo:device}`` to this host's device) (under ``$VERL_DEMO_DIR``, like the RL demo's), so no download is needed.
"""

from __future__ import annotations

import contextlib
import json
import random

from omegaconf import OmegaConf

from verl.trainer.demo import _build_atomically, demo_root, ensure_assets

TASK = "calculator_calls"
TASK_VERSION = "v1"
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "a+b",
                                      "parameters": {"a": "int", "b": "int"}}},
    {"type": "function", "function": {"name": "mul", "description": "a*b",
                                      "parameters": {"a": "int", "b": "int"}}},
]
_OPS = {"add": ("plus", lambda a, b: a + b), "mul": ("times", lambda a, b: a * b)}


def make_conversation(rng: random.Random) -> dict:
    name = rng.choice(sorted(_OPS))
    word, fn = _OPS[name]
    a, b = rng.randrange(10), rng.randrange(10)
    result = fn(a, b)
    messages = [
        {"role": "user", "content": f"{a} {word} {b}?"},
        # Arguments as a JSON string, as OpenAI-style data stores them (parquet would otherwise merge the
        # argument structs of all rows into one schema).
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})}}]},
        {"role": "tool", "content": str(result)},
        {"role": "assistant", "content": f"It is {result}."},
    ]
    return {"messages": messages, "tools": json.dumps(TOOLS), "enable_thinking": False}


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_conversation(rng) for _ in range(n)]


def _build_data(d) -> None:
    import pandas as pd

    pd.DataFrame(make_rows(512, seed=0)).to_parquet(d / "train.parquet")
    pd.DataFrame(make_rows(32, seed=1)).to_parquet(d / "val.parquet")


def ensure_sft_assets() -> dict[str, str]:
    data = _build_atomically(demo_root() / f"{TASK}_{TASK_VERSION}", _build_data)
    return {"model": ensure_assets()["model"], "train": str(data / "train.parquet"), "val": str(data / "val.parquet")}


_DRY_RUN = False  # set by dry_run(): `--cfg job` shows the config without building the assets


@contextlib.contextmanager
def dry_run():
    """Within: the demo's asset paths resolve to a placeholder instead of being built (a dry run builds nothing)."""
    global _DRY_RUN
    before, _DRY_RUN = _DRY_RUN, True
    try:
        yield
    finally:
        _DRY_RUN = before


def _resolve(name: str) -> str:
    if name == "device":  # the demo runs on whatever this host has
        from verl.utils.device import get_device_name

        return get_device_name()
    if _DRY_RUN:
        return f"<demo {name}: built into $VERL_DEMO_DIR on the first run>"
    assets = ensure_sft_assets()
    if name not in assets:
        raise ValueError(f"${{verl_sft_demo:{name}}} is not an SFT demo asset; use one of {sorted(assets)}")
    return assets[name]


def register_resolver() -> None:
    if not OmegaConf.has_resolver("verl_sft_demo"):
        OmegaConf.register_new_resolver("verl_sft_demo", _resolve)

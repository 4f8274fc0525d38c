"""The embedded demo: a tiny Qwen3.5 and the "letter echo" task, built once into a cache directory.

Task: the prompt names a letter ("Repeat: c"); the reward is the fraction of the first four response
characters equal to it (``verl.utils.reward_score.letter_echo``). A random tiny model scores ~0; copying a
prompt token is something GRPO teaches a 4-layer hybrid model within a few dozen CPU steps (the greedy
validation score reaches 1.0 by step 60 on this machine).

Config values ``${verl_demo:model}``, ``${verl_demo:train}`` and ``${verl_demo:test}`` resolve to the
built assets, so ``python -m verl.trainer.main_ppo`` needs no downloads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

DEMO_VERSION = "v3"
LETTERS = "ab"
TASK = "letter_echo"


def demo_root() -> Path:
    base = os.environ.get("VERL_DEMO_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "verl", "demo")
    return Path(base) / DEMO_VERSION


def _build_atomically(target: Path, build) -> Path:
    """Build into a temp dir and rename, so concurrent runs never see a half-written asset."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def make_rows(n: int, seed: int, split: str) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        letter = rng.choice(LETTERS)
        rows.append({
            "data_source": TASK,
            "prompt": [{"role": "user", "content": f"Repeat: {letter}"}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": letter},
            "extra_info": {"split": split, "index": i},
        })
    return rows


def _build_data(d: Path) -> None:
    import pandas as pd

    pd.DataFrame(make_rows(256, seed=0, split="train")).to_parquet(d / "train.parquet")
    pd.DataFrame(make_rows(32, seed=1, split="test")).to_parquet(d / "test.parquet")


def _build_model(d: Path) -> None:
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    # A wider init than HF's 0.02 gives the tied embedding / LM head enough scale that a policy (or a LoRA
    # adapter on the frozen base) can move the output distribution far within a few dozen steps.
    build_tiny_qwen3_5(d, kind="dense", seed=0, initializer_range=0.1)


def ensure_assets() -> dict[str, str]:
    root = demo_root()
    model = _build_atomically(root / "tiny-qwen3_5", _build_model)
    data = _build_atomically(root / TASK, _build_data)
    return {"model": str(model), "train": str(data / "train.parquet"), "test": str(data / "test.parquet")}


def _resolve(name: str) -> str:
    assets = ensure_assets()
    if name not in assets:
        raise ValueError(f"${{verl_demo:{name}}} is not a demo asset; use one of {sorted(assets)}")
    return assets[name]


def register_resolver() -> None:
    if not OmegaConf.has_resolver("verl_demo"):
        OmegaConf.register_new_resolver("verl_demo", _resolve)

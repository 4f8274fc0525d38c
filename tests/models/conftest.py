"""Fixtures for the model tests: tiny fp32 Qwen3.5 models (built once per module), one CPU thread."""

import pytest
import torch

from verl.models.qwen3_5.tiny import build_tiny_qwen3_5


@pytest.fixture(autouse=True)
def _few_threads():
    # The CPU is shared with other jobs; one thread keeps timings stable.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_models():
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = build_tiny_qwen3_5(None, kind=kind, seed=0, with_tokenizer=False)
        return cache[kind]

    return get

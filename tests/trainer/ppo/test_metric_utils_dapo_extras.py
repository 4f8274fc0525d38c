"""Where the DAPO manager's overlong extras show up, as recipe/dapo/README.md tells users to look for them.

Upstream verl turns reward extras into metrics at validation only (training steps log the GDPO keys and
nothing else from the extras); this project does the same. The README names
``val-aux/<data_source>/overlong/mean@N`` and ``.../overlong_reward/mean@N``; this test builds those names the
way the trainer's validation does (the manager's extras through process/flatten_validation_metrics) and
checks both that they exist with the right values and that the README still names them.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from verl import DataProto
from verl.models.tiny import build_tiny_tokenizer
from verl.trainer.ppo.metric_utils import flatten_validation_metrics, process_validation_metrics
from verl.workers.reward_manager import DAPORewardManager

README = Path(__file__).resolve().parents[3] / "recipe" / "dapo" / "README.md"


def _batch(lengths, resp_len=10):
    b = len(lengths)
    mask = torch.zeros(b, 2 + resp_len, dtype=torch.long)
    mask[:, :2] = 1
    for i, n in enumerate(lengths):
        mask[i, 2:2 + n] = 1
    nt = {"data_source": np.array(["src"] * b, dtype=object),
          "reward_model": np.array([{"ground_truth": "x"} for _ in range(b)], dtype=object)}
    return DataProto.from_dict({"prompts": torch.full((b, 2), 3), "responses": torch.full((b, resp_len), 4),
                                "attention_mask": mask}, non_tensors=nt)


def test_overlong_extras_become_the_validation_metrics_the_readme_names():
    manager = DAPORewardManager(build_tiny_tokenizer(), 0, compute_score=lambda *a, **k: 1.0, max_resp_len=10,
                                overlong_buffer_cfg={"enable": True, "len": 4, "penalty_factor": 1.0, "log": True})
    # Two prompts, two responses each (val_kwargs.n = 2): lengths 3 and 8 for prompt a, 10 and 2 for prompt b.
    out = manager(_batch([3, 8, 10, 2]), return_dict=True)
    extras = out["reward_extra_info"]
    scores = out["reward_tensor"].sum(-1).tolist()
    metrics = flatten_validation_metrics(process_validation_metrics(
        ["src"] * 4, ["a", "a", "b", "b"], {"reward": scores, **extras}))
    # overlong: [F, T, T, F] -> per-prompt means 0.5 and 0.5; overlong_reward: [0, -0.5, -1, 0] -> -0.25, -0.5.
    assert metrics["val-aux/src/overlong/mean@2"] == pytest.approx(0.5)
    assert metrics["val-aux/src/overlong_reward/mean@2"] == pytest.approx(-0.375)
    text = README.read_text()
    for name in ("val-aux/<data_source>/overlong/mean@N", "val-aux/<data_source>/overlong_reward/mean@N"):
        assert name in text, f"recipe/dapo/README.md no longer names {name}"

"""GRPO on the demo with a discriminative reward model (reward.reward_model.*): a tiny Qwen3.5
sequence-classification checkpoint with its own chat template scores every response; the scores are the
token-level rewards, reach the advantages, and equal a direct Hugging Face forward of the reward model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from tests.trainer.e2e_utils import REPO, demo_dir, run_main_ppo, train_records

RM_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
FAST = ["trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.total_training_steps=2"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.models.tiny import build_tiny_tokenizer

    d = tmp_path_factory.mktemp("rm") / "rm"
    build_tiny_qwen3_5(d, kind="seq_cls", seed=3, with_tokenizer=False)
    build_tiny_tokenizer(d, chat_template=RM_TEMPLATE)
    return d


def _rm_keys(rm_dir) -> list[str]:
    return ["reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir}",
            "reward.reward_model.rollout.name=hf", "reward.reward_model.rollout.max_num_batched_tokens=256"]


def test_grpo_with_reward_model_scores_equal_hf_forward(tmp_path, rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "records.json"
    env = dict(os.environ, VERL_DEMO_DIR=demo_dir(), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, str(REPO / "tests/trainer/rm_e2e_driver.py"), str(out), "--config-name", "demo",
           f"trainer.default_local_dir={tmp_path / 'ckpt'}", "trainer.logger=[console]", *FAST, *_rm_keys(rm_dir)]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = json.loads(out.read_text())["records"]
    assert sorted({r["step"] for r in records}) == [1, 2] and len(records) == 2 * 4 * 4

    # The policy is the demo model; its tokenizer decodes the responses (run_ppo resolved the demo's path).
    from verl.trainer.main_ppo import load_config

    cfg = load_config(["--config-name", "demo"])
    policy_tok = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    rm_tok = AutoTokenizer.from_pretrained(str(rm_dir))
    hf = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), dtype=torch.float32).eval()
    for r in records:
        text = policy_tok.decode(r["response_ids"]).replace(policy_tok.eos_token, "")
        chat = r["raw_prompt"] + [{"role": "assistant", "content": text}]
        ids = torch.tensor([rm_tok(rm_tok.apply_chat_template(chat, tokenize=False))["input_ids"]])
        with torch.no_grad():
            want = hf(input_ids=ids).logits[0, -1].item()
        last = len(r["response_ids"]) - 1
        # The RM score, on the last response token, is the token-level reward (bf16 compute on accelerators;
        # fp32 on the CPU here).
        assert r["rm_scores"][last] == pytest.approx(want, abs=1e-3)
        assert r["token_level_scores"] == r["rm_scores"]
    # GRPO: within a group the advantages follow the RM scores (the higher score, the higher advantage).
    groups = defaultdict(list)
    for r in records:
        groups[(r["step"], r["uid"])].append((sum(r["rm_scores"]), r["advantages"][0]))
    spread = 0
    for members in groups.values():
        members.sort()
        advs = [a for _, a in members]
        assert advs == sorted(advs)
        spread += advs[-1] - advs[0] > 1e-3
    assert spread > 0  # some group's responses scored differently and moved the advantages


def test_reward_model_logs_score_and_generative_route_needs_a_causal_lm(tmp_path, rm_dir):
    # Upstream's legacy spellings (top-level reward_model.*) are read as reward.reward_model.*.
    legacy = ["reward_model.enable=true", f"reward_model.model.path={rm_dir}", "reward_model.rollout.name=hf"]
    proc, rec = run_main_ppo(tmp_path / "ok", FAST + legacy)
    assert "reward.reward_model.model_path" in proc.stderr + proc.stdout  # the deprecation note names the new key
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    # Through the CLI too (the parity itself is checked above): finite scores reach the logged metrics.
    assert all(abs(s["critic/score/mean"]) < 1e6 and s["critic/advantages/max"] > 0 for s in steps.values())
    # A custom function with the reward model is upstream's generative route (tests/trainer/test_genrm_e2e.py):
    # a sequence-classification checkpoint cannot be its judge, and is refused by name.
    proc, _ = run_main_ppo(tmp_path / "genrm", FAST + _rm_keys(rm_dir) + [
        "reward.custom_reward_function.path=pkg://verl.utils.reward_score.genrm"], check=False)
    assert proc.returncode != 0 and "needs a causal LM judge" in proc.stderr

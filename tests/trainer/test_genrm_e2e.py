"""GRPO with a generative reward model (upstream's GenRM route): the tiny Qwen3.5 judges its own responses.

``reward.reward_model.enable`` with a causal-LM ``model_path`` and ``reward.custom_reward_function.path`` pointing at
the built-in GenRM scorer: every response is put into the prompt template, the judge generates a verdict through
the built-in rollout (greedy here, so the test can regenerate it with Hugging Face), the parser turns it into the
reward, and the router's and parser's counters are logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer.e2e_utils import REPO, demo_dir

FAST = ["trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.total_training_steps=2"]
TEMPLATE = "Q: {problem}\nA: {solution}\nScore {score_min}-{score_max}:"
MAX_TOKENS = 1
DEFAULT_SCORE = -1.0
KWARGS = "reward.custom_reward_function.reward_kwargs"  # bound to the scorer: its template and options


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import pandas as pd

    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.trainer.demo import make_rows

    root = tmp_path_factory.mktemp("genrm")
    judge = build_tiny_qwen3_5(root / "judge", kind="dense", seed=7, tie_word_embeddings=False)
    # A random judge's greedy verdicts are all alike (the same unparsable character). Give its LM head two live
    # rows, "7" and "a", along opposite directions across which the judge's last hidden states spread: the verdict
    # is "7" (a valid score) or "a" (no verdict) by the side a response falls on, so the rewards differ.
    import random

    from transformers import AutoTokenizer

    from verl.utils.reward_score.genrm import render_prompt

    tok = AutoTokenizer.from_pretrained(str(root / "judge"))
    rng, states = random.Random(0), []
    head = judge.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, inp, out: states.append(inp[0][0, -1].detach()))
    for _ in range(32):
        answer = "".join(rng.choice("ABCDEFGH \n") for _ in range(rng.randint(1, 12)))
        text = tok.apply_chat_template([{"role": "user", "content": render_prompt(TEMPLATE, "Repeat: A", answer)}],
                                       add_generation_prompt=True, tokenize=False)
        with torch.no_grad():
            judge(input_ids=torch.tensor([tok(text, add_special_tokens=False)["input_ids"]]))
    hook.remove()
    h = torch.stack(states)
    mean = h.mean(0)
    spread = torch.linalg.svd(h - mean, full_matrices=False).Vh[0]
    direction = spread - (spread @ mean) / (mean @ mean) * mean  # orthogonal to the common part
    with torch.no_grad():
        head.weight.zero_()
        head.weight[tok.convert_tokens_to_ids("7")] = direction
        head.weight[tok.convert_tokens_to_ids("a")] = -direction
    judge.save_pretrained(str(root / "judge"))
    for split, n, seed in (("train", 64, 0), ("test", 8, 1)):
        rows = make_rows(n, seed=seed, split=split)
        for r in rows:  # upstream's preprocessing keeps the question in extra_info, where the GenRM scorer reads it
            r["extra_info"]["question"] = r["prompt"][0]["content"]
        pd.DataFrame(rows).to_parquet(root / f"{split}.parquet")
    return root


def _genrm_keys(root) -> list[str]:
    return [f"data.train_files={root / 'train.parquet'}", f"data.val_files={root / 'test.parquet'}",
            "reward.reward_model.enable=true", f"reward.reward_model.model_path={root / 'judge'}",
            "reward.reward_model.rollout.name=hf", "reward.reward_model.rollout.do_sample=false",
            "reward.custom_reward_function.path=pkg://verl.utils.reward_score.genrm",
            "reward.custom_reward_function.name=compute_score",
            f"+{KWARGS}.template='{TEMPLATE}'", f"+{KWARGS}.max_tokens={MAX_TOKENS}",
            f"+{KWARGS}.default_score={DEFAULT_SCORE}"]


def test_grpo_rewards_are_the_judges_parsed_verdicts(tmp_path, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.utils.reward_score.genrm import parse_verdict, render_prompt

    out, log = tmp_path / "records.json", tmp_path / "metrics.jsonl"
    env = dict(os.environ, VERL_DEMO_DIR=demo_dir(), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               VERL_FILE_LOGGER_PATH=str(log), PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, str(REPO / "tests/trainer/rm_e2e_driver.py"), str(out), "--config-name", "demo",
           f"trainer.default_local_dir={tmp_path / 'ckpt'}", "trainer.logger=[console,file]", *FAST,
           *_genrm_keys(assets), "trainer.test_freq=2", "data.val_batch_size=4"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = json.loads(out.read_text())["records"]
    assert sorted({r["step"] for r in records}) == [1, 2] and len(records) == 2 * 4 * 4

    from verl.trainer.main_ppo import load_config

    policy_tok = AutoTokenizer.from_pretrained(load_config(["--config-name", "demo"]).actor_rollout_ref.model.path)
    judge_tok = AutoTokenizer.from_pretrained(str(assets / "judge"))
    judge = AutoModelForCausalLM.from_pretrained(str(assets / "judge"), dtype=torch.float32).eval()
    statuses = []
    for r in records:
        solution = policy_tok.decode(r["response_ids"], skip_special_tokens=True)
        prompt = render_prompt(TEMPLATE, r["raw_prompt"][0]["content"], solution, "", 1, 10)
        text = judge_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = torch.tensor([judge_tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():  # the judge's greedy verdict, regenerated outside the trainer
            gen = judge.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=judge_tok.eos_token_id, pad_token_id=judge_tok.pad_token_id)
        want = judge_tok.decode(gen[0, ids.size(1):], skip_special_tokens=True)
        assert r["genrm_response"] == want  # the judge saw this template and generated this verdict
        verdict = parse_verdict(want, 1, 10)
        assert r["genrm_verdict"] == verdict.status
        score = verdict.score if verdict.status == "ok" else DEFAULT_SCORE
        last = len(r["response_ids"]) - 1
        assert r["token_level_scores"][last] == pytest.approx(score)  # the parsed verdict is the reward
        assert sum(r["token_level_scores"]) == pytest.approx(score)
        statuses.append((r["step"], verdict.status))
    assert {v for _, v in statuses} == {"ok", "missing"}  # both kinds of verdict reached the reward

    steps, val = {}, {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if "reward/genrm/requests" in rec["data"]:
            steps[rec["step"]] = rec["data"]
        val.update({k: v for k, v in rec["data"].items() if k.startswith("val-aux/genrm/")})
    # Validation after step 2 was judged too (its 8 prompts, one response each), counted apart from training.
    assert sum(val[f"val-aux/genrm/verdict_{s}"] for s in ("ok", "missing", "malformed", "out_of_range")) == 8
    assert sorted(steps) == [1, 2]
    for step, m in steps.items():
        assert m["reward/genrm/requests"] == 16  # one judge request per response, batched by the router
        assert m["reward/genrm/generate_calls"] >= 1
        for status in ("ok", "missing", "malformed", "out_of_range"):
            assert m[f"reward/genrm/verdict_{status}"] == sum(1 for s, v in statuses if s == step and v == status)


def test_upstream_legacy_genrm_command_runs(tmp_path, assets):
    # Upstream's GenRM test spells the keys the old way (reward_model.*, custom_reward_function.*) and uses the dapo
    # manager; through the CLI, with the built-in scorer's defaults (its template, 0.0 for unusable verdicts) and
    # the judge's max_tokens from reward_model.rollout.response_length.
    from tests.trainer.e2e_utils import run_main_ppo, train_records

    legacy = [f"data.train_files={assets / 'train.parquet'}", f"data.val_files={assets / 'test.parquet'}",
              "reward_model.enable=True", f"reward_model.model.path={assets / 'judge'}", "reward_model.rollout.name=hf",
              "reward_model.rollout.response_length=2", "reward_model.reward_manager=dapo",
              "custom_reward_function.path=pkg://verl.utils.reward_score.genrm",
              "custom_reward_function.name=compute_score"]
    proc, rec = run_main_ppo(tmp_path / "legacy", FAST + legacy)
    assert "reward.reward_model.model_path" in proc.stderr + proc.stdout  # the deprecation note names the new key
    steps = {r["step"]: r["data"] for r in rec if "reward/genrm/requests" in r["data"]}
    assert sorted(steps) == [1, 2] and sorted(train_records(rec)) == [1, 2]
    for m in steps.values():
        assert m["reward/genrm/requests"] == 16
        assert sum(m[f"reward/genrm/verdict_{s}"] for s in ("ok", "missing", "malformed", "out_of_range")) == 16
        assert m["reward/genrm/completion_tokens_mean"] <= 2


def test_genrm_refusals(tmp_path, assets):
    # (A sequence-classification judge is refused in tests/trainer/test_reward_model_e2e.py.)
    from tests.trainer.e2e_utils import run_main_ppo

    proc, _ = run_main_ppo(tmp_path / "pool", FAST + _genrm_keys(assets) + [
        "reward.reward_model.enable_resource_pool=true"], check=False)
    assert proc.returncode != 0 and "reward.reward_model.enable_resource_pool" in proc.stderr
    proc, _ = run_main_ppo(tmp_path / "remax", FAST + _genrm_keys(assets) + ["algorithm.adv_estimator=remax"],
                           check=False)
    assert proc.returncode != 0 and "algorithm.adv_estimator" in proc.stderr

"""The controller-side keys of ``main_ppo`` (``trainer.*``, the data order, the advantage and reward keys, the
rollout counts) change what the training loop does.

``run_ppo`` runs for real on the embedded demo (config composition and validation, tokenizer, datasets,
reward manager, RayPPOTrainer, tracker, reward curve), with the worker groups replaced by in-process
stand-ins that answer like the real ones (responses built with the real batching helper, log-probs,
values) and record what the controller sent them. No model is trained, so a run takes seconds; what the
workers do with their own keys is tested with the workers. The key names are spelled out so
key_status.txt can point here.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from verl.protocol import DataProto


class FakeActorRollout:
    """Answers generate / log-prob / update calls; responses alternate between the two demo letters, so
    rewards (and GRPO advantages) vary within every group."""

    world_size = 1

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.letters = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab"]
        self.generate, self.updates, self.saved, self.loaded = [], [], [], []

    def init_model(self):
        return [True]

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        from verl.workers.rollout.base import GenerationOutput
        from verl.workers.rollout.batching import outputs_to_batch

        self.generate.append({"n": len(prompts), "meta": dict(prompts.meta_info),
                              "non_tensor": sorted(prompts.non_tensor_batch)})
        length = self.cfg.actor_rollout_ref.rollout.response_length
        outs = [[GenerationOutput(token_ids=[self.letters[i % 2]] * 4, log_probs=None, finish_reason="stop")]
                for i in range(len(prompts))]
        out = outputs_to_batch(prompts, outs, length, self.tok.pad_token_id)
        out.meta_info = {}
        return out

    def compute_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"old_log_probs": -torch.ones_like(data.batch["responses"], dtype=torch.float32)})

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"ref_log_prob": -2 * torch.ones_like(data.batch["responses"],
                                                                                 dtype=torch.float32)})

    def update_actor(self, data: DataProto):
        self.updates.append({"advantages": data.batch["advantages"].clone(), "meta": dict(data.meta_info),
                             "rewards": data.batch["token_level_rewards"].clone(),
                             "scores": data.batch["token_level_scores"].clone(),
                             "index": [e["index"] for e in data.non_tensor_batch["extra_info"]]})
        return [{"actor/pg_loss": 0.0}]

    def save_checkpoint(self, path, global_step=0):
        os.makedirs(path, exist_ok=True)
        self.saved.append((path, global_step))

    def load_checkpoint(self, path):
        self.loaded.append(path)


class FakeCritic:
    world_size = 1

    def __init__(self):
        self.updates, self.saved = [], []

    def init_model(self):
        return [True]

    def compute_values(self, data: DataProto) -> DataProto:
        r = data.batch["responses"].size(1)
        return DataProto.from_dict(tensors={"values": torch.linspace(0.1, 0.5, r).repeat(len(data), 1)})

    def update_critic(self, data: DataProto):
        self.updates.append(len(data))
        return [{"critic/vf_loss": 0.0}]

    def save_checkpoint(self, path, global_step=0):
        os.makedirs(path, exist_ok=True)
        self.saved.append(global_step)

    def load_checkpoint(self, path):
        pass


@pytest.fixture
def run(tmp_path, monkeypatch):
    """``run(*overrides)`` -> (result, fakes, cfg) for ``main_ppo`` on the demo with the fakes as workers."""
    from verl.trainer import main_ppo
    from verl.utils.tokenizer import load_tokenizer_and_processor

    demo = os.environ.get("VERL_TEST_DEMO_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "verl-test-demo")
    monkeypatch.setenv("VERL_DEMO_DIR", demo)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "logs"))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    fakes = {}

    def launch(cfg, specs):
        tok, _ = load_tokenizer_and_processor(cfg.actor_rollout_ref.model)
        fakes["actor_rollout"] = FakeActorRollout(cfg, tok)
        if "critic" in specs:
            fakes["critic"] = FakeCritic()
        return dict(fakes)

    monkeypatch.setattr(main_ppo, "launch_workers", launch)

    def _run(*overrides, base=("trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.logger=[console]")):
        cfg = main_ppo.load_config([*base, f"trainer.default_local_dir={tmp_path / 'ckpt'}", *overrides])
        fakes.clear()
        result = main_ppo.run_ppo(cfg)
        return result, dict(fakes), cfg

    return _run


# ------------------------------------------------------------------------------------------ trainer.*
def test_total_epochs_sets_the_number_of_steps(run):
    # 256 training prompts, 64 per step: 4 steps an epoch
    _, fakes, cfg = run("trainer.total_training_steps=null", "trainer.total_epochs=2", "data.train_batch_size=64",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=64", "trainer.val_before_train=false")
    assert len(fakes["actor_rollout"].updates) == 8
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps == 8  # what the LR schedule is told


def test_val_only_validates_and_stops(run):
    result, fakes, _ = run("trainer.val_only=true")
    ar = fakes["actor_rollout"]
    assert ar.updates == [] and all(g["meta"].get("validate") for g in ar.generate)
    assert any(k.startswith("val-core/") for k in result)


def test_critic_warmup_trains_only_the_critic_first(run):
    _, fakes, _ = run("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=8", "trainer.critic_warmup=2", "trainer.total_training_steps=3",
                      "trainer.val_before_train=false")
    assert len(fakes["critic"].updates) == 3 and len(fakes["actor_rollout"].updates) == 1


def test_val_batch_size_splits_validation(run):
    _, fakes, _ = run("data.val_batch_size=8", "trainer.total_training_steps=1")
    val = [g for g in fakes["actor_rollout"].generate if g["meta"].get("validate")]
    assert [g["n"] for g in val] == [8, 8, 8, 8]  # the 32 validation prompts, 8 at a time (val_kwargs.n=1)
    _, fakes, _ = run("trainer.total_training_steps=1")
    assert [g["n"] for g in fakes["actor_rollout"].generate if g["meta"].get("validate")] == [32]


def test_resume_from_path(run, tmp_path):
    _, fakes, _ = run("trainer.save_freq=2", "trainer.val_before_train=false")
    assert fakes["actor_rollout"].saved[-1][1] == 2
    step2 = tmp_path / "ckpt" / "global_step_2"
    _, fakes, _ = run("trainer.resume_mode=resume_path", f"trainer.resume_from_path={step2}",
                      "trainer.total_training_steps=3", "trainer.val_before_train=false",
                      f"trainer.default_local_dir={tmp_path / 'elsewhere'}")
    assert fakes["actor_rollout"].loaded == [str(step2 / "actor")]
    assert len(fakes["actor_rollout"].updates) == 1  # steps 1-2 are restored, step 3 runs


def test_project_experiment_logger_and_default_local_dir(run, tmp_path):
    run("trainer.project_name=proj", "trainer.experiment_name=exp1", "trainer.logger=[console,file]",
        f"trainer.default_local_dir={tmp_path / 'out'}", "trainer.val_before_train=false", base=(
            "trainer.total_training_steps=2", "trainer.test_freq=-1"))
    log = tmp_path / "logs" / "proj" / "exp1.jsonl"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    # The curve goes to this run's directory below the checkpoints (issue 25).
    assert [p.name for p in (tmp_path / "out" / "runs").glob("*/reward_curve.png")] == ["reward_curve.png"]
    run("trainer.project_name=proj", "trainer.experiment_name=exp2", "trainer.logger=[console]",
        "trainer.val_before_train=false")
    assert not (tmp_path / "logs" / "proj" / "exp2.jsonl").exists()  # no file logger, no file


# ------------------------------------------------------------------------------------------ data order
def _order(fakes):
    return [i for u in fakes["actor_rollout"].updates for i in u["index"][::8]]  # one per prompt (n=8)


def test_data_seed_and_shuffle_choose_the_prompt_order(run):
    _, a, _ = run("data.seed=1", "trainer.val_before_train=false")
    _, b, _ = run("data.seed=2", "trainer.val_before_train=false")
    _, c, _ = run("data.shuffle=false", "trainer.val_before_train=false")
    assert _order(a) != _order(b)
    assert _order(c) == list(range(32))  # two steps of 16 prompts, in file order


# ------------------------------------------------------------------------------------------ rollout counts
def test_rollout_n_and_val_kwargs(run):
    _, fakes, _ = run("actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                      "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                      "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                      "actor_rollout_ref.rollout.temperature=0.7", "trainer.total_training_steps=1")
    gens = fakes["actor_rollout"].generate
    val, train = [g for g in gens if g["meta"].get("validate")], [g for g in gens if not g["meta"].get("validate")]
    assert [g["n"] for g in val] == [64] and val[0]["meta"]["do_sample"] is True
    assert [g["n"] for g in train] == [64]  # 16 prompts x rollout.n
    assert fakes["actor_rollout"].updates[0]["meta"]["temperature"] == 0.7


# ------------------------------------------------------------------------------------------ advantages
def _gae(rewards, values, gamma, lam):
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.size(0))
    for t in reversed(range(rewards.size(1))):
        nxt = values[:, t + 1] if t + 1 < rewards.size(1) else torch.zeros(rewards.size(0))
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.5, 0.8)])
def test_gamma_and_lam_shape_the_gae_advantages(run, gamma, lam):
    _, fakes, _ = run("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=8", f"algorithm.gamma={gamma}", f"algorithm.lam={lam}",
                      "trainer.total_training_steps=1", "trainer.val_before_train=false")
    u = fakes["actor_rollout"].updates[0]
    r = u["rewards"]
    values = torch.linspace(0.1, 0.5, r.size(1)).repeat(r.size(0), 1)
    # responses are 4 tokens long in a 6-token window: the mask zeroes the last two positions
    mask = torch.zeros_like(r)
    mask[:, :4] = 1
    expected = _gae(r * mask, values * mask, gamma, lam)
    mean, std = expected[mask.bool()].mean(), expected[mask.bool()].std()
    torch.testing.assert_close(u["advantages"] * mask, ((expected - mean) / (std + 1e-8)) * mask, atol=1e-4, rtol=1e-4)


def test_kl_in_reward_keys(run, tmp_path):
    base = ["algorithm.use_kl_in_reward=true", "trainer.val_before_train=false", "trainer.logger=[console,file]",
            "trainer.project_name=p", "trainer.experiment_name=kl"]
    # policy log-probs -1, reference -2 (the fakes): the "kl" (k1) estimate is 1 per token, "mse" 0.5
    for penalty, per_token in (("kl", 1.0), ("mse", 0.5)):
        _, fakes, _ = run(*base, f"algorithm.kl_penalty={penalty}", "algorithm.kl_ctrl.kl_coef=0.25")
        u = fakes["actor_rollout"].updates[0]
        mask = torch.zeros_like(u["scores"])
        mask[:, :4] = 1  # 4 response tokens of a 6-token window
        torch.testing.assert_close(u["rewards"], u["scores"] - 0.25 * per_token * mask)
    log = tmp_path / "logs" / "p" / "kl.jsonl"

    def coefs(*extra):
        if log.exists():
            log.unlink()
        run(*base, "algorithm.kl_ctrl.kl_coef=0.25", "trainer.total_training_steps=3", *extra)
        return [json.loads(line)["data"]["actor/reward_kl_penalty_coeff"] for line in log.read_text().splitlines()]

    assert coefs() == [0.25, 0.25, 0.25]  # fixed
    # adaptive: KL 1 against target 0.1 is clipped to +20%, scaled by 128 responses / horizon per step
    adaptive = coefs("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1", "algorithm.kl_ctrl.horizon=10")
    assert adaptive == pytest.approx([0.25, 0.25 * (1 + 0.2 * 12.8), 0.25 * (1 + 0.2 * 12.8) ** 2])
    slow = coefs("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1", "algorithm.kl_ctrl.horizon=1000")
    assert slow[1] == pytest.approx(0.25 * (1 + 0.2 * 0.128))
    # a target above the observed KL shrinks it
    above = coefs("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=2.0", "algorithm.kl_ctrl.horizon=1000")
    assert above[1] == pytest.approx(0.25 * (1 - 0.2 * 0.128))


# ------------------------------------------------------------------------------------------ reward
SCORER = "def my_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return {value}\n"


def _mean_train_reward(fakes):
    return float(fakes["actor_rollout"].updates[0]["rewards"].sum(-1).mean())


@pytest.mark.parametrize("prefix", ["reward.custom_reward_function", "custom_reward_function"])
def test_custom_reward_function_path_and_name(run, tmp_path, prefix):
    f = tmp_path / "score.py"
    f.write_text(SCORER.format(value=0.375))
    _, fakes, _ = run(f"{prefix}.path={f}", f"{prefix}.name=my_score", "trainer.total_training_steps=1",
                      "trainer.val_before_train=false")
    assert _mean_train_reward(fakes) == pytest.approx(0.375)


def test_reward_custom_reward_function_keys_spelled_out(run, tmp_path):
    f = tmp_path / "score2.py"
    f.write_text(SCORER.format(value=0.625))
    _, fakes, _ = run(f"reward.custom_reward_function.path={f}", "reward.custom_reward_function.name=my_score",
                      "trainer.total_training_steps=1", "trainer.val_before_train=false")
    assert _mean_train_reward(fakes) == pytest.approx(0.625)
    _, fakes, _ = run(f"custom_reward_function.path={f}", "custom_reward_function.name=my_score",
                      "trainer.total_training_steps=1", "trainer.val_before_train=false")
    assert _mean_train_reward(fakes) == pytest.approx(0.625)


def test_reward_manager_from_a_module(run, tmp_path):
    f = tmp_path / "my_manager.py"
    f.write_text(
        "import torch\n"
        "class HalfManager:\n"
        "    def __init__(self, tokenizer, num_examine, compute_score, reward_fn_key, scale=1.0, **kw):\n"
        "        self.scale = scale\n"
        "    def __call__(self, data, return_dict=False):\n"
        "        r = torch.zeros_like(data.batch['responses'], dtype=torch.float32)\n"
        "        r[:, 0] = 0.5 * self.scale\n"
        "        return {'reward_tensor': r, 'reward_extra_info': {}} if return_dict else r\n")
    _, fakes, _ = run("reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={f}",
                      "reward.reward_manager.name=HalfManager", "trainer.total_training_steps=1",
                      "trainer.val_before_train=false")
    assert _mean_train_reward(fakes) == pytest.approx(0.5)
    # reward.reward_kwargs go to the manager's constructor
    _, fakes, _ = run("reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={f}",
                      "reward.reward_manager.name=HalfManager", "+reward.reward_kwargs.scale=0.5",
                      "trainer.total_training_steps=1", "trainer.val_before_train=false")
    assert _mean_train_reward(fakes) == pytest.approx(0.25)


def test_default_rewards_are_the_letter_echo_scores(run):
    _, fakes, _ = run("trainer.total_training_steps=1", "trainer.val_before_train=false")
    sums = fakes["actor_rollout"].updates[0]["rewards"].sum(-1)
    assert set(np.round(sums.numpy(), 3)) <= {0.0, 1.0} and 0 < float(sums.mean()) < 1


def test_a_save_step_times_the_save_inside_the_step(run, monkeypatch):
    """Upstream times trainer.save_freq's checkpoint save inside ``timing_s/step`` (and so in perf/time_per_step
    and perf/throughput); a step without a save does not include one."""
    import time

    slow = FakeActorRollout.save_checkpoint

    def save(self, path, global_step=0):
        time.sleep(0.4)
        slow(self, path, global_step)

    monkeypatch.setattr(FakeActorRollout, "save_checkpoint", save)
    result, _, _ = run("trainer.save_freq=2", "trainer.val_before_train=false")
    first, second = result["history"]
    assert "timing_s/save_checkpoint" not in first
    save_s = second["timing_s/save_checkpoint"]
    assert save_s >= 0.4
    assert second["timing_s/step"] >= save_s + second["timing_s/gen"]
    assert second["perf/time_per_step"] == second["timing_s/step"]
    assert second["perf/throughput"] == pytest.approx(second["perf/total_num_tokens"] / second["timing_s/step"])


def test_the_weight_sync_is_its_own_phase(run, monkeypatch):
    """The workers sync weights at the start of generate_sequences (when they changed); the trainer reports that
    as upstream's ``timing_s/update_weights`` (the slowest rank's) and keeps it out of ``timing_s/gen``."""
    import time

    plain = FakeActorRollout.generate_sequences

    def generate(self, prompts):
        time.sleep(0.3)  # stands for the sync the worker reports below
        out = plain(self, prompts)
        out.meta_info["metrics"] = [{"timing_s/update_weights": 0.3}, {"timing_s/update_weights": 0.1}]
        return out

    monkeypatch.setattr(FakeActorRollout, "generate_sequences", generate)
    result, _, _ = run("trainer.val_before_train=false")
    for step in result["history"]:
        assert step["timing_s/update_weights"] == 0.3
        assert step["timing_s/gen"] < 0.2  # the 0.3 s went to update_weights


def test_no_sync_no_weight_sync_phase(run):
    result, _, _ = run("trainer.val_before_train=false")
    assert all("timing_s/update_weights" not in step for step in result["history"])

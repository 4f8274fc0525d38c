"""The batch-size keys of the actor, rollout, reference and critic sections reach the engine calls.

A role (PPOActor, PPOCritic, the actor/rollout/ref worker) turns its section into per-call settings: how many
rows per optimizer step, per micro-batch, whether micro-batches are balanced by a token budget, how many PPO
epochs. Here the roles run on a recording engine (the FSDP and Megatron engines' handling of those settings
is tested with the engines), over sections composed with the key changed. The key names are spelled out so
key_status.txt can point here.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from verl.protocol import DataProto
from verl.single_controller.dp_layout import DataParallelLayout
from verl.trainer.config.checks import compose_config


class RecordingEngine:
    def __init__(self):
        self.calls = []

    def infer_batch(self, data, outputs=("log_probs",)):
        self.calls.append(("infer", len(data), dict(data.meta_info)))
        n, length = data.batch["input_ids"].shape
        return {k: torch.zeros(n, length) for k in outputs}

    def train_batch(self, data, loss_fn, outputs=("log_probs",)):
        self.calls.append(("train", len(data), dict(data.meta_info)))
        return {"grad_norm": 0.0}


def _cfg(*overrides):
    cfg = compose_config("ppo_trainer", list(overrides), validate=False)
    OmegaConf.resolve(cfg)
    return cfg


def _data(n=8, prompt=3, response=4):
    ids = torch.randint(0, 50, (n, prompt + response))
    mask = torch.ones_like(ids)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                 "responses": ids[:, prompt:], "response_mask": mask[:, prompt:].float(),
                 "old_log_probs": torch.zeros(n, response), "advantages": torch.zeros(n, response),
                 "values": torch.zeros(n, response), "returns": torch.zeros(n, response)},
        meta_info={"temperature": 1.0})


# ------------------------------------------------------------------------------------------ actor update
def _update(*overrides):
    from verl.workers.actor.ppo_actor import PPOActor

    engine = RecordingEngine()
    PPOActor(_cfg(*overrides).actor_rollout_ref.actor, engine).update_policy(_data())
    return engine.calls


def test_actor_mini_batches_and_epochs():
    calls = _update("actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=3")
    assert [c[1] for c in calls] == [4, 4] * 3


def test_actor_micro_batch_and_dynamic_bsz_settings():
    (call, *_) = _update("actor_rollout_ref.actor.ppo_mini_batch_size=8",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert call[2]["micro_batch_size"] == 3 and call[2]["use_dynamic_bsz"] is False
    (call, *_) = _update("actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                         "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=123")
    assert call[2]["use_dynamic_bsz"] is True and call[2]["max_token_len"] == 123


# ------------------------------------------------------------------------------------------ the worker
def _worker(cfg, dp_size=2):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    w = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)  # the batch-size logic only, no model
    w.config, w._is_actor, w.dp_size = cfg.actor_rollout_ref, True, dp_size
    return w


def test_global_batch_sizes_become_per_rank_sizes():
    cfg = _cfg("actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
               "actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
               "actor_rollout_ref.rollout.log_prob_micro_batch_size=6",
               "actor_rollout_ref.ref.log_prob_micro_batch_size=10")
    w = _worker(cfg)
    w._normalize_batch_sizes()
    a = w.config
    assert a.actor.ppo_mini_batch_size == 8 * 4 // 2  # prompts x n responses over 2 ranks
    assert a.actor.ppo_micro_batch_size_per_gpu == 4
    assert a.rollout.log_prob_micro_batch_size_per_gpu == 3 and a.ref.log_prob_micro_batch_size_per_gpu == 5


def test_log_prob_micro_batches_of_the_rollout_and_the_reference():
    from verl.workers.actor.ppo_actor import PPOActor

    cfg = _cfg("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5",
               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=77")
    w = _worker(cfg)
    actor_engine, ref_engine = RecordingEngine(), RecordingEngine()
    w.actor = PPOActor(cfg.actor_rollout_ref.actor, actor_engine)
    w.ref_policy = PPOActor(cfg.actor_rollout_ref.ref, ref_engine)
    # what __init__ sets for the reference's call: its engine (no sequence-parallel group here) and one rank per
    # dispatched chunk
    w.ref_engine, w._dp_layout = ref_engine, DataParallelLayout.blocks(1)
    w.compute_log_prob(_data())
    w.compute_ref_log_prob(_data())
    (_, _, meta), = actor_engine.calls
    assert meta["micro_batch_size"] == 3 and meta["max_token_len"] == 77  # log_prob_max_token_len follows
    (_, _, meta), = ref_engine.calls
    assert meta["micro_batch_size"] == 5


# ------------------------------------------------------------------------------------------ critic
def _critic_calls(*overrides):
    from verl.workers.critic.ppo_critic import PPOCritic

    cfg = _cfg(*overrides).critic
    with open_dict(cfg):
        cfg.ppo_mini_batch_size = 8  # (normalised per rank by the critic worker)
    engine = RecordingEngine()
    critic = PPOCritic(cfg, engine)
    critic.compute_values(_data())
    critic.update_critic(_data())
    return engine.calls


def test_critic_micro_batch_keys():
    infer, train = _critic_calls("critic.ppo_micro_batch_size=6")
    assert infer[2]["micro_batch_size"] == 6 and train[2]["micro_batch_size"] == 6  # per_gpu follows it
    infer, train = _critic_calls("critic.ppo_micro_batch_size_per_gpu=2", "critic.forward_micro_batch_size_per_gpu=7")
    assert infer[2]["micro_batch_size"] == 7 and train[2]["micro_batch_size"] == 2
    infer, train = _critic_calls("critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=99",
                                 "critic.ppo_micro_batch_size_per_gpu=2")
    assert train[2]["use_dynamic_bsz"] is True and train[2]["max_token_len"] == 99
    assert infer[2]["max_token_len"] == 99  # forward_max_token_len_per_gpu follows


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.grad_clip", "critic.grad_clip"])
def test_legacy_grad_clip_is_the_engines_clip(key):
    from verl.workers.engine.fsdp.engine import FSDPEngine

    cfg = _cfg(f"{key}=0.25")
    section = OmegaConf.select(cfg, key.rsplit(".", 1)[0])
    engine = FSDPEngine({}, {}, section.optim, role="critic" if key.startswith("critic") else "actor",
                        role_config=section)
    assert engine._clip_grad() == 0.25


def test_calculate_entropy_asks_the_engine_for_entropy():
    from verl.workers.actor.ppo_actor import PPOActor

    class Engine(RecordingEngine):
        def train_batch(self, data, loss_fn, outputs=("log_probs",)):
            self.calls.append(outputs)
            return {"grad_norm": 0.0}

    def outputs(*overrides):
        engine = Engine()
        PPOActor(_cfg("actor_rollout_ref.actor.ppo_mini_batch_size=8", *overrides).actor_rollout_ref.actor,
                 engine).update_policy(_data())
        return engine.calls[0]

    assert "entropy" in outputs("actor_rollout_ref.actor.calculate_entropy=true")
    assert "entropy" not in outputs("actor_rollout_ref.actor.calculate_entropy=false")
    # a non-zero entropy bonus needs the entropy whatever calculate_entropy says
    assert "entropy" in outputs("actor_rollout_ref.actor.calculate_entropy=false", "actor_rollout_ref.actor.entropy_coeff=0.1")

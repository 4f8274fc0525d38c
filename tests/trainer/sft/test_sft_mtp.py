"""``model.mtp.*`` in the SFT trainer on a tiny Qwen3.5 with an MTP head: the MTP loss is logged under
upstream's name (``mtp_losses/mtp_1_loss``), the reported SFT loss stays the language-model loss, and the MTP
loss trains the main model only without ``model.mtp.detach_encoder`` and only with a non-zero
``model.mtp.mtp_loss_scaling_factor``. Refusals: ``model.mtp.enable_rollout`` in SFT (no rollout) and MTP on the
Megatron engine; for main_ppo, what ``actor_rollout_ref.model.mtp.enable_rollout`` (speculative decoding) needs.
The key names are spelled out so key_status.txt can point here."""

import math

import pytest

from tests.trainer.sft.test_sft_trainer import run_in_process

SMALL = ["--config-name=sft_demo", "data.train_max_samples=8", "data.train_batch_size=8",
         "data.micro_batch_size_per_gpu=4", "data.use_dynamic_bsz=false", "trainer.resume_mode=disable",
         "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.device=cpu",
         "optim.lr_warmup_steps=0",  # step 1 must update the weights for step 2 to show it
         "optim.clip_grad=1000000.0"]  # no clipping: the MTP head's gradient must not rescale the base update


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("sft_mtp")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0, mtp_num_hidden_layers=1)
    return str(path)


@pytest.mark.slow  # four SFT runs of two steps (~5 min on a shared 2-core CPU)
def test_sft_trains_with_the_mtp_loss(tmp_path, mtp_dir):
    def run(name, *keys):
        return run_in_process(tmp_path / name, [*SMALL, f"model.path={mtp_dir}", *keys])["history"]

    off = run("off", "model.mtp.enable=false")
    detached = run("detached", "model.mtp.enable=true", "model.mtp.enable_train=true", "model.mtp.detach_encoder=true",
                   "model.mtp.mtp_loss_scaling_factor=1.0")
    joint = run("joint", "model.mtp.enable=true", "model.mtp.enable_train=true", "model.mtp.detach_encoder=false",
                "model.mtp.mtp_loss_scaling_factor=1.0")
    zero = run("zero", "model.mtp.enable=true", "model.mtp.enable_train=true", "model.mtp.detach_encoder=false",
               "model.mtp.mtp_loss_scaling_factor=0.0")
    assert "mtp_losses/mtp_1_loss" not in off[0]
    for hist in (detached, joint, zero):
        assert all(math.isfinite(h["mtp_losses/mtp_1_loss"]) and h["mtp_losses/mtp_1_loss"] > 0 for h in hist)
        # step 1 runs on the checkpoint's weights: the same language-model loss whatever MTP does
        assert hist[0]["train/loss"] == pytest.approx(off[0]["train/loss"], rel=1e-6)
    # step 2 shows what step 1's update did to the main model
    assert detached[1]["train/loss"] == pytest.approx(off[1]["train/loss"], rel=1e-5)
    assert zero[1]["train/loss"] == pytest.approx(off[1]["train/loss"], rel=1e-5)
    assert joint[1]["train/loss"] != pytest.approx(off[1]["train/loss"], rel=1e-5)
    # the head itself learns from its loss: lower MTP loss at step 2 when it trains with factor 1 than with 0
    assert detached[1]["mtp_losses/mtp_1_loss"] < zero[1]["mtp_losses/mtp_1_loss"]


@pytest.mark.parametrize("overrides, message", [
    (["model.mtp.enable=true", "model.mtp.enable_rollout=true"], "`model.mtp.enable_rollout=true`: speculative"),
    (["engine=megatron", "model.mtp.enable=true"], "`model.mtp.enable=true` with strategy=megatron"),
    (["model.mtp.mtp_loss_scaling_factor=-1"], "`model.mtp.mtp_loss_scaling_factor=-1` must be a number >= 0"),
])
def test_sft_mtp_refusals(overrides, message):
    from verl.trainer.config.checks import ConfigValidationError
    from verl.trainer.sft_trainer import compose_sft_config, validate_sft_config

    cfg, strategy = compose_sft_config(["model.path=/m", "data.train_files=x", *overrides])
    with pytest.raises(ConfigValidationError, match=message):
        validate_sft_config(cfg, strategy)


ON = ["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_rollout=true"]


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.model.mtp.enable_rollout=true"],
     "`actor_rollout_ref.model.mtp.enable_rollout=true` drafts with the checkpoint's MTP head"),
    ([*ON, "actor_rollout_ref.rollout.name=vllm"], "enable_rollout=true` with rollout.name=vllm"),
    ([*ON, "actor_rollout_ref.model.mtp.num_speculative_tokens=0"],
     "`actor_rollout_ref.model.mtp.num_speculative_tokens=0` must be an integer >= 1"),
    ([*ON, "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
     "enable_rollout=true` with actor_rollout_ref.rollout.enable_rollout_routing_replay=true"),
    ([*ON, "actor_rollout_ref.model.mtp.method=eagle"], "actor_rollout_ref.model.mtp.method"),
    (["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.actor.strategy=megatron"],
     "`actor_rollout_ref.model.mtp.enable=true` with strategy=megatron"),
])
def test_ppo_mtp_refusals(overrides, message):
    from verl.trainer.config.checks import ConfigValidationError, compose_config

    with pytest.raises(ConfigValidationError, match=message):
        compose_config("ppo_trainer", overrides, validate=True)


def test_ppo_speculative_decoding_composes_on_the_hf_rollout():
    """mtp.enable + mtp.enable_rollout (+ mtp.num_speculative_tokens) with the built-in hf rollout is accepted."""
    from verl.trainer.config.checks import compose_config

    cfg = compose_config("demo", [*ON, "actor_rollout_ref.rollout.name=hf",
                                         "actor_rollout_ref.model.mtp.num_speculative_tokens=2"], validate=True)
    assert cfg.actor_rollout_ref.model.mtp.num_speculative_tokens == 2

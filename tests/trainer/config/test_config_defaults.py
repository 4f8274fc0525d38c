"""The YAML configs compose and keep upstream verl 0.9.1's defaults.

Values are spelled out here (not read from an upstream checkout) so the tests run on a
fresh clone; each one was checked against upstream's generated config.
"""

import pytest
from omegaconf import OmegaConf


UPSTREAM_DEFAULTS = {
    # data
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "data.val_batch_size": None,
    "data.prompt_key": "prompt",
    "data.reward_fn_key": "data_source",
    "data.return_raw_chat": True,
    "data.return_raw_input_ids": False,
    "data.shuffle": True,
    "data.truncation": "error",
    "data.filter_overlong_prompts": False,
    "data.dataloader_num_workers": 8,
    "data.custom_cls.path": None,
    # model
    "actor_rollout_ref.hybrid_engine": True,
    "actor_rollout_ref.model.path": "~/models/deepseek-llm-7b-chat",
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.model.lora_rank": 0,
    "actor_rollout_ref.model.lora_alpha": 16,
    "actor_rollout_ref.model.target_modules": "all-linear",
    "actor_rollout_ref.model.use_fused_kernels": False,
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": "torch",
    "actor_rollout_ref.model.trust_remote_code": False,
    # actor
    "actor_rollout_ref.actor.strategy": "fsdp",
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size": None,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.shuffle": False,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.use_remove_padding": True,  # follows model.use_remove_padding
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.warmup_style": None,
    "actor_rollout_ref.actor.optim.min_lr_ratio": 0.0,
    "actor_rollout_ref.actor.optim.num_cycles": 0.5,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.optim.betas": [0.9, 0.999],
    "actor_rollout_ref.actor.optim.total_training_steps": -1,
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": True,
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": -1,
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params": 0,
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "fp32",
    "actor_rollout_ref.actor.checkpoint.save_contents": ["model", "optimizer", "extra"],
    "actor_rollout_ref.actor.checkpoint.load_contents": ["model", "optimizer", "extra"],
    # ref
    "actor_rollout_ref.ref.strategy": "fsdp",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": False,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.ref.fsdp_config.forward_only": True,
    # rollout
    "actor_rollout_ref.rollout.mode": "async",
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.top_p": 1,
    "actor_rollout_ref.rollout.prompt_length": 512,
    "actor_rollout_ref.rollout.response_length": 512,
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.max_num_batched_tokens": 8192,
    "actor_rollout_ref.rollout.max_num_seqs": 256,
    "actor_rollout_ref.rollout.load_format": "dummy",
    "actor_rollout_ref.rollout.free_cache_engine": True,
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.rollout.do_sample": True,
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.calculate_log_probs": True,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "actor_rollout_ref.rollout.val_kwargs.n": 1,
    "actor_rollout_ref.rollout.multi_turn.enable": False,
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": 1,
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": 256,
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": "middle",
    "actor_rollout_ref.rollout.multi_turn.format": "hermes",
    "actor_rollout_ref.rollout.agent.num_workers": 8,
    "actor_rollout_ref.rollout.agent.default_agent_loop": "single_turn_agent",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 2048,
    "actor_rollout_ref.rollout.engine_kwargs.vllm": {},
    # critic
    "critic.strategy": "fsdp",
    "critic.enable": None,
    "critic.optim.lr": 1e-5,
    "critic.ppo_mini_batch_size": 256,
    "critic.ppo_max_token_len_per_gpu": 32768,
    "critic.forward_max_token_len_per_gpu": 32768,
    "critic.cliprange_value": 0.5,
    "critic.fsdp.param_offload": False,
    # reward
    "reward.num_workers": 8,
    "reward.reward_manager.name": "naive",
    "reward.reward_manager.source": "register",
    "reward.custom_reward_function.name": "compute_score",
    "reward.reward_model.enable": False,
    "custom_reward_function.path": None,
    "custom_reward_function.name": None,
    # algorithm
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    # trainer
    "trainer.balance_batch": True,
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.resume_mode": "auto",
    "trainer.val_before_train": True,
    "trainer.critic_warmup": 0,
    "trainer.default_local_dir": "checkpoints/verl_examples/gsm8k",
    "trainer.max_actor_ckpt_to_keep": None,
    "trainer.device": "cuda",
    "ray_kwargs.ray_init.num_cpus": None,
    "ray_kwargs.timeline_json_file": None,
}


@pytest.mark.parametrize("key,expected", sorted(UPSTREAM_DEFAULTS.items()))
def test_upstream_default(base_cfg, key, expected):
    value = OmegaConf.select(base_cfg, key, default="<absent>")
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    assert value == expected


def test_rollout_name_is_mandatory_like_upstream(base_cfg):
    # Upstream 0.9.1 ships `name: ???`; a run must pick hf / vllm / sglang explicitly.
    assert OmegaConf.is_missing(base_cfg.actor_rollout_ref.rollout, "name")


def test_project_additions_have_documented_defaults(base_cfg):
    assert base_cfg.trainer.launcher == "ray"
    assert base_cfg.actor_rollout_ref.model.model_type is None


def test_dropped_subsystems_are_absent(base_cfg):
    for key in ("transfer_queue", "skip", "reward_model", "sandbox_fusion"):
        assert key not in base_cfg, key
    # profiling exists (tool=torch only): tests/utils/test_profiler.py
    assert base_cfg.global_profiler.tool is None and base_cfg.actor_rollout_ref.actor.profiler.enable is False
    assert "prometheus" not in base_cfg.actor_rollout_ref.rollout


def test_interpolations_follow_their_sources(compose_fn):
    cfg = compose_fn(overrides=["data.max_prompt_length=100", "actor_rollout_ref.rollout.n=4",
                                 "actor_rollout_ref.actor.use_dynamic_bsz=true", "trainer.project_name=p"])
    assert cfg.actor_rollout_ref.rollout.prompt_length == 100
    assert cfg.actor_rollout_ref.actor.rollout_n == 4
    assert cfg.critic.use_dynamic_bsz is True
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is True
    assert cfg.trainer.default_local_dir == "checkpoints/p/gsm8k"


def test_megatron_config_composes(megatron_cfg, compose_fn):
    actor = megatron_cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron"
    assert megatron_cfg.actor_rollout_ref.ref.strategy == "megatron"
    assert megatron_cfg.critic.strategy == "megatron"
    assert "fsdp_config" not in actor and "fsdp" not in megatron_cfg.critic
    meg = actor.megatron
    assert (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size, meg.context_parallel_size) == (1, 1, 1)
    assert meg.virtual_pipeline_model_parallel_size is None
    assert meg.expert_model_parallel_size == 1 and meg.expert_tensor_parallel_size is None
    assert meg.sequence_parallel is True and meg.use_distributed_optimizer is True
    assert meg.use_mbridge is True and meg.use_dist_checkpointing is False
    assert meg.override_transformer_config.recompute_modules == ["core_attn"]
    assert actor.optim.optimizer == "adam" and actor.optim.lr_decay_style == "constant"
    assert megatron_cfg.critic.optim.lr == 1e-5 and megatron_cfg.critic.nccl_timeout == 600
    # The ref's parallel layout follows the actor's.
    cfg = compose_fn("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 4
    # Shared sections are untouched by the engine switch.
    assert megatron_cfg.algorithm.kl_ctrl.kl_coef == 0.001 and megatron_cfg.data.max_prompt_length == 512


def test_model_engine_override_equals_megatron_config(megatron_cfg, compose_fn):
    assert compose_fn(overrides=["model_engine=megatron"]) == megatron_cfg


def test_keys_of_a_left_out_engine_are_refused_in_one_sentence(capsys):
    """Upstream's FSDP-Turbo scripts set a dozen `turbo_config.*` keys: one sentence names the engine, instead
    of a dozen refusals; a single key of a left-out feature keeps its own message; strategy=fsdp_turbo names it."""
    from verl.trainer.main_ppo import main

    keys = ["+actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.ulysses_parallel_size=1",
            "+actor_rollout_ref.actor.fsdp_config.turbo_config.memory.recompute=True",
            "+actor_rollout_ref.ref.fsdp_config.turbo_config.memory.recompute=True"]
    assert main(["actor_rollout_ref.model.path=/m", *keys, "--cfg", "job"]) == 2
    err = capsys.readouterr().err
    assert "1 invalid config override" in err and "and 2 more key(s) of the same command belong to FSDP-Turbo" in err
    assert main(["actor_rollout_ref.model.path=/m", keys[0], "--cfg", "job"]) == 2
    err = capsys.readouterr().err
    assert "`actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.ulysses_parallel_size` belongs to " \
           "FSDP-Turbo" in err and "more key(s)" not in err
    assert main(["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.strategy=fsdp_turbo", "--cfg", "job"]) == 2
    assert "selects FSDP-Turbo" in capsys.readouterr().err

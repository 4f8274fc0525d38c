"""Upstream-style launch commands compose and validate here (issue 16), and left-out features are refused
naming the feature. Commands go through ``main_ppo.main`` with ``--cfg job`` (Hydra's dry run), in process."""

from __future__ import annotations

import warnings

import pytest
import yaml

from verl.trainer.main_ppo import main

# What an upstream GRPO script typically sets (a 2-GPU node; nothing here is run).
BASE = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=/data/gsm8k/train.parquet",
    "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=8",
    "data.max_prompt_length=512",
    "data.max_response_length=256",
    "actor_rollout_ref.model.path=Qwen/Qwen3.5-0.8B",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "trainer.logger=['console','wandb']",
    "trainer.n_gpus_per_node=2",
    "trainer.nnodes=1",
]


def dry_run(capsys, *extra, base=BASE):
    """(exit code, composed config or None, stderr)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main([*base, *extra, "--cfg", "job"])
    out, err = capsys.readouterr()
    err += "".join(f"\n{w.message}" for w in caught)
    return code, (yaml.safe_load(out) if code == 0 else None), err


def test_plain_upstream_command(capsys):
    code, cfg, err = dry_run(capsys)
    assert code == 0, err
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and cfg["actor_rollout_ref"]["rollout"]["n"] == 4


# --------------------------------------------------------------------------- item 1: free-form keys, +null


def test_ray_init_keys_as_upstream_writes_them(capsys):
    code, cfg, err = dry_run(capsys, "ray_kwargs.ray_init.runtime_env.py_executable='uv run --frozen --extra vllm'",
                             "ray_kwargs.ray_init.num_cpus=16",
                             "+ray_kwargs.ray_init.runtime_env.env_vars.NCCL_DEBUG=WARN")
    assert code == 0, err
    ray_init = cfg["ray_kwargs"]["ray_init"]
    assert ray_init["runtime_env"]["py_executable"] == "uv run --frozen --extra vllm"
    assert ray_init["runtime_env"]["env_vars"] == {"NCCL_DEBUG": "WARN"} and ray_init["num_cpus"] == 16


def test_plus_on_an_existing_null_key_sets_it_as_in_hydra(capsys):
    code, cfg, err = dry_run(capsys, "+trainer.total_training_steps=5", "+actor_rollout_ref.rollout.max_model_len=1024")
    assert code == 0, err
    assert cfg["trainer"]["total_training_steps"] == 5 and cfg["actor_rollout_ref"]["rollout"]["max_model_len"] == 1024


def test_plus_on_a_set_key_is_still_an_error(capsys):
    code, _, err = dry_run(capsys, "+trainer.total_epochs=3")
    assert code == 2 and "already exists" in err


def test_plus_with_a_list_or_dict_merges_as_in_hydra(capsys):
    # Hydra applies `+key=<list or dict>` on a key that holds a value (merged, force_add).
    code, cfg, err = dry_run(capsys, "+trainer.logger=[console]", "+ray_kwargs.ray_init={num_cpus: 8}")
    assert code == 0, err
    assert cfg["trainer"]["logger"] == ["console"]
    assert cfg["ray_kwargs"]["ray_init"]["num_cpus"] == 8 and "runtime_env" in cfg["ray_kwargs"]["ray_init"]


# --------------------------------------------------------------------------- item 7: Megatron keys

OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"


def test_megatron_recompute_command(capsys):
    """An upstream Megatron script's recompute / offload overrides compose and validate. megatron-core is not
    needed: the Megatron rules (verl.workers.engine.megatron.validation) read the config only."""
    code, cfg, err = dry_run(capsys, "--config-name=ppo_megatron_trainer",
                             "actor_rollout_ref.actor.megatron.grad_offload=True",
                             f"+{OTC}.recompute_method=uniform",
                             f"+{OTC}.recompute_granularity=full",
                             f"+{OTC}.recompute_num_layers=1",
                             f"+{OTC}.recompute_modules=['core_attn','mlp']",
                             "actor_rollout_ref.actor.megatron.use_dist_checkpointing=False")
    assert code == 0, err
    actor = cfg["actor_rollout_ref"]["actor"]
    assert actor["strategy"] == "megatron" and actor["megatron"]["grad_offload"] is True
    assert actor["megatron"]["use_dist_checkpointing"] is False
    assert actor["megatron"]["override_transformer_config"] == {
        "attention_backend": "flash", "recompute_granularity": "full", "recompute_modules": ["core_attn", "mlp"],
        "recompute_method": "uniform", "recompute_num_layers": 1}


# --------------------------------------------------------------------------- item 2: legacy homes


def test_legacy_homes_are_aliases_with_one_warning_each(capsys):
    code, cfg, err = dry_run(capsys, "reward_model.reward_manager=naive", "reward_model.enable=False",
                             "reward_model.model.path=/models/rm", "reward_model.rollout.name=vllm",
                             "reward_model.rollout.gpu_memory_utilization=0.3",
                             "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
                             "critic.model.fsdp_config.param_offload=True",
                             "critic.model.fsdp_config.optimizer_offload=False")
    assert code == 0, err
    reward = cfg["reward"]
    assert reward["reward_manager"]["name"] == "naive" and reward["reward_model"]["model_path"] == "/models/rm"
    assert reward["reward_model"]["rollout"]["gpu_memory_utilization"] == 0.3
    assert cfg["critic"]["fsdp"]["param_offload"] is True
    for old, new in (("reward_model.reward_manager", "reward.reward_manager.name"),
                     ("reward_model.rollout", "reward.reward_model.rollout"),
                     ("critic.model.fsdp_config", "critic.fsdp")):
        assert err.count(f"`{old}` is deprecated; use `{new}`") == 1, err


def test_legacy_reward_kwargs_move_to_reward_kwargs(capsys):
    # DAPO's overlong buffer through the legacy home lands in reward.reward_kwargs (the manager's constructor
    # arguments).
    code, cfg, err = dry_run(capsys, "reward_model.reward_manager=dapo",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
                             "+reward_model.reward_kwargs.max_resp_len=256")
    assert code == 0, err
    assert cfg["reward"]["reward_kwargs"] == {"overlong_buffer_cfg": {"enable": True, "len": 64}, "max_resp_len": 256}
    assert err.count("`reward_model.reward_kwargs` is deprecated; use `reward.reward_kwargs`") == 1


def test_reward_kwargs_a_manager_does_not_take_are_refused(capsys):
    from verl.workers.reward_manager import register

    @register("strict_test_manager")
    class StrictManager:
        def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", max_len=1):
            pass

    code, _, err = dry_run(capsys, "reward.reward_manager.name=strict_test_manager",
                           "+reward.reward_kwargs.overlong_buffer_cfg.enable=True")
    assert code == 2 and "`reward.reward_kwargs`" in err and "overlong_buffer_cfg" in err and "max_len" in err


def test_legacy_reward_model_enable_reaches_its_validation(capsys):
    # The legacy spellings land on reward.reward_model.*, whose rules then apply: the engine name is required.
    code, _, err = dry_run(capsys, "reward_model.enable=True", "reward_model.model.path=/models/rm")
    assert code == 2 and "`reward.reward_model.rollout.name` is not set" in err
    code, _, err = dry_run(capsys, "reward_model.enable=True", "reward_model.model.path=/models/rm",
                           "reward_model.rollout.name=vllm")
    assert code == 0, err


def test_legacy_home_without_its_new_home_is_refused(capsys):
    code, _, err = dry_run(capsys, "critic.model.fsdp_config.param_offload=True", "model_engine=megatron",
                           base=[o for o in BASE if "ppo_micro" not in o])
    assert code == 2 and "critic.model.fsdp_config.param_offload" in err


# --------------------------------------------------------------------------- items 3, 4: CLI like Hydra's


def test_relative_config_path_is_relative_to_main_ppo(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing named config/ here: Hydra resolves against verl/trainer/
    code, cfg, err = dry_run(capsys, "--config-path=config", "--config-name=ppo_trainer")
    assert code == 0, err and cfg["trainer"]["nnodes"] == 1


def test_user_config_folder_builds_on_ours(capsys, tmp_path):
    (tmp_path / "my_exp.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\ntrainer:\n  total_epochs: 7\n")
    code, cfg, err = dry_run(capsys, f"--config-path={tmp_path}", "--config-name", "my_exp.yaml",
                             "model_engine=dp")
    assert code == 0, err
    assert cfg["trainer"]["total_epochs"] == 7


@pytest.mark.parametrize("flags, words", [
    (["--config-name=nope"], ["Cannot find primary config 'nope'", "--config-name"]),
    (["--config-path=/nonexistent/dir", "--config-name=x"], ["/nonexistent/dir", "not a folder"]),
    (["--config-path=configs"], ["verl/trainer/configs", "relative to verl/trainer/"]),
    (["model_engine=nope"], ["`model_engine=nope`", "dp, megatron"]),
])
def test_missing_config_or_group_is_one_paragraph(capsys, flags, words):
    code, _, err = dry_run(capsys, *flags)
    assert code == 2
    text = err.strip().splitlines()
    assert len(text) == 1 and text[0].startswith("Config error:") and "Traceback" not in err, err
    for word in words:
        assert word in err


def test_dry_run_prints_validated_config_and_package(capsys):
    code = main([*BASE, "--cfg", "job", "--package", "actor_rollout_ref.rollout"])
    out = capsys.readouterr().out
    assert code == 0 and yaml.safe_load(out)["name"] == "vllm"
    code = main([*BASE, "actor_rollout_ref.actor.ppo_mini_batch_size=3", "--cfg", "job"])
    assert code == 2 and "ppo_mini_batch_size" in capsys.readouterr().err  # validated, not just composed


def test_help_lists_config_groups(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "== Configuration groups ==" in out
    assert "model_engine: dp, megatron" in out and "rollout: rollout" in out and "ppo_megatron_trainer" in out


# --------------------------------------------------------------------------- items 5, 6: profiler, formats


def test_profiler_keys_with_torch(capsys):
    code, cfg, err = dry_run(capsys, "global_profiler.tool=torch", "global_profiler.steps=[2,4]",
                             "global_profiler.save_path=/tmp/profile",
                             "actor_rollout_ref.actor.profiler.enable=True",
                             "actor_rollout_ref.actor.profiler.all_ranks=True",
                             "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,cuda]")
    assert code == 0, err and cfg["global_profiler"]["steps"] == [2, 4]


@pytest.mark.parametrize("tool", ["nsys", "npu"])
def test_other_profilers_refused(capsys, tool):
    code, _, err = dry_run(capsys, f"global_profiler.tool={tool}")
    assert code == 2 and f"'{tool}'" in err and "torch" in err


def test_multi_turn_formats(capsys):
    on = "actor_rollout_ref.rollout.multi_turn.enable=true"  # the format is read (and checked) with multi-turn on
    code, _, err = dry_run(capsys, on, "actor_rollout_ref.rollout.multi_turn.format=qwen3_xml")
    assert code == 0, err  # vLLM's name for the qwen3_coder XML syntax
    code, _, err = dry_run(capsys, on, "actor_rollout_ref.rollout.multi_turn.format=gpt-oss")
    assert code == 2 and "gpt-oss" in err and "hermes" in err and "qwen3_coder" in err


# --------------------------------------------------------------------------- out of scope


@pytest.mark.parametrize("extra, feature", [
    (["distillation.enabled=True", "distillation.teacher_models.teacher_model.model_path=/t",
      "distillation.distillation_loss.loss_mode=forward_kl_topk"], "top-k forward-KL"),
    (["distillation.nnodes=1"], "distillation.nnodes"),
    (["model_engine=veomni"], "VeOmni"),
    (["actor_rollout_ref.rollout.name=trtllm"], "TRT-LLM"),
    (["+actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_size=8"], "TRT-LLM"),
    (["--config-name=ppo_megatron_trainer", "trainer.device=npu"], "MindSpeed"),
])
def test_left_out_features_are_named(capsys, extra, feature):
    code, _, err = dry_run(capsys, *extra)
    assert code == 2 and feature in err, err


def test_null_for_a_left_out_upstream_key_is_dropped_with_a_note(capsys):
    code, cfg, err = dry_run(capsys, "trainer.default_hdfs_dir=null")
    assert code == 0, err
    assert "default_hdfs_dir" not in cfg["trainer"] and "`trainer.default_hdfs_dir=null`" in err
    code, _, err = dry_run(capsys, "trainer.default_hdfs_dir=/hdfs/ckpt")
    assert code == 2 and "`trainer.default_hdfs_dir` is an upstream verl option" in err

"""``fsdp_config.mixed_precision.{param_dtype,reduce_dtype,buffer_dtype}`` (actor, ref, critic's ``fsdp``, the SFT
``engine``), set the way upstream's scripts do (with ``+``), on CPU with one gloo rank.

``buffer_dtype`` is applied on every device (the buffers are cast before sharding), so the built engine shows it.
``param_dtype`` / ``reduce_dtype`` make FSDP2's MixedPrecisionPolicy, which the engine installs on accelerators
only (the CPU build computes in the weights' dtype): here the policy the engine would install is checked, built
from the composed section by the engine's own function; test_keys_fsdp_gpu.py covers compute in the policy.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from test_keys_fsdp import build
from verl.workers.engine.fsdp.model_init import precision_policy

SECTIONS = {"actor_rollout_ref.actor.fsdp_config": "actor", "actor_rollout_ref.ref.fsdp_config": "ref",
            "critic.fsdp": "critic", "engine": "sft"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("keys_fsdp_precision")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)


def _buffers(engine):
    return {b.dtype for b in engine.module.buffers() if b.is_floating_point()}


@pytest.mark.parametrize("section", list(SECTIONS))
def test_buffer_dtype_is_the_dtype_buffers_are_held_in(gloo, model_dir, section):
    assert _buffers(build(model_dir, f"{section}.model_dtype", "fp32")) == {torch.float32}  # null: as loaded
    engine = build(model_dir, f"{section}.model_dtype", "fp32", f"+{section}.mixed_precision.buffer_dtype=bf16")
    assert _buffers(engine) == {torch.bfloat16}
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}  # the weights are model_dtype's


def _section(section, *overrides):
    from verl.trainer.config.checks import compose_config

    name = "sft_trainer_engine" if section == "engine" else "ppo_trainer"
    cfg = compose_config(name, list(overrides), validate=False)
    return OmegaConf.select(cfg, section)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_param_and_reduce_dtype_make_the_fsdp2_policy(section):
    default = precision_policy(_section(section), torch.float32)
    assert (default.param_dtype, default.reduce_dtype) == (torch.bfloat16, torch.float32)  # upstream's defaults
    policy = precision_policy(_section(section, f"+{section}.mixed_precision.param_dtype=fp16",
                                       f"+{section}.mixed_precision.reduce_dtype=bf16"), torch.float32)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.bfloat16)
    # param_dtype wins over the engine's dtype key; all in the weights' dtype: nothing to cast
    same = _section(section, f"{section}.dtype=bfloat16", f"+{section}.mixed_precision.param_dtype=fp32",
                    f"+{section}.mixed_precision.reduce_dtype=fp32")
    assert precision_policy(same, torch.float32) is None
    # bf16 weights: the reduction still runs in fp32 unless reduce_dtype says otherwise
    bf16 = precision_policy(_section(section), torch.bfloat16)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_a_bad_dtype_is_refused_at_validation():
    from verl.trainer.config import ConfigValidationError
    from verl.trainer.config.checks import compose_config

    base = ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1"]
    for key in ("actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype",
                "critic.fsdp.mixed_precision.param_dtype"):
        with pytest.raises(ConfigValidationError, match=key):
            compose_config("ppo_trainer", [*base, f"+{key}=fp8"])

"""Every registry-backed key is validated against its live registry (issue 10 item 5): whatever a user
registers before main_ppo runs is accepted, and all registries behave alike (duplicates, listing, errors)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl.experimental.agent_loop.agent_loop import AGENT_LOOP_REGISTRY
from verl.experimental.agent_loop.tool_parser import TOOL_PARSER_REGISTRY
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
from verl.trainer.ppo.kl import KL_ESTIMATOR_REGISTRY
from verl.utils.registry import Registry, UnknownNameError
from verl.workers.engine import EngineRegistry
from verl.workers.reward_manager.registry import REWARD_MANAGER_REGISTRY
from verl.workers.rollout.base import ROLLOUT_REGISTRY

REPO = Path(__file__).resolve().parents[3]
ALL = {
    "algorithm.adv_estimator": ADV_ESTIMATOR_REGISTRY,
    "actor_rollout_ref.actor.policy_loss.loss_mode": POLICY_LOSS_REGISTRY,
    "actor_rollout_ref.actor.kl_loss_type": KL_ESTIMATOR_REGISTRY,
    "actor_rollout_ref.rollout.name": ROLLOUT_REGISTRY,
    "reward.reward_manager.name": REWARD_MANAGER_REGISTRY,
    "actor_rollout_ref.rollout.multi_turn.format": TOOL_PARSER_REGISTRY,
    "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_LOOP_REGISTRY,
    "actor_rollout_ref.actor.strategy": EngineRegistry,  # a user's own training engine
    "critic.strategy": EngineRegistry,
}

LAUNCHER = """
import sys
from verl.trainer.ppo.core_algos import register_adv_est
from verl.trainer.ppo.advantage import compute_grpo_outcome_advantage

if "--register" in sys.argv:
    sys.argv.remove("--register")

    @register_adv_est("my_grpo")
    def my_grpo(token_level_rewards, response_mask, index, **kwargs):
        return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)

from verl.trainer.main_ppo import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("register", [True, False])
def test_launcher_that_registers_an_estimator(tmp_path, register):
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(LAUNCHER))
    cmd = [sys.executable, str(script), "algorithm.adv_estimator=my_grpo", "actor_rollout_ref.rollout.n=8",
           "--cfg", "job", "--package", "algorithm"]
    if register:
        cmd.append("--register")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    if register:
        assert proc.returncode == 0, proc.stderr
        assert "adv_estimator: my_grpo" in proc.stdout
    else:
        assert proc.returncode == 2
        assert "`algorithm.adv_estimator` is 'my_grpo', not a registered advantage estimator" in proc.stderr
        assert "grpo" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("key", sorted(ALL))
def test_validation_accepts_what_is_registered(key, compose_fn, valid_overrides):
    from verl.trainer.config import ConfigValidationError, validate_config

    registry = ALL[key]
    name = "user_ext_" + key.rsplit(".", 1)[-1]
    overrides = valid_overrides + [f"{key}={name}", "actor_rollout_ref.actor.use_kl_loss=true"]
    if ".multi_turn." in key or ".agent." in key:  # read (and checked) only with multi-turn on
        overrides.append("actor_rollout_ref.rollout.multi_turn.enable=true")
    with pytest.raises(ConfigValidationError, match=f"`{key}` is '{name}', not a registered {registry.kind}"):
        validate_config(compose_fn(overrides=overrides))
    registry.register(name, object())
    try:
        problems = []
        try:
            validate_config(compose_fn(overrides=overrides))
        except ConfigValidationError as err:
            problems = [p for p in err.problems if f"`{key}`" in p]
        assert problems == []
    finally:
        del registry[name]


@pytest.mark.parametrize("registry", list(ALL.values()), ids=list(ALL))
def test_registries_behave_alike(registry):
    assert isinstance(registry, Registry)
    assert registry.names() == sorted(registry)

    def one():
        pass

    def two():
        pass

    name = "same_behaviour_probe"
    try:
        registry.register(name, one)
        registry.register(name, one)  # the same object again: no-op
        with pytest.raises(ValueError, match="already registered"):
            registry.register(name, two)
        registry.register(name, two, override=True)
        assert registry.get_or_raise(name) is two
    finally:
        registry.pop(name, None)
    with pytest.raises(UnknownNameError, match="registered: ") as info:
        registry.get_or_raise("no_such_entry")
    assert isinstance(info.value, ValueError)


def test_builtin_names_still_resolve():
    assert ADV_ESTIMATOR_REGISTRY.known("grpo") and POLICY_LOSS_REGISTRY.known("vanilla")
    assert KL_ESTIMATOR_REGISTRY.known("low_var_kl") and KL_ESTIMATOR_REGISTRY.canonical("low_var_kl") == "k3"
    assert ROLLOUT_REGISTRY.known("hf") and REWARD_MANAGER_REGISTRY.known("naive")
    assert TOOL_PARSER_REGISTRY.known("qwen3_xml") and TOOL_PARSER_REGISTRY.canonical("qwen3_xml") == "qwen3_coder"
    assert AGENT_LOOP_REGISTRY.known("tool_agent")
    assert EngineRegistry.known("megatron") and EngineRegistry.canonical("fsdp") == "fsdp2"


def test_fsdp_alias_still_gets_the_fsdp2_rules(compose_fn, valid_overrides):
    """strategy=fsdp is the registry's alias of fsdp2 (the engine warns once that it runs FSDP2): validation
    accepts it and applies the FSDP rules to it, e.g. Ulysses SP needs remove-padding."""
    from verl.trainer.config import ConfigValidationError, validate_config

    a = "actor_rollout_ref.actor"
    validate_config(compose_fn(overrides=valid_overrides + [f"{a}.strategy=fsdp", "critic.strategy=fsdp"]))
    bad = valid_overrides + [f"{a}.strategy=fsdp", f"{a}.ulysses_sequence_parallel_size=2",
                             "actor_rollout_ref.model.use_remove_padding=false"]
    with pytest.raises(ConfigValidationError, match="needs `actor_rollout_ref.model.use_remove_padding=true`"):
        validate_config(compose_fn(overrides=bad))

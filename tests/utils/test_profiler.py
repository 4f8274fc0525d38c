"""Profiling through upstream's keys: global_profiler.{tool, steps, profile_continuous_steps, save_path} and
<role>.profiler.{enable, all_ranks, ranks, save_path, tool, tool_config.torch.{contents, discrete, schedule}}."""

from __future__ import annotations

import json

import pytest
from verl.utils.profiler import ProfilePlan, StepProfiler, check_profiler_config
from verl.single_controller.profiler_worker import ProfilerWorkerMixin


@pytest.fixture(scope="module")
def compose_fn():
    from hydra import compose, initialize_config_dir

    from verl.trainer.config import CONFIG_DIR

    def _compose(name="ppo_trainer", overrides=()):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(config_name=name, overrides=list(overrides))

    return _compose


def _cfg(compose_fn, *overrides):
    return compose_fn("ppo_trainer", list(overrides))


ON = ("global_profiler.tool=torch", "global_profiler.steps=[1,2]",
      "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.all_ranks=true")


def test_defaults_have_nothing_to_check(compose_fn):
    cfg = _cfg(compose_fn)
    assert check_profiler_config(cfg) == [] and not ProfilePlan.from_config(cfg).active


@pytest.mark.parametrize("tool", ["nsys", "npu", "precision_debugger"])  # npu: torch_npu is absent here
def test_other_tools_are_refused_by_name(compose_fn, tool):
    problems = check_profiler_config(_cfg(compose_fn, f"global_profiler.tool={tool}"))
    assert any("`global_profiler.tool`" in p and tool in p and "torch" in p for p in problems), problems


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.actor.profiler.tool_config.torch.discrete=sometimes", "discrete"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch.schedule.wait=1", "schedule"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch.schedule.warmup=1", "schedule"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch.schedule.active=1", "schedule"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch.schedule.repeat=1", "schedule"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch.schedule.skip_first=1", "schedule"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch.contents=[gpu]", "contents"),
    ("global_profiler.steps=[0]", "global_profiler.steps"),
    ("actor_rollout_ref.actor.profiler.tool=nsys", "actor_rollout_ref.actor.profiler.tool"),
])
def test_unbuilt_options_are_refused(compose_fn, override, key):
    problems = check_profiler_config(_cfg(compose_fn, *ON, override))
    assert any(key in p for p in problems), problems


def test_enable_needs_tool_steps_and_ranks(compose_fn):
    problems = check_profiler_config(_cfg(compose_fn, "actor_rollout_ref.actor.profiler.enable=true"))
    text = " ".join(problems)
    assert "global_profiler.tool" in text and "all_ranks" in text


def test_plan_merges_the_roles_of_one_worker_group(compose_fn, tmp_path):
    cfg = _cfg(compose_fn, "global_profiler.tool=torch", "global_profiler.steps=[2]",
               f"global_profiler.save_path={tmp_path}", "actor_rollout_ref.ref.profiler.enable=true",
               "actor_rollout_ref.ref.profiler.ranks=[1]", "actor_rollout_ref.rollout.profiler.enable=true",
               "actor_rollout_ref.rollout.profiler.ranks=[0]",
               "actor_rollout_ref.rollout.profiler.tool_config.torch.contents=[cpu,shapes]",
               "critic.profiler.enable=true", "critic.profiler.all_ranks=true")
    assert check_profiler_config(cfg) == []
    plan = ProfilePlan.from_config(cfg)
    assert plan.active and plan.steps == [2] and not plan.continuous
    spec = plan.workers["actor_rollout"]
    assert spec.ranks == [0, 1] and not spec.all_ranks and spec.contents == ["cpu", "shapes"]
    assert spec.save_path == str(tmp_path)  # save_path inherits global_profiler.save_path
    assert plan.workers["critic"].all_ranks


class _Rank(ProfilerWorkerMixin):
    def __init__(self, rank):
        self.rank = rank


class _Group:
    """A stand-in worker group: calls every rank in this process, as the local launcher does."""

    def __init__(self, n):
        self.ranks = [_Rank(r) for r in range(n)]

    def start_profile(self, spec, label):
        return [w.start_profile(spec, label) for w in self.ranks]

    def stop_profile(self):
        return [w.stop_profile() for w in self.ranks]


def _work():
    import torch

    return (torch.randn(64, 64) @ torch.randn(64, 64)).sum()


def test_traces_written_for_chosen_steps_and_ranks(compose_fn, tmp_path):
    cfg = _cfg(compose_fn, "global_profiler.tool=torch", "global_profiler.steps=[2,3]",
               "global_profiler.profile_continuous_steps=false", f"global_profiler.save_path={tmp_path}",
               "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.ranks=[1]")
    group = _Group(2)
    profiler = StepProfiler(cfg, {"actor_rollout": group, "critic": _Group(1)})
    for step in (1, 2, 3):
        with profiler.step(step):
            _work()
    assert sorted(profiler.traces) == [str(tmp_path / "step2" / "actor_rollout_rank1.json"),
                                       str(tmp_path / "step3" / "actor_rollout_rank1.json")]
    trace = json.loads((tmp_path / "step2" / "actor_rollout_rank1.json").read_text())
    assert any("mm" in str(ev.get("name", "")) for ev in trace["traceEvents"])
    assert not (tmp_path / "step1").exists()


def test_continuous_steps_share_one_trace(compose_fn, tmp_path):
    cfg = _cfg(compose_fn, "global_profiler.tool=torch", "global_profiler.steps=[1,2]",
               "global_profiler.profile_continuous_steps=true", f"global_profiler.save_path={tmp_path}",
               "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.all_ranks=true")
    profiler = StepProfiler(cfg, {"actor_rollout": _Group(1)})
    for step in (1, 2):
        with profiler.step(step):
            _work()
    assert profiler.traces == [str(tmp_path / "step1" / "actor_rollout_rank0.json")]


def test_validation_reports_profiler_problems():
    from verl.trainer.config import ConfigValidationError, compose_config

    with pytest.raises(ConfigValidationError, match="global_profiler.tool"):
        compose_config("demo", ["global_profiler.tool=nsys"])

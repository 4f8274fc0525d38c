"""global_profiler.relocate_results, tool=torch_memory (global_tool_config.torch_memory.* and each role's
profiler.tool_config.torch_memory.*) and tool=npu (profiler.tool_config.npu.*) through upstream's keys
(issue 27): traces written for real on CPU, the CUDA / Ascend backends checked through stand-ins."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from verl.single_controller.profiler_worker import ProfilerWorkerMixin
from verl.trainer.config import ConfigValidationError, compose_config
from verl.utils.profiler import ProfilePlan, StepProfiler, check_profiler_config


def _cfg(*overrides):
    return compose_config("ppo_trainer", list(overrides), validate=False)


class _Rank(ProfilerWorkerMixin):
    def __init__(self, rank):
        self.rank = rank


class _Group:
    """Calls every rank in this process, as the local launcher does."""

    def __init__(self, n):
        self.ranks = [_Rank(r) for r in range(n)]

    def start_profile(self, spec, label):
        return [w.start_profile(spec, label) for w in self.ranks]

    def stop_profile(self):
        return [w.stop_profile() for w in self.ranks]


def _work():
    layer = torch.nn.Linear(32, 32)
    layer(torch.randn(16, 32)).sum().backward()


def _run(cfg, steps, groups=None):
    profiler = StepProfiler(cfg, groups or {"actor_rollout": _Group(2)})
    for step in steps:
        with profiler.step(step):
            _work()
    return profiler


TORCH_ON = ("global_profiler.tool=torch", "global_profiler.steps=[1,2]",
            "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.ranks=[0]")


# --------------------------------------------------------------------------- relocate_results


def test_relocate_results_puts_every_trace_in_save_path(tmp_path):
    nested = _run(_cfg(*TORCH_ON, f"global_profiler.save_path={tmp_path / 'a'}"), [1, 2])
    assert nested.traces == [str(tmp_path / "a" / "step1" / "actor_rollout_rank0.json"),
                             str(tmp_path / "a" / "step2" / "actor_rollout_rank0.json")]
    cfg = _cfg(*TORCH_ON, f"global_profiler.save_path={tmp_path / 'b'}", "global_profiler.relocate_results=true")
    assert cfg.actor_rollout_ref.actor.profiler.relocate_results is True  # each role inherits the global key
    flat = _run(cfg, [1, 2])
    assert flat.traces == [str(tmp_path / "b" / "step1_actor_rollout_rank0.json"),
                           str(tmp_path / "b" / "step2_actor_rollout_rank0.json")]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step1_actor_rollout_rank0.json",
                                                                  "step2_actor_rollout_rank0.json"]
    assert json.loads((tmp_path / "b" / "step2_actor_rollout_rank0.json").read_text())["traceEvents"]


def test_a_role_can_keep_its_own_relocate_setting(tmp_path):
    cfg = _cfg(*TORCH_ON, f"global_profiler.save_path={tmp_path}", "global_profiler.relocate_results=true",
               "actor_rollout_ref.actor.profiler.relocate_results=false")
    assert _run(cfg, [1]).traces == [str(tmp_path / "step1" / "actor_rollout_rank0.json")]


# --------------------------------------------------------------------------- torch_memory

def test_torch_memory_writes_a_memory_trace_per_window_on_cpu(tmp_path):
    # As upstream, every worker group takes part without `enable`, on rank 0 unless ranks are given.
    cfg = _cfg("global_profiler.tool=torch_memory", "global_profiler.steps=[1,2,3]",
               f"global_profiler.save_path={tmp_path}")
    plan = ProfilePlan.from_config(cfg)
    assert plan.active and set(plan.workers) == {"actor_rollout", "critic"} and plan.workers["critic"].ranks == [0]
    traces = _run(cfg, [1, 2, 3]).traces
    assert traces == [str(tmp_path / f"step{n}" / "actor_rollout_rank0_torch_memory.json") for n in (1, 2, 3)]
    times, sizes = json.loads(open(traces[0]).read())
    assert len(times) == len(sizes) > 0 and any(any(v > 0 for v in row) for row in sizes)


def test_memory_snapshot_num_steps_makes_one_snapshot_per_window(tmp_path):
    cfg = _cfg("global_profiler.tool=torch_memory", "global_profiler.steps=[1,2,4,5]",
               f"global_profiler.save_path={tmp_path}",
               "global_profiler.global_tool_config.torch_memory.memory_snapshot_num_steps=2")
    assert cfg.critic.profiler.tool_config.torch_memory.memory_snapshot_num_steps == 2  # inherited by the roles
    profiler = StepProfiler(cfg, {"actor_rollout": _Group(1)})
    for step in (1, 2, 3, 4):
        with profiler.step(step):
            _work()
    # steps 1 and 2 fill the first window; step 4 opens the second, which step 5 fills
    assert profiler.traces == [str(tmp_path / "step1-step2" / "actor_rollout_rank0_torch_memory.json")]
    with profiler.step(5):
        _work()
    assert profiler.traces[1:] == [str(tmp_path / "step4-step5" / "actor_rollout_rank0_torch_memory.json")]


def test_torch_memory_settings_reach_the_cuda_allocator_history(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    cfg = _cfg("global_profiler.tool=torch_memory", "global_profiler.steps=[4]",
               f"global_profiler.save_path={tmp_path}",
               "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=777",
               "global_profiler.global_tool_config.torch_memory.context=alloc",
               "global_profiler.global_tool_config.torch_memory.stacks=python",
               "+global_profiler.global_tool_config.torch_memory.kw_args.device=0",
               "actor_rollout_ref.rollout.profiler.enable=true",
               "actor_rollout_ref.rollout.profiler.ranks=[1]",
               "actor_rollout_ref.rollout.profiler.tool_config.torch_memory.trace_alloc_max_entries=555")
    assert check_profiler_config(cfg) == []
    assert cfg.global_profiler.global_tool_config.torch_memory.kw_args == {"device": 0}
    traces = _run(cfg, [3, 4], {"actor_rollout": _Group(2)}).traces
    snapshot = str(tmp_path / "step4" / "actor_rollout_rank1_torch_memory.pickle")
    assert traces == [snapshot]
    # the role's own trace_alloc_max_entries wins over the global one; context / stacks / kw_args are global
    assert calls == [("record", {"max_entries": 555, "context": "alloc", "stacks": "python", "device": 0}),
                     ("dump", snapshot), ("record", {"enabled": None})]


@pytest.mark.parametrize("override, words", [
    ("global_profiler.global_tool_config.torch_memory.context=everything", "context"),
    ("global_profiler.global_tool_config.torch_memory.stacks=cpp", "stacks"),
    ("critic.profiler.tool_config.torch_memory.memory_snapshot_num_steps=0", "memory_snapshot_num_steps"),
    ("global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=-1", "trace_alloc_max_entries"),
])
def test_torch_memory_options_are_checked(override, words):
    problems = check_profiler_config(_cfg("global_profiler.tool=torch_memory", "global_profiler.steps=[1]", override))
    assert any(words in p for p in problems), problems


def test_torch_memory_without_steps_warns_that_no_snapshot_is_taken():
    with pytest.warns(UserWarning, match="takes no snapshot"):
        compose_config("demo", ["global_profiler.tool=torch_memory"])


# --------------------------------------------------------------------------- npu

NPU_ON = ("global_profiler.tool=npu", "global_profiler.steps=[1]", "actor_rollout_ref.actor.profiler.enable=true",
          "actor_rollout_ref.actor.profiler.ranks=[0]")


def test_npu_without_torch_npu_is_refused_naming_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(ConfigValidationError, match="torch_npu is not installed here"):
        compose_config("demo", list(NPU_ON))


def test_npu_options_of_every_role_are_checked_with_or_without_torch_npu():
    bad = {"actor_rollout_ref.actor.profiler.tool_config.npu.level": "level3",
           "actor_rollout_ref.ref.profiler.tool_config.npu.level": "L1",
           "actor_rollout_ref.rollout.profiler.tool_config.npu.level": "level_all",
           "critic.profiler.tool_config.npu.level": "0",
           "actor_rollout_ref.actor.profiler.tool_config.npu.contents": "[gpu]",
           "actor_rollout_ref.ref.profiler.tool_config.npu.contents": "[npu,cuda]",
           "actor_rollout_ref.rollout.profiler.tool_config.npu.contents": "[kernels]",
           "critic.profiler.tool_config.npu.contents": "[cpu,gpu]",
           "actor_rollout_ref.actor.profiler.tool_config.npu.analysis": "maybe",
           "actor_rollout_ref.ref.profiler.tool_config.npu.analysis": "2",
           "actor_rollout_ref.rollout.profiler.tool_config.npu.analysis": "yes_please",
           "critic.profiler.tool_config.npu.analysis": "null"}
    problems = " ".join(check_profiler_config(_cfg(*NPU_ON, *(f"{k}={v}" for k, v in bad.items()))))
    assert all(f"`{key}`" in problems for key in bad), problems
    good = check_profiler_config(_cfg(*NPU_ON, "critic.profiler.tool_config.npu.level=level_none",
                                      "critic.profiler.tool_config.npu.contents=[cpu,stack]"))
    assert not [p for p in good if "tool_config.npu" in p]


def test_npu_discrete_is_refused():
    with pytest.raises(ConfigValidationError, match="critic.profiler.tool_config.npu.discrete"):
        compose_config("demo", ["critic.profiler.tool_config.npu.discrete=true"])


def _fake_torch_npu(record):
    prof = types.SimpleNamespace(
        ProfilerActivity=types.SimpleNamespace(CPU="CPU", NPU="NPU"),
        ProfilerLevel=types.SimpleNamespace(Level_none="L-", Level0="L0", Level1="L1", Level2="L2"),
        _ExperimentalConfig=lambda **kw: ("exp", kw),
        tensorboard_trace_handler=lambda path, analyse_flag: ("handler", path, analyse_flag))

    class Profile:
        def __init__(self, **kw):
            record.append(("profile", kw))

        def start(self):
            record.append("start")

        def stop(self):
            record.append("stop")

    prof.profile = Profile
    return types.SimpleNamespace(profiler=prof)


def test_npu_options_reach_torch_npus_profiler(tmp_path, monkeypatch):
    record = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(record))
    cfg = _cfg(*NPU_ON, f"global_profiler.save_path={tmp_path}",
               "actor_rollout_ref.actor.profiler.tool_config.npu.contents=[npu,memory,module]",
               "actor_rollout_ref.actor.profiler.tool_config.npu.level=level2",
               "actor_rollout_ref.actor.profiler.tool_config.npu.analysis=false")
    assert check_profiler_config(cfg) == []
    traces = _run(cfg, [1], {"actor_rollout": _Group(1)}).traces
    target = str(tmp_path / "step1" / "actor_rollout_rank0")
    assert traces == [target] and record[1:] == ["start", "stop"]
    kw = record[0][1]
    assert kw["activities"] == ["NPU"] and kw["profile_memory"] and kw["with_modules"]
    assert not kw["record_shapes"] and not kw["with_stack"]
    assert kw["experimental_config"] == ("exp", {"profiler_level": "L2"})
    assert kw["on_trace_ready"] == ("handler", target, False)

"""global_profiler.relocate_results, tool=torch_memory (global_tool_config.torch_memory.* and each role's
profiler.tool_config.torch_memory.*) and tool=npu (profiler.tool_config.npu.*) through upstream's keys
(issue 27): traces written for real on CPU, the CUDA / Ascend backends checked through stand-ins."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from verl.single_controller.profiler_worker import ProfilerWorkerMixin, profiled_task
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


def test_npu_discrete_must_be_a_bool(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace())
    problems = check_profiler_config(_cfg(*NPU_ON, "actor_rollout_ref.actor.profiler.tool_config.npu.discrete=1"))
    assert any("actor_rollout_ref.actor.profiler.tool_config.npu.discrete" in p for p in problems), problems
    assert check_profiler_config(_cfg(*NPU_ON, "actor_rollout_ref.actor.profiler.tool_config.npu.discrete=true")) == []


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


def test_npu_discrete_opens_torch_npus_profiler_per_task(tmp_path, monkeypatch):
    record = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(record))
    cfg = _cfg(*NPU_ON, f"global_profiler.save_path={tmp_path}",
               "actor_rollout_ref.actor.profiler.tool_config.npu.discrete=true",
               "actor_rollout_ref.actor.profiler.tool_config.npu.level=level1")
    assert check_profiler_config(cfg) == []
    assert ProfilePlan.from_config(cfg).workers["actor_rollout"].discrete
    traces = _run_tasks(cfg, [1, 2]).traces
    step = tmp_path / "step1"
    targets = [str(step / "actor_rollout_rank0_actor_compute_log_prob"), str(step / "actor_rollout_rank0_actor_update")]
    assert traces == targets and all((step / t).is_dir() for t in targets)  # step 2 is not profiled
    assert [r if isinstance(r, str) else r[0] for r in record] == ["profile", "start", "stop"] * 2
    handlers = [r[1]["on_trace_ready"] for r in record if not isinstance(r, str)]
    assert handlers == [("handler", t, True) for t in targets]
    assert record[0][1]["experimental_config"] == ("exp", {"profiler_level": "L1"})


# --------------------------------------------------------------------------- discrete (one trace per task)

class _TaskRank(_Rank):
    """A worker with upstream's tasks: the actor's log-prob pass and update, the reference's pass, generation."""

    @profiled_task("actor", "actor_compute_log_prob")
    def compute_log_prob(self):
        _work()

    @profiled_task("actor", "actor_update")
    def update_actor(self):
        _work()

    @profiled_task("ref", "ref_compute_log_prob")
    def compute_ref_log_prob(self):
        _work()

    @profiled_task("rollout", "rollout_generate")
    def generate_sequences(self):
        _work()


class _TaskGroup(_Group):
    def __init__(self, n):
        self.ranks = [_TaskRank(r) for r in range(n)]


def _run_tasks(cfg, steps, n=1):
    group = _TaskGroup(n)
    profiler = StepProfiler(cfg, {"actor_rollout": group})
    for step in steps:
        with profiler.step(step):
            for rank in group.ranks:
                rank.generate_sequences()
                rank.compute_log_prob()
                rank.compute_ref_log_prob()
                rank.update_actor()
    return profiler


def _names(path):
    return {e.get("name") for e in json.loads(open(path).read())["traceEvents"]}


def test_torch_discrete_writes_one_trace_per_task_of_the_discrete_roles(tmp_path):
    cfg = _cfg("global_profiler.tool=torch", "global_profiler.steps=[2]", f"global_profiler.save_path={tmp_path}",
               "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.ranks=[1]",
               "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true",
               "actor_rollout_ref.rollout.profiler.enable=true", "actor_rollout_ref.rollout.profiler.ranks=[1]",
               "actor_rollout_ref.rollout.profiler.tool_config.torch.discrete=true")
    assert check_profiler_config(cfg) == []
    traces = _run_tasks(cfg, [1, 2], n=2).traces
    step = tmp_path / "step2"
    # rank 1 only, step 2 only; the reference is not enabled, so its task writes nothing
    assert traces == [str(step / f"actor_rollout_rank1_{t}.json")
                      for t in ("rollout_generate", "actor_compute_log_prob", "actor_update")]
    assert sorted(p.name for p in step.iterdir()) == sorted(p.rsplit("/", 1)[-1] for p in traces)
    for path, stage in zip(traces, ("rollout_generate", "actor_compute_log_prob", "actor_update")):
        names = _names(path)
        assert stage in names and any(n and n.startswith("aten::") for n in names)  # the task's own ops


def test_torch_discrete_false_keeps_one_step_trace_with_tasks_labelled(tmp_path):
    # upstream's torch script: the actor end to end, the rollout discrete; one process runs one profiler, so
    # the step trace runs and every task is a labelled range in it
    cfg = _cfg("global_profiler.tool=torch", "global_profiler.steps=[1]", f"global_profiler.save_path={tmp_path}",
               "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.ranks=[0]",
               "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=false",
               "actor_rollout_ref.rollout.profiler.enable=true", "actor_rollout_ref.rollout.profiler.ranks=[0]",
               "actor_rollout_ref.rollout.profiler.tool_config.torch.discrete=true")
    spec = ProfilePlan.from_config(cfg).workers["actor_rollout"]
    assert spec.discrete_roles == ["rollout"] and not spec.discrete
    traces = _run_tasks(cfg, [1]).traces
    assert traces == [str(tmp_path / "step1" / "actor_rollout_rank0.json")]
    assert {"rollout_generate", "actor_compute_log_prob", "ref_compute_log_prob", "actor_update"} <= _names(traces[0])


def test_a_failing_task_stops_its_profiler(tmp_path):
    cfg = _cfg(*TORCH_ON, f"global_profiler.save_path={tmp_path}",
               "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true")

    class Failing(_Rank):
        @profiled_task("actor", "actor_update")
        def update_actor(self):
            raise RuntimeError("boom")

    worker = Failing(0)
    spec = ProfilePlan.from_config(cfg).workers["actor_rollout"].as_dict()
    assert worker.start_profile(spec, "step1")
    with pytest.raises(RuntimeError, match="boom"):
        worker.update_actor()
    assert worker.stop_profile() == [str(tmp_path / "step1" / "actor_rollout_rank0_actor_update.json")]
    with torch.profiler.profile():  # no profiler was left running in this process
        _work()


def test_the_actor_worker_traces_its_log_prob_task(tmp_path):
    """The real worker's task methods carry the hook: a discrete actor's old-log-prob pass writes its trace."""
    from tests.engine_utils import single_rank_gloo
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.protocol import DataProto
    from verl.workers.engine_workers import ActorRolloutRefWorker

    model_dir = str(tmp_path / "m")
    build_tiny_qwen3_5(model_dir, kind="dense", seed=0)
    cfg = compose_config("ppo_trainer", [
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.n_gpus_per_node=1",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", *TORCH_ON,
        f"global_profiler.save_path={tmp_path / 'p'}", "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true"])
    ids = torch.randint(20, 100, (2, 6))
    mask = torch.ones_like(ids)
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "responses": ids[:, 3:],
                                         "position_ids": mask.cumsum(-1) - 1, "response_mask": mask[:, 3:]})
    with single_rank_gloo():
        worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor", full_config=cfg)
        worker.init_model()
        spec = ProfilePlan.from_config(cfg).workers["actor_rollout"].as_dict()
        assert worker.start_profile(spec, "step1")
        worker.compute_log_prob(batch)
        traces = worker.stop_profile()
    assert traces == [str(tmp_path / "p" / "step1" / "actor_rollout_rank0_actor_compute_log_prob.json")]
    assert "actor_compute_log_prob" in _names(traces[0])


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout",
                                  "critic"])
def test_every_roles_discrete_reaches_the_plan(role, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace())
    group = "critic" if role == "critic" else "actor_rollout"
    on = (f"{role}.profiler.enable=true", f"{role}.profiler.ranks=[0]", "global_profiler.steps=[1]")
    torch_cfg = _cfg("global_profiler.tool=torch", *on, f"{role}.profiler.tool_config.torch.discrete=true")
    npu_cfg = _cfg("global_profiler.tool=npu", *on, f"{role}.profiler.tool_config.npu.discrete=true")
    for cfg in (torch_cfg, npu_cfg):
        assert check_profiler_config(cfg) == []
        spec = ProfilePlan.from_config(cfg).workers[group]
        assert spec.discrete and spec.discrete_roles == [role.rsplit(".", 1)[-1]]
    bad = check_profiler_config(_cfg("global_profiler.tool=torch", *on, f"{role}.profiler.tool_config.torch.discrete=2"))
    assert any(f"{role}.profiler.tool_config.torch.discrete" in p for p in bad), bad

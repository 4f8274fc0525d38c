"""Each role's ``profiler`` keys decide which ranks of which worker group write torch traces, and where.

The trainer's :class:`StepProfiler` turns the composed config into a plan and starts/stops the profiler on
the worker groups around the chosen steps; here the groups are in-process stand-ins whose ranks run the real
worker-side recorder (:class:`ProfilerWorkerMixin`), so the test reads the trace files back. Every role of
the two worker groups (actor/ref/rollout in ``actor_rollout``, the critic in ``critic``) is exercised with
its key names spelled out, so key_status.txt can point here.
"""

from __future__ import annotations

import json

import pytest

from verl.trainer.config.checks import compose_config
from verl.utils.profiler import StepProfiler
from verl.single_controller.profiler_worker import ProfilerWorkerMixin


class _Rank(ProfilerWorkerMixin):
    def __init__(self, rank):
        self.rank = rank


class _Group:
    def __init__(self, n):
        self.ranks = [_Rank(r) for r in range(n)]

    def start_profile(self, spec, label):
        return [w.start_profile(spec, label) for w in self.ranks]

    def stop_profile(self):
        return [w.stop_profile() for w in self.ranks]


def _traces(tmp_path, *overrides, steps=(1, 2), n_ranks=2):
    """Trace files of a run over ``steps``; ``n_ranks`` in-process ranks per group (one torch profiler may be
    active per process, so a test that traces every rank uses one rank)."""
    import torch

    cfg = compose_config("ppo_trainer", ["global_profiler.tool=torch", "global_profiler.steps=[2]",
                                         f"global_profiler.save_path={tmp_path / 'global'}", *overrides],
                         validate=False)
    profiler = StepProfiler(cfg, {"actor_rollout": _Group(n_ranks), "critic": _Group(n_ranks)})
    for step in steps:
        with profiler.step(step):
            (torch.randn(32, 32) @ torch.randn(32, 32)).sum()
    return sorted(str(p) for p in profiler.traces)


ROLES = {"actor_rollout_ref.actor": "actor_rollout", "actor_rollout_ref.ref": "actor_rollout",
         "actor_rollout_ref.rollout": "actor_rollout", "critic": "critic"}


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.profiler.enable", "actor_rollout_ref.ref.profiler.enable",
                                 "actor_rollout_ref.rollout.profiler.enable", "critic.profiler.enable"])
def test_enable_with_all_ranks_traces_every_rank_of_the_roles_group(key, tmp_path):
    role = key.rsplit(".profiler.", 1)[0]
    group = ROLES[role]
    assert _traces(tmp_path, f"{role}.profiler.ranks=[1]") == []  # not enabled: nothing
    got = _traces(tmp_path, f"{key}=true", f"{role}.profiler.ranks=[1]")
    assert got == [str(tmp_path / "global" / "step2" / f"{group}_rank1.json")]  # step 2 only


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.profiler.all_ranks", "actor_rollout_ref.ref.profiler.all_ranks",
                                 "actor_rollout_ref.rollout.profiler.all_ranks", "critic.profiler.all_ranks"])
def test_all_ranks(key, tmp_path):
    role = key.rsplit(".profiler.", 1)[0]
    on = _traces(tmp_path / "on", f"{role}.profiler.enable=true", f"{key}=true", n_ranks=1)
    off = _traces(tmp_path / "off", f"{role}.profiler.enable=true", f"{key}=false", n_ranks=1)  # and no ranks
    assert len(on) == 1 and off == []


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.profiler.ranks", "actor_rollout_ref.ref.profiler.ranks",
                                 "actor_rollout_ref.rollout.profiler.ranks", "critic.profiler.ranks"])
def test_ranks_choose_the_traced_ranks(key, tmp_path):
    role = key.rsplit(".profiler.", 1)[0]
    got = _traces(tmp_path, f"{role}.profiler.enable=true", f"{key}=[1]")
    assert got == [str(tmp_path / "global" / "step2" / f"{ROLES[role]}_rank1.json")]


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.profiler.save_path", "actor_rollout_ref.ref.profiler.save_path",
                                 "actor_rollout_ref.rollout.profiler.save_path", "critic.profiler.save_path"])
def test_save_path_overrides_the_global_one(key, tmp_path):
    role = key.rsplit(".profiler.", 1)[0]
    got = _traces(tmp_path, f"{role}.profiler.enable=true", f"{role}.profiler.ranks=[0]", f"{key}={tmp_path / 'mine'}")
    assert got == [str(tmp_path / "mine" / "step2" / f"{ROLES[role]}_rank0.json")]


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.profiler.tool_config.torch.contents",
                                 "actor_rollout_ref.ref.profiler.tool_config.torch.contents",
                                 "actor_rollout_ref.rollout.profiler.tool_config.torch.contents",
                                 "critic.profiler.tool_config.torch.contents"])
def test_contents_shapes_records_input_shapes(key, tmp_path):
    role = key.rsplit(".profiler.", 1)[0]

    def shapes_recorded(path):
        events = json.loads(open(path).read())["traceEvents"]
        return any("Input Dims" in (ev.get("args") or {}) for ev in events)

    base = [f"{role}.profiler.enable=true", f"{role}.profiler.ranks=[0]"]
    (plain,) = _traces(tmp_path / "plain", *base, f"{key}=[cpu]")
    (shaped,) = _traces(tmp_path / "shaped", *base, f"{key}=[cpu,shapes]")
    assert shapes_recorded(shaped) and not shapes_recorded(plain)

"""Faults injected into ``main_ppo`` (the real entry point, config, datasets, reward manager, trainer loop and
checkpoint protocol) with in-process stand-in workers: each test checks the message and what is on disk.

* a NaN/inf gradient norm: ``trainer.on_nonfinite=skip`` logs the dropped update and goes on, ``error`` stops
  naming the step (and the last checkpoint is untouched);
* a reward function returning NaN: a reward error naming the function and the row;
* SIGTERM mid-step: the step finishes, a checkpoint is written, exit 143, ``resume_mode=auto`` continues;
* upstream's ESI expiration (``trainer.esi_redundant_time``): a forced save before the instance expires;
* a full disk during a save; a truncated or partial checkpoint on resume; pruning next to a partial directory.

The same faults against the real model (metrics of the resumed run equal to an uninterrupted one, a Ray worker
killed mid-step) are in test_faults_e2e.py. docs/advance/faults.md lists them all.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import time

import pytest
import torch

from tests.trainer.test_keys_trainer_loop import FakeActorRollout
from verl.utils.checkpoint import step_dirs

BASE = ("trainer.total_training_steps=4", "trainer.test_freq=-1", "trainer.logger=[console,file]",
        "trainer.val_before_train=false")


class ScriptedActor(FakeActorRollout):
    """The loop's stand-in actor with hooks: ``grad_norm(step)`` for the reported gradient norm, ``on_update(step)``
    and ``on_save(path, step)`` run inside the call, as a fault in the worker would."""

    grad_norm = staticmethod(lambda step: 1.0)
    on_update = staticmethod(lambda step: None)
    on_save = staticmethod(lambda path, step: None)

    def update_actor(self, data):
        super().update_actor(data)
        step = len(self.updates) + self.resumed_at
        self.on_update(step)
        g = self.grad_norm(step)
        return [{"actor/pg_loss": 0.0 if math.isfinite(g) else g, "actor/grad_norm": [g]}]

    resumed_at = 0

    def save_checkpoint(self, path, global_step=0):
        super().save_checkpoint(path, global_step)
        with open(os.path.join(path, f"model_world_size_1_rank_0.pt"), "wb") as f:
            torch.save({"step": global_step, "w": torch.arange(1000.0)}, f)
        self.on_save(path, global_step)

    def load_checkpoint(self, path):
        super().load_checkpoint(path)
        step_dirs.torch_load(os.path.join(path, "model_world_size_1_rank_0.pt"))
        type(self).resumed_at = step_dirs.step_of(os.path.dirname(path))


@pytest.fixture
def main(tmp_path, monkeypatch):
    """``main(*overrides, **hooks)`` -> (exit code, stdout, stderr, actor, metrics by step) of ``main_ppo.main`` on the
    demo, with a :class:`ScriptedActor` whose hooks are ``hooks``."""
    from verl.trainer import main_ppo
    from verl.utils.tokenizer import load_tokenizer_and_processor

    demo = os.environ.get("VERL_TEST_DEMO_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "verl-test-demo")
    monkeypatch.setenv("VERL_DEMO_DIR", demo)
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(log))

    def _main(*overrides, capsys, **hooks):
        actors = []

        def launch(cfg, specs):
            tok, _ = load_tokenizer_and_processor(cfg.actor_rollout_ref.model)
            cls = type("Actor", (ScriptedActor,), {k: staticmethod(v) for k, v in hooks.items()})
            cls.resumed_at = 0
            actors.append(cls(cfg, tok))
            return {"actor_rollout": actors[-1]}

        monkeypatch.setattr(main_ppo, "launch_workers", launch)
        if log.exists():
            log.unlink()
        capsys.readouterr()
        code = main_ppo.main([*BASE, f"trainer.default_local_dir={tmp_path / 'ckpt'}", *overrides])
        out = capsys.readouterr()
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return code, out.out, out.err, (actors[-1] if actors else None), {r["step"]: r["data"] for r in records}

    return _main


def _last(err: str) -> str:
    """The error paragraph: stderr's last line (the demo banner and the progress bar come first)."""
    return err.strip().splitlines()[-1]


def _latest(tmp_path) -> str:
    return (tmp_path / "ckpt" / step_dirs.LATEST_FILE).read_text().strip()


# ------------------------------------------------------------------------------------------ non-finite
def test_nonfinite_grad_is_skipped_and_logged(main, capsys):
    """trainer.on_nonfinite=skip (the default, upstream's behaviour): the run goes on; the step's metrics and a
    warning say which update was dropped."""
    code, _, err, actor, metrics = main(capsys=capsys, grad_norm=lambda s: float("nan") if s == 2 else 1.0)
    assert code == 0 and len(actor.updates) == 4
    assert metrics[2]["actor/nonfinite_updates_skipped"] == 1.0
    assert all("actor/nonfinite_updates_skipped" not in metrics[s] for s in (1, 3, 4))
    assert "step 2: the actor update: 1 of its 1 optimizer steps had a non-finite gradient norm (nan)" in err
    assert "skipped (trainer.on_nonfinite=skip)" in err


def test_nonfinite_grad_stops_the_run_with_on_nonfinite_error(main, capsys, tmp_path):
    code, _, err, actor, metrics = main("trainer.on_nonfinite=error", "trainer.save_freq=1", capsys=capsys,
                                        grad_norm=lambda s: float("inf") if s == 3 else 1.0)
    assert code == 1
    assert _last(err).startswith("Training error: step 3: the actor update: 1 of its 1 optimizer steps had a non-finite "
                          "gradient norm (inf)")
    assert "trainer.on_nonfinite=error" in err and "Nothing of step 3 was saved" in err
    assert len(actor.updates) == 3 and sorted(metrics) == [1, 2]
    assert _latest(tmp_path) == "2" and not (tmp_path / "ckpt" / "global_step_3").exists()


def test_bad_on_nonfinite_value_is_a_config_error(main, capsys):
    code, _, err, _, _ = main("trainer.on_nonfinite=ignore", capsys=capsys)
    assert code == 2 and "trainer.on_nonfinite" in err


def test_nan_reward_names_the_function_and_the_row(main, capsys, tmp_path):
    scorer = tmp_path / "score.py"
    scorer.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                      "    return float('nan') if extra_info['index'] == 3 else 1.0\n")
    code, _, err, actor, _ = main(f"reward.custom_reward_function.path={scorer}", "data.shuffle=false",
                                  "reward.custom_reward_function.name=my_score", capsys=capsys)
    assert code == 1 and actor.updates == []
    first = _last(err)
    assert first.startswith("Reward error:") and f"my_score (from {scorer})" in first
    rows = [i for i in range(8 * 16) if i // 8 == 3]  # prompt 3's eight responses (rollout.n=8, no shuffle)
    assert f"returned nan on row {rows[0]} " in first


def test_nan_from_a_reward_manager_names_it_and_the_rows(main, capsys, tmp_path):
    f = tmp_path / "nan_manager.py"
    f.write_text("import torch\n"
                 "class NaNManager:\n"
                 "    def __init__(self, tokenizer, num_examine, compute_score, reward_fn_key, **kw):\n"
                 "        pass\n"
                 "    def __call__(self, data, return_dict=False):\n"
                 "        r = torch.zeros(data.batch['responses'].shape)\n"
                 "        r[5, 0] = float('inf')\n"
                 "        return {'reward_tensor': r, 'reward_extra_info': {}} if return_dict else r\n")
    code, _, err, _, _ = main("reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={f}",
                              "reward.reward_manager.name=NaNManager", capsys=capsys)
    assert code == 1 and "Reward error:" in err and "NaNManager" in err and "non-finite score on row 5" in err


# ------------------------------------------------------------------------------------------ preemption
def test_sigterm_mid_step_saves_the_step_exits_143_and_resumes(main, capsys, tmp_path):
    """The signal arrives inside step 2's actor update (save_freq=-1: no checkpoint would be written otherwise)."""
    code, _, err, actor, metrics = main(capsys=capsys, on_update=lambda s: s == 2 and os.kill(os.getpid(),
                                                                                           signal.SIGTERM))
    assert code == 143
    assert "SIGTERM received: finishing the current step" in err
    assert "stopped after step 2; checkpoint" in err and "global_step_2 written" in err and "Exit code 143" in err
    assert [s for _, s in actor.saved] == [2] and sorted(metrics) == [1, 2]  # step 2 finished, logged, saved
    assert _latest(tmp_path) == "2"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the trainer's handler is gone again
    code, out, _, actor, metrics = main(capsys=capsys)
    assert code == 0 and "Resuming from" in out and actor.loaded[0].endswith("global_step_2/actor")
    assert len(actor.updates) == 2 and sorted(metrics) == [3, 4]


def test_sigterm_while_a_step_is_logged_still_saves_that_step(main, capsys, tmp_path, monkeypatch):
    """The signal lands after step 2's update, while its metrics are logged (the moment "step 2 |" is printed,
    when a scheduler watching the log would send it): step 2 is saved before the run stops, not lost."""
    from verl.utils.tracking import Tracking

    log = Tracking.log

    def log_then_signal(self, data, step, backend=None):
        log(self, data, step, backend)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Tracking, "log", log_then_signal)
    code, _, err, actor, metrics = main(capsys=capsys)
    assert code == 143 and "stopped after step 2; checkpoint" in err and "global_step_2 written" in err
    assert [s for _, s in actor.saved] == [2] and sorted(metrics) == [1, 2]
    assert _latest(tmp_path) == "2"
    monkeypatch.setattr(Tracking, "log", log)
    code, out, _, actor, metrics = main(capsys=capsys)
    assert code == 0 and actor.loaded[0].endswith("global_step_2/actor") and sorted(metrics) == [3, 4]


def test_sigterm_on_the_last_step_just_finishes(main, capsys, tmp_path):
    code, _, _, actor, _ = main(capsys=capsys, on_update=lambda s: s == 4 and os.kill(os.getpid(), signal.SIGTERM))
    assert code == 0 and len(actor.updates) == 4


def test_a_second_sigterm_exits_at_once():
    from verl.trainer.faults import PreemptionGuard

    with PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested == "SIGTERM"
        with pytest.raises(SystemExit) as exc:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exc.value.code == 143


# ------------------------------------------------------------------------------------------ ESI expiration
def test_esi_expiration_forces_a_save(main, capsys, tmp_path, monkeypatch):
    """Upstream's rule: with save_freq > 0, a checkpoint is forced once the instance expires within the longest
    step + 60 s + trainer.esi_redundant_time."""
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() + 1000))
    code, out, _, actor, _ = main("trainer.save_freq=100", capsys=capsys)
    assert code == 0 and [s for _, s in actor.saved] == [4]  # 1000 s left: nothing forced, the last step saved
    code, out, _, actor, _ = main("trainer.save_freq=100", "trainer.esi_redundant_time=2000", "trainer.resume_mode=disable",
                                  capsys=capsys)
    assert code == 0 and [s for _, s in actor.saved] == [1, 2, 3, 4]
    assert out.count("Force saving checkpoint: ESI instance expiration approaching.") == 4  # as upstream: every step
    code, out, _, actor, _ = main("trainer.esi_redundant_time=2000", "trainer.resume_mode=disable", capsys=capsys)
    assert actor.saved == []  # as upstream: saving off (save_freq=-1) stays off


def test_should_save_ckpt_esi_reads_both_platforms(monkeypatch):
    from verl.trainer.faults import should_save_ckpt_esi

    for var in ("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"):
        monkeypatch.delenv(var, raising=False)
    assert not should_save_ckpt_esi(10, redundant_time=10**6)
    monkeypatch.setenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(int(time.time()) + 300))
    assert should_save_ckpt_esi(10, redundant_time=300) and not should_save_ckpt_esi(10, redundant_time=0)
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() + 300))
    assert should_save_ckpt_esi(10, redundant_time=300) and not should_save_ckpt_esi(0, redundant_time=300)


# ------------------------------------------------------------------------------------------ storage
def _disk_full_on(step):
    def on_save(path, global_step):
        if global_step == step:
            with open(os.path.join(path, "optim_world_size_1_rank_0.pt.tmp"), "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, "optim_world_size_1_rank_0.pt"))
    return on_save


def test_disk_full_during_save_keeps_the_previous_checkpoint(main, capsys, tmp_path):
    code, _, err, _, metrics = main("trainer.save_freq=2", capsys=capsys, on_save=_disk_full_on(4))
    assert code == 1
    first = _last(err)
    assert first.startswith("Checkpoint error: saving the checkpoint") and "global_step_4 failed (OSError: [Errno 28] " \
        "No space left on device" in first
    assert "the partial global_step_4 was removed" in first and "global_step_2 is still the latest complete" in first
    assert _latest(tmp_path) == "2" and not (tmp_path / "ckpt" / "global_step_4").exists()
    assert step_dirs.manifest_problem(str(tmp_path / "ckpt" / "global_step_2")) is None
    code, out, _, actor, metrics = main(capsys=capsys)  # and it resumes from there
    assert code == 0 and "Resuming from" in out and actor.loaded[0].endswith("global_step_2/actor")


def test_failed_tmp_write_leaves_no_tmp_file(tmp_path, monkeypatch):
    def full(obj, f, *a, **kw):
        with open(f, "wb") as fh:
            fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError):
        step_dirs.atomic_torch_save({"a": 1}, str(tmp_path / "x.pt"))
    assert os.listdir(tmp_path) == []


def test_truncated_checkpoint_is_refused_naming_the_file(main, capsys, tmp_path):
    code, *_ = main("trainer.save_freq=2", capsys=capsys)
    assert code == 0 and _latest(tmp_path) == "4"
    shard = tmp_path / "ckpt" / "global_step_4" / "actor" / "model_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err, actor, _ = main("trainer.total_training_steps=6", capsys=capsys)
    assert code == 1 and actor.loaded == []  # refused before any worker loads a thing
    assert f"Checkpoint error: cannot resume from {tmp_path / 'ckpt' / 'global_step_4'}: {shard} is 100 bytes" in err
    earlier = tmp_path / "ckpt" / "global_step_2"
    assert f"trainer.resume_mode=resume_path trainer.resume_from_path={earlier}" in err
    code, _, _, actor, _ = main("trainer.total_training_steps=6", "trainer.resume_mode=resume_path",
                                f"trainer.resume_from_path={earlier}", "trainer.save_freq=2", capsys=capsys)
    assert code == 0 and actor.loaded == [str(earlier / "actor")] and len(actor.updates) == 4
    # A checkpoint without a manifest (upstream's, or one from before manifests): the load itself names the file.
    os.remove(tmp_path / "ckpt" / "global_step_6" / step_dirs.MANIFEST_FILE)
    shard = tmp_path / "ckpt" / "global_step_6" / "actor" / "model_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err, _, _ = main("trainer.total_training_steps=8", capsys=capsys)
    assert code == 1 and f"Checkpoint error: checkpoint file {shard} (100 bytes) cannot be read" in err
    assert f"trainer.resume_from_path={tmp_path / 'ckpt' / 'global_step_4'} " in err  # written again since


def test_missing_latest_directory_is_a_checkpoint_error(main, capsys, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / step_dirs.LATEST_FILE).write_text("7")
    code, _, err, _, _ = main(capsys=capsys)
    assert code == 1 and "Checkpoint error: the checkpoint directory" in err and "global_step_7 does not exist" in err


def test_prune_never_deletes_the_marked_step_next_to_a_newer_partial_one(tmp_path):
    """A failed save of step 6 left global_step_6 behind (unmarked); the run resumed from 4 and saves 5: keeping
    one checkpoint must keep 5 (the marked one), not the partial 6."""
    for s in (4, 5, 6):
        (tmp_path / f"global_step_{s}").mkdir()
    step_dirs.mark_latest(str(tmp_path), 5)
    step_dirs.prune_steps(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path)) == ["global_step_5", "global_step_6", step_dirs.LATEST_FILE]

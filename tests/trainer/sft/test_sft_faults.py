"""Faults in the SFT trainer (the embedded demo on CPU, in process): SIGTERM mid-step saves the step and the
resumed run continues exactly; a NaN loss drops the update and is logged (``trainer.on_nonfinite=skip``) or stops
the run naming the step (``error``); a truncated checkpoint is refused naming the file. See
docs/advance/faults.md."""

from __future__ import annotations

import math
import os
import signal

import pytest

from tests.trainer.sft.test_sft_trainer import COMMON, run_in_process


def _at_step(monkeypatch, step: int, action):
    """Run ``action()`` inside the train step ``step`` (counting from the run's first step)."""
    from verl.trainer.sft.trainer import SFTTrainer

    real = SFTTrainer.train_step
    seen = []

    def train_step(self, rows):
        seen.append(1)
        if len(seen) == step:
            action()
        return real(self, rows)

    monkeypatch.setattr(SFTTrainer, "train_step", train_step)


def test_sigterm_saves_the_step_and_the_resumed_run_matches(tmp_path, monkeypatch, capsys, straight):
    from verl.trainer.faults import Preempted

    with monkeypatch.context() as m:
        _at_step(m, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
        with pytest.raises(Preempted) as exc:
            run_in_process(tmp_path / "b", [*COMMON, "trainer.resume_mode=disable"])
    assert exc.value.step == 2 and exc.value.checkpoint.endswith("global_step_2")
    assert "SIGTERM received: stopped after step 2" in str(exc.value)
    ckpt = tmp_path / "b" / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    resumed = run_in_process(tmp_path / "b", [*COMMON, "trainer.resume_mode=auto"])
    assert [h["training/global_step"] for h in resumed["history"]] == [3, 4]
    for got, want in zip(resumed["history"], straight["history"][2:]):
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert got[key] == want[key], key
    assert resumed["history"][-1]["val/loss"] == straight["history"][-1]["val/loss"]
    # A truncated shard of that checkpoint is refused naming the file.
    shard = ckpt / "global_step_2" / "model_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    from verl.utils.checkpoint.step_dirs import CheckpointError

    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")  # (the resumed run saved no later step)
    with pytest.raises(CheckpointError, match=f"cannot resume from {ckpt / 'global_step_2'}: {shard} is 1000 bytes"):
        run_in_process(tmp_path / "b", [*COMMON, "trainer.resume_mode=auto", "trainer.total_training_steps=6"])


@pytest.mark.parametrize("mode", ["skip", "error"])
def test_nan_loss_is_skipped_or_stops_naming_the_step(tmp_path, monkeypatch, capsys, mode):
    import torch

    import verl.trainer.sft.trainer as sft
    from verl.trainer.faults import RunFault

    real = sft.make_sft_loss
    calls = []

    def make_loss(*args, **kwargs):
        inner = real(*args, **kwargs)
        calls.append(1)
        if len(calls) != 2:
            return inner

        def nan_loss(outputs, mb):
            loss, metrics = inner(outputs, mb)
            return loss * torch.tensor(float("nan")), metrics

        return nan_loss

    monkeypatch.setattr(sft, "make_sft_loss", make_loss)
    overrides = [*COMMON, "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.resume_mode=disable",
                 f"trainer.on_nonfinite={mode}"]
    if mode == "error":
        with pytest.raises(RunFault, match=r"step 2: the SFT update: 1 of its 1 optimizer steps had a non-finite "
                                           r"gradient norm \(nan\)"):
            run_in_process(tmp_path, overrides)
        return
    result = run_in_process(tmp_path, overrides)
    steps = {h["training/global_step"]: h for h in result["history"]}
    assert sorted(steps) == [1, 2] and steps[2]["train/nonfinite_updates_skipped"] == 1.0
    assert "train/nonfinite_updates_skipped" not in steps[1] and math.isnan(steps[2]["train/grad_norm"])
    assert "step 2: the SFT update" in capsys.readouterr().err

"""What the trainers do when a run meets a fault: non-finite updates, preemption (SIGTERM), an expiring
elastic instance (upstream's ESI keys), a failed or partial checkpoint, a worker that died.

Each fault ends in one of two ways: the run carries on and logs what happened, or it stops with one paragraph
naming the fault, the step, and what is safe on disk (exit code 1, :class:`RunFault`), never a hang or a bare
traceback. Preemption is the exception: the trainer finishes the step it is in, writes a complete checkpoint and
exits with :data:`PREEMPTED_EXIT_CODE`. ``docs/advance/faults.md`` lists every fault with the test that
injects it.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Iterable, Optional

from verl.single_controller.worker_group import WorkerDied
from verl.utils.user_errors import UserFacingError

__all__ = ["PREEMPTED_EXIT_CODE", "NONFINITE_MODES", "RunFault", "Preempted", "PreemptionGuard", "WorkerDied",
           "nonfinite_update_check", "should_save_ckpt_esi"]

# 128 + SIGTERM: what a shell reports for a process SIGTERM ended. Not 0, so a job runner that restarts failed
# jobs (a Kubernetes Job's backoffLimit, `until python -m verl.trainer.main_ppo ...; do :; done`) starts the
# run again, and trainer.resume_mode=auto continues from the checkpoint written on the way out.
PREEMPTED_EXIT_CODE = 143

# trainer.on_nonfinite: what a NaN/inf loss or gradient norm in an update does.
NONFINITE_MODES = ("skip", "error")


class RunFault(UserFacingError):
    """A fault that stops the run: printed as one paragraph (``<kind> error: ...``), exit code 1."""


class Preempted(Exception):
    """Raised by a trainer loop after it saved on SIGTERM; the entry point exits with PREEMPTED_EXIT_CODE."""

    def __init__(self, step: int, checkpoint: Optional[str], signame: str = "SIGTERM", detail: str = ""):
        self.step, self.checkpoint, self.signame = step, checkpoint, signame
        if not detail:
            detail = (f"stopped after step {step}; checkpoint {checkpoint} written" if checkpoint else
                      f"stopped before training a step (the last completed step is {step}); no new checkpoint")
        super().__init__(f"{signame} received: {detail}. Start the same command again (trainer.resume_mode=auto) "
                         f"to continue. Exit code {PREEMPTED_EXIT_CODE}.")


# ------------------------------------------------------------------------------------------ non-finite
def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return True  # not a number: nothing to judge


def _values(per_rank: list[dict], key: str) -> list:
    """The per-update values of ``key`` on the first rank that reports it (every rank sees the same global grad
    norm), or []."""
    for metrics in per_rank or []:
        if key in metrics:
            v = metrics[key]
            return list(v) if isinstance(v, (list, tuple)) else [v]
    return []


def nonfinite_update_check(role: str, per_rank: list[dict], step: int, mode: str,
                           loss_keys: Iterable[str] = (), label: Optional[str] = None) -> dict:
    """Inspect one role's update metrics (``{role}/grad_norm`` per optimizer step, lists per rank).

    The engines never apply a step whose gradient norm is NaN/inf (upstream's behaviour: the gradients are
    dropped). ``mode="skip"`` logs how many were dropped (returned as ``{role}/nonfinite_updates_skipped``, and
    printed); ``mode="error"`` stops the run with a :class:`RunFault` naming the step. A non-finite loss with a
    finite gradient (a loss term that carries no gradient) is reported the same way.
    """
    grads = _values(per_rank, f"{role}/grad_norm")
    bad = [i for i, g in enumerate(grads) if not _finite(g)]
    losses = {k: _values(per_rank, k) for k in loss_keys}
    bad_loss = {k: v for k, v in losses.items() if any(not _finite(x) for x in v)}
    if not bad and not bad_loss:
        return {}
    parts = []
    if bad:
        parts.append(f"{len(bad)} of its {len(grads)} optimizer steps had a non-finite gradient norm "
                     f"({', '.join(str(grads[i]) for i in bad[:4])})")
    for k, v in bad_loss.items():
        parts.append(f"{k} was {', '.join(str(x) for x in v if not _finite(x))}")
    what = f"step {step}: the {label or role} update: " + "; ".join(parts)
    if mode == "error":
        raise RunFault("Training", f"{what} (a NaN/inf loss or gradient), and trainer.on_nonfinite=error",
                       f"Nothing of step {step} was saved: the last checkpoint is as it was. Lower the learning rate, "
                       "check the reward and advantages for NaN/inf, or set trainer.on_nonfinite=skip to drop such "
                       "updates and go on.")
    print(f"WARNING: {what}; those updates were skipped (trainer.on_nonfinite=skip)", file=sys.stderr, flush=True)
    return {f"{role}/nonfinite_updates_skipped": float(len(bad))}


def check_nonfinite_mode(mode: str) -> str:
    if mode not in NONFINITE_MODES:
        raise RunFault("Config", f"trainer.on_nonfinite={mode!r}; expected one of {', '.join(NONFINITE_MODES)}")
    return mode


# ------------------------------------------------------------------------------------------ preemption
class PreemptionGuard:
    """While entered (on the main thread), SIGTERM only sets :attr:`requested`: the loop checks it between steps,
    saves and raises :class:`Preempted`. A second SIGTERM ends the process at once, as without the guard.
    Elsewhere (not the main thread) it does nothing."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.signals = tuple(signals)
        self.requested: Optional[str] = None
        self.received_at: Optional[float] = None
        self._saved: dict = {}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None:  # the second one: leave now
            self._restore()
            raise SystemExit(128 + signum)
        self.requested, self.received_at = name, time.time()
        print(f"\n{name} received: finishing the current step, then saving a checkpoint and exiting "
              f"(send it again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._saved[s] = signal.signal(s, self._handler)
        return self

    def _restore(self):
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved = {}

    def __exit__(self, *exc):
        self._restore()
        return False


# ------------------------------------------------------------------------------------------ ESI expiration
def should_save_ckpt_esi(max_steps_duration: float, save_ckpt_duration: float = 60, redundant_time: float = 0) -> bool:
    """Upstream's rule (``trainer.esi_redundant_time``): whether the elastic instance the run is on expires before
    one more step and a checkpoint could finish. The expiration comes from the platform's environment:
    ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (Volcano Engine ML platform, seconds since the epoch) or
    ``SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (AWS); neither set: never."""
    exp_mlp = os.getenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    exp_aws = os.getenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    margin = save_ckpt_duration + max_steps_duration + redundant_time
    if exp_mlp:
        try:
            remaining = float(exp_mlp) - time.time()
        except ValueError:
            return False
        return remaining > 0 and max_steps_duration > 0 and remaining <= margin
    if exp_aws:
        try:
            remaining = int(exp_aws) - time.time()
        except ValueError:
            return False
        return remaining < margin
    return False

"""How far the rollout pool may run ahead of the trainer, in generation chunks.

A chunk is one generation call on the rollout pool (``chunk_prompts`` prompts times ``rollout.n``); a trainer
step consumes ``chunks_per_step`` of them. The rollouter may start a chunk only while both limits allow it:

* ``max_queued``: chunks waiting in the queue (one-step off-policy: one step's worth, so generation of step
  k+1 overlaps the training of step k and no more);
* ``max_per_version``: chunks generated with one weight version (fully async, upstream's rule): the trainer
  needs ``require_batches * ppo_mini_batch_size`` prompts per step and syncs every
  ``trigger_parameter_sync_step`` steps, and the rollouter may produce ``1 + staleness_threshold`` times what
  the trainer consumes between two syncs before it waits for new weights; chunks still queued at a sync count
  against the new version's allowance. ``staleness_threshold=0`` is the synchronous schedule (generate, train,
  sync, generate, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Schedule:
    mode: str  # "one_step_off" or "fully_async"
    chunk_prompts: int  # prompts per generation call
    chunks_per_step: int  # chunks one trainer step consumes
    trigger_parameter_sync_step: int  # trainer steps between weight syncs
    max_queued: Optional[int]  # None: no limit
    max_per_version: Optional[int]  # None: no limit
    staleness_threshold: float = 0.0

    @property
    def prompts_per_step(self) -> int:
        return self.chunk_prompts * self.chunks_per_step


def _chunk_prompts(gen_batch_size, per_step: int, key: str) -> int:
    chunk = int(gen_batch_size or 0) or per_step
    if per_step % chunk:
        raise ValueError(f"data.gen_batch_size={chunk} must divide the prompts one trainer step consumes "
                         f"({per_step}, {key})")
    return chunk


def one_step_off_schedule(cfg) -> Schedule:
    """Generation of step k+1 overlaps training of step k; weights are synced after every step."""
    per_step = int(cfg.data.train_batch_size)
    chunk = _chunk_prompts(cfg.data.get("gen_batch_size"), per_step, "data.train_batch_size")
    return Schedule("one_step_off", chunk, per_step // chunk, 1, max_queued=per_step // chunk, max_per_version=None,
                    staleness_threshold=1.0)


def fully_async_schedule(cfg) -> Schedule:
    at = cfg.async_training
    per_step = int(at.require_batches) * int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    chunk = _chunk_prompts(cfg.data.get("gen_batch_size"), per_step,
                           "async_training.require_batches * actor_rollout_ref.actor.ppo_mini_batch_size")
    trigger = int(at.trigger_parameter_sync_step)
    threshold = float(at.staleness_threshold)
    # Upstream's max_required_samples = required_samples * (staleness_threshold + 1) * trigger, in chunks.
    cap = math.ceil(per_step // chunk * trigger * (1.0 + threshold) - 1e-9)
    return Schedule("fully_async", chunk, per_step // chunk, trigger, max_queued=None, max_per_version=cap,
                    staleness_threshold=threshold)

"""The asynchronous trainer: consumes generated chunks from the rollouter's queue, trains on the trainer pool,
and pushes new weights to the rollout pool every ``trigger_parameter_sync_step`` steps.

Everything after generation (old/ref log-probs, advantages, the updates, validation, logging) is
:class:`~verl.trainer.ppo.ray_trainer.RayPPOTrainer`'s; this class changes where batches come from, when
weights move, which correction stale samples get, and what a checkpoint holds.

Checkpoints hold the trainer's state exactly (actor and optimizer, step, parameter version, the prompt
position of the last chunk *consumed*, and the rollout pool's sampling RNG right after generating it). The
queue's contents and the chunks in flight are **dropped**, partial responses included (with
``async_training.partial_rollout`` a response in flight may already hold tokens of several versions; none of it
is kept): a resumed run regenerates those prompts from scratch with the resumed weights, so with
``staleness_threshold=0`` a resumed run continues exactly like an uninterrupted one.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, _combine_agent_loop_metrics, marked_timer
from verl.workers.rollout.hf_engine.session import COUNTED_STATS

from . import staleness as st
from .pool import RolloutPool, pipeline_depth
from .rollouter import Rollouter
from .schedule import Schedule

logger = logging.getLogger(__name__)

QUEUE_POLICY = "dropped"  # what a checkpoint keeps of the queue (see the module docstring)

# The engines' chunk-pipeline counts over disjoint stretches of their work (each chunk's collect reports the
# stretch since the previous one): a step's figures are their sums, so 1 - slot_steps / (decode_steps x slots)
# stays the share of idle decode slots over the step; everything else combines as the synchronous trainer's
# ranks do.
_SUMMED = tuple(f"perf/hf_engine/{k}" for k in COUNTED_STATS) + \
    tuple(f"perf/vllm/{k}" for k in ("steps", "pauses", "reprefills", "reprefill_tokens"))


def combine_chunk_metrics(per_chunk: list[dict]) -> dict:
    out = _combine_agent_loop_metrics(per_chunk)
    for k in _SUMMED:
        vals = [m[k] for m in per_chunk if k in m]
        if vals:
            out[k] = float(sum(vals))
    return out


class AsyncPPOTrainer(RayPPOTrainer):
    """``worker_groups`` holds ``actor_rollout`` (the trainer pool: actor, and reference where needed) and
    ``rollout`` (the rollout pool)."""

    def __init__(self, *args, schedule: Schedule, **kwargs):
        self.schedule = schedule
        super().__init__(*args, **kwargs)
        if self.rollout_wg is self.actor_rollout_wg:
            raise ValueError("the asynchronous trainer needs a separate rollout worker group ('rollout')")
        self.param_version = 0
        self.rollouter: Optional[Rollouter] = None
        self._consumed_loader_state: Optional[dict] = None
        self._consumed_rng: Optional[list] = None
        self._stale_samples_processed = 0
        self._wait_s = 0.0
        self._busy_s = 0.0

    def _total_steps(self) -> int:
        per_epoch = len(self.train_dataloader) // self.schedule.chunks_per_step
        if per_epoch == 0:
            raise ValueError(f"the training set has {len(self.train_dataset)} rows, fewer than the "
                             f"{self.schedule.prompts_per_step} prompts one trainer step consumes")
        total = per_epoch * self.config.trainer.total_epochs
        if self.config.trainer.get("total_training_steps"):
            total = int(self.config.trainer.total_training_steps)
        return total

    # ------------------------------------------------------------------ weights
    def _export_weights(self) -> list:
        return self.actor_rollout_wg.export_rollout_weights()[0]

    # ------------------------------------------------------------------ fit hooks
    def _before_steps(self) -> None:
        # The rollout pool starts from the trainer's weights (the checkpoint's, on resume) and sampling RNG.
        self.rollout_wg.load_rollout_weights(self._export_weights(), self.param_version)
        if self._consumed_rng is not None:
            self.rollout_wg.set_rollout_rng_state(self._consumed_rng)

    def _start_steps(self) -> None:
        pipelining = all(self.rollout_wg.rollout_pipelining())
        depth = pipeline_depth(self.config, self.schedule, pipelining)
        # Partial rollout (weights installed with chunks in flight) needs the workers' decode sessions; a pool
        # that cannot pipeline drains at each sync as without it.
        wanted = bool((self.config.get("async_training") or {}).get("partial_rollout", False))
        partial = wanted and pipelining
        if wanted and not partial:
            logger.warning("async_training.partial_rollout: this rollout pool cannot keep chunks in flight (its "
                           "engine has no chunk pipeline here: the built-in engine without a decode runner for "
                           "this model, vLLM with ranks sharing an engine or recording routes, or a vLLM "
                           "server); weights go in between chunks instead")
        pool = RolloutPool(self, depth, session=pipelining and (depth > 1 or partial))
        self.rollouter = Rollouter(self.schedule, pool, self._batch_stream(), self.train_dataloader.state_dict,
                                   version=self.param_version, depth=depth, partial=partial)
        self.rollouter.start()

    def _end_steps(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop()

    def _validate_now(self) -> dict[str, float]:
        if self.rollouter is None:
            return self._validate()
        with self.rollouter.exclusive():  # between chunks, on the newest synced weights
            return self._validate()

    def _fit_step(self) -> dict[str, Any]:
        cfg = self.config
        timing: dict[str, float] = {}
        self._timing = timing
        metrics: dict[str, Any] = {}
        with marked_timer("step", timing):
            with marked_timer("gen", timing):  # the trainer's wait for samples
                chunks, waited = self.rollouter.take(self.schedule.chunks_per_step)
            for c in chunks:  # each chunk carries the step that generated it; the batch is this step's
                c.batch.meta_info.pop("global_steps", None)
            batch = DataProto.concat([c.batch for c in chunks])
            batch.meta_info["global_steps"] = self.global_steps
            metrics.update(combine_chunk_metrics([c.metrics for c in chunks]))
            ages = st.sample_staleness(batch, self.param_version)
            metrics.update(st.staleness_metrics(ages))
            metrics.update(st.partial_metrics(batch, self.param_version))
            self._stale_batch = bool((ages > 0).any())
            self._stale_samples_processed += int((ages > 0).sum())
            with marked_timer("train", timing):
                batch = self._train_on_batch(batch, timing, metrics)
            self._consumed_loader_state = chunks[-1].loader_state
            self._consumed_rng = chunks[-1].rng_state
            if self.global_steps % self.schedule.trigger_parameter_sync_step == 0:
                with marked_timer("sync_rollout_weights", timing):
                    self.param_version += 1
                    self.rollouter.offer_weights(self._export_weights(), self.param_version)
        metrics.update(self.rollouter.read_utilization())
        step_s = timing["step"]
        metrics.update({
            "fully_async/total_wait_time": waited,
            "fully_async/trainer/idle_ratio": waited / step_s if step_s > 0 else 0.0,
            "fully_async/count/current_param_version": self.param_version,
            "fully_async/count/stale_samples_processed": self._stale_samples_processed,
            "fully_async/count/total_generated_samples": self.rollouter.total_generated_samples,
            "fully_async/queue_size": self.rollouter.queue_size(),
            "static/staleness_threshold": self.schedule.staleness_threshold,
        })
        return self._step_metrics(batch, timing, metrics)

    def _rollout_correction_config(self, batch: DataProto):
        rc, applied = st.default_correction(self.config.algorithm.get("rollout_correction"),
                                            getattr(self, "_stale_batch", False))
        self._default_is = applied
        return rc

    def _step_metrics(self, batch, timing, metrics):
        metrics.update(st.default_correction_flag(getattr(self, "_default_is", False)))
        return super()._step_metrics(batch, timing, metrics)

    # ------------------------------------------------------------------ checkpoints
    def _data_state(self) -> dict:
        return {"loader": self._consumed_loader_state or self.train_dataloader.state_dict(),
                "param_version": self.param_version, "rollout_rng": self._consumed_rng, "queue": QUEUE_POLICY}

    def _load_data_state(self, state: dict) -> None:
        if "loader" not in state:
            raise ValueError("this checkpoint was written by the synchronous trainer; the asynchronous modes "
                             "resume only from their own checkpoints (they also keep the weight version)")
        self.train_dataloader.load_state_dict(state["loader"])
        self._consumed_loader_state = state["loader"]
        self.param_version = int(state["param_version"])
        self._consumed_rng = state.get("rollout_rng")

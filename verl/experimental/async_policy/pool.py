"""The rollouter's handle on the rollout pool: submit a chunk, collect it (generated and scored), install weights.

With the built-in engine the pool keeps several chunks in flight (:mod:`verl.workers.rollout.pipelined`):
``submit`` dispatches the chunk's prompts over the data-parallel ranks the way ``generate_sequences`` is
dispatched and returns at once; ``collect`` gathers the chunk back and scores it on the controller. How many
chunks may be in flight is :func:`pipeline_depth`'s business. A pool that cannot pipeline (another rollout, an
agent loop, ranks sharing one engine) generates at ``collect`` time, one chunk per call, as before. With
``async_training.partial_rollout`` the pool keeps a session even at depth 1, so that weights can go in while a
chunk is in flight (``load_rollout_weights(..., in_flight=True)``), and ``ready`` lets the rollouter poll rather
than block in a collect.

The rollout ranks draw each chunk's sampling seed from their global RNG when the chunk starts, so the RNG state
a chunk carries (a checkpoint's part) is read right after its submit: the state after that chunk, whatever was
submitted behind it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

from .schedule import Schedule


def pipeline_depth(cfg, schedule: Schedule, pipelining: bool) -> int:
    """Chunks in flight on the rollout pool: upstream's ``async_training.concurrent_samples_per_replica`` prompts
    (generation groups of ``rollout.n``) per rollout replica, in whole chunks, at least one; 1 where the pool
    cannot pipeline. At most the schedule's allowance per weight version and its queue room (with
    ``staleness_threshold=0`` and a step per chunk that is 1); the rollouter applies those limits per chunk too."""
    if not pipelining:
        return 1
    per_replica = (cfg.get("async_training") or {}).get("concurrent_samples_per_replica")
    if per_replica is None:
        return 1
    replicas = int(cfg.rollout.n_gpus_per_node) * int(cfg.rollout.nnodes)
    depth = max(1, int(per_replica) * replicas // schedule.chunk_prompts)
    # More than one version's allowance (or the queue's room) can never be in flight at once.
    for bound in (schedule.max_per_version, schedule.max_queued):
        if bound is not None:
            depth = min(depth, max(1, int(bound)))
    return depth


@dataclass
class InFlight:
    batch_dict: Optional[dict]  # the prompts, for a pool that generates at collect
    batch: Optional[DataProto] = None  # the training batch waiting for its responses
    tag: Optional[int] = None
    pad: int = 0
    rng_state: Any = None
    started: float = field(default_factory=time.perf_counter)


class RolloutPool:
    """``trainer``: the :class:`~.trainer.AsyncPPOTrainer` (its rollout worker group, batch preparation and
    scoring); ``depth``: chunks kept in flight; ``session``: submit to the workers' decode sessions (default: when
    ``depth`` > 1; otherwise generate at collect)."""

    def __init__(self, trainer, depth: int, session: Optional[bool] = None):
        self.trainer = trainer
        self.wg = trainer.rollout_wg
        self.depth = int(depth)
        self.session = self.depth > 1 if session is None else bool(session)
        self._tags = itertools.count()

    def load_rollout_weights(self, weights: list, version: int, in_flight: bool = False) -> None:
        self.wg.load_rollout_weights(weights, version, in_flight)

    def ready(self, job: "InFlight", timeout: float) -> bool:
        """Whether the chunk is done on every rank (waiting up to ``timeout`` seconds on each)."""
        if job.batch_dict is not None:
            return True
        return all(self.wg.generation_ready(job.tag, timeout))

    def submit(self, batch_dict: dict, ahead: int) -> InFlight:
        """Start the chunk; ``ahead``: the most chunks that will be in flight together (sizes a new session's
        slots: a chunk's sequences times ``ahead``)."""
        if not self.session:
            return InFlight(batch_dict)
        batch, gen = self.trainer._generation_inputs(batch_dict)
        padded, pad = pad_dataproto_to_divisor(gen, self.trainer._dp_size(self.wg.submit_generation))
        tag = next(self._tags)
        self.wg.submit_generation(padded, tag, min(int(ahead), self.depth))
        return InFlight(None, batch, tag, pad, self.wg.rollout_rng_state())

    def collect(self, job: InFlight) -> Any:
        """Wait for the chunk's responses (``job.rng_state`` is set afterwards)."""
        if job.batch_dict is not None:  # no pipelining: generate (and score) now
            metrics: dict[str, Any] = {}
            batch = self.trainer._generate_and_score(job.batch_dict, {}, metrics)
            job.rng_state = self.wg.rollout_rng_state()
            return batch, metrics
        return unpad_dataproto(self.wg.collect_generation(job.tag), job.pad)

    def finish(self, job: InFlight, out: Any) -> tuple[DataProto, dict]:
        """The collected chunk scored, and its metrics (on the controller, while the pool generates on)."""
        if job.batch_dict is not None:
            return out
        metrics: dict[str, Any] = {}
        return self.trainer._score_generation(job.batch, out, {}, metrics), metrics

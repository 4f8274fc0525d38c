"""When a colocated rollout engine holds memory and when it gets new weights (the hybrid-engine cycle).

The trainer and the rollout engine share the device. Upstream's order, which this follows:

* before generating: wake the engine's **weights**, sync the actor's weights into them (only when the actor
  changed since the last sync, or the sleep discarded them), then wake the **KV cache** — waking the cache
  last keeps the peak at weights + gathered bucket instead of weights + cache + bucket;
* after generating (so before the log-prob passes and the actor update): put the engine to sleep, handing
  its weights and KV cache back to the trainer.

Whether sleeping frees anything is the engine's business (``rollout.free_cache_engine`` with vLLM's sleep
mode; vLLM's CPU build keeps its memory, its ``sleep`` / ``wake_up`` do nothing). The hf engine generates with
the training module, except on Megatron, whose engine keeps a Hugging Face copy: with ``free_cache_engine`` the
copy's parameter memory goes back to the trainer after generating (``release``; its contents are discarded, as
vLLM's sleep level 2) and the next sync re-allocates and refills it.
The worker only calls :meth:`RolloutCycle.before_generate`, :meth:`RolloutCycle.after_generate` and
:meth:`RolloutCycle.weights_changed`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class RolloutCycle:
    """``rollout``: a :class:`~verl.workers.rollout.base.BaseRollout`; ``sync()``: pushes the actor's
    current weights into it (a collective on every rank: all ranks call these methods together)."""

    def __init__(self, rollout, sync: Callable[[], None], dedicated: bool = False,
                 release: Optional[Callable[[], bool]] = None):
        """``dedicated``: the engine has its devices to itself (a rollout pool of its own, asynchronous modes)
        and gets its weights from elsewhere: it never sleeps and this cycle never syncs. ``release()``: after the
        engine's sleep, free the memory of weights that the next ``sync()`` rewrites in full; True when it freed
        them (the next generation then syncs first, whether or not the actor changed)."""
        self.rollout = rollout
        self.sync = sync
        self.dedicated = dedicated
        self.release = release
        self.last_sync_s = 0.0  # seconds of the sync in the last before_generate (0: none was needed)
        self.stale = True  # the engine starts from the checkpoint (or dummy weights): sync before first use

    def weights_changed(self) -> None:
        """The actor's weights moved (an optimizer step, a checkpoint load): sync before the next generation."""
        self.stale = True

    def before_generate(self) -> None:
        if self.dedicated:
            return
        self.rollout.wake_up(("weights",))
        self.last_sync_s = 0.0
        if self.stale or getattr(self.rollout, "weights_lost_in_sleep", False):
            t0 = time.perf_counter()
            self.sync()
            self.last_sync_s = time.perf_counter() - t0
            self.stale = False
        self.rollout.wake_up(("kv_cache",))

    def after_generate(self) -> None:
        if self.dedicated:
            return
        self.rollout.sleep(("weights", "kv_cache"))
        if self.release is not None and self.release():
            self.stale = True

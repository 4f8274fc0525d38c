"""Asynchronous RL: rollout and training on separate resource pools, overlapped, with bounded staleness.

Shared by the two upstream entry points, ``verl.experimental.one_step_off_policy.main_ppo`` and
``verl.experimental.fully_async_policy.fully_async_main``:

* :mod:`.schedule` -- how far generation may run ahead of training (one step; or a staleness threshold);
* :mod:`.rollouter` -- the controller thread that generates into a queue on the rollout pool;
* :mod:`.pool` -- the rollouter's handle on the rollout pool: chunks submitted ahead, collected in order;
* :mod:`.staleness` -- per-sample weight versions -> staleness metrics, and the default off-policy correction;
* :mod:`.trainer` -- the trainer loop that consumes the queue and syncs weights to the rollout pool;
* :mod:`.launch` -- the two Ray resource pools and the entry points' shared ``main``.
"""

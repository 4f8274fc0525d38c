"""Fully asynchronous PPO/GRPO: a rollout pool generates continuously into a queue; the trainer pool consumes it
and syncs weights every ``async_training.trigger_parameter_sync_step`` steps, with generation bounded by
``async_training.staleness_threshold``.

Entry point: ``python -m verl.experimental.fully_async_policy.fully_async_main`` (upstream's); the machinery is
shared with the one-step off-policy mode in :mod:`verl.experimental.async_policy`.
"""

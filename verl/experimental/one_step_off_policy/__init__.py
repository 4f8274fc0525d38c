"""One-step off-policy PPO/GRPO: generation of step k+1 on a rollout pool overlaps training of step k.

Entry point: ``python -m verl.experimental.one_step_off_policy.main_ppo`` (upstream's); the machinery is
shared with the fully asynchronous mode in :mod:`verl.experimental.async_policy`.
"""

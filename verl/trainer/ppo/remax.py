"""ReMax's greedy baseline (Li et al., arXiv:2310.10505).

For each prompt the trainer generates one extra, greedy response and scores it with the training reward;
that score is the baseline subtracted from every sampled response of the prompt
(:func:`verl.trainer.ppo.advantage.compute_remax_outcome_advantage` reads it from
``batch["reward_baselines"]``). The greedy responses are used for nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from verl import DataProto

__all__ = ["greedy_reward_baselines"]


def greedy_reward_baselines(trainer, prompts: "DataProto") -> torch.Tensor:
    """The reward of each prompt's greedy response, shape ``(len(prompts),)``.

    ``prompts`` is the training batch before it is repeated ``rollout.n`` times; stored in it as
    ``reward_baselines``, the repeat hands every sampled response its prompt's baseline.
    """
    from verl.trainer.ppo.reward import compute_reward

    gen = trainer._gen_batch(prompts)
    gen.meta_info = {"do_sample": False, "global_steps": trainer.global_steps}
    out = trainer._dp_call(trainer.actor_rollout_wg.generate_sequences, gen)
    out.meta_info = {}
    # A new TensorDict over the same tensors: merging pops the prompt keys from it, not from ``prompts``.
    scored = trainer._merge_generation(prompts.select(batch_keys=list(prompts.batch.keys()), deepcopy=True), out)
    scores, _ = compute_reward(scored, trainer.reward_fn)
    return scores.sum(dim=-1)

"""The unfused decode sampler the fused one replaced, kept only as the oracle of its tests and benchmark.

Every step is a separate pass over the (B, V) logits in fp32: copy, divide by T, log-sum-exp, softmax,
cumulative sum, compare with the target, count.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl.workers.rollout.hf_engine.sampling import counter_uniform


def reference_sample(logits: torch.Tensor, temperature: float, keys: Optional[torch.Tensor],
                     steps: Optional[torch.Tensor],
                     suppress_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probs); ``keys is None`` or ``temperature <= 0``: greedy (log-probs at T = 1)."""
    greedy = keys is None or temperature <= 0
    raw = logits.float()
    scaled = raw if greedy or temperature == 1.0 else raw / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    cand = scaled
    if suppress_index is not None and suppress_index.numel():
        cand = scaled.index_fill(-1, suppress_index, float("-inf"))
    if greedy:
        tokens = cand.argmax(-1)
    else:
        probs = torch.softmax(cand, dim=-1)
        cdf = probs.cumsum(-1)
        target = counter_uniform(keys, steps) * cdf[:, -1]
        tokens = (cdf < target[:, None]).sum(-1).clamp(max=cand.shape[-1] - 1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse

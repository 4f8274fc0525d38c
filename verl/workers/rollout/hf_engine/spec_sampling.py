"""Speculative sampling on the device: draw draft tokens, then accept or replace them against the target model.

The rule (Leviathan et al. / Chen et al.): draft token ``x`` drawn from the draft distribution ``q`` is kept with
probability ``min(1, p(x) / q(x))`` where ``p`` is the target distribution; at the first rejection the token is
drawn from ``normalise(max(0, p - q))`` and the rest of the drafts are dropped; when every draft is kept, one more
token is drawn from the target's next distribution. The emitted tokens then follow exactly the distribution plain
sampling from ``p`` would give. ``p`` and ``q`` are the distributions the plain sampler draws from (temperature,
top-k / top-p, suppressed ids applied: :func:`sampling_probs`), so speculation changes the speed, never the
output distribution. Greedy (temperature <= 0): a draft is kept iff it is the target's arg-max.

Random numbers come from :func:`counter_uniform` keyed by (sequence key, output index), with one salt per use
(draft draw, accept coin; the replacement / bonus draw uses the plain sampler's own stream), so a sequence's
tokens depend only on its key and the models, never on the batch. Each output index is decided in exactly one
verification; a draft drawn past a rejection influenced nothing visible, so reusing its numbers in the next round
keeps the draws independent.

The log-probs returned are the TARGET model's, of the emitted token under ``softmax(logits / T)`` over the whole
vocabulary (T = 1 when greedy): what the plain sampler returns and the trainer recomputes.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl.workers.rollout.hf_engine.sampling import SamplerConfig, counter_uniform, sample_tokens

# Key salts of the random streams speculative decoding adds (keys are < 2**31, so xor keeps them there).
DRAFT_SALT = 0x5BD1E995 & 0x7FFFFFFF
ACCEPT_SALT = 0x27D4EB2F & 0x7FFFFFFF


def sampling_probs(logits: torch.Tensor, cfg: SamplerConfig, suppress: Optional[torch.Tensor]) -> torch.Tensor:
    """The distribution (N, V), in vocabulary order, that :func:`sample_tokens` draws from for ``logits`` (N, V):
    softmax(logits / T), suppressed ids removed, then top-k / top-p (the top candidate always survives),
    renormalised."""
    x = logits.float() / float(cfg.temperature)
    if suppress is not None and suppress.numel():
        x = x.index_fill(-1, suppress, float("-inf"))
    vocab = x.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly ahead of each candidate
        sorted_p = sorted_p.masked_fill(before > cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from unnormalised ``weights`` (N, V) with uniforms ``u`` (N,)."""
    cdf = weights.cumsum(-1)
    target = u * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def _greedy(logits: torch.Tensor, suppress: Optional[torch.Tensor]) -> torch.Tensor:
    x = logits.float()
    if suppress is not None and suppress.numel():
        x = x.index_fill(-1, suppress, float("-inf"))
    return x.argmax(-1)


def draw_draft(logits: torch.Tensor, cfg: SamplerConfig, keys: torch.Tensor, index: torch.Tensor,
               suppress: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One draft token per row from the drafter's ``logits`` (B, V) for output index ``index`` (B,):
    (tokens, the draft distribution q (B, V); None when greedy)."""
    if cfg.greedy:
        return _greedy(logits, suppress), None
    q = sampling_probs(logits, cfg, suppress)
    return _inverse_cdf(q, counter_uniform(keys ^ DRAFT_SALT, index)), q


def target_log_probs(logits: torch.Tensor, tokens: torch.Tensor, cfg: SamplerConfig) -> torch.Tensor:
    """log softmax(logits / T)[token] over the whole vocabulary, for (..., V) logits and (...) tokens."""
    x = logits.float()
    if not cfg.greedy and cfg.temperature != 1.0:
        x = x / float(cfg.temperature)
    return x.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(x, dim=-1)


def verify(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: Optional[torch.Tensor],
           cfg: SamplerConfig, keys: torch.Tensor, steps: torch.Tensor, suppress: Optional[torch.Tensor]):
    """Accept / replace ``drafts`` (B, k) against ``target_logits`` (B, k + 1, V) (row j: the target's logits for
    the token after the j-th fed token, so row j judges draft j and row k gives the bonus token).

    ``draft_probs`` (B, k, V): the distributions the drafts were drawn from (None when greedy). ``steps`` (B,):
    the output index of the first token this verification emits.
    Returns (tokens (B, k + 1), log-probs (B, k + 1), accepted (B,)): the emitted tokens are ``tokens[:, :a + 1]``
    with ``a = accepted``; entries past them are meaningless.
    """
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    j = torch.arange(k1, device=drafts.device)
    index = steps[:, None] + j[None, :]  # output index of each emitted position
    if cfg.greedy:
        best = _greedy(target_logits.reshape(b * k1, vocab), suppress).reshape(b, k1)
        ok = drafts == best[:, :k]
        tokens = best  # a kept draft equals the arg-max; the first mismatch is replaced by it
    else:
        p = sampling_probs(target_logits.reshape(b * k1, vocab), cfg, suppress).reshape(b, k1, vocab)
        p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
        q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        coin = counter_uniform((keys ^ ACCEPT_SALT)[:, None].expand(b, k), index[:, :k])
        ok = coin * q_d < p_d  # u < p / q, with q(draft) > 0 as the draft was drawn from q
        # Replacement at each position (only the first rejection's is used): residual max(0, p - q); a residual
        # with no mass (p == q up to rounding) falls back to p itself.
        resid = (p[:, :k] - draft_probs).clamp_(min=0.0)
        empty = resid.sum(-1, keepdim=True) <= 1e-12
        resid = torch.where(empty, p[:, :k], resid)
        u = counter_uniform(keys[:, None].expand(b, k), index[:, :k])
        repl = _inverse_cdf(resid.reshape(b * k, vocab), u.reshape(-1)).reshape(b, k)
        # Bonus token after k kept drafts: the plain sampler's own draw from the last target distribution.
        bonus, _ = sample_tokens(target_logits[:, k], cfg, keys, index[:, k], suppress)
        tokens = torch.cat([torch.where(ok, drafts, repl), bonus[:, None]], dim=1)
    # accepted = length of the leading run of kept drafts
    accepted = torch.cumprod(ok.long(), dim=1).sum(1)
    return tokens, target_log_probs(target_logits, tokens, cfg), accepted

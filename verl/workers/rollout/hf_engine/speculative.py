"""One speculative decoding step of the slot loop: draft k tokens with the runner's drafter (Qwen3.5: the MTP
head), verify them with ONE target forward over k + 1 positions per slot, keep the accepted prefix plus one
target token (:mod:`.spec_sampling`), then rewind what the rejected drafts left in the caches.

Everything stays on the device (no host sync): each slot emits 1 .. k + 1 tokens per step, cut at its first stop
token and at its token budget; a slot that finished keeps running no-op steps (masked) until the host retires it,
as in the plain loop. The step runs eagerly (no CUDA graphs: the verification's per-slot acceptance and the
drafter's catch-up are not captured here; :class:`.engine.DecodeEngine` warns).

Counters per sequence (``SpecState.seq_stats``, over its live steps): draft tokens proposed, drafts accepted,
verification steps; :func:`spec_stats` turns them into ``spec_accept_rate`` (accepted / proposed) and
``spec_accept_length`` (1 + accepted / steps: the tokens a sequence gains per step), token-weighted and as
upstream's per-request means.
"""

from __future__ import annotations

import torch

from verl.workers.rollout.hf_engine.spec_sampling import draw_draft, verify


def speculative_step(engine, b: int) -> None:
    c, runner, cfg = engine.cache, engine.runner, engine.sampler
    sp = c.spec
    k = sp.k
    rows = torch.arange(b, device=c.tokens.device)
    active = ~c.done[:b]
    steps, keys = c.steps[:b], c.keys[:b]

    logits, hidden = runner.draft_first(c, b)
    drafts, probs = [], []
    for j in range(k):
        tok, q = draw_draft(logits, cfg, keys, steps + j, engine.suppress)
        drafts.append(tok)
        probs.append(q)
        if j + 1 < k:
            logits, hidden = runner.draft_next(c, b, tok, hidden, c.lengths[:b] + j)
    drafts_t = torch.stack(drafts, dim=1)
    q = None if cfg.greedy else torch.stack(probs, dim=1)

    fed = torch.cat([c.tokens[:b, None], drafts_t], dim=1)  # the pending token, then the drafts
    target_logits, target_hidden = runner.verify_logits(c, b, fed)
    tokens, log_probs, accepted = verify(target_logits, drafts_t, q, cfg, keys, steps, engine.suppress)

    # Emitted: the accepted drafts and the target's token, cut at the budget and after the first stop token.
    gained = accepted + 1
    j = torch.arange(k + 1, device=rows.device)
    emit = torch.minimum(gained, c.limit[:b] - steps)
    stopped = torch.zeros_like(active)
    if engine.stop.numel():
        is_stop = torch.isin(tokens, engine.stop) & (j[None, :] < emit[:, None])
        stopped = is_stop.any(1)
        first = is_stop.long().argmax(1) + 1
        emit = torch.where(stopped, torch.minimum(emit, first), emit)
    emit = torch.where(active, emit, torch.zeros_like(emit))
    for i in range(k + 1):
        live = i < emit
        col = (steps + i).clamp(max=c.max_new - 1)
        c.out_tokens[rows, col] = torch.where(live, tokens[:, i], c.out_tokens[rows, col])
        c.out_logprobs[rows, col] = torch.where(live, log_probs[:, i], c.out_logprobs[rows, col])
    new_steps = steps + emit
    c.steps[:b] = new_steps
    finished = active & ((new_steps >= c.limit[:b]) | stopped)
    c.done[:b] = c.done[:b] | finished

    # The model has now consumed the pending token and the accepted drafts; the target's own token is pending.
    # Rows that finished keep their lengths: their no-op steps until retirement then stay inside the cache.
    going = active & ~finished
    c.lengths[:b] = c.lengths[:b] + torch.where(going, gained, torch.zeros_like(gained))
    c.tokens[:b] = torch.where(going, tokens[rows, accepted], c.tokens[:b])
    runner.rewind(c, b, gained)
    # What the drafter catches up on next step: the target's hidden states at the consumed positions, each
    # followed by the token emitted after it.
    sp.hid[:b] = target_hidden.to(sp.hid.dtype)
    sp.ctok[:b] = tokens
    sp.count[:b] = torch.where(going, gained, sp.count[:b])

    live = active.long()
    sp.seq_stats[:b] += torch.stack([k * live, accepted * live, live], dim=1)


def spec_stats(per_seq: list[tuple[int, int, int]]) -> dict:
    """Engine stats from each sequence's (drafted, accepted, verification steps): totals, the token-weighted
    acceptance rate and tokens gained per step, and upstream's per-request means (``rollout/spec_accept_rate``:
    mean of accepted / drafted; ``rollout/spec_accept_length``: mean of 1 + accepted / steps)."""
    drafted, accepted, verifies = (sum(s[i] for s in per_seq) for i in range(3))
    n = max(len(per_seq), 1)
    return {
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_verify_steps": verifies,
        "spec_accept_rate": accepted / drafted if drafted else 0.0,
        "spec_accept_length": 1.0 + accepted / verifies if verifies else 0.0,
        "spec_request_accept_rate": sum(a / d if d else 0.0 for d, a, _ in per_seq) / n,
        "spec_request_accept_length": sum(1.0 + a / v if v else 0.0 for _, a, v in per_seq) / n,
    }
